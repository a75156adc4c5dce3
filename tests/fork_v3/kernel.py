"""A stand-in for a fork of tpu-inference's RPA v3, for ``docs/targets.md``'s second example.

Its API has v3's shape: the new tokens' keys and values are inputs that the kernel writes into the cache
and the updated cache is returned with the attention; one flat page list in which sequence ``i`` owns the
pages ``page_list[cu_kv_lens[i] // page_size : cu_kv_lens[i + 1] // page_size]`` (cumulative kv lengths
rounded up to whole pages); ``distribution = (decodes_end, prefills_end, num_seqs)``; the cache's head_dim
padded to 128 lanes; a static validator with its own messages, and no dynamic one. It writes the cache on
the host and computes the attention through the bundled kernel on the written cache: what the example
exercises is the adapter and the judging of both outputs, not a second attention implementation.
"""

import numpy as np

from rpa_harness import kernel as bundled
from rpa_harness.targets import layouts

LANES = 128


def check_static(queries, keys, kv_cache, *, sliding_window=None, soft_cap=None):
    """Shape and option errors, raised by ``ragged_paged_attention`` itself."""
    if queries.shape[-1] != keys.shape[-1]:
        raise ValueError(f"queries have head_dim {queries.shape[-1]}, keys {keys.shape[-1]}")
    if queries.shape[1] % keys.shape[1]:
        raise ValueError(f"num_q_heads={queries.shape[1]} is not a multiple of num_kv_heads={keys.shape[1]}")
    if kv_cache.shape[-1] % LANES:
        raise ValueError(f"the cache's head_dim {kv_cache.shape[-1]} is not padded to {LANES} lanes")
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"sliding_window={sliding_window} must be positive")
    if soft_cap == 0:
        raise ValueError(f"soft_cap={soft_cap} would divide by zero")


def write_new_tokens(keys, values, kv_cache, kv_lens, page_list, cu_kv_lens, cu_q_lens, num_seqs):
    """The cache with each live sequence's new tokens (its last ``q_len`` keys) written to their slots."""
    cache = np.array(kv_cache)
    page_size, head_dim = cache.shape[1], keys.shape[-1]
    new = np.empty((keys.shape[0], 2 * keys.shape[1], head_dim), cache.dtype)
    new[:, 0::2], new[:, 1::2] = keys, values
    for i in range(num_seqs):
        q_len, kv_len = int(cu_q_lens[i + 1] - cu_q_lens[i]), int(kv_lens[i])
        first_page = int(cu_kv_lens[i]) // page_size
        for j in range(q_len):
            position = kv_len - q_len + j
            page = page_list[first_page + position // page_size]
            cache[page, position % page_size, :, :head_dim] = new[cu_q_lens[i] + j]
    return cache


def ragged_paged_attention(
    queries, keys, values, kv_cache, kv_lens, page_list, cu_kv_lens, cu_q_lens, distribution, *,
    sm_scale=1.0, sliding_window=None, soft_cap=None, mask_value=bundled.DEFAULT_MASK_VALUE, k_scale=None,
    v_scale=None, num_kv_pages_per_block=None, num_queries_per_block=None, vmem_limit_bytes=None,
):  # fmt: skip
    """(attention, updated cache): sequence ``i < distribution[2]``'s queries over its ``kv_lens[i]``
    keys, after its new tokens are written to the cache."""
    check_static(queries, keys, kv_cache, sliding_window=sliding_window, soft_cap=soft_cap)
    kv_lens, page_list = np.asarray(kv_lens), np.asarray(page_list)
    cu_kv_lens, cu_q_lens, num_seqs = np.asarray(cu_kv_lens), np.asarray(cu_q_lens), int(distribution[2])
    cache = write_new_tokens(keys, values, kv_cache, kv_lens, page_list, cu_kv_lens, cu_q_lens, num_seqs)
    table = layouts.page_table_from_flat(
        page_list, cu_kv_lens // cache.shape[1], pages_per_seq=len(page_list) // len(kv_lens)
    )
    out = bundled.ragged_paged_attention(
        queries, cache[..., : keys.shape[-1]], kv_lens, table, cu_q_lens, np.array([num_seqs], np.int32),
        sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap, mask_value=mask_value,
        k_scale=k_scale, v_scale=v_scale, num_kv_pages_per_block=num_kv_pages_per_block,
        num_queries_per_block=num_queries_per_block, vmem_limit_bytes=vmem_limit_bytes,
    )  # fmt: skip
    return out, cache
