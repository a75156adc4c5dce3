"""Kernel ≈ float64 oracle on serving-scale cases (the production bucket) and on long contexts (the long
bucket), a handful per run.

The cases have production shapes (up to 8,192 query rows, 256-512 sequence slots, up to 128k keys and
thousands of pages per sequence, 8-64 q heads, head_dim 128/256) and serving layouts (mostly decode, a few
long prefills, every slot live, one sequence over many KV blocks, every page in use), with block sizes
left to the kernel or taken from upstream's tuned values (``rpa_harness.strategies.valid.ProductionBucket``).

The long cases have few query rows (decodes and short prefill chunks, up to 256 rows) against contexts up to
131,072 keys, with lengths and query positions on both sides of 2^15 and 2^16
(``rpa_harness.strategies.valid.LongBucket``). Where narrow integer arithmetic breaks is known in advance,
so every run draws each corner of the bucket for the target (``long_corners``: float32 and packed queries,
the longest context just up to and just past 2^15 and 2^16, block sizes the kernel's and given), each its
own parametrisation, shrinking within its corner; the nightly profile adds random long examples.

Each is drawn only when its bucket is selected (``--rpa-buckets=long,production``; by default the ci
profile selects long, the nightly profile both); production examples never run under the ci profile. On
CPU the examples run on the fast interpreter only: the checking one would take far longer per example
(see docs/production-and-long-shapes.md). Production examples are not shrunk (every step would compile a new
kernel at that scale; the small buckets shrink the same bugs, and the failing example is kept as a repro);
long ones are, toward short contexts and one decode.
"""

import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from rpa_harness.checks import check_differential
from rpa_harness.plugin import parametrize_per_target, settings_of
from rpa_harness.properties.budget import LONG_CORNER_EXAMPLES, LONG_EXAMPLES, PRODUCTION_EXAMPLES
from rpa_harness.property_names import DIFFERENTIAL, PropertyName
from rpa_harness.recording import closeness_notes, recorded
from rpa_harness.strategies.buckets import is_packed, long_corners, why_not_drawn
from rpa_harness.strategies.valid import valid_cases


def _corners(run) -> list:
    return [pytest.param(corner, id=corner.name) for corner in long_corners(run.target.capabilities)]


def pytest_generate_tests(metafunc):
    if "long_corner" in metafunc.fixturenames:
        parametrize_per_target(metafunc, "long_corner", _corners)


def large_target(target, pytestconfig, bucket: str, *, random: bool = True):
    """The target, when examples of the large ``bucket`` are to be drawn in this run (else the test is
    skipped); ``random``: examples anywhere in the bucket, not in a corner."""
    run = settings_of(pytestconfig, target)
    if bucket == "production" and run.profile == "ci":
        pytest.skip("production examples never run under the ci profile (tens of seconds each)")
    if bucket == "long" and random and run.profile == "ci":
        pytest.skip(
            "the ci profile draws the long bucket's corners only (..._long_corner); nightly adds these"
        )
    why = why_not_drawn(target.capabilities, run.buckets, bucket)
    if why is not None:
        pytest.skip(why)
    return target


def draw_and_compare(target, backend, repro_dir, data, selection, bucket: str, corner=None):
    capabilities, issues = target.capabilities_on(backend), target.known_issues_on(backend)
    if corner and not any(is_packed(d) == corner.packed_queries for d in capabilities.q_dtypes):
        pytest.skip(
            f"{corner.label}: the target takes no such q dtype on {backend.label}: {capabilities.q_dtypes}"
        )
    drawn = valid_cases(capabilities, large=bucket, excluding=issues, long_corner=corner, selection=selection)
    case = data.draw(drawn, label="case")
    arrays, options = case.arrays(), case.options()
    name = PropertyName(DIFFERENTIAL, f"{bucket}-{corner.name}" if corner else bucket, backend.label)
    with recorded(repro_dir, name, target, backend, arrays, options, case=case) as notes:
        comparison = check_differential(target, backend, arrays, options)
        notes.update(closeness_notes(comparison, case))


@settings(max_examples=PRODUCTION_EXAMPLES, phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(data=st.data())
def test_kernel_matches_oracle_production(
    target, pytestconfig, volume_backend, repro_dir, bucket_selection, data
):
    target = large_target(target, pytestconfig, "production")
    draw_and_compare(target, volume_backend, repro_dir, data, bucket_selection, "production")


@settings(max_examples=LONG_EXAMPLES, phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink])
@given(data=st.data())
def test_kernel_matches_oracle_long(target, pytestconfig, volume_backend, repro_dir, bucket_selection, data):
    target = large_target(target, pytestconfig, "long")
    draw_and_compare(target, volume_backend, repro_dir, data, bucket_selection, "long")


@settings(
    max_examples=LONG_CORNER_EXAMPLES, phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink]
)
@given(data=st.data())
def test_kernel_matches_oracle_long_corner(
    target, pytestconfig, volume_backend, repro_dir, bucket_selection, long_corner, data
):
    target = large_target(target, pytestconfig, "long", random=False)
    draw_and_compare(target, volume_backend, repro_dir, data, bucket_selection, "long", long_corner)
