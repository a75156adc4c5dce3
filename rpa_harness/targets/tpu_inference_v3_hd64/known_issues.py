"""Known issues of tpu-inference's head_dim-64 kernel (``docs/tpu-inference-v3-findings/hd64-*``) and their
predicates.

Restated from ``kernel_hd64.py`` (0.32.0): per sequence, query blocks of ``num_queries_per_block`` rows;
every query block walks the KV blocks of ``num_kv_pages_per_block`` pages from ``max(kv_len - q_len -
window, 0) // bkv`` (0 without a window) through the block holding key ``kv_len - 1``, whole, and replaces
every masked logit it computes with ``mask_value``. ``prepare_inputs`` reshapes ``attention_sink``
[num_q_heads] to [-1, q heads per KV head padded to the q packing, 1], and its prologue zeroes each KV
buffer as int32 tiles of 8 x 128 words. The block sizes are the target's
mapping of the case (``hd64_inputs``): the case's, or the tuned table's for the chip a generation emulates.
"""

import dataclasses
import functools

from rpa_harness import generations
from rpa_harness.failures import OverTheBound, RaisedOnValidInput
from rpa_harness.known_issues import NUMERIC_MISMATCH, KnownIssue, case_arrays, findings_dir
from rpa_harness.spec.interface import values_per_word
from rpa_harness.strategies.case import Case
from rpa_harness.targets.tpu_inference.findings import (
    finite_replacing_mask_value,
    masked_keys_weigh,
    with_v3_default_mask_value,
)
from rpa_harness.targets.tpu_inference_v3_hd64 import adapter as hd64

FINDINGS = findings_dir("tpu-inference-v3-findings")


@functools.lru_cache(maxsize=1)
def _block_sizes_on(case: Case, generation: str) -> tuple[int, int]:
    return hd64.hd64_inputs(**case_arrays(case), **case.options()).block_sizes


def hd64_sink_on_padded_q_heads(case: Case) -> bool:
    """Sinks with a number of q heads per KV head that is not a multiple of q's packing (bfloat16: 2): the
    kernel pads the heads per KV head but reshapes the sinks unpadded, so it fails to trace (the count does
    not divide) or reads each KV head's sinks from the wrong heads, past the end for the last KV heads."""
    if case.attention_sink is None:
        return False
    return (case.num_q_heads // case.num_kv_heads) % values_per_word(case.q_dtype) != 0


def without_sinks(case: Case) -> Case:
    return dataclasses.replace(case, attention_sink=None)


SUBLANES = 8  # rows of 32-bit words in a TPU tile: the prologue's zeroing reshapes the KV buffer to them


def _words_per_key(case: Case) -> int:
    """32-bit rows per key in the KV buffer: the KV heads padded to the packing, ``packing`` per row."""
    packing = values_per_word(case.kv_dtype)
    return -(-case.num_kv_heads // packing)


def hd64_kv_block_not_whole_tiles(case: Case) -> bool:
    """A KV block whose rows (keys times 128-lane rows per key) are not a multiple of 8: the prologue's
    ``bkv_x2_ref.bitcast(jnp.int32).reshape((2, -1, 8, 128))`` raises while the kernel traces, an error its
    validators do not name (they accept every positive block)."""
    kv_pages, _ = _block_sizes_on(case, generations.current())
    return kv_pages * case.page_size * _words_per_key(case) % SUBLANES != 0


def with_whole_tile_kv_blocks(case: Case) -> Case:
    """The KV block nearest the case's, within the page table, that is whole tiles (a tuning change); the
    case itself where there is none."""
    kv_pages, queries = _block_sizes_on(case, generations.current())
    whole = [
        pages
        for pages in range(1, case.pages_per_seq + 1)
        if pages * case.page_size * _words_per_key(case) % SUBLANES == 0
    ]
    if not whole:
        return case
    nearest = min(whole, key=lambda pages: (abs(pages - kv_pages), pages))
    return dataclasses.replace(case, num_kv_pages_per_block=nearest, num_queries_per_block=queries)


def hd64_finite_mask_value_weights_keys_by_block(case: Case) -> bool:
    """A finite replacing mask_value with a weight exp(mask_value - row max) that does not underflow, in a
    sequence whose visited keys are not exactly [0, kv_len).

    The kernel gives the weight to the masked keys of the KV blocks it visits, the slots past kv_len in the
    last block included (with whatever values its KV buffer holds there), and none to the keys of the blocks
    a sliding window skips. Its reference gives every masked key in [0, kv_len) the weight with its value,
    and no other key.
    """
    mask_value = finite_replacing_mask_value(case)
    if mask_value is None:
        return False
    kv_pages, _ = _block_sizes_on(case, generations.current())
    block = kv_pages * case.page_size
    window = case.sliding_window
    # Slots past kv_len in the last block, or a first visited block past block 0 (a window skips keys).
    not_exactly_their_keys = (
        seq
        for seq, (q_len, kv_len) in enumerate(zip(case.q_lens, case.kv_lens, strict=True))
        if kv_len % block or (window is not None and max(kv_len - q_len - window, 0) >= block)
    )
    return masked_keys_weigh(case, mask_value, not_exactly_their_keys, sinks=True)


RPA_HARNESS_CATALOGUE = (
    KnownIssue(
        "hd64-sink-on-padded-q-heads",
        "attention sinks with bfloat16 queries and an odd number of q heads per KV head: the kernel fails to "
        "trace, or takes each KV head's sinks from the wrong heads and reads past its sink buffer",
        FINDINGS / "hd64-sink-on-padded-q-heads" / "differential-checked_interpret.json",
        hd64_sink_on_padded_q_heads,
        without_sinks,
        rf"cannot reshape|Out-of-bounds read|{NUMERIC_MISMATCH}",
        explanation=(
            "`prepare_inputs` pads the queries per KV head to a whole number of q's packing (2 for bfloat16) "
            "but reshapes the sinks unpadded, `attention_sink.reshape((-1, num_q_heads_per_kv_head, 1))` with "
            "the padded count. So KV head i takes the sinks of q heads `2i, 2i+1` (its one real head gets q "
            "head 2i's), and the KV heads past half read past the `[num_q_heads / 2, 2, 128]` sink buffer (on "
            "a TPU, VMEM beyond it: bounds checks are off); where the count does not divide, the reshape "
            "raises while the kernel traces. `ref_ragged_paged_attention_hd64` reshapes to the real head "
            "count and is right. Float32 queries (packing 1) and an even number of q heads per KV head "
            "(gpt-oss: 64 over 8) are not affected."
        ),
        fails_as=(RaisedOnValidInput, OverTheBound),
    ),
    KnownIssue(
        "hd64-kv-block-not-whole-tiles-fails-to-trace",
        "a KV block of fewer than 8 rows of 32-bit words (or not a multiple of 8): the kernel's prologue "
        "raises a reshape ValueError while it traces; its validators accept the block",
        FINDINGS / "hd64-kv-block-not-whole-tiles-fails-to-trace" / "differential-checked_interpret.json",
        hd64_kv_block_not_whole_tiles,
        with_whole_tile_kv_blocks,
        r"do not evenly divide the size of the ref",
        explanation=(
            "The prologue zeroes the KV double buffer as int32 tiles, `bkv_x2_ref.bitcast(jnp.int32).reshape("
            "(2, -1, 8, 128))`, which needs the block's rows (keys times `ceil(num_kv_heads / packing)` rows of "
            "128 words per key) to be a multiple of 8. `static_validate_inputs` accepts any positive "
            "`num_kv_pages_per_block`, so a caller learns the rule from a reshape error. The tuned table's "
            "blocks are whole tiles; given ones need not be."
        ),
        releases=">=0.13.0",  # 0.12.0's prologue has no such reshape (its repro passes there)
        fails_as=(RaisedOnValidInput,),
    ),
    KnownIssue(
        "hd64-finite-mask-value-weights-keys-by-block",
        "a finite mask_value weights the masked keys of the KV blocks the kernel visits (slots past kv_len "
        "included, with stale values), not the masked keys in [0, kv_len)",
        FINDINGS / "hd64-finite-mask-value-weights-keys-by-block" / "differential-checked_interpret.json",
        hd64_finite_mask_value_weights_keys_by_block,
        with_v3_default_mask_value,
        NUMERIC_MISMATCH,
        explanation=(
            "Every query block computes its logits for whole KV blocks, from `max(kv_len - q_len - "
            "sliding_window, 0) // bkv` through the block holding key `kv_len - 1`, and replaces each masked "
            "one with `mask_value`: the empty slots past `kv_len` in the last block get the weight "
            "`exp(mask_value - m)` with whatever the KV buffer holds there (zeros, or stale keys of an earlier "
            "block or sequence), and with a sliding window the masked keys of the blocks before that start get "
            "none. `ref_ragged_paged_attention_hd64` gives the weight to exactly the masked keys in "
            "`[0, kv_len)`. With `kv_len` a multiple of the block and no window skip the two agree; the default "
            "mask value masks fully and is not affected."
        ),
        fails_as=(OverTheBound,),
    ),
)
