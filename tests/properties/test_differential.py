"""Kernel ≈ float64 oracle on valid cases, on the fast interpreter (volume) and the checking one.

Each interpreter runs many ragged layouts over the pooled configurations (few compilations) and fewer
examples over the whole static space the target supports (nearly every example compiles). The fast
interpreter carries the volume; the checking one (out-of-bounds reads raise, scratch is NaN, DMAs land only
when waited for, races are asserted) checks memory safety.
"""

from hypothesis import given, settings
from hypothesis import strategies as st

from rpa_harness import reference
from rpa_harness.checks import DIFFERENTIAL, check_differential
from rpa_harness.recording import recorded
from rpa_harness.strategies.valid import valid_cases
from rpa_harness.properties.budget import (
    ANY_CONFIG_EXAMPLES,
    CHECKING_ANY_CONFIG_EXAMPLES,
    CHECKING_EXAMPLES,
    POOLED_EXAMPLES,
)


def draw_and_compare(target, backend, repro_dir, data, *, pooled, variant=""):
    """Draws a valid case (pooled configurations or the whole static space) and compares with the oracle."""
    cases = valid_cases(target.capabilities, pooled=pooled, excluding=target.known_issues)
    case = data.draw(cases, label="case")
    arrays, options = case.arrays(), case.options()
    name = f"{DIFFERENTIAL}{variant}[{backend.name}]"
    with recorded(repro_dir, name, target, backend, arrays, options, case=case) as notes:
        comparison = check_differential(target, backend, arrays, options)
        notes.update(max_ratio=comparison.max_ratio, q_dtype=case.q_dtype, kv_dtype=case.kv_dtype)


@settings(max_examples=POOLED_EXAMPLES)
@given(data=st.data())
def test_kernel_matches_oracle(target, volume_backend, repro_dir, data):
    draw_and_compare(target, volume_backend, repro_dir, data, pooled=True)


@settings(max_examples=ANY_CONFIG_EXAMPLES)
@given(data=st.data())
def test_kernel_matches_oracle_any_config(target, volume_backend, repro_dir, data):
    draw_and_compare(target, volume_backend, repro_dir, data, pooled=False, variant="-any-config")


@settings(max_examples=CHECKING_EXAMPLES)
@given(data=st.data())
def test_kernel_matches_oracle_checked(target, checking_backend, repro_dir, data):
    draw_and_compare(target, checking_backend, repro_dir, data, pooled=True, variant="-checked")


@settings(max_examples=CHECKING_ANY_CONFIG_EXAMPLES)
@given(data=st.data())
def test_kernel_matches_oracle_checked_any_config(target, checking_backend, repro_dir, data):
    draw_and_compare(
        target, checking_backend, repro_dir, data, pooled=False, variant="-checked-any-config"
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
