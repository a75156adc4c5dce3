"""Known issues of tpu-inference's DeepSeek-V4 sliding-window latent attention
(``docs/tpu-inference-mla-swa-findings/``) and their predicates, restated from
``experimental/deepseek_v4/core_attention/mla_swa.py`` (0.32.0)."""

import dataclasses

from rpa_harness.failures import RaisedOnValidInput
from rpa_harness.known_issues import KnownIssue, findings_dir
from rpa_harness.strategies.case import Case

FINDINGS = findings_dir("tpu-inference-mla-swa-findings")


def float32_queries(case: Case) -> bool:
    """Float32 queries over the kernel's bfloat16 latent (a value that is the whole key): its cases only, so
    that another target's float32 failure is not named after it."""
    return case.q_dtype == "float32" and case.kv_dtype == "bfloat16" and case.value_head_dim == case.head_dim


def with_bfloat16_queries(case: Case) -> Case:
    return dataclasses.replace(case, q_dtype="bfloat16")


RPA_HARNESS_CATALOGUE = (
    KnownIssue(
        "mla-swa-float32-queries-fail-to-trace",
        "float32 queries fail to trace: the kernel sizes a token's cache bytes by q's dtype, its wrapper by the "
        "cache's bfloat16",
        FINDINGS / "mla-swa-float32-queries-fail-to-trace" / "differential_fast-interpret.json",
        float32_queries,
        with_bfloat16_queries,
        # The generic interpreter fails copying the mismatched rows while it traces, the TPU interpreter when
        # the copy runs.
        r"raised on valid inputs: \S+: (ValueError: )?(Incompatible shapes for broadcasting|cannot reshape array)",
        explanation=(
            "The wrapper `mla_sliding_window_ragged_paged_attention` takes any query dtype (it asserts only "
            "`new_kv.dtype == jnp.bfloat16` and the uint8 cache) and has a float32 branch of its own: the "
            "output is divided exactly, `lax.div(acc, l_sum) if q_dtype == jnp.float32` (mla_swa.py:728). But "
            "it sizes a token's cache row by the cache's dtype, `token_bytes = head_dim * "
            "get_dtype_bitwidth(new_kv.dtype) // 8` (:941), and the kernel by the query's, `token_bytes = "
            "head_dim * get_dtype_bitwidth(q_dtype) // 8` (:122). A float32 query doubles the kernel's "
            "`slots_per_token`: `_fetch_bkv` views the cache as tokens of 8 rows of 128 bytes and copies them "
            "into a key buffer the wrapper made of 4 (`bkv_x2_ref`), so the first copy (the prologue's "
            "`start_fetch_bkv`, :763) has a source and a destination of different shapes: the generic "
            "interpreter fails while tracing it (`ValueError: Incompatible shapes for broadcasting: "
            "shapes=[(16, 4, 128), (16, 8, 128), (16, 4, 128)]`), the TPU interpreter when it runs "
            "(`ValueError: cannot reshape array of size 512 into shape (1,8,128)`). The float32 branch cannot "
            "run; sizing the kernel's token by the cache's element (bfloat16) rather than q's lets it."
        ),
        fails_as=(RaisedOnValidInput,),
    ),
)
