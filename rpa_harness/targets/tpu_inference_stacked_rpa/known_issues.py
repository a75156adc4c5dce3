"""Known issues of tpu-inference's stacked RPA (``docs/tpu-inference-stacked-rpa-findings/``) and their
predicates, restated from ``experimental/stacked_rpa/`` (0.32.0): its KV blocks are whole 128-key pages
(the case's ``num_kv_pages_per_block``, a sliding window's anchored span), walked per query block; with a
sliding window its mixed kernel writes new tokens back by a schedule ``both_outputs`` restates."""

import dataclasses

import numpy as np

from rpa_harness.device import INTERPRET, TPU, Backend
from rpa_harness.failures import CacheMismatch, OverTheBound
from rpa_harness.known_issues import NUMERIC_MISMATCH, KnownIssue, findings_dir
from rpa_harness.strategies.case import Case
from rpa_harness.targets import layouts
from rpa_harness.targets.tpu_inference import arguments, judging
from rpa_harness.targets.tpu_inference.findings import (
    finite_replacing_mask_value,
    masked_keys_weigh,
    with_v3_default_mask_value,
)
from rpa_harness.targets.tpu_inference_stacked_rpa import both_outputs

FINDINGS = findings_dir("tpu-inference-stacked-rpa-findings")


def finite_mask_value_weights_keys_by_block(case: Case) -> bool:
    """A finite replacing mask_value whose weight exp(mask_value - row max) does not underflow, in a
    sequence with masked keys among those its KV blocks visit: slots past kv_len in its last block (kv_len
    not a multiple of the block's keys, or a window's anchored block), or keys past a query's position (more
    than one query). A superset: it does not restate which blocks each query block visits."""
    mask_value = finite_replacing_mask_value(case)
    if mask_value is None:
        return False
    block = (case.num_kv_pages_per_block or 1) * case.page_size
    with_masked_keys = (
        seq
        for seq, (q_len, kv_len) in enumerate(zip(case.q_lens, case.kv_lens, strict=True))
        if kv_len % block or q_len != 1 or case.sliding_window is not None
    )
    return masked_keys_weigh(case, mask_value, with_masked_keys)


def window_write_back_leaves_new_tokens_unwritten(case: Case) -> bool:
    """A sliding window, the cache updated, and a mixed sequence (one past the leading single-token
    decodes) with new tokens the window kernel's write-back misses (``both_outputs``' restatement of its
    schedule, for the case's query block; any mixed sequence where the kernel chooses its own blocks)."""
    if case.sliding_window is None or not case.update_kv_cache:
        return False
    q_lens = np.asarray(case.q_lens, np.int32)  # a case of no sequences has q_lens ()
    mixed = range(int(layouts.distribution(q_lens, case.num_seqs)[1]), len(case.q_lens))
    given = arguments.given_block_options(
        case.num_queries_per_block, case.num_kv_pages_per_block, case.pages_per_seq
    )
    if given is None:
        return len(mixed) > 0
    unwritten = both_outputs.window_unwritten_positions(
        case.q_lens, case.kv_lens, mixed, window=case.sliding_window, bq=given[0],
        total_q_tokens=case.max_num_batched_tokens, page_size=case.page_size, pages_per_seq=case.pages_per_seq,
    )  # fmt: skip
    return bool(unwritten)


def cache_read_not_written(case: Case) -> Case:
    """The same attention with the new tokens already in the cache, which the kernel then leaves alone."""
    return dataclasses.replace(case, update_kv_cache=False)


def _replay_where_the_cache_is_written(issue, target, backend, repro) -> None:
    """Replays both outputs on a TPU, else on the TPU interpreter: jax 0.10's generic interpreter returns an
    aliased cache as given, whatever the kernel writes."""
    where = backend if backend.name == TPU else Backend(INTERPRET, generation=repro.tpu_generation)
    judging.checks_both_outputs(both_outputs.judge)(target, where, repro.arrays, repro.options)


RPA_HARNESS_CATALOGUE = (
    KnownIssue(
        "stacked-rpa-finite-mask-value-weights-keys-by-block",
        "a finite mask_value weights the masked keys of the KV blocks the kernel visits, the empty slots past "
        "kv_len among them, not the masked keys in [0, kv_len)",
        FINDINGS
        / "stacked-rpa-finite-mask-value-weights-keys-by-block"
        / "differential_fast-interpret-v6e.json",
        finite_mask_value_weights_keys_by_block,
        with_v3_default_mask_value,
        NUMERIC_MISMATCH,
        explanation=(
            "`flash_attention_qk_softmax` (stacked_rpa/flash_attention.py) replaces every logit it computes "
            "outside the mask (`q_idx < effective_kv_len`, `q_idx >= kv_idx`, the window) with `mask_value` "
            "(`jnp.where(compute_mask(), qk, mask_value)`), over every slot of the KV block it loaded; the "
            "decode kernel then zeroes the values past the block's valid keys (`v = jnp.where(keep, v, 0)`). "
            "A slot past `kv_len` in a sequence's last block is thus one more masked key, with weight "
            "`exp(mask_value - max)` and value 0. The default mask value (`finfo(out_dtype).min`) makes that "
            'weight 0; a finite one (the docstring\'s "Value to use for causal masking") does not, and the '
            "output then depends on the KV block size, a tuning parameter, and on the 128-key pages: one "
            "decode of one key is divided among 128 slots."
        ),
        fails_as=(OverTheBound,),
    ),
    KnownIssue(
        both_outputs.WINDOW_WRITE_BACK_FINDING,
        "with a sliding window, the mixed kernel places a page's cache write-back by the new tokens' rows in "
        "the batch, not their key positions: their slots are not written unless the two meet",
        FINDINGS / both_outputs.WINDOW_WRITE_BACK_FINDING / "v3-attention-and-cache_interpret-v6e.json",
        window_write_back_leaves_new_tokens_unwritten,
        cache_read_not_written,
        rf"exactly the slots of {both_outputs.WINDOW_WRITE_BACK_FOLDER}",
        replay=_replay_where_the_cache_is_written,
        explanation=(
            "`compute_metadata` (stacked_rpa/prefill/sliding_window/schedule.py) bounds the lanes a query block "
            "writes back to each page by `dirty_lo = max(update_page_start, new_kv_start)` and `dirty_hi = "
            "min(update_page_start + page_size, new_kv_start + new_size)`. `update_page_start` is a key "
            "position (`update_page << page_size_log2`), but `new_kv_start = q_end - new_left` is a row of "
            "the batch's new tokens (`q_end = cu_q_lens[s_idx + 1]`). Unless the sequence's rows in the batch "
            "meet its new tokens' key positions on that page, `dirty_hi <= dirty_lo` and the page is not "
            "written back: one mixed sequence of 2 new tokens at key positions 128-129 (rows 0-1) leaves both "
            "slots as they were. The attention is right (it reads the new tokens from the batch), so only a "
            "later reader of the cache sees it. The decode kernel, and the mixed kernel without a window, wrote "
            "every new token in the cases checked."
        ),
        fails_as=(CacheMismatch,),
    ),
)
