"""tpu-inference's MLA v2 as a harness target: ``--rpa-target=rpa_harness.targets.tpu_inference_mla_v2``.

``mla_ragged_paged_attention`` from ``tpu_inference/kernels/mla/v2/kernel.py`` (PyPI ``tpu-inference``): MLA
v1's computation rewritten for speed (batched decodes, split mixed queries, a two-step flash attention, an
optional transposed cache) with MLA v1's API but for a head-major latent query. ``adapter`` maps upstream's
latent cases onto it as MLA v1's adapter does, with ``s_dtype=float32`` (see there). Install as for v3:

    pip install --no-deps tpu-inference==0.32.0
"""

from rpa_harness.targets.tpu_inference import kit
from rpa_harness.targets.tpu_inference_mla_v1 import RPA_HARNESS_CAPABILITIES as V1_CAPABILITIES
from rpa_harness.targets.tpu_inference_mla_v2 import known_issues as _known_issues
from rpa_harness.targets.tpu_inference_mla_v2.adapter import (  # noqa: F401  (the adapter's public names)
    PRECISION_OPTIONS,
    call_mla,
    kernel,
    mla_inputs,
    ragged_paged_attention,
)
from rpa_harness.targets.tpu_inference_mla_v2.rules import RULES as RPA_HARNESS_RULES  # noqa: F401

RPA_HARNESS_UPDATES_CACHE = True  # it writes the new tokens into the cache it returns: judged bit for bit
# MLA v1's, block sizes included: v2 has no tuned ones for any TPU generation either (see v1's), so on a chip
# or an emulated generation mla-v2-default-block-sizes-raise moves the cases that leave them to it.
RPA_HARNESS_CAPABILITIES = dict(V1_CAPABILITIES)
# With s_dtype=float32 (the adapter's): logits, the running max and sum and the accumulator float32; P
# rounded to the cache's dtype before P @ V (p_same_dtype_as_v, its default), v_scale multiplying P @ V
# after; float32 outputs divide exactly, narrower ones multiply by pltpu.reciprocal(l, approx=True).
RPA_HARNESS_PRECISION = ("probabilities-in-cache-dtype", "approx-reciprocal-for-narrow-output")
# mla/v2/kernel.py: its logits and P @ V are jnp.einsum calls without a precision: DEFAULT, one bfloat16
# pass for float32 operands on a TPU.
RPA_HARNESS_PRODUCT_PRECISION = "default"
RPA_HARNESS_VERSION = kit.version("MLA v2, s_dtype=float32")
RPA_HARNESS_KERNEL = kernel  # imported on first use: the target loads only where tpu-inference is installed

# Its known issues (docs/tpu-inference-mla-v2-findings/): their cases are not drawn.
RPA_HARNESS_CATALOGUE, RPA_HARNESS_KNOWN_ISSUES = kit.every_finding(_known_issues.RPA_HARNESS_CATALOGUE)


# The family's report with MLA's sections (tpu_inference_mla_v1.report) and v2's call.
def _reported_kernel():  # imported when a report is asked for: the report module loads the kernel
    from rpa_harness.targets.tpu_inference_mla_v2.report import MLA_V2

    return MLA_V2


RPA_HARNESS_REPORT = kit.deferred_report(_reported_kernel)
