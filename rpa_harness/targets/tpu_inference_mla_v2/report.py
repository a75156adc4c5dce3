"""MLA v2's ``rpa-harness report``: MLA's report (``tpu_inference_mla_v1.report``) with v2's call, its
head-major query and attention, and the stand-ins its imports need where sympy and vllm are absent."""

from rpa_harness.targets import tpu_inference_mla_v2 as mla_v2
from rpa_harness.targets.tpu_inference import report as family_report
from rpa_harness.targets.tpu_inference_mla_v1 import report as mla_report

# Lines of the script's loader: v2's modules import sympy (divisors) and tpu_inference.logger (vllm's).
SCRIPT_STUBS = """\
    if "sympy" not in sys.modules and importlib.util.find_spec("sympy") is None:
        sys.modules["sympy"] = types.ModuleType("sympy")
        sys.modules["sympy"].divisors = lambda n: [d for d in range(1, n + 1) if n % d == 0]
    if "tpu_inference.logger" not in sys.modules and importlib.util.find_spec("vllm") is None:
        sys.modules["tpu_inference.logger"] = types.ModuleType("tpu_inference.logger")
        sys.modules["tpu_inference.logger"].init_logger = logging.getLogger
"""


MLA_V2 = mla_report.ReportedMla(
    name="tpu-inference MLA v2",
    **family_report.adapted(mla_v2, mla_v2.mla_inputs, mla_v2.call_mla),
    head_major=True,
    script_stubs=SCRIPT_STUBS,
    reference_owner="MLA v1's",
)
