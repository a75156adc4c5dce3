"""Known issues of v3 as tpu-inference 0.11.1 to 0.13.x ship it (``docs/tpu-inference-v3-findings/early-*``)
and their predicates, each entry with the releases that have it.

Restated from those releases' ``v3/kernel.py``: per sequence, query blocks of ``num_queries_per_block`` rows
(one row for the leading decodes); every query block walks the whole KV blocks of ``num_kv_pages_per_block``
pages from 0 through the block holding key ``kv_len - 1`` (no compute chunks, no causal stop), and masks a
logit by adding ``mask_value`` (0.11.1, 0.12.0) or replacing it (0.13.x). 0.13.x also starts each sequence's
KV prefetches at its window's block ``max(kv_len - q_len - sliding_window, 0) // bkv`` and zeroes its KV
buffers in its prologue as int32 tiles of 8 x 128 words. The block sizes are the v3 target's mapping of the
case (``early_api.early_v3_inputs``): the case's, or the tuned table's for the chip a generation emulates.
"""

import dataclasses
import functools
import math

import numpy as np

from rpa_harness import generations
from rpa_harness.failures import NonFiniteOutput, OverTheBound, RaisedOnValidInput
from rpa_harness.known_issues import (
    FLOAT32_EXP_UNDERFLOW,
    NUMERIC_MISMATCH,
    KnownIssue,
    case_arrays,
    findings_dir,
    hidden_keys,
    sequence_queries_and_keys,
    soft_capped_logits,
)
from rpa_harness.reference.float64 import quantised_query
from rpa_harness.spec.interface import MASK_ADDED, MASK_REPLACES, values_per_word
from rpa_harness.strategies.case import Case
from rpa_harness.targets.tpu_inference.arguments import UPSTREAM_DEFAULT_MASK_VALUE
from rpa_harness.targets.tpu_inference_v3 import adapter

FINDINGS = findings_dir("tpu-inference-v3-findings")
SUBLANES = 8  # rows of 32-bit words in a TPU tile: 0.13.x's prologue reshapes each KV buffer to them
LANES = 128


@functools.lru_cache(maxsize=1)
def _inputs_on(case: Case, generation: str) -> adapter.V3Inputs:
    return adapter.v3_inputs(**case_arrays(case), **case.options())


def _kv_block(case: Case) -> int:
    """Keys per KV block, as the installed kernel runs the case on the chip seen now."""
    return _inputs_on(case, generations.current()).mixed_block_sizes[1]


def _rows_per_key(case: Case) -> int:
    """Rows of 128 32-bit words per key in the KV buffer: K and V of every KV head, padded to the packing,
    ``packing`` per word, head_dim padded to 128 lanes."""
    packing = values_per_word(case.kv_dtype)
    return -(-2 * case.num_kv_heads // packing) * -(-case.head_dim // LANES)


def early_kv_block_not_whole_tiles(case: Case) -> bool:
    """A KV block whose rows (keys times rows per key) are not a multiple of 8: 0.13.x's prologue
    ``bkv_x2_ref.bitcast(jnp.int32).reshape((2, -1, 8, 128))`` raises while the kernel traces, for a block
    its validators accept (any positive ``num_kv_pages_per_block``)."""
    return _kv_block(case) * _rows_per_key(case) % SUBLANES != 0


def with_whole_tile_kv_blocks(case: Case) -> Case:
    """The KV block of whole tiles nearest the case's (a tuning change), within the page table where one is
    (8 pages always are whole tiles)."""
    inputs = _inputs_on(case, generations.current())
    queries, kv_pages = inputs.mixed_block_sizes[0], inputs.mixed_block_sizes[1] // case.page_size
    whole = [
        pages
        for pages in range(1, max(case.pages_per_seq, SUBLANES) + 1)
        if pages * case.page_size * _rows_per_key(case) % SUBLANES == 0
    ]
    nearest = min(whole, key=lambda pages: (pages > case.pages_per_seq, abs(pages - kv_pages), pages))
    return dataclasses.replace(case, num_kv_pages_per_block=nearest, num_queries_per_block=queries)


def _window_start_blocks(case: Case) -> list[int]:
    """Per live sequence, the KV block 0.13.x starts its prefetches at: its window's first block."""
    assert case.sliding_window is not None  # asked only of a case with a window
    bkv = _kv_block(case)
    return [
        max(kv_len - q_len - case.sliding_window, 0) // bkv
        for q_len, kv_len in zip(case.q_lens, case.kv_lens, strict=True)
    ]


def early_window_past_block_0(case: Case) -> bool:
    """A sliding window that starts a live sequence past its first KV block (``kv_len - q_len -
    sliding_window >= bkv``)."""
    return case.sliding_window is not None and any(_window_start_blocks(case))


def with_window_from_block_0(case: Case) -> Case:
    """The narrowest window that starts every sequence in its first KV block, whatever the block: as wide as
    the keys before the longest run of new tokens."""
    return dataclasses.replace(
        case, sliding_window=max(kv - q for q, kv in zip(case.q_lens, case.kv_lens, strict=True))
    )


def early_row_max_logits(case: Case, arrays: dict, seq: int, mask_value: float) -> np.ndarray:
    """[q_len, num_q_heads] largest logit over keys [0, kv_len) as the early kernels compute them: q
    quantised with q_scale, k_scale and q_scale folded into the score scale, soft cap, then the mask value
    added to (``added``) or put in place of (``replaces``) each masked logit, by the case's meaning."""
    q, k = sequence_queries_and_keys(case, arrays, seq)
    q = quantised_query(q, case.q_scale, k.dtype)
    logits = soft_capped_logits(case, q, k, case.sm_scale * (case.k_scale or 1.0) * (case.q_scale or 1.0))
    masked = hidden_keys(case, case.q_lens[seq], case.kv_lens[seq])[:, None, :]
    if case.mask_value_meaning == MASK_ADDED:
        return (logits + np.where(masked, mask_value, 0.0)).max(axis=-1)
    return np.where(masked, mask_value, logits).max(axis=-1)


def finite_mask_value_weights_slots_past_kv_len(case: Case) -> bool:
    """A finite mask value with a weight ``exp(mask_value - row max)`` that does not underflow, in a live
    sequence whose last KV block has slots past kv_len (``kv_len`` not a multiple of the block).

    The early kernels mask those slots as keys the causal mask hides: 0.11.1 and 0.12.0 zero their K and V
    and add the mask value to the logit 0, 0.13.x replaces their logit (its buffer holds zeros or stale keys
    and values there): each gets the weight ``exp(mask_value - m)``. Every key in [0, kv_len) is visited
    (no block is skipped), so those slots are the only difference from the specified semantics.
    """
    mask_value = UPSTREAM_DEFAULT_MASK_VALUE if case.mask_value is None else case.mask_value
    if not math.isfinite(mask_value):
        return False
    bkv = _kv_block(case)
    arrays = None
    for seq, kv_len in enumerate(case.kv_lens):
        if kv_len % bkv == 0:
            continue
        arrays = arrays or case_arrays(case)
        if (mask_value - early_row_max_logits(case, arrays, seq, mask_value) > FLOAT32_EXP_UNDERFLOW).any():
            return True
    return False


def added_finite_mask_value_weights_slots_past_kv_len(case: Case) -> bool:
    """``finite_mask_value_weights_slots_past_kv_len`` with an added mask value (0.11.1, 0.12.0)."""
    return case.mask_value_meaning == MASK_ADDED and finite_mask_value_weights_slots_past_kv_len(case)


def replacing_finite_mask_value_weights_slots_past_kv_len(case: Case) -> bool:
    """``finite_mask_value_weights_slots_past_kv_len`` with a replacing mask value (0.13.x)."""
    return case.mask_value_meaning == MASK_REPLACES and finite_mask_value_weights_slots_past_kv_len(case)


def with_default_mask_value(case: Case) -> Case:
    """The kernels' default mask value (masked keys get no weight, under either meaning)."""
    return dataclasses.replace(case, mask_value=None)


RPA_HARNESS_CATALOGUE = (
    KnownIssue(
        "early-kv-block-not-whole-tiles-fails-to-trace",
        "a KV block of fewer than 8 rows of 32-bit words (or not a multiple of 8): the kernel's prologue "
        "raises a reshape ValueError while it traces; its validators accept the block",
        FINDINGS / "early-kv-block-not-whole-tiles-fails-to-trace" / "differential-checked_interpret.json",
        early_kv_block_not_whole_tiles,
        with_whole_tile_kv_blocks,
        r"do not evenly divide the size of the ref",
        releases=">=0.13.0,<0.18.0",
        explanation=(
            "The prologue zeroes the KV double buffer as int32 tiles, `bkv_x2_ref.bitcast(jnp.int32).reshape("
            "(2, -1, 8, 128))`, which needs the block's rows (keys times `num_kv_heads_x2 // kv_packing` rows "
            "of 128 words per key for each 128 lanes of head_dim) to be a multiple of 8. "
            "`static_validate_inputs` accepts any positive `num_kv_pages_per_block`, so a caller learns the "
            "rule from a reshape error. 0.11.1 and 0.12.0 have no such prologue."
        ),
        fails_as=(RaisedOnValidInput,),
    ),
    KnownIssue(
        "early-window-past-block-0-desyncs-kv-prefetch",
        "a sliding window that starts a sequence past its first KV block: the kernel prefetches the window's "
        "block but its KV loop starts at block 0, so it waits for a copy of another size (a deadlock) or "
        "runs its first step on a softmax state it has not initialised (non-finite rows)",
        FINDINGS / "early-window-past-block-0-desyncs-kv-prefetch" / "differential-checked_interpret.json",
        early_window_past_block_0,
        with_window_from_block_0,
        rf"deadlock|non-finite values|{NUMERIC_MISMATCH}",
        releases=">=0.13.0,<0.18.0",
        explanation=(
            "0.13.x computes each sequence's first KV block `bkv_idx_start = max(kv_len - q_len - "
            "sliding_window, 0) // bkv_sz`, starts the prologue's and `get_next_bkv_ids`'s prefetches of the "
            "sequence there and initialises `m` and `l` at `bkv_idx == bkv_idx_start`, but its KV loop is "
            "still `lax.fori_loop(0, num_bkv, compute_with_bkv, None)` (and `acc` is initialised at `bkv_idx "
            "== 0`). Its first step waits for block 0 (`wait_fetch_bkv(seq_idx, 0, ...)`, sized as block 0) "
            "while the copy in flight is block `bkv_idx_start`'s: where the sizes differ the wait never "
            "completes (the TPU interpreter reports the deadlock). Where they agree, the steps before "
            "`bkv_idx_start` read `m` and `l` before they are initialised for the query block: a row whose "
            "scratch holds no finite earlier value (uninitialised VMEM; NaN on the interpreters) puts NaN in "
            "`acc`, which the reset at `bkv_idx_start` scales by 0 and keeps NaN. What a TPU's stale VMEM "
            "gives there has not been run on hardware. 0.11.1 and 0.12.0 fetch from block 0 and only mask "
            "the window."
        ),
        fails_as=(RaisedOnValidInput, NonFiniteOutput, OverTheBound),
    ),
    KnownIssue(
        "early-finite-mask-value-weights-slots-past-kv-len",
        "an added finite mask_value gives softmax weight to the empty slots past kv_len in a sequence's "
        "last KV block",
        FINDINGS
        / "early-finite-mask-value-weights-slots-past-kv-len"
        / "differential-checked_interpret.json",
        added_finite_mask_value_weights_slots_past_kv_len,
        with_default_mask_value,
        NUMERIC_MISMATCH,
        releases="<0.13.0",
        explanation=(
            "Every query block computes logits for whole KV blocks through the block holding key `kv_len - "
            "1`. The slots past `kv_len` in that block have their K and V zeroed (`bkv_mask`) and are masked "
            "as keys the causal mask hides, `s += jnp.where(mask, mask_value, 0.0)`: each gets the logit "
            "`mask_value` and the weight `exp(mask_value - m)` in the denominator, 0 in float32 for the "
            "default mask value, not for one within ~100 of the row's largest logit. The reference "
            "(`ref_ragged_paged_attention`) gives weight to keys in `[0, kv_len)` only. Upstream jax's kernel "
            "has the same bug (`finite-mask-value-weights-keys-past-kv-len`)."
        ),
        fails_as=(OverTheBound,),
    ),
    KnownIssue(
        "early-finite-mask-value-weights-stale-slots-past-kv-len",
        "a replacing finite mask_value gives softmax weight to the slots past kv_len in a sequence's last "
        "KV block, with whatever values the KV buffer holds there",
        FINDINGS
        / "early-finite-mask-value-weights-stale-slots-past-kv-len"
        / "differential-checked_interpret.json",
        replacing_finite_mask_value_weights_slots_past_kv_len,
        with_default_mask_value,
        NUMERIC_MISMATCH,
        releases=">=0.13.0,<0.18.0",
        explanation=(
            "Every query block computes logits for whole KV blocks through the block holding key `kv_len - "
            "1`, and `s = jnp.where(mask, s, mask_value)` replaces the logits of the slots past `kv_len` in "
            "that block, which the causal mask hides: each gets the weight `exp(mask_value - m)`, and enters "
            "P @ V with the value the KV buffer holds there (0.13.x no longer zeroes them: zeros from the "
            "prologue, or a key of an earlier block or sequence). 0 in float32 for the default mask value, "
            "not for one within ~100 of the row's largest logit. 0.13.x's reference "
            "(`ref_ragged_paged_attention`) still adds the mask value (`attn += jnp.where(mask, mask_value, "
            "0.0)`) and weights keys in `[0, kv_len)` only."
        ),
        fails_as=(OverTheBound,),
    ),
)
