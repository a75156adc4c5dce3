"""Invalid inputs raise the specified ValueError; valid ones pass; our validators agree with upstream's.

A target is held to the rule table it declares (``RPA_HARNESS_RULES``): by default the specification's,
upstream's rules and messages, with our stricter rules only for targets that opt in (``strict_validation``);
a target with validators of its own declares their table. Static rules must fire from ``ragged_paged_attention``
itself, dynamic ones from ``dynamic_validate_inputs``.
"""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as upstream

from rpa_harness import runlog
from rpa_harness.checks import check_validation
from rpa_harness.plugin import parametrize_per_target
from rpa_harness.properties.budget import EXAMPLES_PER_VARIANT
from rpa_harness.property_names import VALIDATION, PropertyName
from rpa_harness.recording import recorded
from rpa_harness.strategies.valid import valid_cases
from rpa_harness.strategies.violations import RULES, UPSTREAM_ACCEPTS, UPSTREAM_ASSERTS, invalid_cases
from rpa_harness.targets import as_jax


def _rule_params(table):
    """Every variant of every rule of the target's table; in the specification's, our stricter rules
    (upstream asserts or accepts) need the strict_validation opt-in."""
    for rule, spec in table.items():
        marks = ()
        if spec.upstream in (UPSTREAM_ASSERTS, UPSTREAM_ACCEPTS):
            reason = f"{rule!r} is our stricter rule; upstream {spec.upstream}"
            marks = pytest.mark.rpa_requires("strict_validation", reason=reason)
        for variant in range(spec.variants):
            yield pytest.param(rule, variant, marks=marks, id=f"{rule}-{variant}")


def pytest_generate_tests(metafunc):
    if "rule" in metafunc.fixturenames:
        parametrize_per_target(
            metafunc, ("rule", "variant"), lambda run: list(_rule_params(run.target.rules))
        )


@settings(max_examples=EXAMPLES_PER_VARIANT)
@given(data=st.data())
def test_invalid_input_raises_specified_error(
    target, backend, repro_dir, bucket_selection, rule, variant, data
):
    drawn = invalid_cases(
        target.capabilities, table=target.rules, rules=(rule,), variant=variant, selection=bucket_selection
    )
    invalid = data.draw(drawn, label="invalid case")
    arrays, options, message = invalid.inputs()
    fields = dict(case=invalid.case, expected_error=message, stage=invalid.stage)
    name = PropertyName(VALIDATION, label=f"{rule} #{variant}")
    with recorded(repro_dir, name, target, backend, arrays, options, **fields):
        check_validation(target, backend, arrays, options, invalid.stage, message)


@given(data=st.data())
def test_valid_input_passes_validation(target, bucket_selection, data):
    if not target.has_validator:
        pytest.skip(f"target {target.name} has no dynamic_validate_inputs (its rules are static only)")
    case = data.draw(valid_cases(target.capabilities, selection=bucket_selection), label="case")
    runlog.record()  # no repro pair: a failure here is the validator rejecting a valid case, shown by pytest
    target.validate(case.arrays(), case.options())


@given(invalid=invalid_cases())
def test_validators_agree_with_upstream(target, invalid):
    """Same accept/reject and message as upstream's validator, except the documented differences."""
    if target.own_rules:
        pytest.skip(
            f"target {target.name} declares its own rule table (RPA_HARNESS_RULES); "
            "test_invalid_input_raises_specified_error checks it"
        )
    arrays, options, message = invalid.inputs()
    runlog.record()
    inputs = as_jax(arrays)
    ours = _outcome(lambda: target.module.dynamic_validate_inputs(**inputs, **options))
    theirs = _outcome(lambda: upstream.dynamic_validate_inputs(**inputs, **options))
    documented = RULES[invalid.rule].upstream
    if documented == UPSTREAM_ASSERTS:
        assert theirs[0] == "AssertionError", (invalid.rule, theirs)
    elif documented == UPSTREAM_ACCEPTS:
        assert theirs == ("accepted", ""), (invalid.rule, theirs)
    else:
        assert ours == theirs, (invalid.rule, ours, theirs)
    if target.capabilities.strict_validation or documented not in (UPSTREAM_ASSERTS, UPSTREAM_ACCEPTS):
        assert ours == ("ValueError", message), (invalid.rule, ours, message)


def _outcome(call):
    try:
        call()
    except Exception as error:
        return type(error).__name__, str(error)
    return "accepted", ""
