"""The targets that branch on the TPU generation, run as a kernel developer runs them, in a child pytest
per target under the ci profile on the fast interpreter: the long-context property on v6e in the corner
where narrow position arithmetic breaks (packed queries just past 2^15 keys, the kernel's own block sizes),
and for upstream's RPA, which looks its block sizes up in a table per chip, the pooled differential
property on two generations (v5e and v6e).

Upstream's RPA then runs on its tuned default block sizes, and tpu-inference's v3 on its own default block
sizes and VMEM limit; both draw the long bucket (contexts to 131,072 keys). The example counts are the ci
profile's resized to fit the suite's budget (``RPA_MAX_EXAMPLES``): the long property, which compiles a
kernel of 128-page blocks for upstream, runs once, in one corner. v3's pooled property on emulated
generations (each example a new configuration, seconds to compile) is left to its campaign, ``rpa-harness
run --profile ci --target tpu_inference_v3``, whose default generations are v5e and v6e; here
``tests/unit/test_generations.py`` runs one v3 case on v6e and on 7x. These properties are those
``rpa-harness run --profile ci --tpu-generation v5e,v6e --buckets small,long`` runs in full.
"""

import os

import pytest

from rpa_harness import targets
from tests.processes import run_python

GENERATIONS = "v5e,v6e"
PROPERTIES = (
    "rpa_harness.properties.test_differential",
    "rpa_harness.properties.test_production",
)
# test_kernel_matches_oracle_long_corner in one corner on v6e, by name (-k also matches module names and
# parameter ids)
LONG_CORNER = "oracle_long and v6e and packed-past-2to15"
# test_kernel_matches_oracle (pooled) on both generations
POOLED = "test_kernel_matches_oracle and not any_config and not checked and not oracle_production and not oracle_long"
EXAMPLES = "1"  # ci profile resized: 5 pooled examples per generation (each a new configuration), 1 long one


@pytest.mark.parametrize(
    "target, selected, properties",
    [
        (targets.UPSTREAM_TARGET, f"({POOLED}) or ({LONG_CORNER})", 3),
        (targets.V3_TARGET, LONG_CORNER, 1),
    ],
    ids=["upstream", "v3"],
)
def test_branching_target_passes_its_long_corner_on_a_generation(target, selected, properties, tmp_path):
    try:
        targets.load(target)
    except targets.TargetError as error:
        pytest.skip(str(error))
    env = dict(os.environ, RPA_MAX_EXAMPLES=EXAMPLES, RPA_RUN_LOG=str(tmp_path / "log"))
    env.pop("HYPOTHESIS_PROFILE", None)
    run = run_python(
        "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-p", "no:xdist", "--pyargs", *PROPERTIES,
        "-k", selected, "--hypothesis-profile=ci", f"--rpa-target={target}", "--rpa-backend=fast-interpret",
        f"--rpa-tpu-generation={GENERATIONS}", "--rpa-buckets=small,long", f"--rpa-repro-dir={tmp_path}",
        cwd=tmp_path, env=env, timeout=1200,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    # Every selected property ran, none skipped: the long bucket and the generations were drawn.
    assert f"{properties} passed" in run.stdout and "skipped" not in run.stdout, run.stdout[-3000:]
