"""Known issues: documented discrepancies a target still has, kept out of the draw until they are fixed.

Each entry names a discrepancy (for upstream's kernel: its folder under ``docs/upstream-findings/``), says
in one line what goes wrong, points at its repro pair and carries a predicate on a ``Case`` that is true
exactly when the case can trigger it, as narrow as the cause, so that the rest of the space stays tested.
A target declares the issues it knows with ``RPA_HARNESS_KNOWN_ISSUES = ("NAME", ...)`` in its module
(upstream's module gets ``UPSTREAM_KNOWN_ISSUES``; ``--rpa-known-issues`` overrides either). The
strategies then move a drawn case that matches a declared issue to the nearest case outside it
(``KnownIssue.avoid``), and ``tests/properties/test_known_issues.py`` replays each declared issue's repro: while it
still fails the issue is an expected failure, once it passes the run fails until the entry is removed.

The predicates restate the causes worked out from upstream's kernel source
(``jax/experimental/pallas/ops/tpu/ragged_paged_attention/kernel.py``; identical in jax 0.10.2 and 0.12):
the kernel walks a grid of (KV-head block, query block); inside a query block it visits the sequences
whose rows it holds, in order, and for each one its KV blocks of ``num_kv_pages_per_block * page_size``
keys, prefetching the next block into the other half of a double buffer before it waits for the current.
"""

import dataclasses
import math
import re
from collections.abc import Callable
from pathlib import Path

import ml_dtypes
import numpy as np
from rpa_harness import runlog
from rpa_harness.strategies.case import Case


def findings_dir(name: str) -> Path:
    """A findings folder: ``docs/NAME`` in a checkout, ``rpa_harness/findings/NAME`` where the wheel put it."""
    here = Path(__file__).resolve().parent
    installed = here / "findings" / name
    return installed if installed.is_dir() else here.parent / "docs" / name


FINDINGS_DIR = findings_dir("upstream-findings")
V3_FINDINGS_DIR = findings_dir("tpu-inference-v3-findings")
OPTION = "--rpa-known-issues"
AUTO, NONE = "auto", "none"
# The smallest positive float32 is exp(-103.3); a weight exp(x) with x below this is exactly 0 in float32
# (the margin covers the difference between float64 logits here and the kernel's float32 ones).
FLOAT32_EXP_UNDERFLOW = -110.0


class KnownIssueError(ValueError):
    """An unknown known-issue name or a malformed declaration; the message lists the known names."""


@dataclasses.dataclass(frozen=True)
class KnownIssue:
    name: str
    description: str  # one line: what goes wrong, for the run summary and the report title
    repro: Path  # the repro pair's JSON (its NPZ beside it)
    matches: Callable[[Case], bool]  # True when the case can trigger the issue
    nearest_outside: Callable[[Case], Case]  # a case close to the argument that does not match
    symptom: str  # a regex the property failure of the repro shows while the issue is present
    # How the repro is replayed: None for the generic property it records (rpa_harness.checks.recheck),
    # else replay(issue, target, backend, repro) raising AssertionError while the issue is present.
    replay: Callable | None = None

    def avoid(self, case: Case) -> Case:
        """The case itself, or the nearest case outside the issue (counted in the run log)."""
        if not self.matches(case):
            return case
        runlog.record_event("known-issue-avoided", issue=self.name)
        return self.nearest_outside(case)

    def shows(self, failure: str) -> bool:
        """Whether a property failure is this issue's (and not some other failure of the repro)."""
        return re.search(self.symptom, failure) is not None


# --- How upstream's kernel schedules a call (restated from its source) ---------------------------------


def _packing(dtype_name: str) -> int:
    """Values per 32-bit word."""
    return 32 // (8 * np.dtype(getattr(ml_dtypes, dtype_name, dtype_name)).itemsize)


def _fully_tiled(count: int, packing: int) -> bool:
    if count % packing:
        return False
    count //= packing
    return count in (1, 2, 4, 8) or count % 8 == 0


def upstream_head_blocks(case: Case) -> int:
    """How many KV-head blocks upstream's grid has: the smallest head block that tiles, else all heads."""
    combined = 2 * case.num_kv_heads
    kv_tiling = 8 * _packing(case.kv_dtype)
    combined_per_block = kv_tiling if combined % kv_tiling == 0 else combined
    q_heads_per_block = combined_per_block // 2 * (case.num_q_heads // case.num_kv_heads)
    if not _fully_tiled(q_heads_per_block, _packing(case.q_dtype)):
        q_heads_per_block = case.num_q_heads
    return case.num_q_heads // q_heads_per_block


def _keep_sequences(case: Case, keep: list[bool]) -> Case:
    return dataclasses.replace(
        case,
        q_lens=tuple(q for q, k in zip(case.q_lens, keep, strict=True) if k),
        kv_lens=tuple(kv for kv, k in zip(case.kv_lens, keep, strict=True) if k),
    )


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
    return _keep_sequences(case, [not s for s in _stealing_empty_sequences(case)])


# --- 2. one-kv-scale-with-mixed-dtypes -------------------------------------------------------------------


def one_kv_scale_with_mixed_dtypes(case: Case) -> bool:
    """Only the scaled side is cast to q's dtype, so K and V differ in dtype and an assert fails."""
    return (case.k_scale is None) != (case.v_scale is None) and case.q_dtype != case.kv_dtype


def without_kv_scales(case: Case) -> Case:
    return dataclasses.replace(case, k_scale=None, v_scale=None)


# --- 3. finite-mask-value-weights-keys-past-kv-len -------------------------------------------------------

_DEFAULT_MASK_VALUE = {f.name: f.default for f in dataclasses.fields(Case)}["mask_value"]


def _partial_last_block(case: Case, kv_len: int) -> bool:
    if case.num_kv_pages_per_block is None:  # the tuned block size is unknown off TPU: any block may be
        return kv_len > 0
    return kv_len % (case.num_kv_pages_per_block * case.page_size) != 0


def _sequence_queries_and_keys(case: Case, arrays: dict, seq: int) -> tuple[np.ndarray, np.ndarray]:
    """One sequence's query rows [q_len, num_q_heads, head_dim] and its keys [kv_len, num_kv_heads, head_dim],
    as stored (the keys read from its pages)."""
    q_len, kv_len = case.q_lens[seq], case.kv_lens[seq]
    start = sum(case.q_lens[:seq])
    pages = arrays["page_indices"][seq, : math.ceil(kv_len / case.page_size)]
    k = arrays["kv_pages"][pages][:, :, 0::2, :].reshape(-1, case.num_kv_heads, case.head_dim)[:kv_len]
    return arrays["q"][start : start + q_len], k


def _soft_capped_logits(case: Case, q: np.ndarray, k: np.ndarray, scale: float) -> np.ndarray:
    """[q_len, num_q_heads, kv_len] float64 logits q.k * scale, soft-capped; k repeated over each KV group."""
    k = np.repeat(k.astype(np.float64), case.num_q_heads // case.num_kv_heads, axis=1)
    logits = np.einsum("qhd,khd->qhk", q.astype(np.float64), k) * scale
    return logits if case.soft_cap is None else case.soft_cap * np.tanh(logits / case.soft_cap)


def _hidden_keys(case: Case, q_len: int, kv_len: int) -> np.ndarray:
    """[q_len, kv_len] True where the causal mask or the sliding window hides the key from the row."""
    position = kv_len - q_len + np.arange(q_len)[:, None]
    key = np.arange(kv_len)[None, :]
    masked = key > position
    if case.sliding_window is not None:
        masked |= position - case.sliding_window >= key
    return masked


def _row_max_logits(case: Case, arrays: dict, seq: int, mask_value: float) -> np.ndarray:
    """[q_len, num_q_heads] largest logit (soft cap and mask added, as upstream) over keys [0, kv_len)."""
    q, k = _sequence_queries_and_keys(case, arrays, seq)
    if case.k_scale is not None:  # scaled in float32, then rounded to q's dtype (upstream)
        k = (k.astype(np.float32) * np.float32(case.k_scale)).astype(arrays["q"].dtype)
    logits = _soft_capped_logits(case, q, k, case.sm_scale)
    masked = _hidden_keys(case, case.q_lens[seq], case.kv_lens[seq])
    return (logits + np.where(masked, mask_value, 0.0)[:, None, :]).max(axis=-1)


def finite_mask_value_weights_keys_past_kv_len(case: Case) -> bool:
    """An empty key slot of a live sequence's last KV block gets a non-zero softmax weight.

    Inside a KV block the kernel zeroes K and V past kv_len and leaves those slots to the causal mask, so
    each gets the logit ``0 + mask_value`` and the weight ``exp(mask_value - row max)``: exactly 0 in
    float32 for the default mask value, not for one within ~100 of the row's largest logit.
    """
    if case.mask_value_meaning != "added":  # a replacing mask value is another option (v3's)
        return False
    mask_value = _DEFAULT_MASK_VALUE if case.mask_value is None else case.mask_value
    if not math.isfinite(mask_value):
        return False
    candidates = [
        i
        for i, (q, kv) in enumerate(zip(case.q_lens, case.kv_lens, strict=True))
        if q > 0 and _partial_last_block(case, kv)
    ]
    if not candidates:
        return False
    arrays = case.arrays()
    return any(
        (mask_value - _row_max_logits(case, arrays, i, mask_value) > FLOAT32_EXP_UNDERFLOW).any()
        for i in candidates
    )


def with_default_mask_value(case: Case) -> Case:
    return dataclasses.replace(case, mask_value=_DEFAULT_MASK_VALUE)


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
    if case.num_queries_per_block is not None and total % case.num_queries_per_block:
        return False
    last_with_rows = max(i for i, q in enumerate(case.q_lens) if q > 0)
    return last_with_rows + 1 < case.num_seqs


def drop_zero_query_tail(case: Case) -> Case:
    last_with_rows = max(i for i, q in enumerate(case.q_lens) if q > 0)
    return _keep_sequences(case, [i <= last_with_rows for i in range(case.num_seqs)])


# --- The catalogue -----------------------------------------------------------------------------------------

NUMERIC_MISMATCH = r"elements over the bound"

CATALOGUE = (
    KnownIssue(
        "empty-sequence-shifts-kv-pages",
        "a sequence with kv_len == 0 hands its prefetched KV page to the next sequence that has query rows",
        FINDINGS_DIR / "empty-sequence-shifts-kv-pages" / "differential_interpret.json",
        empty_sequence_shifts_kv_pages,
        drop_stealing_empty_sequences,
        NUMERIC_MISMATCH,
    ),
    KnownIssue(
        "one-kv-scale-with-mixed-dtypes",
        "exactly one of k_scale/v_scale with q's dtype different from the cache's fails an assert",
        FINDINGS_DIR / "one-kv-scale-with-mixed-dtypes" / "differential_fast-interpret.json",
        one_kv_scale_with_mixed_dtypes,
        without_kv_scales,
        r"raised on valid inputs: AssertionError",
    ),
    KnownIssue(
        "finite-mask-value-weights-keys-past-kv-len",
        "a finite mask_value gives softmax weight to the empty key slots of a sequence's last KV block",
        FINDINGS_DIR / "finite-mask-value-weights-keys-past-kv-len" / "differential_interpret.json",
        finite_mask_value_weights_keys_past_kv_len,
        with_default_mask_value,
        NUMERIC_MISMATCH,
    ),
    KnownIssue(
        "zero-query-tail-skips-head-blocks",
        "query rows ending on a query-block boundary, then a q_len == 0 sequence: later KV-head blocks "
        "skip every sequence",
        FINDINGS_DIR / "zero-query-tail-skips-head-blocks" / "differential_fast-interpret.json",
        zero_query_tail_skips_head_blocks,
        drop_zero_query_tail,
        NUMERIC_MISMATCH,
    ),
)
UPSTREAM_KNOWN_ISSUES = tuple(issue.name for issue in CATALOGUE)


# --- tpu-inference RPA v3 (harness/tpu_inference_v3.py; docs/tpu-inference-v3-findings/) ------------------
# Restated from v3's kernel (tpu_inference/kernels/ragged_paged_attention/v3/kernel.py, 0.32.0): per
# sequence, query blocks of bq rows (one row per block for the leading decodes, v3's decode kernel); each
# query block walks KV blocks of bkv keys from max(first position - window, 0) // bkv (0 without a window)
# up to its effective length min(kv_len, first position + bq), each block in compute chunks of bkv_chunk
# keys up to that length. The block sizes are the v3 target's mapping of the case (rpa_harness.tpu_inference_v3,
# imported only when a v3 predicate runs: the catalogue must load without tpu-inference).


def _v3():
    from rpa_harness import tpu_inference_v3

    return tpu_inference_v3


def _v3_query_blocks(case: Case):
    """Per live sequence and query block: (sequence, first row, rows, first key visited, the block's
    effective kv length (keys from it on have their values zeroed), end of the keys visited)."""
    v3 = _v3()
    inputs = v3.v3_inputs(**case.arrays(), **case.options())
    decodes = int(inputs.args[-1][0])
    window = case.sliding_window
    for i, (q_len, kv_len) in enumerate(zip(case.q_lens, case.kv_lens, strict=True)):
        bq, bkv, _, bkv_chunk = inputs.kwargs["d_block_sizes" if i < decodes else "m_block_sizes"]
        block_rows = min(bq, 1) if i < decodes else bq
        for first in range(0, q_len, block_rows):
            position = kv_len - q_len + first
            start = max(position - window, 0) // bkv * bkv if window is not None else 0
            effective = min(kv_len, position + block_rows)
            last_block = (-(-effective // bkv) - 1) * bkv
            end = last_block + -(-(effective - last_block) // bkv_chunk) * bkv_chunk
            yield i, first, min(block_rows, q_len - first), start, effective, end


def v3_sliding_window_skips_cache_writes(case: Case) -> bool:
    """A sliding window lets the last query block of a sequence skip KV blocks that hold new tokens."""
    if case.sliding_window is None:
        return False
    v3 = _v3()
    return bool(v3.unwritten_by_sliding_window(v3.v3_inputs(**case.arrays(), **case.options())).any())


def one_query_block_per_sequence(case: Case) -> Case:
    """Query blocks as long as the longest sequence: the last block is the only one (a tuning change)."""
    return dataclasses.replace(case, num_queries_per_block=max(case.q_lens))


def v3_q_len_zero_before_live_sequence(case: Case) -> bool:
    """A q_len == 0 sequence followed by one with query rows (v3's validator forbids q_len == 0)."""
    return any(q == 0 and any(case.q_lens[i + 1 :]) for i, q in enumerate(case.q_lens))


def drop_empty_sequences_before_live_ones(case: Case) -> Case:
    q = case.q_lens
    return _keep_sequences(case, [not (q[i] == 0 and any(q[i + 1 :])) for i in range(case.num_seqs)])


def _v3_row_max_logits(case: Case, arrays: dict, seq: int, mask_value: float) -> np.ndarray:
    """[q_len, num_q_heads] largest logit over keys [0, kv_len), v3's semantics: q quantised with q_scale,
    k_scale and q_scale folded into the score scale, soft cap, masked logits replaced by mask_value."""
    from rpa_harness.reference.float64 import quantised_query

    q, k = _sequence_queries_and_keys(case, arrays, seq)
    q = quantised_query(q, case.q_scale, arrays["kv_pages"].dtype)
    scale = case.sm_scale * (case.k_scale or 1.0) * (case.q_scale or 1.0)
    logits = _soft_capped_logits(case, q, k, scale)
    masked = _hidden_keys(case, case.q_lens[seq], case.kv_lens[seq])
    return np.where(masked[:, None, :], mask_value, logits).max(axis=-1)


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
    if case.mask_value_meaning != "replaces" or case.mask_value is None or not math.isfinite(case.mask_value):
        return False
    arrays = None
    for seq, first, rows, start, effective, end in _v3_query_blocks(case):
        if start == 0 and effective == end == case.kv_lens[seq]:
            continue
        arrays = arrays or case.arrays()
        row_max = _v3_row_max_logits(case, arrays, seq, case.mask_value)[first : first + rows]
        if (case.mask_value - row_max > FLOAT32_EXP_UNDERFLOW).any():
            return True
    return False


def with_v3_default_mask_value(case: Case) -> Case:
    """v3's default mask value (finfo(output dtype).min: masked keys get no weight)."""
    return dataclasses.replace(case, mask_value=None)


def _replay_v3_both_outputs(issue, target, backend, repro) -> None:
    """The v3 property: attention against the oracle under v3's contract, updated cache bit for bit."""
    verdict = _v3().judge(repro.arrays, repro.options)
    problems = [str(verdict.comparison)] if not verdict.comparison.ok else []
    if verdict.cache_error is not None:
        problems.append(str(verdict.cache_error))
    if problems:
        raise AssertionError("\n".join(problems))


def _replay_v3_hang(issue, target, backend, repro) -> None:
    """Replays the hang in a child process: fails while it hangs, whether the TPU interpreter's deadlock
    check says so (``hangs: ...``, in seconds) or the watchdog ends the child (a wait that cannot be
    interrupted, where the check is unpatched)."""
    import os
    import subprocess
    import sys

    seconds = float(os.environ.get("RPA_KNOWN_HANG_TIMEOUT", "60"))
    env = dict(os.environ, RPA_CALL_TIMEOUT=f"{seconds:g}")
    child = subprocess.run(
        [sys.executable, "-m", "rpa_harness.tpu_inference_v3", str(issue.repro)],
        env=env,
        capture_output=True,
        text=True,
        timeout=seconds + 180,
    )
    deadlocks = [
        line.removeprefix("hangs: ") for line in child.stdout.splitlines() if line.startswith("hangs: ")
    ]
    if child.returncode == 1 and deadlocks:
        raise AssertionError(f"still hangs: {deadlocks[0]}")
    if child.returncode == 70:  # rpa_harness.backends.HANG_EXIT_CODE: the watchdog ended the child
        raise AssertionError(f"still hangs: no return within {seconds:g} s (RPA_CALL_TIMEOUT)")


V3_CATALOGUE = (
    KnownIssue(
        "sliding-window-skips-cache-writes",
        "with a sliding window, new tokens in KV blocks the last query block skips are not written to the cache",
        V3_FINDINGS_DIR / "sliding-window-skips-cache-writes" / "v3-attention-and-cache_interpret.json",
        v3_sliding_window_skips_cache_writes,
        one_query_block_per_sequence,
        r"updated cache differs from the expected cache",
        replay=_replay_v3_both_outputs,
    ),
    KnownIssue(
        "q-len-zero-before-a-live-sequence-hangs",
        "a q_len == 0 sequence before one with query rows: the call never returns (a DMA wait)",
        V3_FINDINGS_DIR / "q-len-zero-before-a-live-sequence-hangs" / "v3-hang_interpret.json",
        v3_q_len_zero_before_live_sequence,
        drop_empty_sequences_before_live_ones,
        r"still hangs",
        replay=_replay_v3_hang,
    ),
    KnownIssue(
        "finite-mask-value-counts-keys-by-block",
        "a finite mask_value weights the masked keys v3's blocks visit (slots past kv_len included, with "
        "values zeroed past the query block's last position), not the masked keys in [0, kv_len)",
        V3_FINDINGS_DIR / "finite-mask-value-counts-keys-by-block" / "differential-checked_interpret.json",
        v3_finite_mask_value_counts_keys_by_block,
        with_v3_default_mask_value,
        NUMERIC_MISMATCH,
    ),
)
V3_KNOWN_ISSUES = tuple(issue.name for issue in V3_CATALOGUE)
BY_NAME = {issue.name: issue for issue in CATALOGUE + V3_CATALOGUE}


def resolve(entries, where: str) -> tuple[KnownIssue, ...]:
    """Catalogue entries for names (a module may also declare its own ``KnownIssue`` objects)."""
    if isinstance(entries, str):
        entries = (entries,)
    issues = []
    for entry in entries:
        if isinstance(entry, KnownIssue):
            issues.append(entry)
        elif entry in BY_NAME:
            issues.append(BY_NAME[entry])
        else:
            raise KnownIssueError(
                f"{where}: unknown known issue {entry!r}; known issues: {', '.join(BY_NAME)} "
                f"(or '{AUTO}' for the target's own declaration, '{NONE}' for none)"
            )
    return tuple(issues)


def parse_option(value: str, declared: tuple[KnownIssue, ...]) -> tuple[KnownIssue, ...]:
    """``auto`` (the target's declaration), ``none``, or a comma-separated list of names."""
    value = value.strip()
    if value == AUTO:
        return declared
    if value == NONE:
        return ()
    names = [name.strip() for name in value.split(",") if name.strip()]
    return resolve(names, f"{OPTION}={value}")


def describe_matches(case: Case) -> str:
    """A line for a failure report naming the catalogued issues the failing case matches, if any."""
    names = [issue.name for issue in CATALOGUE if issue.matches(case)]  # v3's need its module: not here
    if not names:
        return ""
    return (
        f"\n  known issue{'s' * (len(names) > 1)} this case matches: {', '.join(names)} "
        f"(harness/known_issues.py; declare it in RPA_HARNESS_KNOWN_ISSUES or with {OPTION})"
    )
