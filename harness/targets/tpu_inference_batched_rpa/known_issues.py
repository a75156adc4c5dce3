"""Known issues of tpu-inference's batched RPA (``docs/tpu-inference-batched-rpa-findings/``) and their
predicates, restated from ``experimental/batched_rpa/`` (0.32.0): its KV blocks are the case's
(``num_kv_pages_per_block`` pages, the adapter's mapping), walked from the first over every key a query
visits."""

from rpa_harness.known_issues import NUMERIC_MISMATCH, KnownIssue, findings_dir
from rpa_harness.targets.tpu_inference_mla_v1.known_issues import finite_mask_value_weights_keys_past_kv_len
from rpa_harness.targets.tpu_inference_v3.known_issues import with_v3_default_mask_value

FINDINGS = findings_dir("tpu-inference-batched-rpa-findings")

RPA_HARNESS_CATALOGUE = (
    KnownIssue(
        "batched-rpa-finite-mask-value-weights-keys-past-kv-len",
        "a finite mask_value weights the empty slots past kv_len in a sequence's last KV block, as v3's and "
        "MLA's kernels do",
        FINDINGS / "batched-rpa-finite-mask-value-weights-keys-past-kv-len" / "differential-checked_interpret-v6e.json",
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
            "causal masking\") does not, and the output then depends on the KV block size, a tuning parameter."
        ),
    ),
)
