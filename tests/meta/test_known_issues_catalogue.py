"""Meta-tests of the known-issue catalogue: each predicate catches its own repro and little else, the
strategies never draw a declared issue's case (and what they draw instead is still valid), and the
declarations and ``--rpa-known-issues`` resolve as documented."""

import dataclasses
import itertools

import pytest
from hypothesis import given, settings
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as upstream_kernel

from rpa_harness import known_issues, targets
from rpa_harness import repro as repro_files
from rpa_harness.device import FAST_INTERPRET, INTERPRET
from rpa_harness.strategies.case import Case
from rpa_harness.strategies.valid import valid_cases
from rpa_harness.targets import as_jax, upstream
from tests.cases import drawn_cases
from tests.processes import run_python

CATALOGUE = upstream.RPA_HARNESS_CATALOGUE
UPSTREAM = upstream.RPA_HARNESS_CAPABILITIES
# Largest share of drawn cases (no issue excluded) a predicate may match: the rest of the space stays tested.
NARROW = 0.25
# A compile finding's cause is a configuration (a head_dim, dtype and head count the chip's compiler refuses):
# it covers whole slices of the space, and its predicate is held to the compiler's verdicts instead
# (tests/unit/test_ahead_of_time.py).
NARROW_ON_A_CHIP = 0.5
# Issues whose cause the strategies draw that often on purpose, with their predicate held to an
# interpreter's own check instead. unwaited-kv-prefetch-halts-the-chip: layouts clip query rows to the token
# budget, so sequences past it get q_len 0 (a tail the kernel's loop never reaches), and 1 batch in 16 is
# empty; its predicate agrees with the checking interpreter's exit check on every case of
# tests/unit/test_exit_state.py (a third of drawn cases match).
NARROW_BY_ISSUE = {"unwaited-kv-prefetch-halts-the-chip": 0.45}


@pytest.fixture(scope="module")
def upstream_cases() -> list[Case]:
    return drawn_cases(valid_cases(UPSTREAM), 200) + drawn_cases(valid_cases(UPSTREAM, pooled=True), 200)


def seen_on_a_chip_only(issue: known_issues.KnownIssue) -> bool:
    """Whether no interpreter can see the issue (a compile finding, a halt): it is judged on what is drawn
    for a chip."""
    return bool(issue.backends) and not {INTERPRET, FAST_INTERPRET} & set(issue.backends)


def on_its_chip(issue: known_issues.KnownIssue) -> known_issues.KnownIssue:
    """The issue's predicates seeing the TPU generation its repro was recorded for (a compile finding's
    chip: v5e; none for the interpreters' findings)."""
    return known_issues.on_generation((issue,), repro_files.read(issue.repro).tpu_generation)[0]


@pytest.fixture(scope="module")
def upstream_cases_on_a_chip() -> list[Case]:
    """What the compile property draws for upstream: block sizes may be left to its tuned table, the long
    bucket included."""
    on_a_chip = dataclasses.replace(UPSTREAM, needs_block_sizes=False)
    long = drawn_cases(valid_cases(on_a_chip, large="long", selection=("tiny", "small", "long")), 100)
    return drawn_cases(valid_cases(on_a_chip), 400) + long


@pytest.mark.parametrize("issue", CATALOGUE, ids=lambda issue: issue.name)
def test_predicate_matches_its_own_repro(issue):
    case = repro_files.read(issue.repro).case
    issue = on_its_chip(issue)
    assert issue.matches(case), f"{issue.name} does not match its own repro's case: {case.describe()}"
    assert not issue.matches(issue.nearest_outside(case))


@pytest.mark.parametrize("issue", CATALOGUE, ids=lambda issue: issue.name)
def test_predicate_is_narrow(issue, upstream_cases, upstream_cases_on_a_chip):
    narrow = NARROW_BY_ISSUE.get(issue.name, NARROW)
    if seen_on_a_chip_only(issue):  # judged on what is drawn there
        issue, upstream_cases, narrow = on_its_chip(issue), upstream_cases_on_a_chip, NARROW_ON_A_CHIP
    matching = [case for case in upstream_cases if issue.matches(case)]
    assert matching, f"{issue.name} matches none of {len(upstream_cases)} drawn cases: is it reachable?"
    share = len(matching) / len(upstream_cases)
    assert share <= narrow, f"{issue.name} matches {share:.0%} of drawn cases; narrow it to its cause"


@pytest.mark.parametrize("pooled", [False, True], ids=["any-config", "pooled"])
@settings(max_examples=100, deadline=None)
@given(data=__import__("hypothesis").strategies.data())
def test_declared_issues_are_never_drawn(pooled, data):
    case = data.draw(valid_cases(UPSTREAM, pooled=pooled, excluding=CATALOGUE))
    assert [issue.name for issue in CATALOGUE if issue.matches(case)] == []
    upstream_kernel.dynamic_validate_inputs(**as_jax(case.arrays()), **case.options())


# What moving out of an issue may change: the layout and the options the interpreters' findings are about;
# the compile findings' head_dim, head counts, VMEM limit and block sizes.
MOVABLE = {"q_lens", "kv_lens", "k_scale", "v_scale", "mask_value"}
MOVABLE_ON_A_CHIP = {
    "wide-heads-strided-kv-load-does-not-compile": {"head_dim"},
    "q-head-block-not-a-multiple-of-8-does-not-lower": {"num_kv_heads", "num_q_heads"},
    "tuned-blocks-overflow-default-vmem": {
        "vmem_limit_bytes",
        "num_kv_pages_per_block",
        "num_queries_per_block",
    },
}


def test_moving_out_of_an_issue_keeps_the_case_close(upstream_cases, upstream_cases_on_a_chip):
    """The nearest case outside an issue changes only what the issue is about."""
    for issue in CATALOGUE:
        cases = upstream_cases_on_a_chip if seen_on_a_chip_only(issue) else upstream_cases
        movable = MOVABLE_ON_A_CHIP.get(issue.name, MOVABLE)
        issue = on_its_chip(issue)
        for case in cases:
            if not issue.matches(case):
                continue
            moved = issue.nearest_outside(case)
            assert not issue.matches(moved), (issue.name, case)
            changed = {
                f.name for f in dataclasses.fields(Case) if getattr(moved, f.name) != getattr(case, f.name)
            }
            assert changed <= movable, (issue.name, changed)


def test_head_blocks_restate_upstream():
    """``upstream_head_blocks`` gives upstream's grid size for every head layout and dtype drawn."""
    for kv_heads, ratio, q_dtype, kv_dtype in itertools.product(
        (1, 2, 4, 8), (1, 2, 3, 4, 8), UPSTREAM.q_dtypes, UPSTREAM.kv_dtypes
    ):
        case = Case(8, 2, 2, 4, 16, kv_heads * ratio, kv_heads, 128, q_dtype=q_dtype, kv_dtype=kv_dtype)
        try:
            q_heads_per_block, _ = upstream_kernel.get_min_heads_per_blk(
                kv_heads * ratio, 2 * kv_heads, case.arrays()["q"].dtype, case.arrays()["kv_pages"].dtype
            )
        except ValueError:  # a combined head count upstream cannot tile: not drawn for it
            continue
        assert upstream.upstream_head_blocks(case) == kv_heads * ratio // q_heads_per_block, case


def test_upstream_declares_every_upstream_finding():
    declared = targets.load(targets.UPSTREAM_TARGET).known_issues
    assert [issue.name for issue in declared] == list(upstream.RPA_HARNESS_KNOWN_ISSUES)
    findings = sorted(p.name for p in upstream.FINDINGS.iterdir() if p.is_dir())
    assert sorted(issue.name for issue in declared) == findings
    assert targets.load(targets.DEFAULT_TARGET).known_issues == ()


def test_option_values():
    declared = CATALOGUE[:2]
    assert known_issues.parse_option("auto", declared, CATALOGUE) == declared
    assert known_issues.parse_option("none", declared, CATALOGUE) == ()
    first, third = CATALOGUE[0], CATALOGUE[2]
    assert known_issues.parse_option(f"{first.name}, {third.name}", (), CATALOGUE) == (first, third)
    with pytest.raises(known_issues.KnownIssueError) as error:
        known_issues.parse_option("no-such-issue", declared, CATALOGUE)
    message = str(error.value)
    assert "'no-such-issue'" in message and all(issue.name in message for issue in CATALOGUE)
    assert "\n" not in message


def test_unknown_known_issue_is_one_usage_error(pytestconfig):
    result = run_python(
        "-m", "pytest", "tests/properties/test_known_issues.py", "--rpa-known-issues=no-such-issue",
        "-p", "no:cacheprovider", cwd=pytestconfig.rootpath,
    )  # fmt: skip
    assert result.returncode == 4, result.stdout + result.stderr
    assert "unknown known issue 'no-such-issue'" in result.stderr and "Traceback" not in result.stderr


def test_one_block_size_given_is_the_tuned_tables_pair():
    """Found by a nightly run on emulated v6e: one decode of one key, pages of one key, a KV block of one
    page given and the query block left to the table. Upstream then takes both sizes from its tuned table
    (a KV block of many pages), whose empty slots the finite mask value weights: the finding, though the
    given KV block alone has no empty slot. With both sizes given it is not the finding."""
    case = Case(max_num_batched_tokens=8, max_num_seqs=2, pages_per_seq=33, total_num_pages=69, page_size=1,
                num_q_heads=1, num_kv_heads=1, head_dim=128, q_lens=(1,), kv_lens=(1,), mask_value=-2.0,
                num_kv_pages_per_block=1)  # fmt: skip
    finding = {issue.name: issue for issue in upstream.RPA_HARNESS_CATALOGUE}[
        "finite-mask-value-weights-keys-past-kv-len"
    ]
    assert finding.matches(case)
    assert not finding.matches(dataclasses.replace(case, num_queries_per_block=8))
