"""Known issues of tpu-inference's batched RPA (``docs/tpu-inference-batched-rpa-findings/``) and their
predicates, restated from ``experimental/batched_rpa/`` (0.32.0): its KV blocks are the case's
(``num_kv_pages_per_block`` pages, the adapter's mapping), walked from the first over every key a query
visits."""

import dataclasses
import math

import jax
import numpy as np

from rpa_harness import generations
from rpa_harness.failures import NonFiniteOutput, OverTheBound, RaisedOnValidInput
from rpa_harness.known_issues import NUMERIC_MISMATCH, KnownIssue, case_arrays, findings_dir, keep_sequences
from rpa_harness.strategies.case import Case
from rpa_harness.targets.tpu_inference.findings import (
    INT16_MAX,
    with_a_window_within_int16,
    with_v3_default_mask_value,
)
from rpa_harness.targets.tpu_inference_batched_rpa import adapter
from rpa_harness.targets.tpu_inference_mla_v1.known_issues import finite_mask_value_weights_keys_past_kv_len

FINDINGS = findings_dir("tpu-inference-batched-rpa-findings")
SCHEDULE_WRITE_ALIGNMENT = 1024  # schedule.py: utils.align_to(write_size, 1024)


def _kernel_configs(case: Case):
    """(decode, mixed) ``configs.RpaConfigs`` as the wrapper builds them for the case (the target's block
    sizes, the chip seen now); None where the kernel tunes its own blocks."""
    inputs = adapter.batched_inputs(**case_arrays(case), **case.options())
    if inputs.decode_block_sizes is None:
        return None
    configs = adapter.configs()
    q, keys, _, kv_cache, kv_lens, page_indices, _, _ = inputs.args
    out_dtype = q.dtype if case.out_dtype is None else case.out_dtype
    model = configs.ModelConfigs(
        num_q_heads=q.shape[1], num_kv_heads=keys.shape[1], head_dim=q.shape[2], mask_value=0.0
    )
    serve = configs.ServingConfigs(
        num_seqs=len(kv_lens), page_size=kv_cache.shape[1], total_q_tokens=q.shape[0],
        num_page_indices=len(page_indices), dtype_q=q.dtype, dtype_kv=kv_cache.dtype, dtype_out=out_dtype,
    )  # fmt: skip
    vmem = inputs.kwargs["vmem_limit_bytes"] or 64 * 2**20
    return tuple(
        configs.RpaConfigs(block=block, model=model, serve=serve, mode=mode, vmem_limit_bytes=vmem)
        for mode, block in (
            (configs.RpaCase.DECODE, inputs.decode_block_sizes),
            (configs.RpaCase.MIXED, inputs.mixed_block_sizes),
        )
    )


def schedule_write_back_overruns_its_buffers(case: Case) -> bool:
    """A kernel (decode or mixed: the wrapper runs both, whatever the batch) whose schedule kernel writes
    back more entries than a schedule buffer holds.

    ``rpa_metadata_schedule_kernel`` (schedule.py) copies each SMEM schedule array of ``k * max_steps_ub``
    entries to HBM with a DMA of ``align_to(k * safe_max_steps, 1024)`` entries, ``safe_max_steps =
    min(steps + n_buffer + 1, max_steps_ub)``: past the array's end when that rounding passes it, as it
    always does for a ``max_steps_ub`` below 1024 (the SMEM budget left after the page table, over a step's
    bytes). The steps are bounded here by the blocks every sequence visits, so a case with thousands of
    steps may be taken for one that reaches the end."""
    configs = _kernel_configs(case)
    if configs is None:
        return False
    schedule = adapter.schedule()
    block_steps = sum(
        math.ceil(q_len / configs[1].bq_sz) * math.ceil(kv_len / configs[1].bkv_sz)
        for q_len, kv_len in zip(case.q_lens, case.kv_lens, strict=True)
    )
    for cfgs in configs:
        safe = min(block_steps + cfgs.n_buffer + 1, cfgs.max_steps_ub)
        for leaf in jax.tree_util.tree_leaves(schedule.RpaSchedule.create_shape_dtype(cfgs)):
            size = leaf.shape[0]
            if size > 1:
                written = -(-(size // cfgs.max_steps_ub) * safe // SCHEDULE_WRITE_ALIGNMENT)
                if written * SCHEDULE_WRITE_ALIGNMENT > size:
                    return True
    return False


def with_room_for_the_schedule(case: Case) -> Case:
    """The KV block halved until the schedule fits (a step's SMEM grows with the block's pages), down to one
    page; then the page table cut to the pages the live sequences use (it takes SMEM from the steps); then
    the batch without its longest sequence, until it fits."""
    while schedule_write_back_overruns_its_buffers(case) and (case.num_kv_pages_per_block or 1) > 1:
        case = dataclasses.replace(case, num_kv_pages_per_block=(case.num_kv_pages_per_block or 1) // 2)
    if schedule_write_back_overruns_its_buffers(case):
        used = max([math.ceil(kv_len / case.page_size) for kv_len in case.kv_lens] or [1])
        pages_per_seq = max(used, case.num_kv_pages_per_block or 1)
        case = dataclasses.replace(
            case, pages_per_seq=pages_per_seq, total_num_pages=max(case.total_num_pages, used + 1)
        )
    while schedule_write_back_overruns_its_buffers(case) and case.kv_lens:
        longest = case.kv_lens.index(max(case.kv_lens))
        case = keep_sequences(case, [i != longest for i in range(len(case.kv_lens))])
    return case


def sliding_window_wraps_int16_positions(case: Case) -> bool:
    """With packed queries (16 bits or fewer) on TPU v6 and v7, batched RPA computes key and query positions
    in int16 (configs.py: ``ServingConfigs.int_ty``), and its window test ``q_idx < kv_idx + sliding_window``
    (flash_attention.py) adds the window to int16 key positions: a window past int16, or one that takes a
    key position past 32,767, wraps. Bounded by the page table's keys, as v3's predicate is."""
    if case.sliding_window is None or np.dtype(case.q_dtype).itemsize == 4:
        return False
    return case.sliding_window + case.kv_capacity > INT16_MAX


RPA_HARNESS_CATALOGUE = (
    KnownIssue(
        "batched-rpa-schedule-write-back-overruns-its-buffers",
        "the schedule kernel writes its step arrays back in whole 1,024-entry chunks: past the end of its "
        "SMEM arrays when they hold fewer (a page table or KV blocks that leave little SMEM for steps)",
        FINDINGS
        / "batched-rpa-schedule-write-back-overruns-its-buffers"
        / "differential-checked_interpret-v6e.json",
        schedule_write_back_overruns_its_buffers,
        with_room_for_the_schedule,
        r"Out-of-bounds read of .* smem",
        backends=("interpret",),  # a copy past an array: only the checking interpreter checks its bounds
        explanation=(
            "`rpa_metadata_schedule_kernel` (schedule.py) keeps the schedule in SMEM arrays of `k * "
            "max_steps_ub` entries (`RpaSchedule.create_shape_dtype`) and copies each to HBM with "
            "`pltpu.make_async_copy(s.at[pl.ds(0, write_size)], h.at[pl.ds(0, write_size)], ...)`, "
            "`write_size = align_to((size // max_steps_ub) * safe_max_steps, 1024)`. The rounding up to "
            "1,024 entries can pass the array's end, and does for every call once `k * max_steps_ub` is "
            "below 1,024: `RpaConfigs.max_steps_ub` is the SMEM left after the metadata over a step's "
            "bytes, so a long page table (the repro: 4 sequences of 60,000 one-token pages, 960 KB of "
            "`page_indices`) or KV blocks of many pages leave room for a few hundred steps. The copy reads "
            "past the SMEM array and writes past the HBM one (the TPU interpreter: `Out-of-bounds read`; "
            "the generic interpreter checks no bounds and the attention comes out right); rounding "
            "`write_size` down to the array, or sizing the arrays to a multiple of 1,024, keeps it inside."
        ),
        fails_as=(RaisedOnValidInput,),
    ),
    KnownIssue(
        "batched-rpa-finite-mask-value-weights-keys-past-kv-len",
        "a finite mask_value weights the empty slots past kv_len in a sequence's last KV block, as v3's and "
        "MLA's kernels do",
        FINDINGS
        / "batched-rpa-finite-mask-value-weights-keys-past-kv-len"
        / "differential-checked_interpret-v6e.json",
        finite_mask_value_weights_keys_past_kv_len,
        with_v3_default_mask_value,
        NUMERIC_MISMATCH,
        explanation=(
            "`flash_attention_qk` (flash_attention.py) masks a logit unless `q_idx < effective_kv_len` and "
            "`q_idx >= kv_idx` (and the window), and replaces a masked one with `mask_value` "
            "(`jnp.where(mask_b, qk[b_idx], mask_value)`). A slot of the last KV block past `kv_len` has a "
            "key position past every query's, so it is one more masked key and gets the weight "
            "`exp(mask_value - max)` with whatever value the block holds there. The default mask value "
            "(`finfo(out_dtype).min`) makes that weight 0; a finite one (the docstring's \"Value to use for "
            'causal masking") does not, and the output then depends on the KV block size, a tuning parameter.'
        ),
        fails_as=(OverTheBound,),
    ),
    KnownIssue(
        "batched-rpa-sliding-window-wraps-int16-positions",
        "on TPU v6 and v7, with packed queries, a sliding window that takes a key position past 32,767 wraps "
        "in batched RPA's int16 position arithmetic and masks the keys, as v3's does",
        FINDINGS
        / "batched-rpa-sliding-window-wraps-int16-positions"
        / "differential-checked-any-config_interpret-v6e.json",
        sliding_window_wraps_int16_positions,
        with_a_window_within_int16,
        rf"non-finite values|{NUMERIC_MISMATCH}",
        explanation=(
            "`ServingConfigs.int_ty` (configs.py) is `jnp.int16` for packed queries "
            "(`get_dtype_packing(dtype_q) != 1`) where `pltpu.get_tpu_info().generation` is 6 or 7, and "
            "`flash_attention_qk` (flash_attention.py) builds its key positions in it "
            "(`broadcasted_iota(int_ty, ...) + processed_kv_len`) and tests the window as `q_idx_b < kv_idx_b "
            "+ sliding_window`: the Python int window is added in int16, so a window past 32,767 (the repro's "
            "2^20 wraps to 0) or a sum past it wraps, the test fails, and the keys it should keep get the "
            "mask value. v5e, float32 queries and a window that stays within int16 are right."
        ),
        # int16 only where the generation is 6 or 7 (``case 6 | 7``)
        generations=tuple(
            g for g in generations.from_major_version(6) if g not in generations.from_major_version(8)
        ),
        fails_as=(NonFiniteOutput, OverTheBound),
    ),
)
