"""The seeded-bug catalogue stays usable: every patch applies, every mutant imports, and none is equivalent.

Each mutant has one small explicit witness on which it differs from the correct kernel: a numeric mutant's
output is off the float64 oracle (or it raises) where our kernel's is within the tolerance model; a
validation mutant accepts, rejects or words an input differently from our validator. The full properties
are not run here (``ci/kill_rate.py`` does that).
"""

import dataclasses
import importlib

import pytest

import mutants
from rpa_harness import kernel, reference
from rpa_harness.device import FAST_INTERPRET, INTERPRET, Backend
from rpa_harness.strategies.violations import RULES
from rpa_harness.targets import as_jax, load
from tests.cases import MIXED

FAST = Backend(FAST_INTERPRET)
CHECKING = Backend(INTERPRET)

WINDOWED = dataclasses.replace(MIXED, sliding_window=5, soft_cap=5.0, garbage=False)
QUANTISED = dataclasses.replace(
    MIXED, q_dtype="bfloat16", kv_dtype="float8_e4m3fn", k_scale=0.5, v_scale=2.0, garbage=False
)
LARGE_VALUES = dataclasses.replace(MIXED, values="large", garbage=False)
# One live sequence and three padding slots holding stale metadata (seed 1: cu_q_lens [0 5 1 3 5]), so a
# padding slot owns rows 1-2 of the live sequence and reads its own stale pages.
GARBAGE_SLOTS = dataclasses.replace(MIXED, q_lens=(5,), kv_lens=(13,), seed=1)

NUMERIC_WITNESSES = {
    "causal_off_by_one": MIXED,
    "context_offset_ignored": MIXED,
    "sliding_window_off_by_one": WINDOWED,
    "soft_cap_after_mask": WINDOWED,
    "gqa_head_mapping": MIXED,
    "kv_deinterleave_swapped": MIXED,
    "last_partial_page_dropped": MIXED,
    "padded_tail_nan_leak": MIXED,
    "padded_seq_slots_processed": GARBAGE_SLOTS,
    "sm_scale_ignored": MIXED,
    "k_scale_ignored": QUANTISED,
    "v_scale_uses_k_scale": QUANTISED,
    "kv_block_count_floor": MIXED,
    "query_block_straddle": MIXED,
    "dma_wrong_slot_computed": MIXED,
    "dma_single_slot": MIXED,
    "dma_wait_one_page_short": MIXED,
    "dma_wait_one_page_long": MIXED,
    "acc_not_rescaled": MIXED,
    "softmax_in_bfloat16": MIXED,
    "softmax_in_q_dtype": QUANTISED,
    "pv_in_bfloat16": MIXED,
    "no_max_subtraction": LARGE_VALUES,
    "logits_in_q_dtype": QUANTISED,
}
# Only the TPU interpreter can see these: the generic one completes every DMA when it starts.
SEEN_ONLY_BY_THE_CHECKING_INTERPRETER = {"dma_wait_one_page_short", "dma_wait_one_page_long"}
# A wait for bytes no copy will bring: the TPU interpreter's deadlock check raises (a TPU would hang).
DEADLOCKS = {"dma_wait_one_page_long"}

# Validation witnesses: (base case, rule broken, rule parameter), or (case, None, None) for a valid input.
VALIDATION_BASE = dataclasses.replace(MIXED, garbage=False)
VALIDATION_WITNESSES = {
    "num_seqs_limit_off_by_one": (VALIDATION_BASE, "num_seqs over max_num_seqs", 0),
    "vmem_limit_zero_accepted": (VALIDATION_BASE, "vmem_limit_bytes not positive", 0),
    "q_len_over_kv_len_assert": (VALIDATION_BASE, "q_len over kv_len", 0),
    "too_few_pages_floor": (VALIDATION_BASE, "too few pages per sequence", 0),
    "too_many_tokens_reworded": (VALIDATION_BASE, "too many q tokens", 0),
    "head_dim_check_missing": (VALIDATION_BASE, "head_dim mismatch", 0),
    "sliding_window_zero_accepted": (VALIDATION_BASE, "sliding_window not positive", 0),
    "soft_cap_wrong_exception": (VALIDATION_BASE, "soft_cap zero", 0),
    "kv_block_upper_bound_exclusive": (
        dataclasses.replace(VALIDATION_BASE, num_kv_pages_per_block=6),
        None,
        None,
    ),
    "kv_block_one_past_accepted": (VALIDATION_BASE, "num_kv_pages_per_block out of range", 2),
}


def test_every_mutant_has_a_witness():
    numeric = {m.name for m in mutants.MUTANTS if m.numeric}
    validation = {m.name for m in mutants.MUTANTS if not m.numeric}
    assert numeric == set(NUMERIC_WITNESSES)
    assert validation == set(VALIDATION_WITNESSES)
    assert len(mutants.MUTANTS) >= 20


@pytest.mark.parametrize("mutant", (*mutants.MUTANTS, mutants.TWO_BUGS), ids=lambda m: m.name)
def test_patch_applies_exactly_once(mutant):
    source = (mutants.REPO_ROOT / mutant.file).read_text()
    assert all(source.count(original) == 1 for original, _ in mutant.patches), mutant.name
    assert mutants.patched_source(mutant) != source


def test_patch_that_no_longer_applies_is_reported():
    stale = dataclasses.replace(mutants.MUTANTS[0], original="text that is not in the kernel")
    with pytest.raises(mutants.PatchError, match="occurs 0 times"):
        mutants.patched_source(stale)


@pytest.mark.parametrize("mutant", mutants.MUTANTS, ids=lambda m: m.name)
def test_mutant_is_a_target(mutant):
    target = load(f"mutants.{mutant.name}")
    assert target.module is importlib.import_module(f"mutants.{mutant.name}")
    assert target.module is getattr(mutants, mutant.name)
    assert target.module.ragged_paged_attention is not kernel.ragged_paged_attention
    assert target.capabilities.strict_validation and target.capabilities.lowers_for_tpu


def _oracle_comparison(target, case, backend=FAST):
    """The target's output vs the float64 oracle on ``case``, or the error it raised."""
    arrays, options = case.arrays(), case.options()
    try:
        actual = backend.run(target.attention, arrays, options)
    except Exception as error:  # a crash on valid inputs is a kill too
        return f"raised {type(error).__name__}"
    return reference.compare(actual, reference.oracle(**arrays, **options), label=target.name)


@pytest.mark.parametrize(
    "case", sorted(set(NUMERIC_WITNESSES.values()), key=repr), ids=lambda c: c.describe()[:60]
)
def test_correct_kernel_passes_the_witnesses(case):
    comparison = _oracle_comparison(load("rpa_harness.kernel"), case)
    assert not isinstance(comparison, str) and comparison.ok, str(comparison)


@pytest.mark.parametrize("name", sorted(NUMERIC_WITNESSES))
def test_numeric_mutant_differs_from_oracle(name):
    backend = CHECKING if name in SEEN_ONLY_BY_THE_CHECKING_INTERPRETER else FAST
    comparison = _oracle_comparison(load(f"mutants.{name}"), NUMERIC_WITNESSES[name], backend)
    assert isinstance(comparison, str) or not comparison.ok, f"mutant {name} matches the oracle: {comparison}"
    assert (comparison == "raised Deadlock") == (name in DEADLOCKS), comparison


def _validation_outcome(module, arrays, options):
    try:
        module.dynamic_validate_inputs(**as_jax(arrays), **options)
    except Exception as error:
        return type(error).__name__, str(error)
    return "accepted", ""


@pytest.mark.parametrize("name", sorted(VALIDATION_WITNESSES))
def test_validation_mutant_differs_from_our_validator(name):
    case, rule, param = VALIDATION_WITNESSES[name]
    arrays, options = case.arrays(), case.options()
    expected = ("accepted", "")
    if rule is not None:
        expected = ("ValueError", RULES[rule].apply(arrays, options, case, param))
    assert _validation_outcome(kernel, arrays, options) == expected
    assert _validation_outcome(getattr(mutants, name), arrays, options) != expected
