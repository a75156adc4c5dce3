"""Both outputs of one stacked RPA call judged: the attention against the float64 oracle, the returned cache
against the case's, bit for bit, slot by slot (its layout read slots first), but for the slots past kv_len
that its whole-tile write-back fills (``check_updated_cache``). A cache error that is exactly the slots
its sliding-window write-back leaves unwritten is attributed to that finding (``unwritten_by_window_write_back``).
"""

from typing import Any

import numpy as np

from rpa_harness.cache_judge import ExpectedCache, cache_mismatch
from rpa_harness.targets.tpu_inference import judging
from rpa_harness.targets.tpu_inference_stacked_rpa import layout
from rpa_harness.targets.tpu_inference_stacked_rpa.adapter import StackedInputs, call_stacked, stacked_inputs

NAME = "tpu-inference stacked RPA"


def check_updated_cache(inputs: StackedInputs, updated_cache) -> None:
    """The returned cache equals the expected one bit for bit: every new token in its slot, no key in [0,
    kv_len) of a live sequence, no padded dim and no page no live sequence uses changed (NaN payloads
    included).

    The slots past kv_len of a live sequence's pages are not judged: stacked RPA writes whole 128-lane
    tiles back (the sequence is on the lanes), the decode stitch filling the lanes after a sequence's new
    token with the new-token rows that follow it (``decode/stitch.py``: ``use_new = lane >= dst_lane``
    for one-token decodes), so those slots take other sequences' keys and values. No query reads them (they
    are past kv_len) and the next call writes its new tokens over them."""
    head_dim = inputs.args[0].shape[2]
    padded = inputs.expected_cache.shape[3]

    def element(index: int) -> str:
        head, dim = divmod(index, padded)
        where = f"dim {dim}" if dim < head_dim else f"padded dim {dim}"
        return f"{'KV'[head % 2]} head {head // 2}, {where}"

    actual = layout.slots_first(updated_cache)
    unjudged = slots_past_kv_len(inputs)
    expected_cache = inputs.expected_cache.copy()
    if actual.shape == expected_cache.shape:  # else the mismatch says the shapes differ
        expected_cache[unjudged] = actual[unjudged]
    expected = ExpectedCache(
        expected_cache, inputs.given_cache, inputs.new_slots, inputs.slot_owner, inputs.slot_position
    )
    mismatch = cache_mismatch(actual, expected, who="stacked RPA", element=element)
    if mismatch is not None:
        raise mismatch


def slots_past_kv_len(inputs: StackedInputs) -> np.ndarray:
    """bool [pages, page_size]: the slots of live sequences' pages at key positions past their kv_len,
    which no query reads (``check_updated_cache`` leaves them unjudged)."""
    kv_lens = np.asarray(inputs.args[4])
    owned = inputs.slot_owner >= 0
    past = np.zeros_like(owned)
    past[owned] = inputs.slot_position[owned] >= kv_lens[inputs.slot_owner[owned]]
    return past


WINDOW_WRITE_BACK_FINDING = "stacked-rpa-window-write-back-placed-by-batch-row"
WINDOW_WRITE_BACK_FOLDER = f"docs/tpu-inference-stacked-rpa-findings/{WINDOW_WRITE_BACK_FINDING}"
LANES = 128  # every TPU generation's vreg lanes (pltpu.get_tpu_info().num_lanes)
# The sliding-window mixed kernel's query blocks (prefill/sliding_window/block_sizes.py).
MAX_WINDOW_QUERY_BLOCK, WINDOW_QUERY_BLOCK_ALIGNMENT = 256, 8


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def window_query_block(bq: int, total_q_tokens: int) -> int:
    """The query block the sliding-window mixed kernel runs for a given one: capped at the batch's rows and
    256, rounded up to a multiple of 8 (``choose_block_sizes``' first candidate, taken as fitting VMEM)."""
    capped = max(min(bq, total_q_tokens, MAX_WINDOW_QUERY_BLOCK), 1)
    return _ceil_div(capped, WINDOW_QUERY_BLOCK_ALIGNMENT) * WINDOW_QUERY_BLOCK_ALIGNMENT


def window_written_positions(
    q_start: int, q_len: int, kv_len: int, *, window: int, bq: int, page_size: int, pages_per_seq: int
) -> set[int]:
    """The key positions of one mixed sequence that the sliding-window mixed kernel writes back to the cache,
    restated from its schedule (prefill/sliding_window/schedule.py, ``compute_metadata``): each query block
    writes the pages from the one holding its first new token on, each on the lanes ``[dirty_lo, dirty_hi)``
    rounded out to whole lane tiles. Those bounds compare the page's key positions with ``new_kv_start =
    q_end - new_left``, a row of the batch's new tokens (``q_start`` is the sequence's first row), so a page
    is written only where the two ranges happen to meet."""
    q_end, prefix = q_start + q_len, kv_len - q_len
    bkv = min(pages_per_seq * page_size, _ceil_div(window + bq + page_size - 1, page_size) * page_size)
    new_pages_per_block = bkv // page_size + 1
    written: set[int] = set()
    for block in range(_ceil_div(q_len, bq)):
        processed_q = prefix + block * bq
        q_size = min(max(q_end - (q_start + block * bq), 0), bq)
        processed_kv = max(processed_q - window, 0) // page_size * page_size
        cache_size = min(max(prefix - processed_kv, 0), bkv)
        new_left = max(max(kv_len - processed_kv, 0) - cache_size, 0)
        new_size = min(bkv - cache_size, new_left)
        new_kv_start = q_end - new_left
        first_page = prefix // page_size if block == 0 else _ceil_div(processed_q, page_size)
        pages = max(_ceil_div(processed_q + q_size, page_size) - first_page, 0)
        for i in range(min(pages, new_pages_per_block)):
            start = min(first_page + i, pages_per_seq - 1) * page_size
            dirty_lo, dirty_hi = max(start, new_kv_start), min(start + page_size, new_kv_start + new_size)
            if dirty_hi > dirty_lo:
                first_lane = min(max(dirty_lo - start, 0), page_size) // LANES * LANES
                end_lane = _ceil_div(min(max(dirty_hi - start, 0), page_size), LANES) * LANES
                written.update(range(start + first_lane, start + end_lane))
    return written


def window_unwritten_positions(
    q_lens,
    kv_lens,
    mixed: range,
    *,
    window: int,
    bq: int,
    total_q_tokens: int,
    page_size: int,
    pages_per_seq: int,
) -> dict[int, list[int]]:
    """Per mixed sequence (``mixed``: their indices), its new tokens' key positions that the sliding-window
    mixed kernel does not write back, for a given query block ``bq`` (empty sequences left out)."""
    bq = window_query_block(bq, total_q_tokens)
    unwritten = {}
    for i in mixed:
        q_start, q_len, kv_len = int(sum(q_lens[:i])), int(q_lens[i]), int(kv_lens[i])
        written = window_written_positions(
            q_start, q_len, kv_len, window=window, bq=bq, page_size=page_size, pages_per_seq=pages_per_seq
        )
        missed = [p for p in range(kv_len - q_len, kv_len) if p not in written]
        if missed:
            unwritten[i] = missed
    return unwritten


def unwritten_by_window_write_back(inputs: StackedInputs) -> np.ndarray | None:
    """bool [pages, page_size]: the new-token slots stacked RPA 0.32.0 leaves unwritten with a sliding
    window (finding ``WINDOW_WRITE_BACK_FINDING``); None where the kernel chooses its own block sizes,
    whose query block this does not restate."""
    unwritten = np.zeros_like(inputs.new_slots)
    window = inputs.kwargs["sliding_window"]
    if window is None or not inputs.kwargs["update_kv_cache"]:
        return unwritten
    mixed_blocks: Any = inputs.mixed_block_sizes  # the kernel's prefill BlockSizes (imported with the kernel)
    if mixed_blocks is None:
        return None
    q, _, _, _, kv_lens, page_indices, cu_q_lens, distribution = inputs.args
    pages_per_seq = len(page_indices) // len(kv_lens)
    page_size = inputs.new_slots.shape[1]
    missed = window_unwritten_positions(
        np.diff(cu_q_lens), kv_lens, range(int(distribution[1]), int(distribution[2])), window=window,
        bq=mixed_blocks.bq_sz, total_q_tokens=q.shape[0], page_size=page_size,
        pages_per_seq=pages_per_seq,
    )  # fmt: skip
    for i, positions in missed.items():
        for position in positions:
            unwritten[page_indices[i * pages_per_seq + position // page_size], position % page_size] = True
    return unwritten


# On jax 0.10's generic interpreter the cache comes back as given (writes into an aliased input are lost
# there): judge the cache on the TPU interpreter, or on jax 0.11.
judge = judging.judge_with(
    NAME,
    stacked_inputs,
    call_stacked,
    check_cache=check_updated_cache,
    finding=(WINDOW_WRITE_BACK_FOLDER, unwritten_by_window_write_back),
)
