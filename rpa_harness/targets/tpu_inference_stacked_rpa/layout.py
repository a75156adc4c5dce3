"""stacked RPA's KV cache layout and upstream's, both ways (NumPy on the host).

Upstream's cache is ``[pages, page_size, 2 * kv_heads, head_dim]``, K at ``0::2`` and V at ``1::2`` of
axis 2. stacked RPA keeps the sequence on the lanes: ``[pages, 2 * kv_heads, padded_head_dim, page_size]``
(``wrapper.get_kv_cache_shape``), the same K/V interleaving on axis 1 (``prepare_seq_along_lane_new_kv_hbm``
concatenates each head's K and V and splits the pair into rows ``2h`` and ``2h + 1``), head_dim padded to
whole sublane tiles of the cache's dtype, ``8 * values_per_word`` rows, and the dtype kept (nothing packed
into 32-bit words).
"""

import numpy as np

from rpa_harness.targets import layouts

__all__ = ["SUBLANES", "STACKED_CACHE", "padded_head_dim", "stack_cache", "unstack_cache", "slots_first"]

SUBLANES = 8  # every TPU generation's vreg rows (pltpu.get_tpu_info().num_sublanes)
STACKED_CACHE = "[pages, 2 * kv_heads, padded_head_dim, page_size]"


def padded_head_dim(head_dim: int, dtype) -> int:
    """head_dim rounded up to whole sublane tiles of ``dtype`` (``get_kv_cache_shape``'s alignment)."""
    multiple = SUBLANES * layouts.values_per_word(np.dtype(dtype))
    return -(-head_dim // multiple) * multiple


def stack_cache(kv_pages) -> np.ndarray:
    """Upstream's cache in stacked RPA's layout, zero in the padded dims (as its new-token packing pads)."""
    kv_pages = np.asarray(kv_pages)
    if kv_pages.ndim != 4:
        raise layouts.LayoutError(
            f"stack_cache: kv_pages has shape {kv_pages.shape}; pass upstream's cache {layouts.UPSTREAM_CACHE}"
        )
    pages, page_size, heads_x2, head_dim = kv_pages.shape
    stacked = np.zeros(
        (pages, heads_x2, padded_head_dim(head_dim, kv_pages.dtype), page_size), kv_pages.dtype
    )
    stacked[:, :, :head_dim, :] = kv_pages.transpose(0, 2, 3, 1)
    return stacked


def unstack_cache(stacked, *, head_dim: int) -> np.ndarray:
    """stacked RPA's cache back to upstream's layout: the inverse of ``stack_cache``, the padded dims dropped
    whatever they hold (the stacked shape does not say how many are padding, hence ``head_dim``)."""
    stacked = np.asarray(stacked)
    if stacked.ndim != 4 or not 0 < head_dim <= stacked.shape[2]:
        raise layouts.LayoutError(
            f"unstack_cache: a cache of shape {stacked.shape} cannot hold head_dim={head_dim}; pass stacked "
            f"RPA's cache {STACKED_CACHE} and the unpadded head_dim"
        )
    return stacked[:, :, :head_dim, :].transpose(0, 3, 1, 2).copy()


def slots_first(stacked) -> np.ndarray:
    """stacked RPA's cache as ``[pages, page_size, 2 * kv_heads, padded_head_dim]``: every element, padding
    included, grouped by slot, as the cache judge (``rpa_harness.cache_judge.cache_mismatch``) reads a cache."""
    stacked = np.asarray(stacked)
    if stacked.ndim != 4:
        raise layouts.LayoutError(
            f"slots_first: a cache of shape {stacked.shape}; pass stacked RPA's cache {STACKED_CACHE}"
        )
    return np.ascontiguousarray(stacked.transpose(0, 3, 1, 2))
