"""The seeded bugs in upstream's kernel (``mutants/upstream.py``) stay usable: every patch applies, every
variant imports with upstream's known issues declared, and each one differs from upstream's kernel on a
small case outside every known issue (so the issues' exclusion cannot hide it). ``ci/kill_rate.py
--upstream`` runs the ci profile against them."""

import dataclasses

import pytest

import mutants.upstream
from rpa_harness.checks import CannotRun, PropertyFailure, check_differential
from rpa_harness.device import FAST_INTERPRET, Backend
from rpa_harness.targets import UPSTREAM_TARGET, load, upstream
from tests.cases import sized_case

FAST = Backend(FAST_INTERPRET)


# One sequence with context (3 queries over 6 keys, two pages), one KV block per page, 2 query heads on 1
# KV head: no empty sequence, no query tail, default mask value, no scales.
BASE = sized_case(
    (3,), (6,), spare_rows=5, spare_pages=2, spare_cache_pages=7, num_q_heads=2, num_kv_heads=1, head_dim=128,
    num_kv_pages_per_block=1, num_queries_per_block=8, poison=False,
)  # fmt: skip
WITNESSES = {
    "causal_off_by_one": BASE,
    "sliding_window_off_by_one": dataclasses.replace(BASE, sliding_window=2),
    "softmax_sum_not_rescaled": dataclasses.replace(BASE, kv_lens=(12,), values="large"),
    "partial_last_page_not_fetched": BASE,
    "last_block_prefetch_off_by_one": dataclasses.replace(BASE, q_lens=(1, 2), kv_lens=(4, 3)),
}


@pytest.fixture(scope="module", autouse=True)
def upstream_runs_here():
    """Skips (with the reason) where upstream's kernel cannot run on the fast interpreter: a recognised
    interpreter limitation. Any other error, or a wrong output, fails the module."""
    try:
        check_differential(load(UPSTREAM_TARGET), FAST, BASE.arrays(), BASE.options())
    except CannotRun as reason:
        pytest.skip(f"upstream's kernel cannot run on {FAST.name} here: {reason}")


def test_every_upstream_mutant_has_a_witness():
    assert sorted(WITNESSES) == sorted(mutants.upstream.BY_NAME)


@pytest.mark.parametrize("name", sorted(WITNESSES))
def test_upstream_mutant_differs_from_upstream_outside_the_known_issues(name):
    case = WITNESSES[name]
    assert [i.name for i in upstream.RPA_HARNESS_CATALOGUE if i.matches(case)] == []
    arrays, options = case.arrays(), case.options()
    check_differential(load(UPSTREAM_TARGET), FAST, arrays, options)
    mutant = load(f"mutants.upstream.{name}")
    assert mutant.known_issues == upstream.RPA_HARNESS_CATALOGUE
    with pytest.raises(PropertyFailure):
        check_differential(mutant, FAST, arrays, options)
