"""tpu-inference v3's known issues (``docs/tpu-inference-v3-findings/``) and their predicates.

Restated from v3's kernel (``tpu_inference/kernels/ragged_paged_attention/v3/kernel.py``, 0.32.0): per
sequence, query blocks of bq rows (one row per block for the leading decodes, v3's decode kernel); each
query block walks KV blocks of bkv keys from max(first position - window, 0) // bkv (0 without a window)
up to its effective length min(kv_len, first position + bq), each block in compute chunks of bkv_chunk
keys up to that length. The block sizes are the v3 target's mapping of the case (``v3_inputs``): the
case's, or v3's defaults for the chip a generation emulates. A fork with v3's API declares these issues
with its own kernel's choices read instead (``for_module``).
"""

import contextvars
import dataclasses
import functools
import os
import types
from collections.abc import Callable
from typing import NamedTuple

import ml_dtypes
import numpy as np

from rpa_harness import generations
from rpa_harness.device import processes
from rpa_harness.failures import CacheMismatch, NonFiniteOutput, OverTheBound, RaisedOnValidInput
from rpa_harness.known_issues import (
    FLOAT32_EXP_UNDERFLOW,
    NUMERIC_MISMATCH,
    KnownIssue,
    TuningFinding,
    case_arrays,
    findings_dir,
    keep_sequences,
    sequence_queries_and_keys,
)
from rpa_harness.reference.tolerance import half_ulp
from rpa_harness.strategies.case import DTYPES, Case
from rpa_harness.targets.tpu_inference.arguments import DEFAULT_QUERIES_PER_BLOCK
from rpa_harness.targets.tpu_inference.findings import (
    INT16_MAX,
    finite_replacing_mask_value,
    v3_logits,
    v3_row_max_logits,
    with_a_window_within_int16,
    with_v3_default_mask_value,
)
from rpa_harness.targets.tpu_inference_v3 import adapter as v3
from rpa_harness.targets.tpu_inference_v3.both_outputs import unwritten_by_sliding_window

FINDINGS = findings_dir("tpu-inference-v3-findings")


# The kernel module whose validator and default block sizes the predicates restate: None for v3's, a
# loader of a fork's while its entries (``for_module``) judge a case.
_MODULE: contextvars.ContextVar[Callable[[], types.ModuleType] | None] = contextvars.ContextVar(
    "module", default=None
)


def _v3_inputs(case: Case) -> v3.V3Inputs:
    """The case in v3's terms on the chip seen now (predicates read it; built once per case, chip and
    kernel module)."""
    return _v3_inputs_on(case, generations.current(), _MODULE.get())


@functools.lru_cache(maxsize=1)
def _v3_inputs_on(case: Case, generation: str, module) -> v3.V3Inputs:
    return v3.v3_inputs(**case_arrays(case), **case.options(), module=None if module is None else module())


def for_module(issue: KnownIssue, module: Callable[[], types.ModuleType]) -> KnownIssue:
    """``issue`` as a fork of v3 with v3's API has it: its predicates read the fork's choices (``module()``,
    its kernel module: its validator and default block sizes) where they read v3's."""

    def reading(function):
        @functools.wraps(function)
        def with_the_module(case):
            token = _MODULE.set(module)
            try:
                return function(case)
            finally:
                _MODULE.reset(token)

        return with_the_module

    return dataclasses.replace(
        issue, matches=reading(issue.matches), nearest_outside=reading(issue.nearest_outside)
    )


class QueryBlock(NamedTuple):
    """One query block of one live sequence, as v3's kernel walks it."""

    seq: int
    first: int  # its first query row in the sequence
    rows: int
    start: int  # the first key it visits (the window's first KV block)
    effective: int  # its effective kv length: keys from here on are masked and their values zeroed
    end: int  # the end of the keys it visits (its last compute chunk's end)
    bkv: int  # keys per KV block
    bkv_chunk: int  # keys per compute chunk (one online-softmax step)

    def chunks(self):
        """The key ranges ``[a, b)`` of its compute chunks, clipped to the effective kv length (the keys past
        it get no weight under v3's default mask value)."""
        for block in range(self.start, self.end, self.bkv):
            for a in range(block, min(block + self.bkv, self.end), self.bkv_chunk):
                b = min(a + self.bkv_chunk, block + self.bkv, self.effective)
                if a < b:
                    yield a, b


def _v3_query_blocks(case: Case):
    """Per live sequence and query block, a ``QueryBlock``: its rows, the keys it visits and its blocking."""
    inputs = _v3_inputs(case)
    decodes = int(inputs.args[-1][0])
    window = case.sliding_window
    for i, (q_len, kv_len) in enumerate(zip(case.q_lens, case.kv_lens, strict=True)):
        bq, bkv, _, bkv_chunk = inputs.decode_block_sizes if i < decodes else inputs.mixed_block_sizes
        block_rows = min(bq, 1) if i < decodes else bq
        for first in range(0, q_len, block_rows):
            position = kv_len - q_len + first
            start = max(position - window, 0) // bkv * bkv if window is not None else 0
            effective = min(kv_len, position + block_rows) if case.use_causal_mask else kv_len
            last_block = (-(-effective // bkv) - 1) * bkv
            end = last_block + -(-(effective - last_block) // bkv_chunk) * bkv_chunk
            yield QueryBlock(i, first, min(block_rows, q_len - first), start, effective, end, bkv, bkv_chunk)


def v3_sliding_window_skips_cache_writes(case: Case) -> bool:
    """A sliding window lets the last query block of a sequence skip KV blocks that hold new tokens."""
    if case.sliding_window is None:
        return False
    return bool(unwritten_by_sliding_window(_v3_inputs(case)).any())


def one_query_block_per_sequence(case: Case) -> Case:
    """Query blocks at least as long as the longest sequence: the last block is the only one (a tuning
    change). Their length is the next power of two, so that the layouts of one configuration share a few
    compilations (a block size is static) rather than one for each longest sequence."""
    return dataclasses.replace(case, num_queries_per_block=1 << (max(max(case.q_lens), 1) - 1).bit_length())


def v3_q_len_zero_before_live_sequence(case: Case) -> bool:
    """A q_len == 0 sequence followed by one with query rows (v3's validator forbids q_len == 0)."""
    return any(q == 0 and any(case.q_lens[i + 1 :]) for i, q in enumerate(case.q_lens))


def drop_empty_sequences_before_live_ones(case: Case) -> Case:
    q = case.q_lens
    return keep_sequences(case, [not (q[i] == 0 and any(q[i + 1 :])) for i in range(case.num_seqs)])


def v3_finite_mask_value_counts_keys_by_block(case: Case) -> bool:
    """A finite replacing mask_value with a weight exp(mask_value - row max) that does not underflow, in a
    query block whose visited keys are not exactly [0, kv_len) with every value kept.

    v3's kernel replaces every masked logit it computes and computes none outside the KV blocks a query
    block visits (the window's skipped blocks, the blocks past the block's last position). Within them it
    also zeroes the values from the block's effective kv length min(kv_len, last position + 1) on, the
    empty slots past kv_len in its last compute chunk included: those keys get the weight with a value of
    0. The masked keys that get weight, and with what value, are set by the block sizes. Its reference
    gives every masked key in [0, kv_len) the weight with its value, and no other key.
    """
    mask_value = finite_replacing_mask_value(case)
    if mask_value is None:
        return False
    arrays = None
    for block in _v3_query_blocks(case):
        if block.start == 0 and block.effective == block.end == case.kv_lens[block.seq]:
            continue
        arrays = arrays or case_arrays(case)
        row_max = v3_row_max_logits(case, arrays, block.seq, mask_value)[
            block.first : block.first + block.rows
        ]
        if (mask_value - row_max > FLOAT32_EXP_UNDERFLOW).any():
            return True
    return False


def v3_out_dtype_not_q_dtype(case: Case) -> bool:
    """An ``out_dtype`` (the accumulators' dtype) other than q's: the kernel stores its result by bitcasting
    it into q's packed layout, which holds a value of q's width only."""
    return case.out_dtype is not None and case.out_dtype != case.q_dtype


def with_q_dtype_accumulators(case: Case) -> Case:
    """v3's default ``out_dtype``: q's (float32 for float32 queries, else bfloat16)."""
    return dataclasses.replace(case, out_dtype=None)


BFLOAT16 = np.dtype(ml_dtypes.bfloat16)


def v3_accumulator_dtype(case: Case) -> np.dtype:
    """The dtype of v3's running max, sum and accumulator: ``out_dtype``, else float32 for float32 queries
    and bfloat16 for the others (kernel.py: ``out_dtype = jnp.float32 if q.dtype == jnp.float32 else
    jnp.bfloat16``)."""
    if case.out_dtype is not None:
        return np.dtype(DTYPES[case.out_dtype])
    return np.dtype(np.float32) if case.q_dtype == "float32" else BFLOAT16


def v3_row_sum_rounds_away_weights(case: Case) -> bool:
    """bfloat16 accumulators, and a query row with a compute chunk whose weights a bfloat16 running sum can
    round away: each below half a bfloat16 ulp of the chunk's sum, together more than half an ulp of it
    (more than the one rounding of the row sum the declared contract allows).

    v3 sums a chunk's weights with ``jnp.sum(p, axis=1, keepdims=True, dtype=out_dtype)``, which casts the
    float32 weights to bfloat16 and reduces them in bfloat16: whatever the order of the additions, a weight
    below half an ulp of the partial sum it is added to is lost. A chunk's weights are taken against its own
    largest logit (the running max scales them and their sum alike). With a finite mask value the masked
    keys' weights count too.

    It matches the loss that is systematic (dropped weights all err one way); the roundings of the weights
    a bfloat16 sum keeps err both ways, and a case with only those is left to the contract's margin, which
    the calibration measures (docs/measurements.md#calibration-at-nightly-scale)."""
    if v3_accumulator_dtype(case) != BFLOAT16:
        return False
    arrays = case_arrays(case)
    finite = finite_replacing_mask_value(case)
    mask_value = -np.inf if finite is None else finite
    sequences = {}
    for block in _v3_query_blocks(case):
        if block.seq not in sequences:
            sequences[block.seq] = sequence_queries_and_keys(case, arrays, block.seq)
        q, k = sequences[block.seq]
        for a, b in block.chunks():
            logits = v3_logits(
                case, q, k, block.seq, mask_value, slice(block.first, block.first + block.rows), slice(a, b)
            )
            with np.errstate(invalid="ignore"):
                weights = np.nan_to_num(np.exp(logits - logits.max(axis=-1, keepdims=True)))
            total = weights.sum(axis=-1, keepdims=True)
            unit = half_ulp(total, BFLOAT16)
            lost = np.where(weights < unit, weights, 0.0).sum(axis=-1, keepdims=True)
            if (lost > unit).any():
                return True
    return False


def with_weights_a_bfloat16_sum_keeps(case: Case) -> Case:
    """Values of the ``tiny`` profile (a nearly uniform softmax: no weight is small against the sum) where
    that is enough, else float32 queries (float32 accumulators)."""
    uniform = dataclasses.replace(case, values="tiny")
    if not v3_row_sum_rounds_away_weights(uniform):
        return uniform
    return dataclasses.replace(case, q_dtype="float32", out_dtype=None)


def chunk_overruns_block(sizes: tuple[int, int, int, int], q_len: int, kv_len: int) -> bool:
    """Whether a v3 kernel with block sizes ``(bq, bkv, bq_chunk, bkv_chunk)`` computes a chunk past its
    block for a sequence of ``q_len`` rows and ``kv_len`` keys. Its KV loop takes ``cdiv(keys in the
    block, bkv_chunk)`` chunks of ``bkv_chunk`` keys (kernel.py:1008-1016) and its query loop chunks of
    ``min(bq_chunk, rows in the block)`` rows (895, 1018): a chunk that does not divide its block runs past
    it once a block holds more than the whole chunks that fit in it; a query chunk larger than its block is
    clamped to the block's rows."""
    bq, bkv, bq_chunk, bkv_chunk = sizes
    whole_keys = bkv // bkv_chunk * bkv_chunk
    whole_rows = bq if bq_chunk > bq else bq // bq_chunk * bq_chunk
    return min(kv_len, bkv) > whole_keys or min(q_len, bq) > whole_rows


def v3_default_blocks_break_its_rules(case: Case) -> bool:
    """v3 chooses its block sizes for the chip (a generation, none given), and for a sequence the kernel
    that runs it (the decode kernel for the leading decodes, else the mixed one, whose sizes v3's prefill
    kernel shares) computes a chunk past its block (``chunk_overruns_block``).

    ``get_default_block_sizes`` on TPU v5 and v6 (0.32.0) takes ``bq_sz = min(1024 // r, max_q // 2)`` but
    ``bq_csz = min(512 // r, max_q)`` (r q heads per KV head, max_q the token budget rounded up to a power of
    2), and ``bkv_csz = min(512, max_kv // 2 aligned to a page)``, which need not divide ``bkv_sz =
    min(1024, max_kv)``. v3 validates given block sizes only; its own go to the kernel unchecked. A query
    chunk twice its block, which its validator also rejects, is clamped by the kernel and does no harm.
    """
    inputs = _v3_inputs(case)
    if inputs.kwargs["m_block_sizes"] is not None:
        return False
    decodes = int(inputs.args[7][0])  # the distribution: the leading decodes run in the decode kernel
    return any(
        chunk_overruns_block(
            inputs.decode_block_sizes if seq < decodes else inputs.mixed_block_sizes, q_len, kv_len
        )
        for seq, (q_len, kv_len) in enumerate(zip(case.q_lens, case.kv_lens, strict=True))
    )


def with_given_block_sizes(case: Case) -> Case:
    """The target's own block sizes, given (v3 validates them): 8 query rows, 2 pages per KV block."""
    return dataclasses.replace(case, num_queries_per_block=DEFAULT_QUERIES_PER_BLOCK)


def v3_sliding_window_wraps_int16_positions(case: Case) -> bool:
    """On TPU v6 and later, with packed queries and a page table of at most 32,767 keys, v3 computes key
    positions in int16 (kernel.py: ``int_ty = jnp.int16``) and its window test ``q_span < k_span +
    sliding_window`` in int16 too: a window that takes a key position past 32,767 wraps, and the test then
    masks keys it should keep (every key, for a window of 2^20)."""
    kernel = v3.kernel()
    if case.sliding_window is None or kernel.get_dtype_packing(np.dtype(case.q_dtype)) == 1:
        return False
    if case.kv_capacity > INT16_MAX or kernel.get_tpu_version() < 6:
        return False
    return case.sliding_window + case.kv_capacity > INT16_MAX


def v3_positions_wrap_in_int16(case: Case) -> bool:
    """tpu-inference 0.18.0 to 0.22.1 compute key and query positions in int16 for packed queries on TPU v6
    and later whatever the page table's length (0.23.0 does so only for tables of at most 32,767 keys): a
    query block that visits a key past position 32,767 (its effective kv length cast with them) wraps to
    negative positions, and its masks keep or drop the wrong keys; a window's test wraps where the window
    takes a visited key's position past 32,767."""
    kernel = v3.kernel()
    if kernel.get_dtype_packing(np.dtype(case.q_dtype)) == 1 or kernel.get_tpu_version() < 6:
        return False
    window = case.sliding_window or 0
    return any(
        block.effective > INT16_MAX or block.end - 1 + window > INT16_MAX for block in _v3_query_blocks(case)
    )


def within_int16_positions(case: Case) -> Case:
    """Each sequence cut to the whole KV blocks that end within int16 (its queries with it), and a window
    that could still wrap dropped where it covers every key, else narrowed; dtypes and blocks are kept, so
    that the case stays a long one of the same kernel (float32 queries would take another branch, and at
    tens of thousands of keys a slower one on the interpreters)."""
    blocks = {block.seq: block.bkv for block in _v3_query_blocks(case)}
    kv_lens = tuple(
        min(kv_len, INT16_MAX // blocks.get(seq, 1) * blocks.get(seq, 1))
        for seq, kv_len in enumerate(case.kv_lens)
    )
    cut = dataclasses.replace(
        case, kv_lens=kv_lens, q_lens=tuple(min(q, kv) for q, kv in zip(case.q_lens, kv_lens, strict=True))
    )
    if cut.sliding_window is not None and v3_positions_wrap_in_int16(cut):
        widest = INT16_MAX + 1 - max(block.end for block in _v3_query_blocks(cut))
        covers_every_key = cut.sliding_window >= max(kv_lens, default=0)
        cut = dataclasses.replace(cut, sliding_window=None if covers_every_key else max(1, widest))
    return cut


def _replay_v3_hang(issue, target, backend, repro) -> None:
    """Replays the hang in a child process (``rpa-harness replay``, on the TPU interpreter): fails while it
    hangs, whether the interpreter's deadlock check says so (in seconds) or the replay's watchdog ends the
    child (a wait that cannot be interrupted, where the check is unpatched)."""
    seconds = float(os.environ.get("RPA_KNOWN_HANG_TIMEOUT", "60"))
    child = processes.run(
        processes.python("-m", "rpa_harness.cli", "replay", str(issue.repro), "--target", target.name,
                         "--backend", "interpret", "--timeout", f"{seconds:g}"),
        timeout=seconds + 180,
    )  # fmt: skip
    if child.timed_out:
        raise TimeoutError(
            f"the hang's replay did not end within {seconds + 180:g} s, its watchdog's included"
        )
    said = [line for line in (child.stdout + child.stderr).splitlines() if "hangs" in line]
    if child.returncode == 1 and said:
        raise AssertionError(f"still hangs: {said[0].split('hangs', 1)[1].lstrip(': ')}")


RPA_HARNESS_CATALOGUE = (
    KnownIssue(
        "sliding-window-skips-cache-writes",
        "with a sliding window, new tokens in KV blocks the last query block skips are not written to the cache",
        FINDINGS / "sliding-window-skips-cache-writes" / "v3-attention-and-cache_interpret.json",
        v3_sliding_window_skips_cache_writes,
        one_query_block_per_sequence,
        r"updated cache differs from the expected cache",
        explanation=(
            "A KV block's new tokens are copied to the cache only while the sequence's last query block runs "
            "(`update_cur_bkv_to_cache` under `bq_idx == num_bq - 1`), and with a sliding window each query "
            "block starts its KV loop at block `max(first_query_position - sliding_window, 0) // bkv_sz`. The "
            "KV blocks before the last query block's start are never visited then, so their new tokens are "
            "never written: any prefill chunk longer than one query block with `sliding_window < q_len - "
            "bq_sz` loses them. The sequence's own outputs are right; a reader of the cache that looks "
            "further back (a prefix-cache hit inside the skipped range, a layer sharing the cache without "
            "the window, a swap or copy of the pages) does not get those keys."
        ),
        releases=">=0.18.0",  # 0.11.1 and 0.12.0 write every new token; 0.13.x's block walk is finding early-window-past-block-0-desyncs-kv-prefetch
        fails_as=(CacheMismatch,),
    ),
    KnownIssue(
        "q-len-zero-before-a-live-sequence-hangs",
        "a q_len == 0 sequence before one with query rows: the kernel never copies the live sequence's query "
        "block or new key, and waits for them (the TPU interpreter: a deadlock; a TPU v5e: the call hangs)",
        FINDINGS / "q-len-zero-before-a-live-sequence-hangs" / "v3-hang_interpret.json",
        v3_q_len_zero_before_live_sequence,
        drop_empty_sequences_before_live_ones,
        r"still hangs",
        replay=_replay_v3_hang,
        explanation=(
            "`dynamic_validate_inputs` rejects `q_len == 0`, but `ragged_paged_attention` does not run it, so "
            "the input reaches the kernel. A sequence with no query block runs no iteration of "
            "`compute_with_bq`, so it starts none of the prefetches for the sequence after it, which waits "
            "instead for the copies started for the empty one. In the repro (`(0, 1), (1, 1)`), sequence 1 "
            "waits for its query block (one token, 512 bytes: `wait_fetch_bq`) on a semaphore that only "
            "sequence 0's query copy of 0 tokens signalled: the Pallas TPU interpreter finds that wait a "
            "deadlock. Its KV wait (one row) takes sequence 0's copy of its one cached row, so were the query "
            "wait to return, sequence 1 would attend to sequence 0's key and value and write them into its "
            "own cache slot: the generic interpreter, whose waits do not block, returns that (NaN attention "
            "from the query buffer nothing wrote, sequence 0's key in sequence 1's slot). A single `(0, 5)` "
            "sequence, or an empty sequence in the last slot, gets the right attention and cache, but the KV "
            "prefetch started for the empty sequence is never waited for (the TPU interpreter's exit check: "
            "it would halt a TPU).\n\n"
            "**On a TPU v5e** (2026-12-07, jax 0.10.2, Python 3.11.7, tpu-inference 0.32.0) the call hangs. "
            "rpa-harness's `ci/chip_verdicts.py --backend tpu` says `reproduces: hangs` for v3 and its "
            "context-parallel fork, and `ci/chip_probe_v3_q_len_zero.py --timeout 30` ran the repro in four "
            "processes, each past 30 s: as a process's first kernel call; after a call of the same "
            "configuration without the empty sequence, which returned in 2.1 s with the right attention and "
            "cache; after a call with a NaN query; and with Mosaic's bounds and semaphore checks on "
            "(`disable_bounds_checks=False`, `disable_semaphore_checks=False`), which did not stop it. The "
            "script below, run as written on that chip, was ended by its own watchdog after 300 s (exit 1, "
            "315 s in all). An earlier report from a v5e session, that the call returned with the right "
            "attention and cache, is withdrawn: that verdict did not come from the chip (rpa-harness then "
            "replayed a hang's repro on the Pallas TPU interpreter in a child process whatever the run's "
            "backend), and these copies cannot give sequence 1 its own query and key.\n\n"
            "**What a caller must do.** Never pass the kernel a batch in which a sequence with `q_len == 0` "
            "comes before a sequence with query rows: no `i < j < distribution[2]` with `cu_q_lens[i + 1] == "
            "cu_q_lens[i]` and `cu_q_lens[j + 1] > cu_q_lens[j]`. A serving engine meets it by dropping the "
            "sequences with no new tokens from the batch it passes (their `kv_lens` and `page_indices` rows "
            "removed, `cu_q_lens` and `distribution` recomputed). Dropping them is safer than moving them "
            "after every live sequence: an empty sequence in the last slot returns the right outputs but "
            "leaves the KV prefetch started for it unwaited, which the TPU interpreter says would halt a TPU "
            "(not run on a chip). `dynamic_validate_inputs`, whose `0 < q_len` rule rejects every such "
            "batch, checks it at the cost of reading the lengths on the host. In the kernel, a sequence with "
            "no query block would have to start the prefetches the next sequence waits for."
        ),
        fails_as=(RaisedOnValidInput, CacheMismatch, NonFiniteOutput),
    ),
    KnownIssue(
        "finite-mask-value-counts-keys-by-block",
        "a finite mask_value weights the masked keys v3's blocks visit (slots past kv_len included, with "
        "values zeroed past the query block's last position), not the masked keys in [0, kv_len)",
        FINDINGS / "finite-mask-value-counts-keys-by-block" / "differential-checked_interpret.json",
        v3_finite_mask_value_counts_keys_by_block,
        with_v3_default_mask_value,
        NUMERIC_MISMATCH,
        explanation=(
            "`flash_attention_step1_qk_softmax` masks `k_span < effective_kv_len` with the causal mask and "
            "the window by `s = jnp.where(mask, s, mask_value)`, so an empty slot past `kv_len` in the last "
            "compute chunk is one more masked key and gets the weight `exp(mask_value - max)`, and the keys "
            "from a query block's effective kv length `min(kv_len, last position + 1)` on get it with their "
            "values zeroed. The kernel computes no logit outside the KV blocks a query block visits (past "
            "`min(kv_len, first position + bq_sz)`, before the window's first block), so those masked keys "
            "get no weight. The reference gives every masked key in `[0, kv_len)` the weight `exp(mask_value "
            "- max)` with its value, and no other key any. Both agree when that weight underflows (the "
            "default `finfo(out_dtype).min`) or a query block visits exactly `[0, kv_len)`; otherwise the "
            "output depends on the block sizes, which are tuning parameters."
        ),
        releases=">=0.18.0",  # earlier kernels weight the slots past kv_len: the early-finite-mask-value findings
        fails_as=(OverTheBound,),
    ),
    KnownIssue(
        "row-sum-accumulated-in-bfloat16",
        "with bfloat16 accumulators (bfloat16 queries) v3 sums each chunk's softmax weights in bfloat16: "
        "weights below half an ulp of the running sum are lost and the denominator comes out short",
        FINDINGS / "row-sum-accumulated-in-bfloat16" / "differential_fast-interpret-v6e.json",
        v3_row_sum_rounds_away_weights,
        with_weights_a_bfloat16_sum_keeps,
        NUMERIC_MISMATCH,
        explanation=(
            "`flash_attention_step1_qk_softmax` computes the weights `p = exp(s - m_curr)` in float32 and their "
            "row sum with `jnp.sum(p, axis=1, keepdims=True, dtype=out_dtype)`. With `dtype=bfloat16`, jax "
            "casts `p` to bfloat16 and reduces in bfloat16 (the traced program is `convert_element_type` to "
            "bf16, then `reduce_sum` of bf16), so every addition rounds to 8 bits of the partial sum: a weight "
            "below half an ulp of it is dropped, the others are rounded, and over a chunk of `bkv_csz` keys "
            'the sum can lose up to `bkv_csz - 1` roundings. The comment above it ("if converting the type '
            'too early, there will be accuracy issue") and the `P @ V` beside it (`preferred_element_type='
            "jnp.float32`, then cast) suggest the intent was to sum in float32 and round once: "
            "`jnp.sum(p, axis=1, keepdims=True).astype(out_dtype)`. In the hand-made repro (`dominant-key`) "
            "every value is 1, so the output must be exactly 1; one key has weight 1 and 63 have weight 0.0035 "
            "each (below 2^-8, half an ulp of 1): the denominator is 1.22, the kernel's about 1.11, and the "
            "output 1.10. In the drawn one a finite mask value gives each masked key such a weight. On the CPU "
            "interpreters XLA adds a short row in order and a long one in several partial sums; the order a "
            "TPU's reduction takes has not been checked on hardware."
        ),
        releases=">=0.18.0",  # earlier kernels accumulate in float32
        # Mosaic reduces a bfloat16 vector in float32 up to v5 (canonicalize_mosaic.cc: a bf16
        # multi_reduction is extended to f32 where hardware_generation <= 5) and in bfloat16 from v6 on.
        generations=generations.from_major_version(6),
        fails_as=(OverTheBound,),
    ),
    KnownIssue(
        "default-blocks-break-v3s-own-rules",
        "on TPU v5 and v6 v3's default mixed block sizes have a KV compute chunk that does not divide its block: "
        "for a sequence with more keys than the whole chunks in a block, the kernel reads past the end of its "
        "KV buffer in VMEM (with pages of a power of two, keys it masks: the outputs stay right; the TPU "
        "interpreter stops the read)",
        FINDINGS / "default-blocks-break-v3s-own-rules" / "differential-any-config_interpret-v6e.json",
        v3_default_blocks_break_its_rules,
        with_given_block_sizes,
        r"Out-of-bounds read",
        # With pages of a power of two (all that is drawn) the rows past the buffer are keys past every
        # kv_len, masked: only the checking interpreter's bounds check shows the read (the generic
        # interpreter reads them as NaN, gap generic-clamped-reads, and the masked outputs are right).
        backends=("interpret",),
        explanation=(
            "On v5 and v6, `get_default_block_sizes` gives the mixed kernel `bq_sz = min(1024 // r, max_q // "
            "2)` but `bq_csz = min(512 // r, max_q)` (r q heads per KV head, max_q the token budget rounded up "
            "to a power of 2), so every budget below `1024 // r` gets a query chunk twice the block, and "
            "`bkv_csz = min(512, max_kv // 2 aligned to a page)`, which need not divide `bkv_sz = min(1024, "
            "max_kv)`. Given explicitly, such sizes are rejected by `static_validate_inputs` (`bq_sz % bq_csz "
            "== 0`, `bkv_sz % bkv_csz == 0`); the defaults are never validated. Once a block holds more keys "
            "than the whole chunks that fit in it, the kernel's last compute chunk (`load_bkv(bkv_sem_idx, "
            "kv_head_idx, idx * bkv_csz, bkv_csz)`) runs past the end of its KV scratch buffer: 8 rows past a "
            "104-row buffer in the repro. v3 turns Mosaic's bounds checks off (`disable_bounds_checks=True`), "
            "so a TPU reads whatever VMEM holds there; the Pallas TPU interpreter stops the read "
            "(out-of-bounds read). With a page size that divides 1,024 (every power of two), a block whose "
            "chunk does not divide it is the whole page table (`bkv_sz = max_kv`, at most 1,024 keys), so "
            "the rows past it are positions past every sequence's `kv_len`. With one that does not (96: "
            "blocks of 1,056 keys in chunks of 576 once the page table holds more than 1,024), the rows "
            "past a block are the next block's keys, within `kv_len`. The query chunk twice the block does "
            "no harm (the kernel clamps a query chunk to the rows of its block). On 7x the same case gets "
            "valid sizes.\n\n"
            "**A memory-safety finding, which a chip does not show.** On a TPU v5e (2026-12-07, jax 0.10.2, "
            "tpu-inference 0.32.0) the repro passes: the read does not fault and the outputs are right; only "
            "a checking interpreter sees it. What is read: the rows of the last compute chunk past the "
            "block's half of the KV double buffer (`bkv_x2_ref`, `(2, bkv_sz, ...)`): for the first half, "
            "the first rows of the second (another block's keys and values), for the second, whatever VMEM "
            "follows the buffer. Whether an output can depend on them: not while they are key positions at "
            "or past the sequence's effective kv length, which holds for every page size dividing 1,024: "
            "`flash_attention_step1_qk_softmax` replaces their logits (`jnp.where(mask, s, mask_value)`, "
            "which also drops a NaN or Inf made of VMEM's bits) and zeroes their values (`jnp.where(v_span < "
            "effective_kv_len, v, 0.0)`) before the row maximum, the row sum and P @ V; `skip_kv_mask=True`, "
            "which drops that mask, requires `kv_len % bkv_csz == 0`, with which the last chunk ends inside "
            "the block. Under which shapes it can: a page size that does not divide 1,024, as above: the "
            "output then depends on what VMEM holds past the buffer (NaN rows on the fast interpreter, which "
            "reads NaN there; not run on a chip). To act: validate the default sizes as given ones are, or "
            "choose a `bkv_csz` that divides `bkv_sz`."
        ),
        releases=">=0.18.0",  # earlier kernels take upstream's block options (their tuned table's blocks are whole)
        generations=("v5e", "v5p", "v6e"),  # get_default_block_sizes: `case 5 | 6`
        fails_as=(RaisedOnValidInput,),
    ),
    KnownIssue(
        "out-dtype-other-than-q-dtype-fails-to-trace",
        "an out_dtype other than q's (float32 accumulators for bfloat16 queries, or bfloat16 for float32): "
        "the kernel raises a reshape TypeError while it traces; its validators accept the option",
        FINDINGS / "out-dtype-other-than-q-dtype-fails-to-trace" / "differential-checked_interpret.json",
        v3_out_dtype_not_q_dtype,
        with_q_dtype_accumulators,
        r"cannot reshape array",
        explanation=(
            "`out_dtype` sets the dtype of `l_ref`, `m_ref` and `acc_ref`, and the final `out = (acc / "
            "l).astype(out_dtype)` is stored with `pltpu.bitcast(out, jnp.int32).reshape(out_ref.shape)`, "
            "where `out_ref` is the output buffer, of q's dtype, viewed as int32 rows: a float32 `out` for "
            "bfloat16 queries has twice the rows that view holds, a bfloat16 one for float32 queries half. "
            "The shapes are fixed while the kernel traces, so the call fails on every backend; "
            "`static_validate_inputs` deletes `out_dtype` unchecked, and the reference "
            "(`ref_ragged_paged_attention`) accepts it and returns its output in `out_dtype`."
        ),
        releases=">=0.18.0",  # earlier kernels take no out_dtype
        fails_as=(RaisedOnValidInput,),
    ),
    KnownIssue(
        "int16-positions-wrap-past-32767-keys",
        "on TPU v6 and later, with packed queries, a sequence whose KV blocks reach past key position 32,767 "
        "wraps in the kernel's int16 position arithmetic: its rows come out NaN or weight the wrong keys",
        FINDINGS
        / "int16-positions-wrap-past-32767-keys"
        / "differential-long-packed-upto-2to15-given-blocks_fast-interpret-v6e.json",
        v3_positions_wrap_in_int16,
        within_int16_positions,
        rf"non-finite values|{NUMERIC_MISMATCH}",
        explanation=(
            "`flash_attention_step1_qk_softmax` picks `int_ty = jnp.int16` when `get_dtype_packing(q_dtype) != "
            "1 and get_tpu_version() >= 6` and casts `processed_q_len`, `processed_kv_len` and "
            "`effective_kv_len` to it, with the key and value iotas built in it. Past 32,767 the positions "
            "wrap to negative values: an `effective_kv_len` of 32,768 or more is negative, so `k_span < "
            "effective_kv_len_int` drops every key of the block (a row with no key: NaN), and keys past "
            "32,767 compare as early ones. Long-context serving (32k and more) with bfloat16 queries on v6e "
            "and 7x is the case. 0.23.0 keeps int16 only where `pages_per_seq * page_size <= 32767`, which "
            "fixes it; float32 queries and v5e take int32."
        ),
        releases=">=0.18.0,<0.23.0",
        generations=generations.from_major_version(6),  # int16 only where get_tpu_version() >= 6
        fails_as=(NonFiniteOutput, OverTheBound),
    ),
    KnownIssue(
        "sliding-window-wraps-int16-positions",
        "on TPU v6 and later, with packed queries and at most 32,767 keys per sequence, a sliding window "
        "that takes a key position past 32,767 wraps in v3's int16 position arithmetic and masks the keys",
        FINDINGS / "sliding-window-wraps-int16-positions" / "differential_fast-interpret-v6e.json",
        v3_sliding_window_wraps_int16_positions,
        with_a_window_within_int16,
        rf"non-finite values|{NUMERIC_MISMATCH}",
        explanation=(
            "With packed queries (`get_dtype_packing(q_dtype) != 1`) on `get_tpu_version() >= 6` and "
            "`pages_per_seq * page_size <= 32767`, the kernel computes its query and key positions in int16 "
            "(`int_ty = jnp.int16`), and the window test `q_span < k_span + sliding_window` adds the Python "
            "int window to the int16 key positions: past 32,767 the sum wraps, the test fails for every key "
            "and every logit is replaced by the mask value. Any window with `sliding_window + key position > "
            "32767` does it; v5e, float32 queries and a window that stays within int16 are right."
        ),
        releases=">=0.18.0",  # the releases before it compute positions in int32
        generations=generations.from_major_version(6),  # int16 only where get_tpu_version() >= 6
        fails_as=(NonFiniteOutput, OverTheBound),
    ),
)


# Where v3's own block sizes lose to ones its rules accept (``rpa-harness bench --sweep-blocks``), measured on
# a chip: its tuned table gives the bench's mixed batch (4 prefill chunks of 96 tokens and 128 decodes,
# Llama-3-8B-like) blocks of (256, 1024, 128, 512) on a v5e.
TUNING_FINDINGS = (
    TuningFinding(
        "v3-own-blocks-slow-on-a-mixed-batch",
        batch="mixed",
        generations=("v5e",),
        measured="TPU v5e, jax 0.10.2, tpu-inference 0.32.0 (2026-12-07): its own blocks 10.8 ms a call; "
        "32 KV pages x 32 queries a block 3.43 ms (3.2x faster); upstream's kernel 4.05 ms",
    ),
)
