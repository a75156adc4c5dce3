"""The targets that branch on the TPU generation, run as a kernel developer runs them: the pooled
differential property on two generations (v5e and v6e) and the long-context one on v6e in the corner where
narrow position arithmetic breaks (packed queries just past 2^15 keys, the kernel's own block sizes), under
the ci profile on the fast interpreter, in a child pytest per target.

Upstream's RPA then runs on its tuned default block sizes, and tpu-inference's v3 on its own default
block sizes and VMEM limit; both draw the long bucket (contexts to 131,072 keys). The example counts are
the ci profile's resized to fit the suite's budget (``RPA_MAX_EXAMPLES``), and the long property, which
compiles a kernel of 128-page blocks for upstream, runs on one generation and in one of its corners: the
properties are those ``rpa-harness run --profile ci --tpu-generation v5e,v6e --buckets small,long`` runs in
full.
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
# test_kernel_matches_oracle (pooled) on both generations and test_kernel_matches_oracle_long_corner in one
# corner on v6e, by name (-k also matches module names and parameter ids)
SELECTED = (
    "test_kernel_matches_oracle and not any_config and not checked and not oracle_production"
    " and not (oracle_long and (v5e or not packed-past-2to15))"
)
EXAMPLES = "2"  # ci profile resized: 10 pooled examples per generation and 1 long example


@pytest.mark.parametrize("target", [targets.UPSTREAM_TARGET, targets.V3_TARGET], ids=["upstream", "v3"])
def test_branching_target_passes_on_two_generations_and_long_contexts(target, tmp_path):
    try:
        targets.load(target)
    except targets.TargetError as error:
        pytest.skip(str(error))
    env = dict(os.environ, RPA_MAX_EXAMPLES=EXAMPLES, RPA_RUN_LOG=str(tmp_path / "log"))
    env.pop("HYPOTHESIS_PROFILE", None)
    run = run_python(
        "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-p", "no:xdist", "--pyargs", *PROPERTIES,
        "-k", SELECTED, "--hypothesis-profile=ci", f"--rpa-target={target}", "--rpa-backend=fast-interpret",
        f"--rpa-tpu-generation={GENERATIONS}", "--rpa-buckets=small,long", f"--rpa-repro-dir={tmp_path}",
        cwd=tmp_path, env=env, timeout=1200,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    # Pooled on both generations and the long corner on v6e, none skipped: the long bucket and the generations were
    # drawn.
    assert "3 passed" in run.stdout and "skipped" not in run.stdout, run.stdout[-3000:]
