"""Kernel ≈ float64 oracle on serving-scale cases (the production bucket), a handful per run.

The cases have production shapes (up to 8,192 query rows, 256-512 sequence slots, up to 128k keys and
thousands of pages per sequence, 8-64 q heads, head_dim 128/256) and serving layouts (mostly decode, a few
long prefills, every slot live, one sequence over many KV blocks, every page in use), with block sizes
left to the kernel or taken from upstream's tuned values (``rpa_harness.strategies.valid.ProductionBucket``).

Drawn only when a large bucket is selected (``--rpa-buckets=production``, or by default under the nightly
profile) and never under the ci profile. On CPU the examples run on the fast interpreter only: the
checking one would take far longer per example (see README, "Production shapes"). No shrinking: every
step would compile a new kernel at this scale; the small buckets shrink the same bugs, and the failing
example is kept as a repro.
"""

import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from rpa_harness.checks import DIFFERENTIAL, check_differential
from rpa_harness.properties.budget import PRODUCTION_EXAMPLES
from rpa_harness.recording import recorded
from rpa_harness.strategies.valid import drawn_buckets, valid_cases


@pytest.fixture(scope="session")
def production_target(target, pytestconfig):
    """The target, when production examples are to be drawn in this run (else the test is skipped)."""
    if pytestconfig.rpa_profile == "ci":
        pytest.skip("production examples never run under the ci profile (tens of seconds each)")
    if not drawn_buckets(target.capabilities, large=True):
        pytest.skip("no large bucket selected (--rpa-buckets=production, or the nightly profile's default)")
    return target


@settings(max_examples=PRODUCTION_EXAMPLES, phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(data=st.data())
def test_kernel_matches_oracle_production(production_target, volume_backend, repro_dir, data):
    target = production_target
    capabilities, issues = target.capabilities_on(volume_backend), target.known_issues_on(volume_backend)
    cases = valid_cases(capabilities, large=True, excluding=issues)
    case = data.draw(cases, label="case")
    arrays, options = case.arrays(), case.options()
    name = f"{DIFFERENTIAL}-production[{volume_backend.label}]"
    with recorded(repro_dir, name, target, volume_backend, arrays, options, case=case) as notes:
        comparison = check_differential(target, volume_backend, arrays, options)
        notes.update(max_ratio=comparison.max_ratio, q_dtype=case.q_dtype, kv_dtype=case.kv_dtype)
