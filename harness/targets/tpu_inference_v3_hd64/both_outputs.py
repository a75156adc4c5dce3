"""Both outputs of one call of the head_dim-64 kernel judged, as v3's are (``tpu_inference_v3.both_outputs``)."""

from rpa_harness.targets.tpu_inference_v3 import both_outputs as v3_judge
from rpa_harness.targets.tpu_inference_v3_hd64.adapter import call_hd64, hd64_inputs


def judge(
    arrays: dict, options: dict, backend=v3_judge.CHECKING, *, precision: tuple[str, ...]
) -> v3_judge.Verdict:
    """Runs the kernel once on ``backend`` (the checking TPU interpreter) and judges both outputs: the
    attention against the float64 oracle under the declared contract, the updated cache bit for bit."""
    from rpa_harness import reference

    inputs = hd64_inputs(**arrays, **options)
    out, cache = backend.run(call_hd64, inputs)
    comparison = reference.compare(
        out,
        reference.oracle(**arrays, **options),
        label=f"tpu-inference v3 hd64 on {backend.label}",
        precision=precision,
    )
    try:
        v3_judge.check_updated_cache(inputs, cache)
    except v3_judge.CacheMismatch as error:
        return v3_judge.Verdict(comparison, error, None)
    return v3_judge.Verdict(comparison, None, None)


check_both_outputs = v3_judge.checks_both_outputs(judge)
