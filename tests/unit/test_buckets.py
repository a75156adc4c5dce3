"""Bucket selection and the production bucket's draws: budgets kept, edge cases of scale reachable.

Nothing here runs a kernel or builds a production case's arrays: the draws are checked on the Case itself.
"""

import functools
import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, find, given, settings

from rpa_harness.strategies.buckets import (
    BUCKETS,
    DEFAULT_BUCKETS,
    BucketError,
    drawn_buckets,
    long_corners,
    parse_buckets,
    why_not_drawn,
)
from rpa_harness.strategies.capabilities import Capabilities
from rpa_harness.strategies.case import DTYPES
from rpa_harness.strategies.coverage import coverage_labels, long_corner_of
from rpa_harness.strategies.options import (
    MAX_UNROLLED_PAGE_COPIES,
    TUNED_KV_PAGES_PER_BLOCK,
    TUNED_QUERIES_PER_BLOCK,
)
from rpa_harness.strategies.shapes import page_bytes, select_buckets
from rpa_harness.strategies.valid import valid_cases
from rpa_harness.targets import UPSTREAM_TARGET
from rpa_harness.targets.bundled import RPA_HARNESS_CAPABILITIES as OUR_KERNEL
from rpa_harness.targets.upstream import RPA_HARNESS_CAPABILITIES as UPSTREAM_KERNEL
from tests.processes import run_python

PRODUCTION = BUCKETS["production"]
SELECTED = select_buckets(OUR_KERNEL, "production")
LONG = BUCKETS["long"]
LONG_SELECTED = select_buckets(OUR_KERNEL, "long")
REPO_ROOT = Path(__file__).resolve().parents[2]


def test_unknown_bucket_is_one_error_listing_the_known_ones():
    with pytest.raises(
        BucketError, match=r"unknown bucket\(s\) huge, tiniest; known: tiny, small, medium, long, production"
    ):
        parse_buckets("tiny,huge, tiniest")


def test_selection_defaults_and_the_nightly_profile():
    default = select_buckets(OUR_KERNEL, "")
    assert drawn_buckets(OUR_KERNEL, default) == DEFAULT_BUCKETS
    assert drawn_buckets(OUR_KERNEL, default, large=True) == ()
    ci = select_buckets(OUR_KERNEL, "", profile="ci")
    assert drawn_buckets(OUR_KERNEL, ci) == DEFAULT_BUCKETS and drawn_buckets(OUR_KERNEL, ci, large=True) == (
        "long",
    )
    nightly = select_buckets(OUR_KERNEL, "", profile="nightly")
    assert drawn_buckets(OUR_KERNEL, nightly) == DEFAULT_BUCKETS
    assert drawn_buckets(OUR_KERNEL, nightly, large=True) == ("long", "production")
    # A target that does not declare production keeps its buckets under the nightly profile.
    upstream_nightly = select_buckets(UPSTREAM_KERNEL, "", profile="nightly")
    assert drawn_buckets(UPSTREAM_KERNEL, upstream_nightly, large=True) == ("long",)


def test_selection_is_within_the_declared_buckets():
    medium = select_buckets(OUR_KERNEL, "medium,production")
    assert drawn_buckets(OUR_KERNEL, medium) == ("medium",)
    assert drawn_buckets(OUR_KERNEL, medium, large=True) == ("production",)
    # Only large buckets selected: the other properties keep the default small ones.
    assert drawn_buckets(OUR_KERNEL, SELECTED) == DEFAULT_BUCKETS
    # Declared ones among several are kept; none declared is an error naming the declaration.
    assert select_buckets(UPSTREAM_KERNEL, "small,production") == ("small",)
    with pytest.raises(
        BucketError, match=r"production: the target declares buckets tiny,small,long .* none of these"
    ):
        select_buckets(UPSTREAM_KERNEL, "production")


def test_production_needs_a_production_head_layout():
    narrow = Capabilities(head_dims=(64,), buckets=("tiny", "production"))
    with pytest.raises(BucketError, match=r"needs head_dim in \(128, 256\)"):
        select_buckets(narrow, "production")


def test_large_draws_need_a_large_selection():
    with pytest.raises(BucketError, match="no large bucket"):
        find(valid_cases(OUR_KERNEL, large=True), lambda case: True)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=valid_cases(OUR_KERNEL, large=True, selection=SELECTED))
def test_production_cases_keep_the_budgets(case):
    q_lens, kv_lens = np.array(case.q_lens), np.array(case.kv_lens)
    assert (
        case.max_num_seqs in PRODUCTION.seq_slots and case.max_num_batched_tokens in PRODUCTION.token_budgets
    )
    assert case.page_size in PRODUCTION.page_sizes and case.head_dim in PRODUCTION.head_dims
    assert PRODUCTION.q_heads[0] <= case.num_q_heads <= PRODUCTION.q_heads[1]
    assert case.max_num_batched_tokens * case.num_q_heads * case.head_dim <= PRODUCTION.max_output_elements
    cache = case.total_num_pages * page_bytes(case.page_size, case.num_kv_heads, case.head_dim, case.kv_dtype)
    assert cache <= PRODUCTION.kv_cache_bytes
    assert 1 <= case.num_seqs <= case.max_num_seqs and case.num_tokens <= case.max_num_batched_tokens
    assert ((1 <= q_lens) & (q_lens <= kv_lens) & (kv_lens <= case.kv_capacity)).all()
    assert np.ceil(kv_lens / case.page_size).sum() <= case.total_num_pages
    assert (q_lens * kv_lens).sum() * case.num_q_heads <= PRODUCTION.max_work
    # Decode first, as vLLM orders a batch: rows past one only in the last four sequences (the prefills).
    assert (np.flatnonzero(q_lens > 1) >= case.num_seqs - 4).all()
    # Block sizes: left to the kernel, or upstream's tuned values clipped as upstream clips them.
    if case.num_kv_pages_per_block is not None:
        assert case.num_kv_pages_per_block in {min(p, case.pages_per_seq) for p in TUNED_KV_PAGES_PER_BLOCK}
        assert case.num_queries_per_block in {
            min(q, case.max_num_batched_tokens) for q in TUNED_QUERIES_PER_BLOCK
        }


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=valid_cases(OUR_KERNEL, selection=LONG_SELECTED, large="long"))
def test_long_cases_keep_the_budgets(case):
    q_lens, kv_lens = np.array(case.q_lens), np.array(case.kv_lens)
    assert case.kv_capacity == LONG.max_model_len and case.page_size in LONG.page_sizes
    assert case.max_num_batched_tokens in LONG.token_budgets and case.max_num_seqs in LONG.seq_slots
    assert case.num_q_heads <= LONG.max_q_heads and case.head_dim in LONG.head_dims
    cache = case.total_num_pages * page_bytes(case.page_size, case.num_kv_heads, case.head_dim, case.kv_dtype)
    assert cache <= LONG.kv_cache_bytes and case.total_num_pages * case.page_size >= LONG.max_model_len
    assert 1 <= case.num_seqs <= case.max_num_seqs and case.num_tokens <= case.max_num_batched_tokens
    assert ((1 <= q_lens) & (q_lens <= kv_lens) & (kv_lens <= case.kv_capacity)).all()
    assert np.ceil(kv_lens / case.page_size).sum() <= case.total_num_pages
    assert (q_lens * kv_lens).sum() * case.num_q_heads <= LONG.max_work


def _long(condition, capabilities=OUR_KERNEL):
    settings_ = settings(
        max_examples=2000, deadline=None, database=None, suppress_health_check=list(HealthCheck)
    )
    return find(
        valid_cases(capabilities, large="long", selection=LONG_SELECTED), condition, settings=settings_
    )


@pytest.mark.parametrize("boundary", LONG.boundaries)
def test_long_lengths_lie_on_both_sides_of_each_boundary(boundary):
    """Contexts that end just below, at and past 2^15 and 2^16, and query rows whose positions cross it."""
    assert max(_long(lambda c: boundary - 2 <= max(c.kv_lens) < boundary).kv_lens) < boundary
    assert boundary in _long(lambda c: boundary in c.kv_lens).kv_lens
    crossing = _long(lambda c: any(kv - q < boundary < kv for q, kv in zip(c.q_lens, c.kv_lens, strict=True)))
    assert any(q > 1 for q in crossing.q_lens)
    assert max(_long(lambda c: max(c.kv_lens) > LONG.max_model_len - 2).kv_lens) <= LONG.max_model_len


def test_a_long_case_shrinks_to_one_short_decode():
    smallest = _long(lambda c: True)
    assert (smallest.q_lens, smallest.kv_lens) == ((1,), (0,)) or smallest.kv_lens[0] <= 1
    assert smallest.num_seqs == 1 and smallest.q_lens == (1,)


def test_long_draws_leave_block_sizes_to_the_kernel_only_where_declared():
    assert _long(lambda c: c.num_kv_pages_per_block is None).num_queries_per_block is None
    expensive = Capabilities(buckets=("tiny", "long"), min_page_size_for_long_default_blocks=256)
    settings_ = settings(
        max_examples=300, deadline=None, database=None, suppress_health_check=list(HealthCheck)
    )

    @settings_
    @given(case=valid_cases(expensive, large="long", selection=("long",)))
    def blocks_given_below_the_page_size(case):
        assert case.page_size >= 256 or None not in (case.num_kv_pages_per_block, case.num_queries_per_block)

    blocks_given_below_the_page_size()
    assert _long(lambda c: c.num_kv_pages_per_block is None, expensive).page_size == 256


def test_the_long_corners_are_each_kind_of_query_on_each_side_of_each_boundary():
    corners = long_corners(OUR_KERNEL)
    assert len(set(corners)) == 8 == len({c.name for c in corners}) == len({c.label for c in corners})
    assert {(c.packed_queries, c.boundary, c.past) for c in corners} == {
        (packed, boundary, past)
        for packed in (False, True)
        for boundary in LONG.boundaries
        for past in (False, True)
    }
    for packed in (False, True):  # each kind of q dtype meets the kernel's block sizes and given ones
        assert {c.kernel_block_sizes for c in corners if c.packed_queries == packed} == {False, True}
    float32_only = long_corners(Capabilities(buckets=("tiny", "long"), q_dtypes=("float32",)))
    assert len(float32_only) == 4 and not any(c.packed_queries for c in float32_only)
    needs_blocks = Capabilities(buckets=("tiny", "long"), needs_block_sizes=True)
    own = next(c for c in long_corners(needs_blocks) if c.kernel_block_sizes)  # off a TPU generation: given
    drawn = find(
        valid_cases(needs_blocks, large="long", long_corner=own, selection=("long",)), lambda c: True
    )
    assert drawn.num_kv_pages_per_block is not None and drawn.num_queries_per_block is not None


@pytest.mark.parametrize("corner", long_corners(OUR_KERNEL), ids=lambda corner: corner.name)
def test_a_corner_draws_only_its_corner(corner):
    """Every case of a corner lies in it (its coverage label says so), the simplest one too: just up to the
    boundary (every query position below it), or one key past it (the last position on it)."""

    @settings(max_examples=30, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(case=valid_cases(OUR_KERNEL, selection=LONG_SELECTED, large="long", long_corner=corner))
    def in_the_corner(case):
        assert long_corner_of(case) == corner and f"long corner: {corner.label}" in coverage_labels(case)
        longest = max(case.kv_lens)
        assert boundary < longest if corner.past else boundary - 2 <= longest <= boundary
        assert case.kv_lens.index(longest) == 0  # the first sequence; the others are short

    boundary = corner.boundary
    in_the_corner()
    smallest = find(valid_cases(OUR_KERNEL, selection=LONG_SELECTED, large="long", long_corner=corner), lambda c: True,
                    settings=settings(database=None, suppress_health_check=list(HealthCheck)))  # fmt: skip
    assert smallest.kv_lens == ((boundary + 1,) if corner.past else (boundary,)) and smallest.q_lens == (1,)


@functools.cache
def _drawn_production_cases() -> tuple:
    """Cases as the production property draws them (derandomized, no shrinking: conditions are looked up)."""
    cases = []

    @settings(
        max_examples=300,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=valid_cases(OUR_KERNEL, large=True, selection=SELECTED))
    def collect(case):
        cases.append(case)

    collect()
    return tuple(cases)


def _found(condition):
    found = [case for case in _drawn_production_cases() if condition(case)]
    assert found, "no drawn production case satisfies the condition"
    return found[0]


def test_production_edge_cases_are_drawn():
    """Every slot live, one sequence over hundreds of pages, every page of the cache in use (the page table
    then holds the last page index), a long prefill, many sequences per default query block."""
    assert _found(lambda c: c.num_seqs == c.max_num_seqs)
    assert _found(lambda c: max(c.kv_lens) >= 256 * c.page_size)
    full = _found(lambda c: sum(-(-kv // c.page_size) for kv in c.kv_lens) == c.total_num_pages)
    assert full.total_num_pages - 1 in full.arrays()["page_indices"][: full.num_seqs]
    assert _found(lambda c: max(c.q_lens) >= 512)
    assert _found(lambda c: c.num_kv_pages_per_block is None and c.num_seqs >= 256)


def test_production_configs_reach_the_scale_of_the_issue():
    assert _found(lambda c: c.max_num_batched_tokens == 8192)
    assert _found(lambda c: c.num_q_heads == 64 and c.head_dim == 256)
    assert _found(lambda c: c.kv_capacity == 131072 and c.max_num_seqs == 512)
    assert _found(lambda c: c.page_size == 256)


def test_production_case_arrays_are_deterministic_and_poisoned_outside_the_live_keys():
    case = _found(
        lambda c: 8 <= c.num_seqs and c.poison and c.kv_dtype == "bfloat16" and c.total_num_pages < 5000
    )
    first, second = case.arrays(), case.arrays()
    for name in first:
        assert first[name].tobytes() == second[name].tobytes(), name
    kv = first["kv_pages"]
    live = 0
    for i, kv_len in enumerate(case.kv_lens):
        pages = first["page_indices"][i, : -(-kv_len // case.page_size)]
        keys = kv[pages].reshape(-1, *kv.shape[2:])
        assert np.isfinite(keys[:kv_len].astype(np.float32)).all()
        assert np.isnan(keys[kv_len:].astype(np.float32)).all()
        live += kv_len
    assert (
        np.isnan(kv.astype(np.float32)).reshape(-1, *kv.shape[2:]).all(axis=(1, 2)).sum()
        == kv.shape[0] * kv.shape[1] - live
    )
    assert kv.dtype == DTYPES["bfloat16"]


def test_a_bucket_no_declared_one_matches_is_a_usage_error(tmp_path):
    """--rpa-buckets naming only buckets the target does not declare: one line, exit 4."""
    env = dict(os.environ, RPA_BUCKETS="production")
    env.pop("HYPOTHESIS_PROFILE", None)
    run = run_python(
        "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", f"--rpa-target={UPSTREAM_TARGET}",
        f"--rpa-repro-dir={tmp_path}", "tests/unit/test_buckets.py", cwd=REPO_ROOT, env=env,
    )  # fmt: skip
    assert run.returncode == 4, run.stdout + run.stderr
    errors = [line for line in run.stderr.splitlines() if "--rpa-buckets" in line]
    assert len(errors) == 1 and "declares buckets tiny,small" in errors[0], run.stderr


def test_production_examples_never_run_under_the_ci_profile(tmp_path):
    env = dict(os.environ, RPA_BUCKETS="production", HYPOTHESIS_PROFILE="ci")
    run = run_python(
        "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "--rpa-backend=fast-interpret",
        "--rpa-allow-no-numeric", f"--rpa-repro-dir={tmp_path}", "tests/properties/test_production.py",
        cwd=REPO_ROOT, env=env,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    assert "passed" not in run.stdout and "never run under the ci profile" in run.stdout, run.stdout
    assert "the long bucket is not selected" in run.stdout, run.stdout


def test_a_bucket_not_drawn_says_whether_it_is_undeclared_or_unselected():
    undeclared = why_not_drawn(Capabilities(), ("small", "long"), "long")
    assert "does not declare the long bucket" in undeclared and "buckets=(..., 'long')" in undeclared
    assert "is not selected" in why_not_drawn(OUR_KERNEL, ("small",), "long")
    assert why_not_drawn(OUR_KERNEL, ("small", "long"), "long") is None


UNROLLED_COPIES = Capabilities(min_page_size_for_long_default_blocks=256)


def many_small_pages(case) -> bool:
    return case.page_size < 256 and case.pages_per_seq > MAX_UNROLLED_PAGE_COPIES


@given(case=valid_cases(UNROLLED_COPIES))
def test_a_kernel_copying_pages_one_by_one_gets_given_blocks_over_many_small_pages(case):
    if many_small_pages(case):
        assert case.num_kv_pages_per_block is not None


def test_such_cases_are_drawn():
    assert find(valid_cases(UNROLLED_COPIES), many_small_pages).num_kv_pages_per_block is not None


# batched RPA's exclusion on a CPU: bfloat16 queries with a bfloat16 cache are not drawn, every other pair is.
WITHOUT_BF16_PAIR = Capabilities(
    excluded_dtype_pairs=(("bfloat16", "bfloat16"),),
    buckets=("tiny", "small", "long"),
    needs_block_sizes=True,
)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    case=valid_cases(WITHOUT_BF16_PAIR, large="long", selection=("tiny", "small", "long"))
    | valid_cases(WITHOUT_BF16_PAIR, pooled=True)
)
def test_an_excluded_dtype_pair_is_never_drawn(case):
    assert (case.q_dtype, case.kv_dtype) != ("bfloat16", "bfloat16")


@pytest.mark.parametrize(
    "pair", [("bfloat16", "float32"), ("float32", "bfloat16"), ("bfloat16", "float8_e4m3fn")]
)
def test_every_other_dtype_pair_is_drawn(pair):
    case = find(valid_cases(WITHOUT_BF16_PAIR), lambda c: (c.q_dtype, c.kv_dtype) == pair)
    assert (case.q_dtype, case.kv_dtype) == pair


def test_a_kv_dtype_left_without_a_q_dtype_is_one_clear_error():
    with pytest.raises(ValueError, match=r"no q dtype is left for the KV dtypes \['bfloat16'\]"):
        Capabilities(q_dtypes=("bfloat16",), excluded_dtype_pairs=(("bfloat16", "bfloat16"),))
    with pytest.raises(ValueError, match="is not a \\(q dtype, KV dtype\\) pair"):
        Capabilities(excluded_dtype_pairs=(("float16", "bfloat16"),))


FEW_PAGES_PER_BLOCK = Capabilities(max_kv_pages_per_block=3, buckets=("tiny", "small", "long"))


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    case=valid_cases(FEW_PAGES_PER_BLOCK, large="long", selection=("tiny", "small", "long"))
    | valid_cases(FEW_PAGES_PER_BLOCK, pooled=True)
)
def test_a_given_kv_block_keeps_to_the_declared_pages(case):
    assert case.num_kv_pages_per_block is None or case.num_kv_pages_per_block <= 3


def test_the_declared_pages_are_reached():
    assert find(valid_cases(FEW_PAGES_PER_BLOCK), lambda c: c.num_kv_pages_per_block == 3).pages_per_seq >= 3
