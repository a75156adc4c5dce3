"""v3's judge of the family's property (``tpu_inference.judging``: both outputs of one call judged), with
the cache errors of its sliding-window finding told from any other."""

import numpy as np

from rpa_harness.targets.tpu_inference.judging import judge_with
from rpa_harness.targets.tpu_inference_v3.adapter import V3Inputs, call_v3, v3_inputs


def unwritten_by_sliding_window(inputs: V3Inputs) -> np.ndarray:
    """bool [pages, page_size]: the new-token slots v3 0.32.0 does not write with a sliding window (finding
    ``docs/tpu-inference-v3-findings/sliding-window-skips-cache-writes``).

    v3 writes a KV block's new tokens to the cache only while its last query block runs, and with a sliding
    window that query block starts its KV loop at block ``max(first_query_position - window, 0) // bkv``:
    the new tokens in the KV blocks before it are never written. This recomputes that set from v3's loop
    bounds, so that a campaign can tell this known finding from any other cache mismatch.
    """
    window = inputs.kwargs["sliding_window"]
    unwritten = np.zeros_like(inputs.new_slots)
    if window is None or not inputs.kwargs.get("update_kv_cache", True):
        return unwritten
    _, _, _, _, kv_lens, page_indices, cu_q_lens, distribution = inputs.args
    page_size = inputs.new_slots.shape[1]
    pages_per_seq = len(page_indices) // len(kv_lens)
    decodes, _, num_seqs = (int(x) for x in distribution)
    for i in range(num_seqs):
        bq, bkv = (inputs.decode_block_sizes if i < decodes else inputs.mixed_block_sizes)[:2]
        q_len, kv_len = int(cu_q_lens[i + 1] - cu_q_lens[i]), int(kv_lens[i])
        q_block = min(bq, q_len) if i < decodes else bq  # the decode kernel's query block is one row
        last_block_start = kv_len - q_len + (-(-q_len // q_block) - 1) * q_block
        first_written = max(last_block_start - window, 0) // bkv * bkv
        for position in range(kv_len - q_len, min(first_written, kv_len)):
            page = page_indices[i * pages_per_seq + position // page_size]
            unwritten[page, position % page_size] = True
    return unwritten


SLIDING_WINDOW_FINDING = "sliding-window-skips-cache-writes"

# v3 itself: both outputs judged, the cache errors of its sliding-window finding attributed to it.
judge = judge_with(
    "tpu-inference v3",
    v3_inputs,
    call_v3,
    finding=(f"docs/tpu-inference-v3-findings/{SLIDING_WINDOW_FINDING}", unwritten_by_sliding_window),
)
