"""Strategies for valid cases: structure first (bucket, heads, dtypes, options), then the ragged layout.

Shapes come from a few static buckets so that examples reuse compiled kernels; the ragged layout
(``q_lens``/``kv_lens``), the page table and the data seed vary as data. Every choice is drawn so that
shrinking moves toward the simplest case: one sequence, fewest heads, smallest head_dim and page size,
no options, float32, the smallest bucket. Edge-case biasing (lengths on page and KV-block boundaries) sits
behind a branch the shrinker can turn off.
"""

import dataclasses

from hypothesis import event, reject
from hypothesis import strategies as st

from rpa_harness.strategies.buckets import (
    BUCKETS,
    LARGE_BUCKETS,
    LONG_BUCKET,
    BucketError,
    LongBucket,
    LongCorner,
    ProductionBucket,
    drawn_buckets,
)
from rpa_harness.strategies.capabilities import WHOLE_SPACE, Capabilities
from rpa_harness.strategies.case import VALUE_PROFILES, Case
from rpa_harness.strategies.coverage import label_coverage
from rpa_harness.strategies.options import (
    RUNTIME_OPTION_VALUES,
    fit_options_to_layout,
    options,
    production_block_sizes,
    tuned_block_sizes,
)
from rpa_harness.strategies.pooled import pool, required_block_sizes
from rpa_harness.strategies.shapes import (
    bucketed_configs,
    layouts,
    long_configs,
    long_layouts,
    production_layouts,
)


def valid_cases(
    capabilities: Capabilities = WHOLE_SPACE,
    *,
    pooled: bool = False,
    large: bool | str = False,
    with_options: bool = True,
    values=tuple(VALUE_PROFILES),
    excluding=(),
    long_corner: LongCorner | None = None,
    selection: tuple[str, ...] | None = None,
    max_block_steps: int | None = None,
) -> st.SearchStrategy[Case]:
    """A valid case: from the whole static space, or (``pooled``) from the few configurations of POOL.

    ``selection``: the run's buckets (``select_buckets``; None: the defaults within the declaration).
    ``large``: from the selected large buckets (``drawn_buckets(..., large=True)``; a bucket name:
    that one; an error if it is not selected) with their layouts (``production_layouts``, ``long_layouts``)
    and block sizes left to the kernel or tuned (``production_block_sizes``). ``long_corner``: a long case in
    that corner of the long bucket (``long_corners``). ``excluding``: known issues of the target (see
    ``outside_known_issues``) whose cases are not drawn. ``max_block_steps``: no case with more
    (``Case.block_steps``), for an interpreter whose cost grows with them. The arguments are checked here,
    before anything is drawn: a mistake is one ValueError naming it.
    """
    _check_max_block_steps("valid_cases", max_block_steps)
    if not isinstance(capabilities, Capabilities):
        raise ValueError(
            f"valid_cases(capabilities={capabilities!r}): pass a Capabilities (Capabilities(**declared) for a "
            "dict of its fields)"
        )
    if long_corner is not None and large != "long":
        raise ValueError(f"valid_cases(long_corner={long_corner!r}) draws long cases: pass large='long'")
    if large and pooled:
        raise ValueError("valid_cases(pooled=True, large=True): the pool holds small configurations only")
    unknown = [profile for profile in values if profile not in VALUE_PROFILES]
    if not values or unknown:
        raise ValueError(
            f"valid_cases(values={values!r}): choose a non-empty subset of {tuple(VALUE_PROFILES)}"
        )
    undeclared = [name for name in selection or () if name not in capabilities.buckets]
    if undeclared:
        raise BucketError(
            f"valid_cases(selection={selection!r}): {', '.join(undeclared)} not among the declared buckets "
            f"{capabilities.buckets}; select with select_buckets"
        )
    not_issues = [
        issue
        for issue in excluding
        if not (callable(getattr(issue, "matches", None)) and callable(getattr(issue, "avoid", None)))
    ]
    if not_issues:
        raise ValueError(
            f"valid_cases(excluding=...): {not_issues[0]!r} is not a known issue (an object with matches(case) "
            "and avoid(case), e.g. rpa_harness.known_issues.KnownIssue)"
        )
    large_buckets = drawn_buckets(capabilities, selection, large=True) if large else ()
    if isinstance(large, str):
        large_buckets = tuple(name for name in large_buckets if name == large)
    if large and not large_buckets:
        wanted = large if isinstance(large, str) else f"no large bucket ({', '.join(LARGE_BUCKETS)})"
        raise BucketError(
            f"valid_cases(large={large!r}): {wanted} is not selected "
            f"(selection={selection}); select it with --rpa-buckets"
        )
    return _valid_cases(
        capabilities,
        pooled,
        large_buckets,
        with_options,
        tuple(values),
        tuple(excluding),
        long_corner,
        selection,
        max_block_steps,
    )


def _check_max_block_steps(function: str, max_block_steps) -> None:
    if max_block_steps is not None and (not isinstance(max_block_steps, int) or max_block_steps < 1):
        raise ValueError(f"{function}(max_block_steps={max_block_steps!r}): pass a positive int, or None")


def within_block_steps(case: Case, max_block_steps: int | None) -> bool:
    """Whether ``case`` visits at most ``max_block_steps`` block pairs (always, for None); an event if not."""
    if max_block_steps is None or case.block_steps <= max_block_steps:
        return True
    event(f"over {max_block_steps} block steps: not drawn")
    return False


@st.composite
def _valid_cases(
    draw,
    capabilities,
    pooled,
    large_buckets,
    with_options,
    values,
    excluding,
    long_corner,
    selection,
    max_block_steps=None,
) -> Case:
    if pooled:
        config, opts = draw(st.sampled_from(pool(capabilities, selection)))
        bucket = None
    else:
        if long_corner is None:
            name, config = draw(
                bucketed_configs(capabilities, buckets=large_buckets or None, selection=selection)
            )
        else:
            name, config = "long", draw(long_configs(capabilities, LONG_BUCKET, long_corner))
        bucket = BUCKETS[name]
        opts = draw(options(config, capabilities)) if with_options else {}
        if long_corner is not None and long_corner.leaves_blocks_to_the_kernel(capabilities):
            opts = {**opts, "num_kv_pages_per_block": None, "num_queries_per_block": None}
        elif long_corner is not None:
            opts = {**opts, **draw(tuned_block_sizes(config, capabilities))}
        elif isinstance(bucket, ProductionBucket | LongBucket):
            defaults = (
                not isinstance(bucket, LongBucket)
                or config["page_size"] >= capabilities.min_page_size_for_long_default_blocks
            )
            opts = {**opts, **draw(production_block_sizes(config, capabilities, kernel_defaults=defaults))}
        elif not with_options and capabilities.needs_block_sizes:
            opts = required_block_sizes(config)
    if isinstance(bucket, ProductionBucket):
        q_lens, kv_lens = draw(production_layouts(config, bucket))
    elif isinstance(bucket, LongBucket):
        q_lens, kv_lens = draw(long_layouts(config, bucket, long_corner))
    else:
        q_lens, kv_lens = draw(
            layouts(config, opts.get("num_kv_pages_per_block"), empty_sequences=capabilities.empty_sequences)
        )
    case = Case(
        **config,
        value_head_dim=capabilities.value_head_dim_for(config["head_dim"]),
        **opts,
        q_lens=q_lens,
        kv_lens=kv_lens,
        seed=draw(st.integers(0, 2**32 - 1)),
        values=draw(st.sampled_from(values)),
        poison=draw(st.booleans()),
        garbage=draw(st.booleans()),
    )
    case = fit_options_to_layout(case, chunk_from_layout=not pooled)
    case = outside_known_issues(case, excluding)
    if not within_block_steps(case, max_block_steps):
        reject()
    label_coverage(case)
    return case


def outside_known_issues(case: Case, known_issues) -> Case:
    """``case`` moved out of every known issue, or rejected when it cannot be.

    A known issue is an object with ``name``, ``matches(case)`` and ``avoid(case)`` (the nearest case
    outside it), e.g. ``rpa_harness.known_issues.KnownIssue``. Moving the drawn case, rather than filtering it,
    keeps rejections rare and lets shrinking work as usual. Moving a case out of one issue can move it into
    another (dropping a sequence changes the data a predicate reads), so the passes repeat until none
    applies.
    """
    for _ in range(len(known_issues) + 1):
        moved = case
        for issue in known_issues:
            before, moved = moved, issue.avoid(moved)
            if moved != before:
                event(f"known issue avoided: {issue.name}")
        if moved == case:
            break
        case = moved
    for issue in known_issues:
        if issue.matches(case):
            event(f"known issue rejected: {issue.name}")
            reject()
    return case


def valid_case_groups(
    capabilities: Capabilities = WHOLE_SPACE,
    *,
    max_cases: int = 4,
    pooled: bool = False,
    excluding=(),
    selection=None,
    max_block_steps: int | None = None,
) -> st.SearchStrategy[list[Case]]:
    """1 to ``max_cases`` valid cases from the whole static space (or, ``pooled``, from the configurations
    of POOL) that share one static configuration and static options, so one compiled kernel serves them
    all: each has its own ragged layout and data, and its own values of the options the target takes at
    run time (``capabilities.runtime_options``; which of them are None is shared).

    The whole-space properties draw these: there a new configuration's compilation costs 10-100x a call,
    so more cases per configuration test more in the same time without narrowing what is drawn (the first
    case is ``valid_cases``' own draw). On a chip the pooled property draws them too: there a call costs
    less than the host's work per Hypothesis example. The extra cases shrink away first.
    ``max_block_steps``: as for ``valid_cases``, each case.
    """
    if not isinstance(max_cases, int) or max_cases < 1:
        raise ValueError(f"max_cases={max_cases!r} must be an int of at least 1")
    _check_max_block_steps("valid_case_groups", max_block_steps)
    return _case_groups(capabilities, max_cases, pooled, excluding, selection, max_block_steps)


@st.composite
def _case_groups(
    draw, capabilities: Capabilities, max_cases: int, pooled: bool, excluding, selection, max_block_steps
) -> list[Case]:
    first = draw(
        valid_cases(
            capabilities,
            pooled=pooled,
            excluding=excluding,
            selection=selection,
            max_block_steps=max_block_steps,
        )
    )
    config = dict(
        page_size=first.page_size,
        pages_per_seq=first.pages_per_seq,
        max_num_seqs=first.max_num_seqs,
        max_num_batched_tokens=first.max_num_batched_tokens,
    )
    # mask_value None is the default mask, a value like the others.
    runtime = [
        name
        for name in capabilities.runtime_options
        if getattr(first, name) is not None or name == "mask_value"
    ]
    sharing = st.builds(
        lambda layout, option_values, seed, values, poison, garbage: dataclasses.replace(
            first,
            q_lens=layout[0],
            kv_lens=layout[1],
            seed=seed,
            values=values,
            poison=poison,
            garbage=garbage,
            **option_values,
        ),
        layouts(config, first.num_kv_pages_per_block, empty_sequences=capabilities.empty_sequences),
        st.fixed_dictionaries({name: st.sampled_from(RUNTIME_OPTION_VALUES[name]) for name in runtime}),
        st.integers(0, 2**32 - 1),
        st.sampled_from(("normal", "large", "ties", "tiny")),
        st.booleans(),
        st.booleans(),
    )
    cases = [first]
    for case in draw(st.lists(sharing, max_size=max_cases - 1)):
        case = outside_known_issues(fit_options_to_layout(case), excluding)
        if within_block_steps(case, max_block_steps):
            label_coverage(case)
            cases.append(case)
    return cases
