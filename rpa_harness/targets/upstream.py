"""jax's upstream ragged paged attention (``jax.experimental.pallas.ops.tpu.ragged_paged_attention``): its profile.

Upstream's module cannot declare one, so the harness keeps it here: what is drawn for it, and its known
issues (``docs/upstream-findings/``) with their predicates. The predicates restate the causes worked out from
upstream's kernel source (``ragged_paged_attention/kernel.py``; identical in jax 0.10.2 and 0.12): the kernel
walks a grid of (KV-head block, query block); inside a query block it visits the sequences whose rows it
holds, in order, and for each one its KV blocks of ``num_kv_pages_per_block * page_size`` keys, prefetching
the next block into the other half of a double buffer before it waits for the current.
"""

import dataclasses
import itertools
import math
import re

import numpy as np
from jax.experimental.pallas import tpu as pltpu

from rpa_harness import device, generations
from rpa_harness.failures import (
    DoesNotCompile,
    NeedsMoreVmem,
    OverTheBound,
    RaisedOnValidInput,
    WouldHaltATpu,
)
from rpa_harness.known_issues import (
    FLOAT32_EXP_UNDERFLOW,
    NUMERIC_MISMATCH,
    KnownIssue,
    case_arrays,
    findings_dir,
    hidden_keys,
    keep_sequences,
    sequence_queries_and_keys,
    soft_capped_logits,
)
from rpa_harness.lowering import real_tpu_generation
from rpa_harness.spec.interface import DEFAULT_MASK_VALUE, MASK_ADDED, values_per_word
from rpa_harness.strategies.capabilities import Capabilities
from rpa_harness.strategies.case import DTYPES, Case

FINDINGS = findings_dir("upstream-findings")

# Upstream's validators are the specification's (RULES); its default block sizes come from a per-chip table
# (tuned_block_sizes.get_tuned_block_sizes reads jax.devices()[0].device_kind): on a CPU device both block
# sizes are given, on an emulated generation they are drawn or left to the table. One K/V scale with mixed
# dtypes is a bug, not a documented limitation: the known issue one-kv-scale-with-mixed-dtypes, not
# paired_kv_scales_for_mixed_dtypes.
RPA_HARNESS_CAPABILITIES = Capabilities(
    head_dims=(128, 256),
    even_kv_heads_for_fp8=True,
    needs_block_sizes=True,
    tpu_generations=("v4", "v5e", "v5p", "v6e", "7x"),
    buckets=("tiny", "small", "long"),
)
# kernel.py: q @ K^T is a jnp.einsum and P @ V a jnp.dot, both without a precision: DEFAULT, one bfloat16
# pass for float32 operands on a TPU.
RPA_HARNESS_PRODUCT_PRECISION = "default"


# --- How upstream's kernel schedules a call (restated from its source) ---------------------------------


def _fully_tiled(count: int, packing: int) -> bool:
    if count % packing:
        return False
    count //= packing
    return count in (1, 2, 4, 8) or count % 8 == 0


def upstream_heads_per_block(case: Case) -> tuple[int, int]:
    """(q heads, combined K/V heads) of one of upstream's head blocks: the smallest that tiles, else all."""
    combined = 2 * case.num_kv_heads
    kv_tiling = 8 * values_per_word(case.kv_dtype)
    combined_per_block = kv_tiling if combined % kv_tiling == 0 else combined
    q_heads_per_block = combined_per_block // 2 * (case.num_q_heads // case.num_kv_heads)
    if not _fully_tiled(q_heads_per_block, values_per_word(case.q_dtype)):
        return case.num_q_heads, combined
    return q_heads_per_block, combined_per_block


def upstream_head_blocks(case: Case) -> int:
    """How many KV-head blocks upstream's grid has."""
    return case.num_q_heads // upstream_heads_per_block(case)[0]


# --- 1. empty-sequence-shifts-kv-pages -------------------------------------------------------------------


def _stealing_empty_sequences(case: Case) -> list[bool]:
    """Per sequence: it has kv_len == 0 and the prefetch made for it is consumed by a sequence with rows.

    Nothing waits for the KV block prefetched for a sequence with kv_len == 0 (its loop over KV blocks runs
    zero times), so the next KV-block iteration in the kernel's order computes from it instead of its own:
    the first later sequence with kv_len > 0, or, after the last sequence, the first such sequence of the
    next KV-head block. A consumer without query rows (q_len == 0) stores nothing and absorbs the shift.
    """
    q, kv = case.q_lens, case.kv_lens
    n = len(kv)
    wraps = upstream_head_blocks(case) > 1
    stealing = []
    for i in range(n):
        if kv[i] != 0:
            stealing.append(False)
            continue
        later = [j for j in range(i + 1, n) if kv[j] > 0]
        if not later and wraps:
            later = [j for j in range(i) if kv[j] > 0]
        stealing.append(bool(later) and q[later[0]] > 0)
    return stealing


def empty_sequence_shifts_kv_pages(case: Case) -> bool:
    return any(_stealing_empty_sequences(case))


def drop_stealing_empty_sequences(case: Case) -> Case:
    """Drops the empty sequences whose prefetch would be stolen (the others' consumers are unchanged)."""
    return keep_sequences(case, [not s for s in _stealing_empty_sequences(case)])


# --- 2. one-kv-scale-with-mixed-dtypes -------------------------------------------------------------------


def one_kv_scale_with_mixed_dtypes(case: Case) -> bool:
    """Only the scaled side is cast to q's dtype, so K and V differ in dtype and an assert fails."""
    return (case.k_scale is None) != (case.v_scale is None) and case.q_dtype != case.kv_dtype


def without_kv_scales(case: Case) -> Case:
    return dataclasses.replace(case, k_scale=None, v_scale=None)


# --- 3. finite-mask-value-weights-keys-past-kv-len -------------------------------------------------------


def _block_sizes_used(case: Case) -> tuple[int, int] | None:
    """(num_kv_pages_per_block, num_queries_per_block) upstream runs the case with: both given, else None.
    Upstream's kernel takes both from its tuned table when either is None (kernel.py: ``if num_q_per_blk is
    None or num_kv_pages_per_blk is None``), the given one included: sizes unknown here."""
    if case.num_kv_pages_per_block is None or case.num_queries_per_block is None:
        return None
    return case.num_kv_pages_per_block, case.num_queries_per_block


def _partial_last_block(case: Case, kv_len: int) -> bool:
    if (sizes := _block_sizes_used(case)) is None:  # the tuned KV block is unknown: any block may be
        return kv_len > 0
    return kv_len % (sizes[0] * case.page_size) != 0


def _row_max_logits(case: Case, arrays: dict, seq: int, mask_value: float) -> np.ndarray:
    """[q_len, num_q_heads] largest logit (soft cap and mask added, as upstream) over keys [0, kv_len)."""
    q, k = sequence_queries_and_keys(case, arrays, seq)
    if case.k_scale is not None:  # scaled in float32, then rounded to q's dtype (upstream)
        k = (k.astype(np.float32) * np.float32(case.k_scale)).astype(arrays["q"].dtype)
    logits = soft_capped_logits(case, q, k, case.sm_scale)
    masked = hidden_keys(case, case.q_lens[seq], case.kv_lens[seq])
    return (logits + np.where(masked, mask_value, 0.0)[:, None, :]).max(axis=-1)


def finite_mask_value_weights_keys_past_kv_len(case: Case) -> bool:
    """An empty key slot of a live sequence's last KV block gets a non-zero softmax weight.

    Inside a KV block the kernel zeroes K and V past kv_len and leaves those slots to the causal mask, so
    each gets the logit ``0 + mask_value`` and the weight ``exp(mask_value - row max)``: exactly 0 in
    float32 for the default mask value, not for one within ~100 of the row's largest logit.
    """
    if case.mask_value_meaning != MASK_ADDED:  # a replacing mask value is another semantics
        return False
    mask_value = DEFAULT_MASK_VALUE if case.mask_value is None else case.mask_value
    if not math.isfinite(mask_value):
        return False
    candidates = [
        i
        for i, (q, kv) in enumerate(zip(case.q_lens, case.kv_lens, strict=True))
        if q > 0 and _partial_last_block(case, kv)
    ]
    if not candidates:
        return False
    arrays = case_arrays(case)
    return any(
        (mask_value - _row_max_logits(case, arrays, i, mask_value) > FLOAT32_EXP_UNDERFLOW).any()
        for i in candidates
    )


def with_default_mask_value(case: Case) -> Case:
    return dataclasses.replace(case, mask_value=DEFAULT_MASK_VALUE)


# --- 4. zero-query-tail-skips-head-blocks ---------------------------------------------------------------


def zero_query_tail_skips_head_blocks(case: Case) -> bool:
    """The query rows end on a query-block boundary, a sequence follows the last one with rows, and the
    grid has more than one KV-head block.

    The kernel carries (sequence, buffer) from one grid step to the next and resets the sequence to 0 only
    when it ran past the last one. When the last sequence with rows ends exactly at the end of its query
    block, the loop stops there and carries the following (q_len == 0) sequence into the next KV-head
    block, which then starts at that sequence and never computes the earlier ones: their output rows for
    those heads are whatever the accumulator held.
    """
    total = sum(case.q_lens)
    if total == 0 or upstream_head_blocks(case) < 2:
        return False
    if (sizes := _block_sizes_used(case)) is not None and total % sizes[1]:
        return False
    last_with_rows = max(i for i, q in enumerate(case.q_lens) if q > 0)
    return last_with_rows + 1 < case.num_seqs


def drop_zero_query_tail(case: Case) -> Case:
    last_with_rows = max(i for i, q in enumerate(case.q_lens) if q > 0)
    return keep_sequences(case, [i <= last_with_rows for i in range(case.num_seqs)])


# Where the chip's compiler runs: on a TPU, and on this host for one (the compile property).
CHIP_COMPILER = (device.TPU, device.TPU_COMPILER)


# --- 5. wide-heads-strided-kv-load-does-not-compile ------------------------------------------------------


def wide_heads_strided_kv_load(case: Case) -> bool:
    """head_dim past one 128-lane row, and a head block's K/V heads span more than one packed row of the
    cache (float32: always; bfloat16: 2 or more KV heads; fp8: 4 or more). The kernel loads a head's K
    (and V) rows out of the interleaved K/V buffer with a strided load, which Mosaic implements only for a
    last dimension of 128 ("The last dim size is not 128 in original base memref"), on every generation."""
    _, combined = upstream_heads_per_block(case)
    return case.head_dim > 128 and combined > values_per_word(case.kv_dtype)


def with_head_dim_128(case: Case) -> Case:
    return dataclasses.replace(case, head_dim=128)


# --- 6. tuned-blocks-overflow-default-vmem ---------------------------------------------------------------


def _chip_generation() -> str | None:
    """The generation a kernel traced now sees: the emulated one, else a real chip's, else None."""
    if generations.current() != generations.NONE:
        return generations.current()
    return real_tpu_generation()


def _blocks_on_the_chip(case: Case) -> tuple[int, int]:
    """(num_kv_pages_per_block, num_queries_per_block) upstream runs with on the chip it is traced for: both
    given, else its tuned table's (kernel.py takes both from it when either is None)."""
    if (sizes := _block_sizes_used(case)) is not None:
        return sizes
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention.tuned_block_sizes import get_tuned_block_sizes

    q_heads, combined = upstream_heads_per_block(case)
    # The table reads the chip from the device kind: the emulated generation's, or the real chip's.
    return get_tuned_block_sizes(
        DTYPES[case.q_dtype], DTYPES[case.kv_dtype], q_heads, combined // 2, case.head_dim,
        case.page_size, case.max_num_batched_tokens, case.pages_per_seq,
    )  # fmt: skip


def upstream_vmem_bound(case: Case) -> int:
    """An upper bound of the VMEM upstream's kernel takes (kernel.py): its scratch and pipelined blocks (the
    double-buffered KV block, the double-buffered q and output blocks, the float32 accumulator, the l and m
    rows of 128 lanes) and the values it computes from one KV block, counted as a float32 copy of it."""
    kv_pages, queries = _blocks_on_the_chip(case)
    q_heads, combined = upstream_heads_per_block(case)
    group = case.num_q_heads // case.num_kv_heads
    kv_block_elements = kv_pages * case.page_size * combined * case.head_dim
    kv_buffers = 2 * kv_block_elements * DTYPES[case.kv_dtype].itemsize
    q_block = queries * q_heads * case.head_dim * DTYPES[case.q_dtype].itemsize
    accumulator = queries * q_heads * case.head_dim * 4
    l_and_m = 2 * (combined // 2) * queries * group * 128 * 4
    return kv_buffers + 4 * q_block + accumulator + l_and_m + 4 * kv_block_elements


# The scoped VMEM limit the TPU compiler gives a kernel that passes no vmem_limit_bytes (libtpu 0.0.42.1's
# "Scoped allocation with size S and limit L", and v4's "Used S of 16.00M vmem", per generation).
DEFAULT_SCOPED_VMEM_BYTES = {
    "v4": 16 << 20,
    "v5e": 16 << 20,
    "v5p": 16 << 20,
    "v6e": 32 << 20,
    "7x": 32 << 20,
}


def tuned_blocks_overflow_default_vmem(case: Case) -> bool:
    """On a TPU (real or emulated), the kernel's VMEM (bounded by ``upstream_vmem_bound``) may exceed the
    limit it compiles under: ``vmem_limit_bytes``, or without one the compiler's default scoped VMEM
    (``DEFAULT_SCOPED_VMEM_BYTES``), which its own tuned block sizes overflow (128 pages of 64 float32 keys
    of one KV head are 16 MiB of KV buffers, v5e's whole default)."""
    generation = _chip_generation()
    if generation not in DEFAULT_SCOPED_VMEM_BYTES:
        return False
    limit = case.vmem_limit_bytes or DEFAULT_SCOPED_VMEM_BYTES[generation]
    return upstream_vmem_bound(case) > limit


def with_blocks_that_fit(case: Case) -> Case:
    """The call as a caller must make it: a VMEM limit of 3/4 of the chip's VMEM, and the block sizes the
    kernel would take, given, the KV block halved until they fit it."""
    limit = int(pltpu.get_tpu_info().vmem_capacity_bytes * 3 // 4)
    kv_pages, queries = _blocks_on_the_chip(case)
    fitted = dataclasses.replace(
        case, vmem_limit_bytes=limit, num_kv_pages_per_block=kv_pages, num_queries_per_block=queries
    )
    while kv_pages > 1 and tuned_blocks_overflow_default_vmem(fitted):
        kv_pages //= 2
        fitted = dataclasses.replace(fitted, num_kv_pages_per_block=kv_pages)
    return fitted


# --- 7. q-head-block-not-a-multiple-of-8-does-not-lower -------------------------------------------------


def q_head_block_not_a_multiple_of_8(case: Case) -> bool:
    """More than one head block, whose query heads are not a multiple of 8: Pallas' TPU lowering takes a
    block's last two dimensions (q heads, head_dim) only when divisible by (8, 128) or whole. A float32
    cache of 8 or more KV heads with one (or three) query heads per KV head: blocks of 4 KV heads' queries."""
    q_heads, _ = upstream_heads_per_block(case)
    return q_heads != case.num_q_heads and q_heads % 8 != 0


def with_one_head_block(case: Case) -> Case:
    """As many KV heads as one head block holds, the same query heads per KV head: one block of all heads."""
    _, combined = upstream_heads_per_block(case)
    group = case.num_q_heads // case.num_kv_heads
    return dataclasses.replace(case, num_kv_heads=combined // 2, num_q_heads=combined // 2 * group)


# --- 8. unwaited-kv-prefetch-halts-the-chip ---------------------------------------------------------------


def _final_kv_block_runs(case: Case, queries_per_block: int) -> bool:
    """Whether upstream's loops reach the one KV-block iteration that starts no copy: the last sequence's
    last KV block, in the query block where its rows end, in the last KV-head block.

    Walks the kernel's grid (KV-head blocks, then query blocks of ``queries_per_block`` rows) and, in each
    query block, its loop over sequences: the loop runs while the block starts before the last query row
    and a sequence is left, starts at the sequence carried from the previous grid step, moves past a
    sequence whose rows end in the block and stops at one whose rows reach the block's end. The carried
    sequence goes back to 0 once the loop has passed the last one (kernel.py: ``seq_buf_idx_ref``)."""
    ends = list(itertools.accumulate(case.q_lens))
    total, last, head_blocks = sum(case.q_lens), case.num_seqs - 1, upstream_head_blocks(case)
    seq = 0
    for head_block in range(head_blocks):
        for block_start in range(0, case.max_num_batched_tokens, queries_per_block):
            block_end = block_start + queries_per_block
            while block_start < total and seq <= last:
                ends_here = ends[seq] <= block_end
                if head_block == head_blocks - 1 and seq == last and ends_here and case.kv_lens[seq] > 0:
                    return True
                reaches_block_end = ends[seq] >= block_end
                if ends_here:
                    seq += 1
                if reaches_block_end:
                    break
            if seq > last:
                seq = 0
    return False


def unwaited_kv_prefetch(case: Case) -> bool:
    """The call ends with a KV-block copy started and never waited for (a DMA in flight at kernel exit).

    Grid step (0, 0) starts the copy of the first KV block whatever the batch holds; from then on each
    iteration over a sequence's KV blocks starts the copy of the next block (its own, the next sequence's,
    or the first of the next KV-head block) and waits for its own, except the iteration that has nothing
    after it (``_final_kv_block_runs``). Where that iteration does not run, the last copy started is never
    waited for: in an empty batch or one without query rows (the loop over sequences never runs), where
    the last sequence has kv_len == 0 (it has no KV iteration), or where q_len == 0 sequences follow rows
    that end on a query-block boundary (the loop stops at the boundary and never reaches them)."""
    if sum(case.q_lens) == 0:
        return True
    return not _final_kv_block_runs(case, _blocks_on_the_chip(case)[1])


def with_every_kv_prefetch_waited(case: Case) -> Case:
    """The sequences up to the last one with query rows (the loop then reaches the last sequence, which
    has keys); where none has rows, one sequence of one query token."""
    if sum(case.q_lens) == 0:
        return dataclasses.replace(case, q_lens=(1,), kv_lens=(max([1, *case.kv_lens[:1]]),))
    return drop_zero_query_tail(case)


# A halted chip's runtime error, which a halt repro's failure quotes (``device.HALT_MESSAGES``).
HALTED = "|".join(re.escape(message) for message in device.HALT_MESSAGES)


# --- The catalogue -----------------------------------------------------------------------------------------

RPA_HARNESS_CATALOGUE = (
    KnownIssue(
        "empty-sequence-shifts-kv-pages",
        "a sequence with kv_len == 0 hands its prefetched KV page to the next sequence that has query rows",
        FINDINGS / "empty-sequence-shifts-kv-pages" / "differential_interpret.json",
        empty_sequence_shifts_kv_pages,
        drop_stealing_empty_sequences,
        NUMERIC_MISMATCH,
        fails_as=(OverTheBound,),
    ),
    KnownIssue(
        "one-kv-scale-with-mixed-dtypes",
        "exactly one of k_scale/v_scale with q's dtype different from the cache's fails an assert",
        FINDINGS / "one-kv-scale-with-mixed-dtypes" / "differential_fast-interpret.json",
        one_kv_scale_with_mixed_dtypes,
        without_kv_scales,
        r"raised on valid inputs: AssertionError",
        fails_as=(RaisedOnValidInput,),
    ),
    KnownIssue(
        "finite-mask-value-weights-keys-past-kv-len",
        "a finite mask_value gives softmax weight to the empty key slots of a sequence's last KV block",
        FINDINGS / "finite-mask-value-weights-keys-past-kv-len" / "differential_interpret.json",
        finite_mask_value_weights_keys_past_kv_len,
        with_default_mask_value,
        NUMERIC_MISMATCH,
        fails_as=(OverTheBound,),
    ),
    KnownIssue(
        "zero-query-tail-skips-head-blocks",
        "query rows ending on a query-block boundary, then a q_len == 0 sequence: later KV-head blocks "
        "skip every sequence",
        FINDINGS / "zero-query-tail-skips-head-blocks" / "differential_fast-interpret.json",
        zero_query_tail_skips_head_blocks,
        drop_zero_query_tail,
        NUMERIC_MISMATCH,
        fails_as=(OverTheBound,),
    ),
    KnownIssue(
        "wide-heads-strided-kv-load-does-not-compile",
        "head_dim past 128 with a head block's K/V heads past one packed row (float32: any) does not compile "
        "for any TPU (Mosaic: the last dim size is not 128)",
        FINDINGS / "wide-heads-strided-kv-load-does-not-compile" / "compiles_tpu-compiler-v5e.json",
        wide_heads_strided_kv_load,
        with_head_dim_128,
        r"does not compile for .*The last dim size is not 128",
        backends=CHIP_COMPILER,
        fails_as=(DoesNotCompile,),
    ),
    KnownIssue(
        "q-head-block-not-a-multiple-of-8-does-not-lower",
        "head blocks of a number of query heads not a multiple of 8 (float32, 8+ KV heads, 1 or 3 query "
        "heads each) do not lower for a TPU",
        FINDINGS / "q-head-block-not-a-multiple-of-8-does-not-lower" / "compiles_tpu-compiler-v5e.json",
        q_head_block_not_a_multiple_of_8,
        with_one_head_block,
        r"does not compile for .*last two dimensions of your block shape are divisible by 8 and 128",
        backends=CHIP_COMPILER,
        fails_as=(DoesNotCompile,),
    ),
    KnownIssue(
        "unwaited-kv-prefetch-halts-the-chip",
        "a KV-block copy started and never waited for (an empty batch, no query rows, a last sequence "
        "never reached or without keys) halts a TPU v5e, in its call or the next",
        FINDINGS / "unwaited-kv-prefetch-halts-the-chip" / "differential-checked_interpret.json",
        unwaited_kv_prefetch,
        with_every_kv_prefetch_waited,
        f"{HALTED}|{re.escape(device.WOULD_HALT_A_TPU)}",
        backends=(device.TPU, device.INTERPRET),
        fails_as=(WouldHaltATpu,),
    ),
    KnownIssue(
        "tuned-blocks-overflow-default-vmem",
        "without vmem_limit_bytes it compiles under the compiler's default scoped VMEM (16 MiB on v5e), "
        "which its tuned block sizes overflow",
        FINDINGS / "tuned-blocks-overflow-default-vmem" / "compiles_tpu-compiler-v5e.json",
        tuned_blocks_overflow_default_vmem,
        with_blocks_that_fit,
        r"needs more VMEM than .*scoped limit",
        backends=CHIP_COMPILER,
        fails_as=(NeedsMoreVmem,),
    ),
)
# Every catalogued issue is still present in the jax versions the harness supports.
RPA_HARNESS_KNOWN_ISSUES = tuple(issue.name for issue in RPA_HARNESS_CATALOGUE)
