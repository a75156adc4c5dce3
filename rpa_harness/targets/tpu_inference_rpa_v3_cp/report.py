"""The context-parallel fork's ``rpa-harness report``: v3's (``tpu_inference_v3.report.V3``, the family's
report with v3's kernel) with the fork's module, whose reference, options and cache layout are v3's."""

import dataclasses

from rpa_harness.targets import tpu_inference_rpa_v3_cp as cp
from rpa_harness.targets.tpu_inference import report as family_report
from rpa_harness.targets.tpu_inference_v3 import report as v3_report

# Lines of the script's loader: the fork's package, as the loader stubs v3's.
SCRIPT_STUBS = family_report.package_stubs("experimental", "rpa_v3_cp")

CP = dataclasses.replace(
    v3_report.V3,
    name="tpu-inference RPA v3 CP (experimental, no CP)",
    **family_report.adapted(cp, cp.cp_inputs, cp.call_cp),
    script_stubs=SCRIPT_STUBS,
)
