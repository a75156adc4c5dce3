"""tpu-inference's MLA v1 behind upstream's API: latent attention (``spec.interface.VALUE_IS_KEY_PREFIX``).

MLA v1 takes the query split in two (``ql_nope [T, H, lkv]``, ``q_pe [T, H, r]``), the new tokens' latent
vectors and rotary keys (``new_kv_c [T, lkv]``, ``new_k_pe [T, r]``), a cache of one row per token
``[kv_c padded to 128 lanes ; k_pe padded to 128 lanes]`` (``[pages, page_size / packing, packing, width]``),
flat page indices and v3's ``distribution``; it writes the new tokens into the cache and returns
``(attention [T, H, lkv], cache)``. An upstream-style latent case has one KV head whose key is
``[kv_c ; k_pe]`` (head_dim = lkv + r) and whose value is ``[kv_c ; 0]``: the adapter splits the query and
the key at lkv (the target's declared ``(head_dim, lkv)`` pairs), passes the new tokens apart, and returns
the attention zero-padded to head_dim with the cache back in upstream's layout.
"""

import dataclasses
import functools
import types

import numpy as np
from jax.experimental.pallas import tpu as pltpu

from rpa_harness.spec.interface import options_taken, values_per_word
from rpa_harness.targets import layouts
from rpa_harness.targets.tpu_inference import kernels

_KERNEL_MODULE = "tpu_inference.kernels.mla.v1.kernel"
# (head_dim, lkv): lkv + r with r = 64 (DeepSeek's rotary dims), the latent 512 (DeepSeek's kv_lora_rank)
# and two small ones that keep an interpreted call cheap.
VALUE_HEAD_DIMS = ((96, 32), (192, 128), (576, 512))
# jax 0.10.2 has no pltpu.reciprocal, which MLA v1 calls for every output narrower than float32.
HAS_TPU_RECIPROCAL = hasattr(pltpu, "reciprocal")
# The options MLA v1 does not take (a case carries mask_value_meaning, the replacing meaning the target
# declares). q_scale it takes as a bare logit multiplier (the caller quantises q), which is not the
# specification's q_scale, so it is not declared.
_NOT_TAKEN = ("q_scale", "attention_sink", "use_causal_mask", "out_dtype", "skip_kv_mask", "update_kv_cache")


@functools.cache
def kernel() -> types.ModuleType:
    """MLA v1's kernel module, imported on first use (ImportError says how to install it)."""
    return kernels.load_kernel_module(_KERNEL_MODULE)


def latent_dim(head_dim: int) -> int:
    """lkv for keys of ``head_dim`` dims; for a head_dim no pair names (an invalid input), all but 64."""
    return dict(VALUE_HEAD_DIMS).get(head_dim, max(head_dim - 64, 1))


def latent_cache(kv_pages, lkv: int) -> np.ndarray:
    """Upstream's one-KV-head cache ``[pages, page_size, 2, lkv + r]`` as MLA's ``[pages, page_size /
    packing, packing, align(lkv) + align(r)]``: each token's key split at lkv, each part padded to 128
    lanes (the value slot is the key's prefix: not stored)."""
    pages, page_size, _, head_dim = kv_pages.shape
    keys = kv_pages[:, :, 0, :]
    row = np.concatenate([layouts.pad_lanes(keys[..., :lkv]), layouts.pad_lanes(keys[..., lkv:])], axis=-1)
    packing = values_per_word(kv_pages.dtype)
    return row.reshape(pages, page_size // packing, packing, row.shape[-1])


def upstream_cache(cache, lkv: int, head_dim: int) -> np.ndarray:
    """MLA's cache back in upstream's layout: key ``[kv_c ; k_pe]``, value ``[kv_c ; 0]``."""
    cache = np.asarray(cache)
    pages, rows, packing, _ = cache.shape
    row = cache.reshape(pages, rows * packing, cache.shape[-1])
    lkv_lanes = -(-lkv // layouts.LANES) * layouts.LANES
    kv_c, k_pe = row[..., :lkv], row[..., lkv_lanes : lkv_lanes + head_dim - lkv]
    key = np.concatenate([kv_c, k_pe], axis=-1)
    value = np.concatenate([kv_c, np.zeros_like(k_pe)], axis=-1)
    return np.stack([key, value], axis=2)


@dataclasses.dataclass(frozen=True)
class MlaInputs:
    args: tuple  # ql_nope, q_pe, new_kv_c, new_k_pe, cache_kv, kv_lens, page_indices, cu_q_lens, distribution
    kwargs: dict
    lkv: int
    head_dim: int


def mla_inputs(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options) -> MlaInputs:
    """An upstream-style latent call in MLA v1's terms: the query and keys split at lkv, the new tokens
    apart (their cache slots poisoned), the page table flat, the distribution."""
    taken = options_taken(options, by="mla_ragged_paged_attention", without=_NOT_TAKEN)
    q, kv_pages = np.asarray(q), np.asarray(kv_pages)
    head_dim = kv_pages.shape[-1]
    lkv = latent_dim(head_dim)
    tokens = layouts.split_new_tokens(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs)
    keys = tokens.keys[:, 0, :]
    kwargs = {
        name: getattr(taken, name)
        for name in (
            "sm_scale", "sliding_window", "soft_cap", "mask_value", "k_scale", "v_scale", "chunk_prefill_size",
            "num_kv_pages_per_block", "num_queries_per_block", "vmem_limit_bytes",
        )
    }  # fmt: skip
    args = (
        q[..., :lkv],
        q[..., lkv:],
        keys[:, :lkv],
        keys[:, lkv:],
        latent_cache(tokens.poisoned_cache(kv_pages), lkv),
        np.asarray(kv_lens),
        np.asarray(page_indices).reshape(-1),
        np.asarray(cu_q_lens),
        layouts.distribution(tokens.q_lens, num_seqs, chunk_prefill_size=taken.chunk_prefill_size),
    )
    return MlaInputs(args, kwargs, lkv, head_dim)


def call_mla(inputs: MlaInputs):
    """Runs MLA v1 (on whatever backend the caller's context selects): ``(attention, updated cache)``."""
    return kernels.run_jitted(kernel().mla_ragged_paged_attention, inputs)


def ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options):
    """Upstream's call on MLA v1: ``(attention zero-padded to head_dim, updated cache in upstream's layout)``."""
    inputs = mla_inputs(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options)
    out, cache = call_mla(inputs)
    out = np.asarray(out)
    padded = np.zeros((*out.shape[:-1], inputs.head_dim), out.dtype)
    padded[..., : out.shape[-1]] = out
    return padded, upstream_cache(cache, inputs.lkv, inputs.head_dim)


def dynamic_validate_inputs(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options):
    """MLA v1's own ``dynamic_validate_inputs`` (its rules, its messages) on the mapped inputs."""
    inputs = mla_inputs(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options)
    kernel().dynamic_validate_inputs(*kernels.device_arrays(inputs.args), **inputs.kwargs)
