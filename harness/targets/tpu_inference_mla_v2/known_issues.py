"""Known issues of tpu-inference's MLA v2 (``docs/tpu-inference-mla-v2-findings/``) and their predicates."""

import dataclasses

from rpa_harness.known_issues import NUMERIC_MISMATCH, KnownIssue, findings_dir
from rpa_harness.spec.interface import values_per_word
from rpa_harness.strategies.case import Case
from rpa_harness.targets.tpu_inference_mla_v1.known_issues import (
    finite_mask_value_weights_keys_past_kv_len,
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
            "MLA v2 writes the new tokens into the cache as whole 32-bit rows of `kv_packing` tokens. Where a "
            "sequence's new tokens end mid-row (kv_len not a multiple of the packing), the row's remaining "
            "slot, past kv_len, gets another token's latent vector. MLA v1 writes exactly the new tokens' "
            "slots. The slot holds no key yet, so attention is unaffected until it is written, but the "
            "returned cache is not the input with the new tokens written."
        ),
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
    ),
)
