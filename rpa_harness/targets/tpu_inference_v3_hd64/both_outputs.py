"""Both outputs of one call of the head_dim-64 kernel judged, as v3's are (``tpu_inference_v3.both_outputs``):
on the checking TPU interpreter by default, the attention against the float64 oracle under the declared
contract, the updated cache bit for bit."""

from rpa_harness.targets.tpu_inference import judging
from rpa_harness.targets.tpu_inference_v3_hd64.adapter import call_hd64, hd64_inputs

judge = judging.judge_with("tpu-inference v3 hd64", hd64_inputs, call_hd64)
check_both_outputs = judging.checks_both_outputs(judge)
