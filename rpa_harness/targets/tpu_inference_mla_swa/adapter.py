"""tpu-inference's DeepSeek-V4 sliding-window latent attention behind upstream's API.

``mla_sliding_window_ragged_paged_attention`` (``experimental/deepseek_v4/core_attention/mla_swa.py``)
attends one bfloat16 latent vector per token used as both key and value: the query ``[T, H, D]``, the new
tokens' vectors ``new_kv [T, D]``, a cache of raw bytes ``[pages, page_size * D / 256, 4, 128]`` uint8,
flat page indices, v3's ``distribution`` and one sink logit per q head (``attention_sinks``, required); it
writes the new tokens into the cache and returns ``(attention [T, H, D], cache, l, m)``. In the
specification that is latent attention with ``value_head_dim == head_dim`` (the value slot holds the whole
key): the adapter passes the key slot's vectors as the latent, the new tokens apart (their cache slots
poisoned), and returns the attention with the cache back in upstream's layout (``upstream_cache``).
"""

import dataclasses
import functools
import inspect
import math
import types
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
from jax.experimental.pallas import tpu as pltpu

from rpa_harness.spec.interface import DEFAULT_MASK_VALUE, options_taken
from rpa_harness.targets import layouts
from rpa_harness.targets.tpu_inference import kernels

KERNEL_MODULE = "tpu_inference.kernels.experimental.deepseek_v4.core_attention.mla_swa"
# (head_dim, value_head_dim): the latent is key and value at once. DeepSeek-V4's is 512 wide; 256 keeps an
# interpreted call cheap. The cache's rows are 4 x 128 bytes, so a token's 2 * D bytes fill whole rows only
# for D a multiple of 256 (mla_swa.py: `assert token_bytes % slot_bytes == 0`).
VALUE_HEAD_DIMS = ((256, 256), (512, 512))
CACHE_PACKING = 4  # the byte cache's third axis, bytes per 32-bit word (the kernel's kv_packing)
CACHE_LANES = 128
BYTES_PER_ROW = CACHE_PACKING * CACHE_LANES
BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
# The options the kernel does not take: upstream's soft_cap, k_scale, v_scale, and the extensions but
# attention_sink and chunk_prefill_size. Nor does it take a mask_value: it replaces a masked logit with
# finfo(float32).min, which weights a key as upstream's default mask does (not at all).
_NOT_TAKEN = (
    "soft_cap", "k_scale", "v_scale", "q_scale", "use_causal_mask", "out_dtype", "skip_kv_mask", "update_kv_cache",
)  # fmt: skip
_DEFAULT_MASKS = (None, DEFAULT_MASK_VALUE)


def reciprocal_call_site() -> str:
    """Where the installed kernel calls ``pltpu.reciprocal`` (``mla_swa.py:LINE``), read from its source."""
    module = kernels.load_kernel_module(KERNEL_MODULE)
    name = Path(inspect.getfile(module)).name
    for number, line in enumerate(inspect.getsource(module).splitlines(), start=1):
        if "pltpu.reciprocal" in line:
            return f"{name}:{number}"
    return name


@functools.cache
def kernel() -> types.ModuleType:
    """The kernel's module, imported on first use. ImportError says how to install tpu-inference, or, on a
    jax without ``pltpu.reciprocal`` (0.10.2), that no call can run there and what jax it needs."""
    module = kernels.load_kernel_module(KERNEL_MODULE)
    if not hasattr(pltpu, "reciprocal"):
        raise ImportError(
            f"tpu-inference's mla_swa does not trace on jax {jax.__version__}: it normalises a bfloat16 output "
            f"with pltpu.reciprocal ({reciprocal_call_site()}), which this jax lacks, and its float32 queries "
            "fail to trace on any jax (mla-swa-float32-queries-fail-to-trace); run it on jax >= 0.12 "
            "(Python >= 3.12)"
        )
    return module


def token_bytes(vectors) -> np.ndarray:
    """bfloat16 vectors ``[..., D]`` as the kernel's bytes ``[..., 2 * D]``: per 128 lanes, the values' low
    bytes, then their high bytes (the layout ``prepare_kv_inputs`` gives the new tokens)."""
    words = np.ascontiguousarray(np.asarray(vectors, BFLOAT16)).view(np.uint16)
    *lead, dim = words.shape
    words = words.reshape(*lead, dim // CACHE_LANES, 1, CACHE_LANES)
    halves = np.concatenate([words & 0xFF, words >> 8], axis=-2).astype(np.uint8)
    return halves.reshape(*lead, 2 * dim)


def token_vectors(data) -> np.ndarray:
    """The kernel's bytes ``[..., 2 * D]`` back as bfloat16 vectors ``[..., D]`` (``token_bytes`` undone)."""
    data = np.asarray(data, np.uint8)
    *lead, width = data.shape
    halves = data.reshape(*lead, width // (2 * CACHE_LANES), 2, CACHE_LANES).astype(np.uint16)
    words = halves[..., 0, :] | (halves[..., 1, :] << 8)
    return np.ascontiguousarray(words.reshape(*lead, width // 2)).view(BFLOAT16)


def byte_cache(kv_pages) -> np.ndarray:
    """Upstream's one-KV-head cache ``[pages, page_size, 2, D]`` (bfloat16, value = key) as the kernel's
    ``[pages, page_size * 2D / 512, 4, 128]`` uint8: each slot's key as its bytes, one token after another."""
    kv_pages = np.asarray(kv_pages)
    pages, page_size, _, dim = kv_pages.shape
    rows = token_bytes(kv_pages[:, :, 0, :]).reshape(pages, page_size * 2 * dim // BYTES_PER_ROW, -1)
    return rows.reshape(pages, rows.shape[1], CACHE_PACKING, CACHE_LANES)


def upstream_cache(cache, head_dim: int) -> np.ndarray:
    """The kernel's byte cache back in upstream's layout, ``[pages, page_size, 2, D]``: key and value the
    slot's vector."""
    cache = np.asarray(cache)
    vectors = token_vectors(cache.reshape(cache.shape[0], -1, 2 * head_dim))
    return np.stack([vectors, vectors], axis=2)


@dataclasses.dataclass(frozen=True)
class SwaInputs:
    args: tuple  # q, new_kv, cache_kv, kv_lens, page_indices, cu_q_lens, distribution, attention_sinks
    kwargs: dict
    head_dim: int


def window_for(sliding_window: int | None, *, pages_per_seq: int, page_size: int) -> int:
    """The kernel's window (it requires one): the case's, or, without one, the page table's capacity, which
    hides no key (a query at position p sees (p - window, p], and p < pages_per_seq * page_size)."""
    return pages_per_seq * page_size if sliding_window is None else sliding_window


def swa_inputs(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options) -> SwaInputs:
    """An upstream-style latent call (value = key) in the kernel's terms: the new tokens apart (their cache
    slots poisoned), the byte cache, the page table flat, the distribution, a sink per head (-inf: none)."""
    taken = options_taken(options, by="mla_sliding_window_ragged_paged_attention", without=_NOT_TAKEN)
    if taken.mask_value not in _DEFAULT_MASKS:
        raise TypeError(
            f"mla_sliding_window_ragged_paged_attention() takes no mask_value (it masks with "
            f"finfo(float32).min); got mask_value={taken.mask_value!r}, pass None or the default"
        )
    q, kv_pages = np.asarray(q), np.asarray(kv_pages)
    num_q_heads, head_dim = q.shape[1], kv_pages.shape[-1]
    tokens = layouts.split_new_tokens(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs)
    sinks = taken.attention_sink if taken.attention_sink is not None else (-math.inf,) * num_q_heads
    page_table = np.asarray(page_indices)
    kwargs = dict(
        sm_scale=taken.sm_scale,
        sliding_window=window_for(
            taken.sliding_window, pages_per_seq=page_table.shape[1], page_size=kv_pages.shape[1]
        ),
        logical_page_size=kv_pages.shape[1],
        chunk_prefill_size=taken.chunk_prefill_size,
        num_kv_pages_per_block=taken.num_kv_pages_per_block,
        num_queries_per_block=taken.num_queries_per_block,
        **({} if taken.vmem_limit_bytes is None else dict(vmem_limit_bytes=taken.vmem_limit_bytes)),
    )
    args = (
        q,
        tokens.keys[:, 0, :],
        byte_cache(tokens.poisoned_cache(kv_pages)),
        np.asarray(kv_lens),
        page_table.reshape(-1),
        np.asarray(cu_q_lens),
        layouts.distribution(tokens.q_lens, num_seqs, chunk_prefill_size=taken.chunk_prefill_size),
        np.asarray(sinks, np.float32),
    )
    return SwaInputs(args, kwargs, head_dim)


def call_swa(inputs: SwaInputs):
    """Runs the kernel (on whatever backend the caller's context selects): ``(attention, byte cache, l, m)``."""
    return kernels.run_jitted(kernel().mla_sliding_window_ragged_paged_attention, inputs)


def ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options):
    """Upstream's call on the kernel: ``(attention, updated cache in upstream's layout)``; its softmax
    statistics ``l`` and ``m`` are not returned (the specification has none)."""
    inputs = swa_inputs(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options)
    out, cache, _, _ = call_swa(inputs)
    return np.asarray(out), upstream_cache(cache, inputs.head_dim)
