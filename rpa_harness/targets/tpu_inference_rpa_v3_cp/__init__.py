"""tpu-inference's context-parallel fork of RPA v3 as a harness target:
``--rpa-target=rpa_harness.targets.tpu_inference_rpa_v3_cp``.

``ragged_paged_attention`` from ``tpu_inference/kernels/experimental/rpa_v3_cp/kernel.py`` (PyPI
``tpu-inference``) is v3 with decode and prefill context parallelism added: keyword-only arguments (the
CP group and rank, the PCP position arrays, a ring over devices) that, left None, give v3's computation on
one device. That path is what this target tests, with v3's adapter, properties and rule table (the fork
keeps v3's validators' messages; it drops only a check the adapter cannot break, that q, k and v have as
many tokens); the fork's own validator and default block sizes decide what it runs. The CP paths need
several devices and a mesh: not drawn (docs/experimental-kernels.md). Install as for v3:

    pip install --no-deps tpu-inference==0.32.0
"""

from rpa_harness.targets import tpu_inference_v3 as v3_target
from rpa_harness.targets.tpu_inference import kit, releases
from rpa_harness.targets.tpu_inference.rules import RULES as RPA_HARNESS_RULES  # noqa: F401
from rpa_harness.targets.tpu_inference_rpa_v3_cp.adapter import (  # noqa: F401  (the adapter's public names)
    call_cp,
    cp_inputs,
    dynamic_validate_inputs,
    kernel,
    ragged_paged_attention,
)
from rpa_harness.targets.tpu_inference_rpa_v3_cp.both_outputs import check_both_outputs, judge  # noqa: F401
from rpa_harness.targets.tpu_inference_v3 import known_issues as v3_known_issues

RPA_HARNESS_CAPABILITIES = v3_target.RPA_HARNESS_CAPABILITIES
# v3's accumulators (l, m and acc allocated in out_dtype; return_lse, which makes l and m float32, is a CP
# option), and unlike v3 P rounded to the cache's dtype (`p = exp(s - m).astype(v.dtype)`, the row sum
# taken from it), v_scale multiplying P @ V after.
RPA_HARNESS_PRECISION = ("probabilities-in-cache-dtype", "accumulators-in-output-dtype")
# rpa_v3_cp/kernel.py: q @ K^T and P @ V are jnp.matmul calls without a precision: DEFAULT, one bfloat16
# pass for float32 operands on a TPU.
RPA_HARNESS_PRODUCT_PRECISION = "default"
RPA_HARNESS_PROPERTIES = kit.both_outputs_judged(check_both_outputs)
RPA_HARNESS_VERSION = kit.version("experimental rpa_v3_cp, no CP")
RPA_HARNESS_KERNEL = kernel  # imported on first use: the target loads only where tpu-inference is installed
RPA_HARNESS_BASELINE = v3_target.__name__  # `rpa-harness bench` times the fork against v3
# v3's findings of the installed release, each replayed on the fork (docs/tpu-inference-v3-findings/): all
# but one reproduce; its default block sizes keep v3's rules (the KV block rounded down to whole chunks), so
# v3's default-blocks-break-v3s-own-rules does not. Their predicates read the fork's choices.
RPA_HARNESS_KNOWN_ISSUES = tuple(
    v3_known_issues.for_module(issue, kernel)
    for issue in v3_target.RPA_HARNESS_CATALOGUE
    if issue.name != "default-blocks-break-v3s-own-rules" and issue.affects(releases.installed_version())
)


# v3's report (the family's with v3's kernel) with the fork's module.
def _reported_kernel():  # imported when a report is asked for: the report module loads the kernel
    from rpa_harness.targets.tpu_inference_rpa_v3_cp.report import CP

    return CP


RPA_HARNESS_REPORT = kit.deferred_report(_reported_kernel)
