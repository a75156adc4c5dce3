"""Known issues of tpu-inference's MLA v2 (``docs/tpu-inference-mla-v2-findings/``) and their predicates."""

import dataclasses

from rpa_harness.failures import CacheMismatch, NonFiniteOutput, OverTheBound, RaisedOnValidInput
from rpa_harness.known_issues import NUMERIC_MISMATCH, KnownIssue, findings_dir
from rpa_harness.spec.interface import values_per_word
from rpa_harness.strategies.case import Case
from rpa_harness.targets.tpu_inference_mla_v1.known_issues import (
    block_sizes_left_to_the_kernel,
    finite_mask_value_weights_keys_past_kv_len,
    with_given_block_sizes,
    with_its_default_mask_value,
)

FINDINGS = findings_dir("tpu-inference-mla-v2-findings")


def packed_cache_row_past_kv_len(case: Case) -> bool:
    """A packed cache (bfloat16: two tokens per 32-bit row) and a live sequence whose last new token does not
    end its row: the row's other slot, past kv_len, is overwritten."""
    packing = values_per_word(case.kv_dtype)
    return packing > 1 and any(
        q_len > 0 and kv_len % packing for q_len, kv_len in zip(case.q_lens, case.kv_lens, strict=True)
    )


def with_kv_lens_ending_rows(case: Case) -> Case:
    """Each live kv_len rounded up to a whole row (the page size is a multiple of the packing, so the
    sequence keeps its pages)."""
    packing = values_per_word(case.kv_dtype)
    kv_lens = tuple(
        -(-kv_len // packing) * packing if q_len else kv_len
        for q_len, kv_len in zip(case.q_lens, case.kv_lens, strict=True)
    )
    return dataclasses.replace(case, kv_lens=kv_lens)


def merge_reads_a_row_past_its_buffer(case: Case) -> bool:
    """A packed cache and a KV block where the merge of a sequence's new tokens into the fetched block
    (kv_utils.pack_new_kv) reads one row past the block's VMEM buffer.

    Stated in the kernel's terms, per live sequence and KV block of ``B`` tokens: ``c`` cached and ``u``
    new tokens in the block, the first new one at ``s`` in the flat new-token array. The merge reads rows
    ``a .. a + n + 1`` of a buffer of ``B / packing + 2`` rows, with ``n = ceil((c % packing + u) /
    packing)`` iterations and ``a = ceil(c / packing)``, one less where ``s % packing < c % packing``.
    """
    packing = values_per_word(case.kv_dtype)
    if packing == 1:
        return False
    if case.num_kv_pages_per_block is None:  # the kernel refuses the call
        return False
    block = case.num_kv_pages_per_block * case.page_size
    rows = block // packing + 2
    q_end = 0
    for q_len, kv_len in zip(case.q_lens, case.kv_lens, strict=True):
        q_end += q_len
        for start in range(0, kv_len, block):
            left = kv_len - start
            cached = min(max(left - q_len, 0), block)
            new = min(block - cached, left - max(left - q_len, 0))
            if new <= 0:
                continue
            first_new = q_end - kv_len + start + cached
            row = -(-cached // packing) - (first_new % packing < cached % packing)
            iterations = -(-(cached % packing + new) // packing)
            if row + iterations + 1 >= rows:
                return True
    return False


def with_cached_tokens_ending_rows(case: Case) -> Case:
    """Each live sequence's cached part shortened to whole rows (fewer keys, the same pages suffice): the
    new tokens then start a row, and the merge stays inside its buffer."""
    packing = values_per_word(case.kv_dtype)
    kv_lens = tuple(
        kv_len - (kv_len - q_len) % packing if q_len else kv_len
        for q_len, kv_len in zip(case.q_lens, case.kv_lens, strict=True)
    )
    return dataclasses.replace(case, kv_lens=kv_lens)


def stale_slots_in_a_bfloat16_cache(case: Case) -> bool:
    """A packed cache with NaN in the slots past kv_len (a poisoned case) and a live sequence whose last KV
    block has such slots."""
    block = (case.num_kv_pages_per_block or 1) * case.page_size
    return (
        case.poison
        and values_per_word(case.kv_dtype) > 1
        and any(q_len > 0 and kv_len % block for q_len, kv_len in zip(case.q_lens, case.kv_lens, strict=True))
    )


def with_finite_stale_slots(case: Case) -> Case:
    """The slots past kv_len hold copies of live values (finite) instead of NaN."""
    return dataclasses.replace(case, poison=False)


RPA_HARNESS_CATALOGUE = (
    KnownIssue(
        "mla-v2-packed-cache-overwrites-the-slot-past-kv-len",
        "with a bfloat16 cache, writing a sequence's last new token overwrites the other slot of its 32-bit "
        "row, past kv_len",
        FINDINGS
        / "mla-v2-packed-cache-overwrites-the-slot-past-kv-len"
        / "differential-checked_interpret.json",
        packed_cache_row_past_kv_len,
        with_kv_lens_ending_rows,
        r"differs from the expected cache in \d+ slots? \(0 of \d+ new-token slots?,",
        explanation=(
            "MLA v2 writes a block's new tokens back from VMEM as whole 32-bit rows of `kv_packing` tokens "
            "(`_update_kv_cache`). Where a sequence's new tokens end mid-row (kv_len not a multiple of the "
            "packing), the row's other slot, past kv_len, gets what the VMEM buffer holds beside the new "
            "token (0 in the repro). MLA v1 writes exactly the new tokens' slots. The slot holds no key yet, so attention is unaffected until it is written, but the "
            "returned cache is not the input with the new tokens written."
        ),
        fails_as=(CacheMismatch,),
    ),
    KnownIssue(
        "mla-v2-merge-reads-a-row-past-its-vmem-buffer",
        "with a packed (bfloat16) cache, merging a sequence's new tokens into its KV block reads one row "
        "past the block's VMEM buffer (the value is unused; the TPU interpreter stops it)",
        FINDINGS / "mla-v2-merge-reads-a-row-past-its-vmem-buffer" / "differential-checked_interpret.json",
        merge_reads_a_row_past_its_buffer,
        with_cached_tokens_ending_rows,
        r"Out-of-bounds read",
        backends=("interpret",),
        explanation=(
            "`kv_utils.pack_new_kv` realigns the new tokens, fetched as whole 32-bit rows right after the "
            "block's cached rows, to their slots: a loop of `n = cdiv(offset % kv_packing + update_sz, "
            "kv_packing)` iterations over rows starting at `kv_packing_idx_new`, each ending with a look-"
            "ahead read of the row after the next (`next_kvc_reg = bkvc_vmem_ref[kv_packing_idx_new + 1]`, "
            "kv_utils.py:218). The last iteration's look-ahead is never used, but where the cached part of "
            "the block does not end a row and the block is full enough, it reads row `bkv_sz / kv_packing "
            "+ 2` of a buffer of `bkv_sz / kv_packing + 2` rows. The Pallas TPU interpreter raises an "
            "out-of-bounds read; the generic interpreter clamps it and the output is right. A float32 cache "
            "(one token per row) never reads past the buffer.\n\n"
            "**A memory-safety finding, which a chip does not show.** On a TPU v5e (2026-12-07, jax 0.10.2, "
            "tpu-inference 0.32.0) the repro passes: the read does not fault and the outputs are right. What "
            "is read: one row (`kv_packing` tokens of `kv_c` and of `k_pe`) past the block's buffer: the "
            "first row of the next buffer of the same scratch array (another batch row's, or the other half "
            "of the double buffer), or, past the array's last, whatever VMEM follows it. Whether an output can "
            "depend on it: no, for any shape: it is the look-ahead loaded at the end of the loop's last "
            "iteration (`next_kvc_reg`, `next_kpe_reg`), which only the loop's carry holds, and the result "
            "of `lax.fori_loop` is discarded; no store or arithmetic reads it. A dead load: it could matter "
            "only if the read left VMEM, which it did not in the repro on a v5e (v2 turns Mosaic's bounds "
            "checks off, `disable_bounds_checks=True`, so nothing stops it there). To act: load the "
            "look-ahead only while another iteration follows, or give the buffer one more row."
        ),
        fails_as=(RaisedOnValidInput,),
    ),
    KnownIssue(
        "mla-v2-bfloat16-cache-reads-slots-past-kv-len",
        "with a bfloat16 cache, the slots past kv_len in a sequence's last KV block enter P @ V with weight "
        "0: a NaN or Inf left there makes the output row NaN",
        FINDINGS / "mla-v2-bfloat16-cache-reads-slots-past-kv-len" / "differential-checked_interpret.json",
        stale_slots_in_a_bfloat16_cache,
        with_finite_stale_slots,
        r"non-finite values in live rows",
        explanation=(
            "With a bfloat16 cache (and p_same_dtype_as_v, its default) MLA v2 multiplies the whole KV block "
            "by P, the slots past kv_len included, whose weight is 0; 0 times a NaN or an Inf left in such a "
            "slot by an earlier sequence is NaN, and the row's output is NaN. With a float32 cache, and in "
            "MLA v1 and v3, the slots past kv_len do not reach the output. On a TPU the slots past kv_len "
            "hold whatever the page held before (finite unless a NaN or Inf was ever written there)."
        ),
        fails_as=(NonFiniteOutput,),
    ),
    KnownIssue(
        "mla-v2-finite-mask-value-weights-keys-past-kv-len",
        "a finite mask_value weights the empty slots past kv_len in a sequence's last KV block, as MLA v1's "
        "does (mla-v1-finite-mask-value-weights-keys-past-kv-len)",
        FINDINGS
        / "mla-v2-finite-mask-value-weights-keys-past-kv-len"
        / "differential-checked_interpret.json",
        finite_mask_value_weights_keys_past_kv_len,
        with_its_default_mask_value,
        NUMERIC_MISMATCH,
        explanation=(
            "v2 keeps v1's masking: each query block computes logits for whole KV blocks and replaces every "
            "masked one, the slots from kv_len to the block's end included, with `mask_value`; a finite one "
            "gives those slots the weight `exp(mask_value - m)`."
        ),
        fails_as=(OverTheBound,),
    ),
    KnownIssue(
        "mla-v2-default-block-sizes-raise",
        "num_kv_pages_per_block or num_queries_per_block left at its default (None) raises ValueError on "
        "every TPU generation, as MLA v1's does (mla-v1-default-block-sizes-raise)",
        FINDINGS / "mla-v2-default-block-sizes-raise" / "differential_fast-interpret-v5e.json",
        block_sizes_left_to_the_kernel,
        with_given_block_sizes,
        r"ValueError: num_kv_pages_per_block and num_queries_per_block must be specified\.",
        explanation=(
            "v2 keeps v1's refusal: both block sizes (each an int or a (decode, prefill, mixed) tuple) default "
            "to None, and the kernel raises the same ValueError when either is None. Its `tuned_params.py` "
            "holds tuned block sizes, but the kernel never reads it: tpu-inference's own caller "
            "(`layers/common/attention_interface.py`) looks them up by the problem's shapes and dtypes, never "
            "the chip, falls back to defaults of its own where no entry matches, and passes them. So a call "
            "with the signature's defaults raises on every TPU generation (seen on a TPU v5e)."
        ),
        fails_as=(RaisedOnValidInput,),
    ),
)
