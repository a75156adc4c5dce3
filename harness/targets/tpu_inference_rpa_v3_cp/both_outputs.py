"""Both outputs of one call of v3's context-parallel fork judged, as v3's are (``tpu_inference_v3.both_outputs``)."""

from rpa_harness.targets.tpu_inference_rpa_v3_cp.adapter import call_cp, cp_inputs
from rpa_harness.targets.tpu_inference_v3 import both_outputs as v3_judge


def judge(
    arrays: dict, options: dict, backend=v3_judge.CHECKING, *, precision: tuple[str, ...]
) -> v3_judge.Verdict:
    """Runs the fork once on ``backend`` (the checking TPU interpreter) and judges both outputs: the
    attention against the float64 oracle under the declared contract, the updated cache bit for bit."""
    comparison, error, _ = v3_judge.judged_call(
        "tpu-inference RPA v3 CP", cp_inputs, call_cp, arrays, options, backend, precision=precision
    )
    return v3_judge.Verdict(comparison, error, None)


check_both_outputs = v3_judge.checks_both_outputs(judge)
