"""Kernel ≈ float64 oracle on valid cases, on the fast interpreter (volume) and the checking one.

Each interpreter runs many ragged layouts over the pooled configurations (few compilations) and fewer
examples over the whole static space the target supports, where nearly every example compiles: there each
example is a group of cases sharing one configuration (``valid_case_groups``), so that one compilation
serves several layouts. On a chip a pooled example is such a group too: a call there costs less than the
host's work per example (docs/compilations.md#on-a-chip). The fast
interpreter carries the volume; the checking one (out-of-bounds reads raise, scratch is NaN, DMAs land only
when waited for, races are asserted) checks memory safety.
"""

import time

from hypothesis import given, settings, target
from hypothesis import strategies as st

from rpa_harness import device, reference, runlog
from rpa_harness.checks import check_differential
from rpa_harness.device import TPU
from rpa_harness.properties.budget import (
    ANY_CONFIG_EXAMPLES,
    CHECKING_ANY_CONFIG_EXAMPLES,
    CHECKING_EXAMPLES,
    CHECKING_MAX_BLOCK_STEPS,
    POOLED_EXAMPLES,
)
from rpa_harness.property_names import DIFFERENTIAL, PropertyName
from rpa_harness.recording import closeness_notes, recorded
from rpa_harness.strategies.valid import valid_case_groups, valid_cases

# Cases per whole-space example, at most (3.9 on average): one compilation, several layouts.
CASES_PER_CONFIG = 6


def draw_and_compare(
    target_, backend, repro_dir, data, selection, *, pooled, variant="", max_block_steps=None, shard=0
):
    """Draws valid cases (one from the pooled configurations, or a group sharing one configuration from
    the whole static space, or on a chip from the pooled ones), compares each with the oracle, and targets
    the largest error/bound."""
    capabilities, issues = target_.capabilities_on(backend), target_.known_issues_on(backend)
    bounds = dict(excluding=issues, selection=selection, max_block_steps=max_block_steps)
    if pooled and backend.name != TPU:
        cases = [data.draw(valid_cases(capabilities, pooled=True, **bounds), label="case")]
    else:
        groups = valid_case_groups(capabilities, max_cases=CASES_PER_CONFIG, pooled=pooled, **bounds)
        cases = data.draw(groups, label="cases")
    name = PropertyName(DIFFERENTIAL, variant, backend.label)
    ratios = []
    for index, case in enumerate(cases):
        started = time.perf_counter()
        arrays, options = case.arrays(), case.options()
        arrays_s = time.perf_counter() - started
        with recorded(repro_dir, name, target_, backend, arrays, options, case=case) as notes:
            notes[runlog.LATER_CASE] = index > 0  # the progress line counts examples, not cases
            notes["shard"] = shard
            # Where a case's host seconds go (`rpa-harness chip throughput` reads them from the run log).
            notes.update(arrays_s=arrays_s, record_s=time.perf_counter() - started - arrays_s)
            with device.metered() as compiled:  # in this process: none where an owner makes the call
                comparison = check_differential(target_, backend, arrays, options, seconds=notes)
            notes["compile_s"] = compiled.seconds
            notes.update(closeness_notes(comparison, case))
        ratios.append(comparison.max_ratio)
    # Hypothesis' targeted phase then mutates the examples that came closest to their bound.
    target(max(ratios), label="max error/bound")


def draw_and_compare_checked(*args, **kwargs):
    """``draw_and_compare`` on the checking interpreter, whose cost grows with a case's block steps: no case
    with more than CHECKING_MAX_BLOCK_STEPS."""
    draw_and_compare(*args, **kwargs, max_block_steps=CHECKING_MAX_BLOCK_STEPS)


@settings(max_examples=POOLED_EXAMPLES)
@given(data=st.data())
def test_kernel_matches_oracle(target, volume_backend, volume_shard, repro_dir, bucket_selection, data):
    draw_and_compare(
        target, volume_backend, repro_dir, data, bucket_selection, pooled=True, shard=volume_shard
    )


@settings(max_examples=ANY_CONFIG_EXAMPLES)
@given(data=st.data())
def test_kernel_matches_oracle_any_config(
    target, volume_backend, volume_shard, repro_dir, bucket_selection, data
):
    draw_and_compare(
        target,
        volume_backend,
        repro_dir,
        data,
        bucket_selection,
        pooled=False,
        variant="any-config",
        shard=volume_shard,
    )


@settings(max_examples=CHECKING_EXAMPLES)
@given(data=st.data())
def test_kernel_matches_oracle_checked(target, checking_backend, repro_dir, bucket_selection, data):
    draw_and_compare_checked(
        target, checking_backend, repro_dir, data, bucket_selection, pooled=True, variant="checked"
    )


@settings(max_examples=CHECKING_ANY_CONFIG_EXAMPLES)
@given(data=st.data())
def test_kernel_matches_oracle_checked_any_config(
    target, checking_backend, repro_dir, bucket_selection, data
):
    draw_and_compare_checked(
        target,
        checking_backend,
        repro_dir,
        data,
        bucket_selection,
        pooled=False,
        variant="checked-any-config",
    )


@given(case=valid_cases(pooled=True))
def test_reference_matches_oracle(case):
    arrays, options = case.arrays(), case.options()
    comparison = reference.compare(
        reference.ragged_paged_attention(**arrays, **options),
        reference.oracle(**arrays, **options),
        label="reference",
    )
    assert comparison.ok, str(comparison)
