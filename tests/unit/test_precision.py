"""Precision contracts: a declared precision choice passes, the same choice undeclared fails with a diagnosis
naming it, and bugs a contract does not cover stay visible under it.

The contract-implementing outputs come from ``rpa_harness.reference.variants.contract_attention`` (float32 NumPy) and,
for the mutants, from our kernel on the generic interpreter.
"""

import dataclasses
import json
import sys
import types

import numpy as np
import pytest

from rpa_harness import cli, reference, repro, targets
from rpa_harness.checks import PropertyFailure, check_differential
from rpa_harness.device import FAST_INTERPRET, TPU, Backend
from rpa_harness.plugin import settings_of
from rpa_harness.property_names import DIFFERENTIAL, PropertyName
from rpa_harness.recording import recorded
from rpa_harness.reference import CONTRACTS, PrecisionError, compare, error_bound, oracle, parse_precision
from rpa_harness.reference.tolerance import (
    ACCUMULATORS_IN_OUTPUT_DTYPE,
    APPROX_RECIPROCAL,
    BF16_MATMUL,
    BF16X3_MATMUL,
    FLOAT32,
    PROBABILITIES_IN_CACHE_DTYPE,
    PROBABILITIES_IN_VALUE_DTYPE,
    SOFTMAX_IN_OUTPUT_DTYPE,
    TPU_TRANSCENDENTALS,
    contract_error,
)
from rpa_harness.reference.variants import contract_attention
from tests.cases import BF16, E4M3, F32, MIXED, build_case
from tests.processes import run_python

ALL = tuple(CONTRACTS)
DECLARED = "tests.injected.rounded_probabilities"


def long_case(q_dtype, kv_dtype, seed=8):
    """Decode, prefill and chunked prefill over 10 pages of 4 keys: several KV blocks per sequence."""
    return build_case(
        seed, (1, 9, 4), (40, 9, 22), q_dtype=q_dtype, kv_dtype=kv_dtype, num_q_heads=4, head_dim=64
    )


def test_contract_names_are_checked_and_canonical():
    assert parse_precision("") == (FLOAT32,)
    assert parse_precision(f" {APPROX_RECIPROCAL},{PROBABILITIES_IN_VALUE_DTYPE} ") == (
        FLOAT32,
        PROBABILITIES_IN_VALUE_DTYPE,
        APPROX_RECIPROCAL,
    )
    with pytest.raises(PrecisionError, match=r"unknown precision contract\(s\) bf16; known: float32, "):
        parse_precision(("bf16", BF16_MATMUL))


@pytest.mark.parametrize(("q_dtype", "kv_dtype"), [(F32, F32), (BF16, BF16), (F32, E4M3)], ids=str)
def test_float32_is_todays_model_and_contracts_only_add(q_dtype, kv_dtype):
    arrays = long_case(q_dtype, kv_dtype)
    result = oracle(**arrays, sm_scale=0.25)
    owned = result.owned_rows
    base = error_bound(result)[owned]
    assert (contract_error(result)[owned] == 0).all()
    assert (error_bound(result, precision=(FLOAT32,))[owned] == base).all()
    for name in CONTRACTS:
        assert (error_bound(result, precision=(name,))[owned] >= base).all(), name
        assert (
            error_bound(result, precision=ALL)[owned] >= error_bound(result, precision=(name,))[owned]
        ).all()


def test_contracts_add_nothing_where_their_choice_changes_nothing():
    """A float32 V is not rounded, a float32 output does not round accumulators, bf16 operands are exact."""
    f32 = oracle(**long_case(F32, F32), sm_scale=0.25)
    bf16 = oracle(**long_case(BF16, BF16), sm_scale=0.25)
    assert (
        contract_error(f32, (PROBABILITIES_IN_VALUE_DTYPE, ACCUMULATORS_IN_OUTPUT_DTYPE))[f32.owned_rows] == 0
    ).all()
    # bf16 q, K and V: bf16-matmul rounds only P, exactly what probabilities-in-value-dtype allows.
    owned = bf16.owned_rows
    assert (
        contract_error(bf16, (BF16_MATMUL,))[owned]
        == contract_error(bf16, (PROBABILITIES_IN_VALUE_DTYPE,))[owned]
    ).all()


def test_accumulator_bound_grows_with_the_number_of_kv_blocks():
    """At most ceil(kv_len / page_size) blocks: the same keys in smaller pages may be rounded more often."""
    bounds = []
    for page_size in (16, 4, 1):
        arrays = build_case(3, (4,), (32,), q_dtype=BF16, kv_dtype=BF16, page_size=page_size, garbage=False)
        result = oracle(**arrays, sm_scale=0.25)
        bounds.append(contract_error(result, (ACCUMULATORS_IN_OUTPUT_DTYPE,))[result.owned_rows].max())
    assert bounds[0] < bounds[1] < bounds[2]


def test_accumulator_contract_counts_the_rescale_factor_rounded_in_the_output_dtype():
    """One decode row over two one-key pages whose logits are 0.125 and 40: the rescale factor exp(0.125 - 40)
    is computed in bfloat16, where the difference rounds to -40 (a tie), so the first key's weight is 12%
    low. The roundings of l and acc alone (2 blocks, 1 rise) allow ~3%; the rescale term covers it."""
    arrays = build_case(0, (1,), (2,), page_size=1, num_q_heads=1, num_kv_heads=1, q_dtype=BF16, kv_dtype=BF16,
                        garbage=False)  # fmt: skip
    arrays["q"][0, 0] = 0
    arrays["q"][0, 0, 0] = 1
    first, second = arrays["page_indices"][0, :2]
    arrays["kv_pages"][[first, second]] = 0
    arrays["kv_pages"][first, 0, 0, 0], arrays["kv_pages"][second, 0, 0, 0] = 0.125, 40.0
    arrays["kv_pages"][first, 0, 1] = 1.0  # v of the first key; the second key's v is 0
    result = oracle(**arrays, sm_scale=1.0)
    out = contract_attention(**arrays, sm_scale=1.0, precision=(ACCUMULATORS_IN_OUTPUT_DTYPE,))
    expected = result.out[0, 0, 0]
    assert np.isclose(out[0, 0, 0].astype(np.float64), expected * np.exp(-0.125), rtol=2**-8)
    assert compare(out, result, precision=(ACCUMULATORS_IN_OUTPUT_DTYPE,)).ok
    without_rescale = dataclasses.replace(result, rescale_excess=np.zeros_like(result.rescale_excess))
    bound = error_bound(without_rescale, precision=(ACCUMULATORS_IN_OUTPUT_DTYPE,))[0, 0, 0]
    assert abs(out[0, 0, 0].astype(np.float64) - expected) > 3 * bound
    undeclared = compare(out, result)
    assert f"diagnosis: consistent with {ACCUMULATORS_IN_OUTPUT_DTYPE}" in str(undeclared), str(undeclared)


# (contract, q dtype, KV dtype): a case where the contract's choice is outside float32's bound.
VARIANT_CASES = [
    (PROBABILITIES_IN_VALUE_DTYPE, BF16, BF16),
    (PROBABILITIES_IN_VALUE_DTYPE, F32, E4M3),
    (ACCUMULATORS_IN_OUTPUT_DTYPE, BF16, BF16),
    (BF16_MATMUL, F32, F32),
    (APPROX_RECIPROCAL, F32, F32),
    (APPROX_RECIPROCAL, BF16, BF16),
]


@pytest.mark.parametrize(("contract", "q_dtype", "kv_dtype"), VARIANT_CASES, ids=str)
def test_variant_fails_under_float32_passes_under_its_contract_and_is_diagnosed(contract, q_dtype, kv_dtype):
    arrays = long_case(q_dtype, kv_dtype)
    result = oracle(**arrays, sm_scale=0.25)
    faithful = compare(contract_attention(**arrays, sm_scale=0.25), result, label="float32 variant")
    assert faithful.ok, str(faithful)  # the variant is correct without its choice
    out = contract_attention(**arrays, sm_scale=0.25, precision=(contract,))
    undeclared = compare(out, result, label=contract)
    assert not undeclared.ok and undeclared.max_ratio > 2, str(undeclared)
    assert f"diagnosis: consistent with {contract} (max error/bound " in str(undeclared)
    declared = compare(out, result, label=contract, precision=(contract,))
    assert declared.ok and not declared.diagnosis, str(declared)
    assert f"(precision {contract})" in str(declared)


def test_the_cache_dtype_contract_rounds_p_to_the_cache_whatever_v_scale():
    """With a v_scale V's dtype is q's (float32 here), so rounding P to the bfloat16 cache, as a kernel that
    scales after P @ V does, is outside probabilities-in-value-dtype and inside probabilities-in-cache-dtype."""
    arrays = long_case(F32, BF16)
    result = oracle(**arrays, sm_scale=0.25, v_scale=2.0)
    out = contract_attention(**arrays, sm_scale=0.25, v_scale=2.0, precision=(PROBABILITIES_IN_CACHE_DTYPE,))
    as_value = compare(out, result, precision=(PROBABILITIES_IN_VALUE_DTYPE,))
    assert not as_value.ok and as_value.max_ratio > 2, str(as_value)
    declared = compare(out, result, precision=(PROBABILITIES_IN_CACHE_DTYPE,))
    assert declared.ok, str(declared)


def test_a_softmax_in_the_output_dtype_is_its_contract_and_not_the_accumulators():
    """Logits and weights in bfloat16 (batched RPA) at logits of a few units: outside float32's bound and
    outside accumulators-in-output-dtype's, inside its own contract."""
    arrays = long_case(BF16, F32)
    result = oracle(**arrays, sm_scale=1.0)
    out = contract_attention(**arrays, sm_scale=1.0, precision=(SOFTMAX_IN_OUTPUT_DTYPE,))
    undeclared = compare(out, result)
    assert not undeclared.ok and undeclared.max_ratio > 2, str(undeclared)
    assert not compare(out, result, precision=(ACCUMULATORS_IN_OUTPUT_DTYPE,)).ok
    assert compare(out, result, precision=(SOFTMAX_IN_OUTPUT_DTYPE,)).ok
    both = (SOFTMAX_IN_OUTPUT_DTYPE, ACCUMULATORS_IN_OUTPUT_DTYPE)
    assert compare(contract_attention(**arrays, sm_scale=1.0, precision=both), result, precision=both).ok


def test_bf16x3_variant_passes_under_its_contract():
    """Three bf16 passes lose ~3 * 2**-16 per product: within its contract, and a single pass is not."""
    arrays = long_case(F32, F32)
    result = oracle(**arrays, sm_scale=1.0)
    out = contract_attention(**arrays, sm_scale=1.0, precision=(BF16X3_MATMUL,))
    assert compare(out, result, precision=(BF16X3_MATMUL,)).ok
    single_pass = contract_attention(**arrays, sm_scale=1.0, precision=(BF16_MATMUL,))
    assert not compare(single_pass, result, precision=(BF16X3_MATMUL,)).ok


def test_a_gross_error_is_explained_by_no_contract():
    arrays = long_case(BF16, BF16)
    result = oracle(**arrays, sm_scale=0.25)
    wrong_scale = contract_attention(**arrays, sm_scale=0.3, precision=ALL)
    comparison = compare(wrong_scale, result, label="wrong sm_scale")
    assert "diagnosis: no precision contract explains it (max error/bound " in str(comparison), str(
        comparison
    )
    assert not compare(wrong_scale, result, precision=ALL).ok


FAST = Backend(FAST_INTERPRET)
BF16_MIXED = dataclasses.replace(MIXED, q_dtype="bfloat16", kv_dtype="bfloat16", garbage=False)
# (mutant, witness, contract it is judged under, killed?): the precision mutants under the contracts that
# cover them (hidden) and under those that do not (killed).
MUTANTS_UNDER_CONTRACTS = [
    ("softmax_in_bfloat16", MIXED, PROBABILITIES_IN_VALUE_DTYPE, True),  # float32 V: P may not be rounded
    ("softmax_in_bfloat16", BF16_MIXED, PROBABILITIES_IN_VALUE_DTYPE, False),  # bf16 V: it is the contract
    ("softmax_in_bfloat16", MIXED, BF16_MATMUL, False),  # a bf16 pass rounds P to bf16 as well
    ("pv_in_bfloat16", MIXED, PROBABILITIES_IN_VALUE_DTYPE, True),
    ("pv_in_bfloat16", MIXED, ACCUMULATORS_IN_OUTPUT_DTYPE, True),
    ("pv_in_bfloat16", MIXED, APPROX_RECIPROCAL, True),
    ("softmax_in_q_dtype", BF16_MIXED, PROBABILITIES_IN_VALUE_DTYPE, True),
    ("softmax_in_q_dtype", BF16_MIXED, APPROX_RECIPROCAL, True),
    ("sm_scale_ignored", MIXED, ALL, True),
    ("sm_scale_ignored", BF16_MIXED, ALL, True),
    ("acc_not_rescaled", BF16_MIXED, ALL, True),
]


@pytest.mark.parametrize(
    ("mutant", "case", "contract", "killed"),
    MUTANTS_UNDER_CONTRACTS,
    ids=[f"{m}-{c.q_dtype}-{p if isinstance(p, str) else 'all'}" for m, c, p, _ in MUTANTS_UNDER_CONTRACTS],
)
def test_mutants_not_covered_by_a_contract_are_caught_under_it(mutant, case, contract, killed):
    target = targets.load(f"mutants.{mutant}")
    arrays, options = case.arrays(), case.options()
    out = FAST.run(target.attention, arrays, options)
    result = oracle(**arrays, **options)
    assert not compare(out, result).ok  # float32 catches every one of them
    comparison = compare(out, result, label=mutant, precision=contract)
    assert comparison.ok is not killed, str(comparison)


def _target_module(name, precision):
    module = types.ModuleType(name)
    module.ragged_paged_attention = lambda *args, **kwargs: None
    module.dynamic_validate_inputs = lambda *args, **kwargs: None
    module.RPA_HARNESS_PRECISION = precision
    return module


def test_a_target_declares_its_contract(monkeypatch):
    monkeypatch.setitem(
        sys.modules, "declares_rounding", _target_module("declares_rounding", ("approx-reciprocal",))
    )
    assert targets.load("declares_rounding").precision == (FLOAT32, APPROX_RECIPROCAL)
    monkeypatch.setitem(sys.modules, "declares_typo", _target_module("declares_typo", ("aprox-reciprocal",)))
    with pytest.raises(
        targets.TargetError, match="RPA_HARNESS_PRECISION: unknown precision contract.*known: float32"
    ):
        targets.load("declares_typo")
    assert targets.load("rpa_harness.kernel").precision == (FLOAT32,)


def test_the_differential_check_judges_under_the_targets_contract(tmp_path):
    target = targets.load(DECLARED)
    assert target.precision == (FLOAT32, PROBABILITIES_IN_VALUE_DTYPE)
    arrays = long_case(BF16, BF16)
    options = {"sm_scale": 0.25}
    assert check_differential(target, FAST, arrays, options).ok
    undeclared = dataclasses.replace(target, precision=(FLOAT32,))
    with pytest.raises(PropertyFailure, match=f"consistent with {PROBABILITIES_IN_VALUE_DTYPE}"):
        with recorded(tmp_path, PropertyName(DIFFERENTIAL, label="x"), undeclared, FAST, arrays, options):
            check_differential(undeclared, FAST, arrays, options)
    written = repro.read(tmp_path / "differential_x.json")
    assert written.precision == (FLOAT32,)
    assert reference.parse_precision(written.precision) == undeclared.precision


def test_precision_option_overrides_the_declaration_and_replay_uses_the_recorded_one(
    tmp_path, pytestconfig, capsys
):
    if settings_of(pytestconfig).target.name != "rpa_harness.kernel":
        pytest.skip("runs its own target")
    common = ("-m", "pytest", "tests/properties/test_differential.py::test_kernel_matches_oracle", "-p", "no:cacheprovider",
              "-q", "-x", f"--rpa-target={DECLARED}", "--rpa-backend=fast-interpret", "--hypothesis-profile=ci",
              f"--rpa-repro-dir={tmp_path}")  # fmt: skip
    declared = run_python(*common, cwd=pytestconfig.rootpath)
    assert declared.returncode == 0, declared.stdout[-3000:] + declared.stderr[-3000:]
    overridden = run_python(*common, "--rpa-precision=float32", cwd=pytestconfig.rootpath)
    assert overridden.returncode == 1, overridden.stdout[-3000:] + overridden.stderr[-3000:]
    assert f"diagnosis: consistent with {PROBABILITIES_IN_VALUE_DTYPE}" in overridden.stdout
    path = tmp_path / "differential_fast-interpret.json"
    assert json.loads(path.read_text())["precision"] == [FLOAT32]
    capsys.readouterr()
    code = cli.main(["replay", str(path)])  # in this process: jax is imported already
    out, err = capsys.readouterr()
    assert code == 1 and "precision: float32\n" in out, out + err
    unknown = run_python(*common, "--rpa-precision=bf16", cwd=pytestconfig.rootpath)
    assert (
        unknown.returncode == 4
        and "--rpa-precision: unknown precision contract(s) bf16; known:" in unknown.stderr
    )
    assert "Traceback" not in unknown.stderr


def test_errors_only_all_contracts_together_explain_are_diagnosed_as_such():
    result = oracle(**long_case(BF16, BF16), sm_scale=0.25)
    owned = result.owned_rows
    combined = error_bound(result, precision=ALL)
    assert all(
        (0.9 * combined[owned] > error_bound(result, precision=(name,))[owned]).any() for name in CONTRACTS
    )
    comparison = compare(result.out + 0.9 * combined, result)
    assert comparison.diagnosis.startswith(
        "consistent with all precision contracts combined (max error/bound 0.9"
    )


def test_one_bfloat16_pass_is_diagnosed_by_name_not_as_an_approximate_reciprocal():
    """What the chip showed (q_len 1, kv_len 1, float32, head_dim 64): with one key the output is V's row,
    which one bfloat16 pass rounds element by element. An approximate reciprocal's bound, 2**-8 |o|, is
    tighter than bf16-matmul's there and accepts those errors too; but its error is one factor per row and
    head, which errors varying along head_dim rule out."""
    arrays = build_case(3, (1,), (1,), head_dim=64, num_q_heads=2, num_kv_heads=1, page_size=8)
    result = oracle(**arrays)
    out = contract_attention(**arrays, precision=(BF16_MATMUL,))
    assert compare(out, result, precision=(APPROX_RECIPROCAL,)).max_ratio <= 1.0  # the bound alone accepts
    comparison = compare(out, result)
    ratio = compare(out, result, precision=(BF16_MATMUL,)).max_ratio
    assert comparison.diagnosis == (
        f"consistent with {BF16_MATMUL} (max error/bound {ratio:.3g} under it): float32 operands multiplied "
        "in one bfloat16 pass (the MXU's DEFAULT precision): declare bf16-matmul, or pass precision=HIGHEST"
    ), str(comparison)
    factor = 1 + 2.0**-9  # one factor per row and head: what an approximate reciprocal does
    scaled = compare(result.out * factor, result)
    assert scaled.diagnosis.startswith(f"consistent with {APPROX_RECIPROCAL} (max error/bound "), str(scaled)


def test_products_at_default_are_judged_with_bf16_matmul_on_a_tpu_generation_only():
    upstream = targets.load(targets.UPSTREAM_TARGET)
    bundled = targets.load("rpa_harness.kernel")
    assert (upstream.product_precision, bundled.product_precision) == ("default", "highest")
    on_v5e, on_cpu = Backend(FAST_INTERPRET, generation="v5e"), FAST
    assert upstream.precision_on(on_v5e) == (FLOAT32, BF16_MATMUL)
    assert upstream.precision_on(on_cpu) == upstream.precision == (FLOAT32,)
    assert bundled.precision_on(on_v5e) == bundled.precision_on(on_cpu) == (FLOAT32,)


def test_on_a_chip_every_target_is_judged_with_the_chips_transcendentals():
    """Only a chip computes exp, tanh and division as a TPU does: the interpreters, emulating a generation
    or not, compute them as the CPU does."""
    upstream = targets.load(targets.UPSTREAM_TARGET)
    bundled = targets.load("rpa_harness.kernel")
    chip = Backend(TPU)
    assert upstream.precision_on(chip) == (FLOAT32, BF16_MATMUL, TPU_TRANSCENDENTALS)
    assert bundled.precision_on(chip) == (FLOAT32, TPU_TRANSCENDENTALS)
    assert TPU_TRANSCENDENTALS not in bundled.precision_on(Backend(FAST_INTERPRET, generation="v5e"))


def test_a_kernel_promising_highest_that_multiplies_at_default_fails_on_an_emulated_generation():
    """The bundled kernel before it asked for HIGHEST: it passes on a CPU device and fails where an
    interpreter multiplies as the chip does, diagnosed by name; the bundled kernel passes there."""
    broken = targets.load("tests.broken.default_precision_products")
    arrays = build_case(0, (1, 3), (1, 9), head_dim=64, num_q_heads=2, num_kv_heads=1, page_size=8)
    on_v5e = Backend(FAST_INTERPRET, generation="v5e")
    assert check_differential(broken, FAST, arrays, {}).ok
    with pytest.raises(PropertyFailure) as failure:
        check_differential(broken, on_v5e, arrays, {})
    assert f"diagnosis: consistent with {BF16_MATMUL} (max error/bound " in str(failure.value)
    assert "float32 operands multiplied in one bfloat16 pass" in str(failure.value)
    assert check_differential(targets.load("rpa_harness.kernel"), on_v5e, arrays, {}).ok


@pytest.mark.parametrize(("q_dtype", "kv_dtype"), [(F32, F32), (BF16, BF16)], ids=str)
def test_a_chips_exp_tanh_and_division_fail_float32_and_pass_under_tpu_transcendentals(q_dtype, kv_dtype):
    """A soft-capped call whose exp, tanh and division are each as far from correctly rounded as a TPU's
    may be (``tpu-transcendentals``): float32's bound does not hold them (the chip's tanh alone is 1,365 ulp
    off), the contract's does."""
    arrays = long_case(q_dtype, kv_dtype)
    options = dict(sm_scale=0.25, soft_cap=30.0)
    result = oracle(**arrays, **options)
    assert compare(contract_attention(**arrays, **options), result).ok
    out = contract_attention(**arrays, **options, precision=(TPU_TRANSCENDENTALS,))
    assert not compare(out, result).ok
    declared = compare(out, result, precision=(TPU_TRANSCENDENTALS,))
    assert declared.ok, str(declared)
