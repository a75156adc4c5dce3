"""A failure means one bug: distinct failures get distinct identities, so Hypothesis reports each apart.

Hypothesis tells failures apart by exception type and raise site, shrinks each identity apart and reports
each one. The checks give every kind of failure its own class, and a numeric failure a class per range of
its longest failing context (``rpa_harness.checks.located``). A kernel with two bugs, one in single-page
sequences and one only for query positions past 32,767 (``mutants.TWO_BUGS``), must come out as two
failures with their own minimal examples: the long-context one must neither shrink into the short-context
one nor be hidden behind it.
"""

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, find, given, settings
from hypothesis import strategies as st

import mutants
from rpa_harness import checks
from rpa_harness.device import FAST_INTERPRET, Backend
from rpa_harness.strategies.buckets import long_corners
from rpa_harness.strategies.case import Case
from rpa_harness.strategies.shapes import select_buckets
from rpa_harness.strategies.valid import valid_cases
from rpa_harness.targets import load
from rpa_harness.targets.bundled import RPA_HARNESS_CAPABILITIES as OUR_KERNEL

FAST = Backend(FAST_INTERPRET)
LONG_SELECTED = select_buckets(OUR_KERNEL, "long")
PAGE = 256


@st.composite
def single_page_cases(draw) -> Case:
    """One sequence of at most one page (16 keys), unit-variance logits."""
    kv_len = draw(st.integers(1, 16))
    return Case(max_num_batched_tokens=8, max_num_seqs=1, pages_per_seq=2, total_num_pages=3, page_size=16,
                num_q_heads=1, num_kv_heads=1, head_dim=64, q_lens=(draw(st.integers(1, min(kv_len, 8))),),
                kv_lens=(kv_len,), sm_scale=0.125, seed=draw(st.integers(0, 3)))  # fmt: skip


@st.composite
def decodes_near_2_to_15(draw) -> Case:
    """One decode a few keys either side of 2^15 keys, in pages of 256."""
    kv_len = draw(st.integers(32760, 32800))
    return Case(max_num_batched_tokens=8, max_num_seqs=1, pages_per_seq=130, total_num_pages=130,
                page_size=PAGE, num_q_heads=1, num_kv_heads=1, head_dim=64, q_lens=(1,), kv_lens=(kv_len,),
                sm_scale=0.125)  # fmt: skip


def test_a_failure_is_located_by_the_longest_context_it_shows_in():
    assert checks.located(checks.OverTheBound, [5, 100]) is checks.OverTheBound
    past_15 = checks.located(checks.OverTheBound, [5, 40000])
    assert past_15 is checks.located(checks.OverTheBound, [32769]) and issubclass(
        past_15, checks.OverTheBound
    )
    assert checks.located(checks.OverTheBound, [70000]) not in (past_15, checks.OverTheBound)
    assert checks.located(checks.NonFiniteOutput, [40000]) is not past_15
    assert "past 2^15 keys" in past_15.kind


def test_a_numeric_failure_is_located_by_the_sequences_over_the_bound():
    """A long sequence that is right and a short one that is wrong: the failure is a short-context one."""
    target = load(f"mutants.{mutants.TWO_BUGS.name}")
    case = Case(max_num_batched_tokens=8, max_num_seqs=2, pages_per_seq=130, total_num_pages=131,
                page_size=PAGE, num_q_heads=1, num_kv_heads=1, head_dim=64, q_lens=(1, 1),
                kv_lens=(32000, 200), sm_scale=0.125)  # fmt: skip
    with pytest.raises(checks.PropertyFailure) as raised:
        checks.check_differential(target, FAST, case.arrays(), case.options())
    assert type(raised.value) is checks.OverTheBound, type(raised.value)


def test_two_bugs_of_one_kind_are_reported_apart():
    """Both bugs give values over the bound (the single-page one also NaN, for a sequence of one key whose
    key it drops). Reported: a failure in a context past 2^15 keys, shrunk to the first query position past
    32,767 (32,769 keys), and the short-context ones, each in a single page."""
    target = load(f"mutants.{mutants.TWO_BUGS.name}")

    @settings(max_examples=30, derandomize=True, database=None, deadline=None, report_multiple_bugs=True,
              phases=[Phase.generate, Phase.shrink], suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(case=st.one_of(single_page_cases(), decodes_near_2_to_15()))
    def kernel_matches_oracle(case):
        checks.check_differential(target, FAST, case.arrays(), case.options())

    with pytest.raises(BaseExceptionGroup) as raised:
        kernel_matches_oracle()
    falsifying = [
        (type(error), "".join(getattr(error, "__notes__", []))) for error in raised.value.exceptions
    ]
    long_context = [kind for kind, example in falsifying if "kv_lens=(32769,)" in example]
    short_context = [kind for kind, example in falsifying if "page_size=16" in example]
    assert long_context == [checks.located(checks.OverTheBound, [32769])], falsifying
    assert checks.OverTheBound in short_context and len(short_context) == len(falsifying) - 1, falsifying


def test_the_two_bugs_kernel_is_right_between_its_bugs():
    """Neither bug shows on two pages of a short context: the two failures above are the two bugs."""
    target = load(f"mutants.{mutants.TWO_BUGS.name}")
    case = Case(max_num_batched_tokens=8, max_num_seqs=1, pages_per_seq=3, total_num_pages=4, page_size=16,
                num_q_heads=1, num_kv_heads=1, head_dim=64, q_lens=(3,), kv_lens=(20,), sm_scale=0.125)  # fmt: skip
    comparison = checks.check_differential(target, FAST, case.arrays(), case.options())
    assert comparison.ok and np.isfinite(comparison.max_ratio)


@pytest.mark.parametrize("corner", long_corners(OUR_KERNEL), ids=lambda corner: corner.name)
def test_every_ci_run_reaches_a_bug_past_2_to_15_keys(corner):
    """The simplest case of each long corner, which every ci run draws: the two-bug kernel's int16
    positions fail every corner with a query position past 32,767 (2^16 from either side, 2^15 from past
    it), as a long-context failure, and pass the corner up to 2^15."""
    target = load(f"mutants.{mutants.TWO_BUGS.name}")
    simplest = find(valid_cases(OUR_KERNEL, selection=LONG_SELECTED, large="long", long_corner=corner), lambda case: True,
                    settings=settings(database=None, suppress_health_check=list(HealthCheck)))  # fmt: skip
    if corner.past or corner.boundary > 1 << 15:
        with pytest.raises(checks.located(checks.OverTheBound, simplest.kv_lens)):
            checks.check_differential(target, FAST, simplest.arrays(), simplest.options())
    else:
        checks.check_differential(target, FAST, simplest.arrays(), simplest.options())
