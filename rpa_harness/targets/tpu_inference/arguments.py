"""An upstream-style call in the terms of tpu-inference's kernels with v3's API (v3 and its forks, batched
and stacked RPA): the new tokens split from the cache, the packed cache, the metadata and distribution v3
takes, the block sizes and the options every one of them reads as v3 does.

v3's API differs from upstream jax's: the new tokens' keys and values are inputs that the kernel writes
into a packed cache, which it returns with the attention. Each target maps a case with these pieces and
adds its own block classes and options (``tpu_inference_v3.adapter.v3_inputs`` is v3's).
"""

import dataclasses

import numpy as np

from rpa_harness import generations
from rpa_harness.spec.interface import MASK_REPLACES
from rpa_harness.targets import layouts

# Upstream's default mask value; v3's default (finfo(out_dtype).min, replacing the logit) masks as fully.
UPSTREAM_DEFAULT_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
DEFAULT_VMEM_LIMIT_BYTES = 64 * 2**20
DEFAULT_QUERIES_PER_BLOCK = 8
DEFAULT_KV_PAGES_PER_BLOCK = 2


@dataclasses.dataclass(frozen=True)
class KernelInputs:
    """One upstream-style call in the terms of one of tpu-inference's v3 kernels, and the cache the kernel
    must return: what ``check_updated_cache`` reads (``V3Inputs``, the hd64 target's ``Hd64Inputs``)."""

    args: tuple  # queries, keys, values, kv_cache, kv_lens, page_indices, cu_q_lens, distribution (NumPy)
    kwargs: dict  # keyword options for the kernel
    expected_cache: np.ndarray  # the packed cache with every live key and value in place
    new_slots: np.ndarray  # bool [pages, page_size]: the slots v3 writes (positions [kv_len - q_len, kv_len))
    slot_owner: np.ndarray  # int [pages, page_size]: sequence whose page holds the slot, -1 for none
    slot_position: np.ndarray  # int [pages, page_size]: the key position of the slot in its sequence

    @classmethod
    def of_tokens(cls, args: tuple, kwargs: dict, expected_cache: np.ndarray, tokens, *block_sizes):
        """The inputs whose new tokens' slots are ``tokens``' (``layouts.split_new_tokens``), followed by the
        subclass's block sizes."""
        return cls(
            args,
            kwargs,
            expected_cache,
            tokens.new_slots,
            tokens.slot_owner,
            tokens.slot_position,
            *block_sizes,
        )


def score_options(options) -> dict:
    """The options every v3-derived kernel takes under the specification's names: how a logit is scaled,
    capped and windowed and how a quantized query and cache are scaled. (The mask value each target maps
    to its kernel's meaning itself.)"""
    return dict(
        sm_scale=options.sm_scale,
        sliding_window=options.sliding_window,
        soft_cap=options.soft_cap,
        q_scale=options.q_scale,
        k_scale=options.k_scale,
        v_scale=options.v_scale,
    )


def block_sizes(tokens_per_block: int, chunk_unit: int) -> tuple[int, int]:
    """A block and its compute chunk: half the block when that is a whole number of units."""
    units = tokens_per_block // chunk_unit
    return tokens_per_block, (units // 2 if units > 0 and units % 2 == 0 else units) * chunk_unit


def given_block_options(
    num_queries_per_block: int | None, num_kv_pages_per_block: int | None, pages_per_seq: int
) -> tuple[int, int] | None:
    """``(query rows, KV pages)`` per block to pass to a v3 kernel, or None where it chooses its own: on a
    TPU generation (real or emulated) with neither given. Off one, the target's defaults fill what is not
    given (8 rows, 2 pages): the kernels' tuned tables need a chip."""
    if num_queries_per_block is None and num_kv_pages_per_block is None and generations.on_a_tpu_generation():
        return None
    return (
        DEFAULT_QUERIES_PER_BLOCK if num_queries_per_block is None else num_queries_per_block,
        min(DEFAULT_KV_PAGES_PER_BLOCK, pages_per_seq)
        if num_kv_pages_per_block is None
        else num_kv_pages_per_block,
    )


def kernel_arguments(
    q, tokens, cache, kv_lens, page_indices, cu_q_lens, num_seqs, *, chunk_prefill_size=None
) -> tuple:
    """The positional arguments both v3 kernels take: q, the new tokens' keys and values, the packed cache
    (their slots poisoned), the metadata as given with the page table flat, and the distribution (the
    leading decodes run by the decode kernel, then the chunked prefills of ``chunk_prefill_size`` rows)."""
    return (
        q,
        tokens.keys,
        tokens.values,
        cache,
        np.asarray(kv_lens),
        np.asarray(page_indices).reshape(-1),
        np.asarray(cu_q_lens),
        layouts.distribution(tokens.q_lens, num_seqs, chunk_prefill_size=chunk_prefill_size),
    )


def shared_kv_inputs(tokens, kv_pages):
    """For ``update_kv_cache=False`` (a KV-shared layer): the cache to pass is the whole cache, new tokens
    included, and the new tokens' keys and values are NaN, so that a kernel that reads them instead of the
    cache returns NaN; it must return the cache unchanged."""
    unused = dataclasses.replace(
        tokens,
        keys=np.full_like(tokens.keys, np.nan),
        values=np.full_like(tokens.values, np.nan),
        new_slots=np.zeros_like(tokens.new_slots),
    )
    return unused, kv_pages


def v3_arguments(
    q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, update_kv_cache: bool, chunk_prefill_size
) -> tuple[layouts.NewTokens, tuple]:
    """The positional arguments of a kernel with v3's API for an upstream-style case, and the new tokens they
    hold (``tpu_inference_v3.adapter.v3_inputs`` says how the new tokens and the cache are laid out)."""
    q, kv_pages = np.asarray(q), np.asarray(kv_pages)
    # The kernel receives the metadata as given (its validators judge dtypes and shapes); the split reads
    # only the entries that exist: invalid metadata is the kernel's validators' business.
    tokens = layouts.split_new_tokens(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs)
    if update_kv_cache:
        packed_cache = layouts.pack_cache(tokens.poisoned_cache(kv_pages))
    else:
        tokens, cache = shared_kv_inputs(tokens, kv_pages)
        packed_cache = layouts.pack_cache(cache)
    args = kernel_arguments(
        q,
        tokens,
        packed_cache,
        kv_lens,
        page_indices,
        cu_q_lens,
        num_seqs,
        chunk_prefill_size=chunk_prefill_size,
    )
    return tokens, args


def vmem_limit(vmem_limit_bytes: int | None) -> int | None:
    """v3 takes its default VMEM limit from the chip (``pltpu.get_tpu_info()``): off a TPU generation,
    which has none, the target passes ``DEFAULT_VMEM_LIMIT_BYTES``."""
    if vmem_limit_bytes is None and not generations.on_a_tpu_generation():
        return DEFAULT_VMEM_LIMIT_BYTES
    return vmem_limit_bytes


def replacing_mask_value(mask_value: float | None, mask_value_meaning: str) -> float | None:
    """The ``mask_value`` to pass to a v3 kernel, which replaces a masked logit with it (None: its default,
    which masks fully). With upstream's meaning (added) only its defaults have a v3 counterpart."""
    if mask_value_meaning == MASK_REPLACES:
        return mask_value
    if mask_value in (None, UPSTREAM_DEFAULT_MASK_VALUE):
        return None
    raise ValueError(
        f"mask_value={mask_value!r} with mask_value_meaning={mask_value_meaning!r}: v3 replaces a masked "
        f"logit with mask_value, so an added mask has no v3 counterpart; pass "
        f"mask_value_meaning={MASK_REPLACES!r} (or the default mask_value)"
    )
