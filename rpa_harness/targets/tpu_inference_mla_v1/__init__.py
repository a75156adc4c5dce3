"""tpu-inference's MLA v1 (DeepSeek's latent attention) as a harness target:
``--rpa-target=rpa_harness.targets.tpu_inference_mla_v1``.

``mla_ragged_paged_attention`` (PyPI ``tpu-inference``, ``tpu_inference/kernels/mla/v1/kernel.py``) is
ragged paged attention in MLA's absorbed form: one KV head whose key is the latent vector and the rotary
part side by side and whose value is the latent vector alone (``spec.interface.VALUE_IS_KEY_PREFIX``).
Cases are drawn with ``value_head_dim`` set (``VALUE_HEAD_DIMS``); ``adapter`` maps them to MLA v1's API
(the split query, the new tokens apart, the latent cache, the distribution) and returns the updated cache
in upstream's layout, which the harness judges slot by slot (``RPA_HARNESS_UPDATES_CACHE``). ``rules``
holds its validators' rules and messages. Install as for v3:

    pip install --no-deps tpu-inference==0.32.0
"""

from rpa_harness.spec.interface import MASK_REPLACES
from rpa_harness.targets.tpu_inference import kit
from rpa_harness.targets.tpu_inference_mla_v1 import known_issues as _known_issues
from rpa_harness.targets.tpu_inference_mla_v1.adapter import (  # noqa: F401  (the adapter's public names)
    HAS_TPU_RECIPROCAL,
    VALUE_HEAD_DIMS,
    MlaInputs,
    call_mla,
    dynamic_validate_inputs,
    kernel,
    latent_cache,
    mla_inputs,
    ragged_paged_attention,
    upstream_cache,
)
from rpa_harness.targets.tpu_inference_mla_v1.rules import RULES as RPA_HARNESS_RULES  # noqa: F401

RPA_HARNESS_UPDATES_CACHE = True  # it writes the new tokens into the cache it returns: judged bit for bit

RPA_HARNESS_CAPABILITIES = kit.latent_capabilities(
    VALUE_HEAD_DIMS,
    q_dtypes=("float32", "bfloat16") if HAS_TPU_RECIPROCAL else ("float32",),
    kv_dtypes=("float32", "bfloat16"),
    page_size_multiple_of_kv_packing=True,
    empty_sequences=False,  # its dynamic validator: "Require 0 < q_len <= kv_len"
    # It replaces a masked logit with mask_value (default upstream's -0.7 * float32 max).
    mask_value_meaning=MASK_REPLACES,
    # k_scale multiplies the logits and v_scale P @ V, unrounded (no cache rounded to q's dtype).
    kv_scales_round_to_q_dtype=False,
    # Both block sizes must be given (kit.latent_capabilities). No TPU generation has tuned ones: MLA v1
    # has no table and never asks which chip it is on (kernel.py's TODO: "support both autotuning table
    # and heuristic logic"); MLA v2 raises alike, its tuned_params.py
    # being read by its caller only (layers/common/attention_interface.py), keyed by the problem's shapes,
    # not the chip. On a chip, or a generation the interpreters emulate, the harness leaves block sizes to
    # the kernel: the known issue mla-v1-default-block-sizes-raise moves those cases to given ones.
    buckets=("tiny", "small", "long"),
)
# Logits, P, the running max and sum and the accumulator are float32 (its l/m/acc scratch is float32, P is
# not rounded before P @ V). The normaliser: float32 queries divide exactly (lax.div), narrower ones
# multiply by pltpu.reciprocal(l, approx=True).
RPA_HARNESS_PRECISION = ("approx-reciprocal-for-narrow-output",)
# mla/v1/kernel.py: the latent and rope logits and P @ V are jnp.einsum calls without a precision: DEFAULT,
# one bfloat16 pass for float32 operands on a TPU.
RPA_HARNESS_PRODUCT_PRECISION = "default"
RPA_HARNESS_VERSION = kit.version("MLA v1")
RPA_HARNESS_KERNEL = kernel  # imported on first use: the target loads only where tpu-inference is installed

# Its known issues (docs/tpu-inference-mla-v1-findings/): their cases are not drawn.
RPA_HARNESS_CATALOGUE, RPA_HARNESS_KNOWN_ISSUES = kit.every_finding(_known_issues.RPA_HARNESS_CATALOGUE)


# The family's report with MLA's sections.
def _reported_kernel():  # imported when a report is asked for: the report module loads the kernel
    from rpa_harness.targets.tpu_inference_mla_v1.report import MLA_V1

    return MLA_V1


RPA_HARNESS_REPORT = kit.deferred_report(_reported_kernel)
