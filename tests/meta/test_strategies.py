"""Meta-tests of the strategies: valid cases are valid, the padding switches change only padding, invalid
ones break exactly their rule, shrinking reaches the simplest case, and the coverage labels all occur."""

import collections
import dataclasses
import importlib
from pathlib import Path

import numpy as np
import pytest
from hypothesis import find, given, settings
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as upstream

from rpa_harness.kernel import dynamic_validate_inputs
from rpa_harness.spec.interface import DEFAULT_MASK_VALUE
from rpa_harness.strategies.capabilities import Capabilities
from rpa_harness.strategies.case import Case
from rpa_harness.strategies.coverage import coverage_labels
from rpa_harness.strategies.valid import valid_cases
from rpa_harness.strategies.violations import RULES, UPSTREAM_RULES, InvalidCase, invalid_cases
from rpa_harness.targets import as_jax
from rpa_harness.targets.bundled import RPA_HARNESS_CAPABILITIES as OUR_KERNEL
from tests.processes import run_python

REPO_ROOT = Path(__file__).resolve().parents[2]


def live_keys(arrays, page_size) -> np.ndarray:
    """[total_num_pages, page_size] mask of the slots holding a key of a live sequence."""
    live = np.zeros(arrays["kv_pages"].shape[:2], bool)
    for seq in range(arrays["num_seqs"][0]):
        kv_len = int(arrays["kv_lens"][seq])
        for position in range(kv_len):
            live[arrays["page_indices"][seq, position // page_size], position % page_size] = True
    return live


@given(case=valid_cases())
def test_padding_switches_change_only_padding(case):
    clean = dataclasses.replace(case, poison=False, garbage=False).arrays()
    dirty = dataclasses.replace(case, poison=True, garbage=True).arrays()
    live = live_keys(clean, case.page_size)
    assert int(live.sum()) == sum(case.kv_lens)
    live_rows = np.arange(case.max_num_batched_tokens) < case.num_tokens
    for name in ("q", "kv_pages"):
        assert np.isfinite(clean[name].astype(np.float32)).all(), f"clean padding of {name} is not finite"
    np.testing.assert_array_equal(dirty["q"][live_rows], clean["q"][live_rows])
    np.testing.assert_array_equal(dirty["kv_pages"][live], clean["kv_pages"][live])
    assert np.isnan(dirty["q"][~live_rows].astype(np.float32)).all()
    assert np.isnan(dirty["kv_pages"][~live].astype(np.float32)).all()
    n = case.num_seqs
    np.testing.assert_array_equal(dirty["kv_lens"][:n], clean["kv_lens"][:n])
    np.testing.assert_array_equal(dirty["cu_q_lens"][: n + 1], clean["cu_q_lens"][: n + 1])


@given(case=valid_cases())
def test_valid_cases_pass_both_validators(case):
    inputs = as_jax(case.arrays())
    dynamic_validate_inputs(**inputs, **case.options())
    upstream.dynamic_validate_inputs(**inputs, **case.options())


@given(invalid=invalid_cases())
def test_invalid_case_breaks_exactly_its_rule(invalid):
    """Our validator reports this rule's message; with the violation undone the same inputs pass."""
    arrays, options, message = invalid.inputs()
    try:
        dynamic_validate_inputs(**as_jax(arrays), **options)
    except ValueError as error:
        assert str(error) == message, (invalid.rule, str(error), message)
    else:
        raise AssertionError(f"{invalid.rule}: accepted")
    dynamic_validate_inputs(**as_jax(invalid.case.arrays()), **invalid.case.options())


@pytest.mark.parametrize("rule", RULES)
def test_every_rule_can_be_drawn_on_its_own(rule):
    """Each rule yields a case (the per-rule validation property draws them this way)."""
    invalid = find(invalid_cases(rules=(rule,)), lambda _: True, settings=settings(database=None))
    assert invalid.rule == rule and invalid.stage == RULES[rule].stage


def test_the_mission_rules_are_upstream_rules():
    mission = {"num_seqs over max_num_seqs", "vmem_limit_bytes not positive", "q_len over kv_len",
               "too few pages per sequence"}  # fmt: skip
    assert mission <= set(UPSTREAM_RULES)


def test_failing_predicate_shrinks_to_the_simplest_case():
    case = find(valid_cases(), lambda c: any(q >= 2 for q in c.q_lens), settings=settings(database=None))
    assert case.q_lens == (2,) and case.kv_lens == (2,), case
    assert (case.num_q_heads, case.num_kv_heads, case.head_dim, case.page_size) == (1, 1, 64, 1)
    assert (case.q_dtype, case.kv_dtype, case.max_num_batched_tokens) == ("float32", "float32", 8)
    assert case.options() == {} and case.mask_value == DEFAULT_MASK_VALUE


def test_every_coverage_label_occurs():
    seen = collections.Counter()

    @settings(max_examples=400, derandomize=True, database=None)
    @given(case=valid_cases())
    def draw(case):
        seen.update(coverage_labels(case))

    draw()
    expected = {"batch: decode", "batch: prefill", "batch: mixed", "batch: empty", "partial last page",
                "multi-block sequence", "sequence spans query blocks", "window active", "soft cap", "fp8 KV",
                "fp8 KV scaled", "padding slots", "padding rows", "block sizes: the kernel's defaults"}  # fmt: skip
    expected |= {f"GQA ratio {r}" for r in OUR_KERNEL.gqa_ratios}
    expected |= {f"values: {v}" for v in ("normal", "large", "ties", "tiny")}
    assert expected <= set(seen), expected - set(seen)


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(head_dims=(96,)), r"Capabilities\(head_dims=\(96,\)\): \[96\] not in the specified space; choose "
         r"a non-empty subset of \(64, 128, 256\)\."),
        (dict(kv_dtypes=("float32", "float16")), r"\['float16'\] not in the specified space"),
        (dict(q_dtypes=()), r"q_dtypes=\(\)\): empty, so nothing can be drawn"),
        (dict(buckets=("huge",)), r"\['huge'\] not in the specified space; choose a non-empty subset of "
         r"\('tiny', 'small', 'medium', 'long', 'production'\)"),
        (dict(num_kv_heads=(1,), even_kv_heads_for_fp8=True), r"no even num_kv_heads for the 8-bit KV dtypes"),
        (dict(backends=("fast-interpret", "tpu"), slow_backends=("interpret",)),
         r"Capabilities\(slow_backends=\('interpret',\)\): \['interpret'\] not in the specified space; choose a "
         r"non-empty subset of \('fast-interpret', 'tpu'\)"),
    ],
)  # fmt: skip
def test_capabilities_outside_the_specified_space_are_one_clear_error(fields, message):
    with pytest.raises(ValueError, match=message):
        Capabilities(**fields)
    Capabilities(head_dims=(128,), kv_dtypes=("bfloat16",), buckets=("medium",))  # a subset is fine


RULE_TABLES = {"specification": RULES}
for _name in ("tpu_inference_v3", "tpu_inference_v3_hd64"):
    try:
        RULE_TABLES[_name] = importlib.import_module(f"rpa_harness.targets.{_name}.rules").RULES
    except ImportError:  # tpu-inference not installed: its tables are not built
        pass


def _digest(inputs) -> tuple:
    arrays, options, message = inputs
    return (
        tuple((name, a.dtype.str, a.shape, a.tobytes()) for name, a in sorted(arrays.items())),
        repr(options),
        message,
    )


@pytest.mark.parametrize("table", RULE_TABLES, ids=str)
def test_each_variant_of_each_rule_is_its_own_violation(table):
    """A rule's variants break it in distinct ways (distinct inputs), the one at the rule's boundary among
    them."""
    base = dataclasses.replace(
        Case(max_num_batched_tokens=8, max_num_seqs=4, pages_per_seq=3, total_num_pages=13, page_size=4,
             num_q_heads=2, num_kv_heads=1, head_dim=64, q_lens=(2, 3), kv_lens=(5, 9)),
        mask_value_meaning="replaces" if table != "specification" else "added",
    )  # fmt: skip
    for rule, spec in RULE_TABLES[table].items():
        broken = {
            _digest(InvalidCase(base, rule, variant, RULE_TABLES[table]).inputs())
            for variant in range(spec.variants)
        }
        assert len(broken) == spec.variants, rule
    if table == "specification":
        one_past = InvalidCase(base, "num_kv_pages_per_block out of range", 2).inputs()[2]
        assert f"num_kv_pages_per_block={base.pages_per_seq + 1}" in one_past


def test_every_variant_of_every_rule_is_a_parametrisation_of_the_validation_property(tmp_path):
    """What a ci run draws: the validation property has one test per (rule, variant) of the target's table,
    so a validator wrong on exactly one variant (the boundary one, say) cannot pass a run."""
    run = run_python(
        "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "--rpa-target=rpa_harness.kernel",
        f"--rpa-repro-dir={tmp_path}", "--pyargs", "rpa_harness.properties.test_validation",
        "-k", "invalid_input_raises_specified_error", cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    collected = {line.split("[", 1)[1].rsplit("-", 2)[0] + "-" + line.rsplit("-", 1)[1].rstrip("]")
                 for line in run.stdout.splitlines() if "[" in line}  # fmt: skip
    expected = {f"{rule}-{variant}" for rule, spec in RULES.items() for variant in range(spec.variants)}
    assert collected == expected, sorted(expected ^ collected)


def test_a_validator_wrong_at_the_boundary_variant_fails_the_ci_profile(tmp_path):
    """The seeded bug the ci profile missed while variants were drawn at random: a validator accepting
    exactly num_kv_pages_per_block == pages_per_seq + 1."""
    run = run_python(
        "-m", "pytest", "-q", "-p", "no:cacheprovider", "--hypothesis-profile=ci", "--rpa-backend=fast-interpret",
        "--rpa-target=mutants.kv_block_one_past_accepted", f"--rpa-repro-dir={tmp_path}",
        "tests/properties/test_validation.py", "-k", "invalid_input and num_kv_pages_per_block and range",
        cwd=REPO_ROOT,
    )  # fmt: skip
    assert run.returncode == 1 and "1 failed, 2 passed" in run.stdout, run.stdout[-3000:]
    assert "out of range-2" in run.stdout, run.stdout[-3000:]


def test_a_target_with_packed_kv_dtypes_only_draws_page_sizes_they_fit():
    """Page sizes a KV dtype cannot fill (a bfloat16 cache in pages of one token, for a target whose page
    size must be a multiple of the packing) are not drawn: the draw does not fail on them."""
    packed_only = Capabilities(kv_dtypes=("bfloat16",), page_size_multiple_of_kv_packing=True)
    case = find(valid_cases(packed_only), lambda case: True)
    assert case.kv_dtype == "bfloat16" and case.page_size % 2 == 0


@pytest.mark.parametrize(
    ("arguments", "says"),
    [
        (dict(capabilities={"head_dims": (64,)}), "pass a Capabilities"),
        (dict(pooled=True, large=True), "the pool holds small configurations only"),
        (dict(values=("normal", "huge")), "choose a non-empty subset of"),
        (dict(values=()), "choose a non-empty subset of"),
        (dict(selection=("production",), capabilities=Capabilities()), "not among the declared buckets"),
        (dict(excluding=("a-name",)), "is not a known issue"),
        (dict(large="long"), "long is not selected"),
    ],
    ids=lambda value: str(value)[:40],
)
def test_a_mistaken_argument_is_one_error_before_anything_is_drawn(arguments, says):
    """As hypothesis.extra.numpy's strategies do: the call that builds the strategy raises, naming the
    argument, so a typo never surfaces as a failing or empty draw."""
    arguments = {"capabilities": OUR_KERNEL, **arguments}
    with pytest.raises(ValueError, match=says):
        valid_cases(arguments.pop("capabilities"), **arguments)
