"""Both outputs of one stacked RPA call judged: the attention against the float64 oracle, the returned cache
against the case's, bit for bit, slot by slot (its layout read slots first), but for the slots past kv_len
that its whole-tile write-back fills (``check_updated_cache``)."""

import numpy as np
from rpa_harness.checks import ExpectedCache, cache_mismatch
from rpa_harness.targets.tpu_inference_stacked_rpa import layout
from rpa_harness.targets.tpu_inference_stacked_rpa.adapter import StackedInputs, call_stacked, stacked_inputs
from rpa_harness.targets.tpu_inference_v3 import both_outputs as v3_judge

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


# On jax 0.10's generic interpreter the cache comes back as given (writes into an aliased input are lost
# there): judge the cache on the TPU interpreter, or on jax 0.11.
judge = v3_judge.judge_with(NAME, stacked_inputs, call_stacked, check_cache=check_updated_cache)
