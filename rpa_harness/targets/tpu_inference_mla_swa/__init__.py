"""tpu-inference's DeepSeek-V4 sliding-window latent attention (experimental) as a harness target:
``--rpa-target=rpa_harness.targets.tpu_inference_mla_swa``.

``mla_sliding_window_ragged_paged_attention`` (PyPI ``tpu-inference``,
``tpu_inference/kernels/experimental/deepseek_v4/core_attention/mla_swa.py``) attends one bfloat16 latent
vector per token, used as both key and value, with a sliding window and a sink logit per q head, from a
cache of raw bytes. In the specification that is latent attention whose value is the whole key
(``value_head_dim == head_dim``, ``spec.interface.VALUE_IS_KEY_PREFIX``) with ``attention_sink``;
``adapter`` maps cases onto it and returns the updated cache in upstream's layout, which the harness judges
slot by slot (``RPA_HARNESS_UPDATES_CACHE``). It needs jax >= 0.12 (``pltpu.reciprocal``); install as for v3:

    pip install --no-deps tpu-inference==0.32.0
"""

from rpa_harness.targets.tpu_inference import kit
from rpa_harness.targets.tpu_inference_mla_swa import known_issues as _known_issues
from rpa_harness.targets.tpu_inference_mla_swa.adapter import (  # noqa: F401  (the adapter's public names)
    VALUE_HEAD_DIMS,
    SwaInputs,
    byte_cache,
    call_swa,
    kernel,
    ragged_paged_attention,
    swa_inputs,
    token_bytes,
    token_vectors,
    upstream_cache,
)
from rpa_harness.targets.tpu_inference_mla_swa.rules import RULES as RPA_HARNESS_RULES  # noqa: F401

# The latent vector is key and value at once: the value is the whole key (VALUE_HEAD_DIMS).
RPA_HARNESS_CAPABILITIES = kit.latent_capabilities(
    VALUE_HEAD_DIMS,
    # Its cache holds bfloat16 bytes (`assert new_kv.dtype == jnp.bfloat16`). Float32 queries, which its
    # wrapper takes and divides exactly, fail to trace: a known issue, whose cases are moved to bfloat16.
    q_dtypes=("float32", "bfloat16"),
    kv_dtypes=("bfloat16",),
    # It has no soft cap, no K/V scales and no mask value of its own (a masked logit becomes finfo(float32).min,
    # the default mask's zero weight).
    options_not_taken=("soft_cap", "mask_value", "k_scale", "v_scale"),
    attention_sink=True,
    # It unrolls a copy per page of a KV block (and one more): its code grows with the block's pages.
    max_kv_pages_per_block=8,
    buckets=("tiny", "small"),
)
# Logits (a float32 product of bfloat16 operands), P, the running max and sum and the accumulator are float32;
# P is not rounded before P @ V. Its bfloat16 output multiplies by pltpu.reciprocal(l + exp(sink - m),
# approx=True); a float32 one would divide exactly (lax.div), were float32 queries to trace.
RPA_HARNESS_PRECISION = ("approx-reciprocal-for-narrow-output",)
RPA_HARNESS_UPDATES_CACHE = True  # it writes the new tokens into the cache it returns: judged bit for bit
# deepseek_v4/core_attention/mla_swa.py: its logits and P @ V are jnp.einsum calls without a precision:
# DEFAULT, one bfloat16 pass for float32 operands on a TPU.
RPA_HARNESS_PRODUCT_PRECISION = "default"
RPA_HARNESS_VERSION = kit.version("experimental deepseek_v4 mla_swa")
# Imported on first use: the target loads only where tpu-inference is installed and jax has what it calls.
RPA_HARNESS_KERNEL = kernel

# Its known issues (docs/tpu-inference-mla-swa-findings/): their cases are not drawn.
RPA_HARNESS_CATALOGUE, RPA_HARNESS_KNOWN_ISSUES = kit.every_finding(_known_issues.RPA_HARNESS_CATALOGUE)
