"""Both outputs of one call of v3's context-parallel fork judged, as v3's are (``tpu_inference_v3.both_outputs``):
on the checking TPU interpreter by default, the attention against the float64 oracle under the declared
contract, the updated cache bit for bit."""

from rpa_harness.targets.tpu_inference import judging
from rpa_harness.targets.tpu_inference_rpa_v3_cp.adapter import call_cp, cp_inputs

judge = judging.judge_with("tpu-inference RPA v3 CP", cp_inputs, call_cp)
check_both_outputs = judging.checks_both_outputs(judge)
