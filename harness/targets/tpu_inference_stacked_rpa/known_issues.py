"""Known issues of tpu-inference's stacked RPA (``docs/tpu-inference-stacked-rpa-findings/``) and their
predicates, restated from ``experimental/stacked_rpa/`` (0.32.0): its KV blocks are whole 128-key pages
(the case's ``num_kv_pages_per_block``, a sliding window's anchored span), walked per query block."""

from rpa_harness.known_issues import (
    FLOAT32_EXP_UNDERFLOW,
    NUMERIC_MISMATCH,
    KnownIssue,
    case_arrays,
    findings_dir,
)
from rpa_harness.strategies.case import Case
from rpa_harness.targets.tpu_inference_v3.known_issues import (
    finite_replacing_mask_value,
    v3_row_max_logits,
    with_v3_default_mask_value,
)

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
    arrays = case_arrays(case)
    for seq, (q_len, kv_len) in enumerate(zip(case.q_lens, case.kv_lens, strict=True)):
        if kv_len % block == 0 and q_len == 1 and case.sliding_window is None:
            continue
        if (mask_value - v3_row_max_logits(case, arrays, seq, mask_value) > FLOAT32_EXP_UNDERFLOW).any():
            return True
    return False


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
    ),
)
