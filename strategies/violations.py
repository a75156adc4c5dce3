"""Deliberately invalid inputs: rule-breaking strategies, and the specification's table of rules.

A rule takes a valid case and breaks exactly one documented constraint. It has two halves: a breaker,
shared by every table, that mutates copies of the inputs and returns the facts of the violation (the
values a validator sees), and a message function that renders the exact error a validator raises from
those facts. ``RULES`` is the specification's table (upstream's rules and our stricter ones), rendered by
the message functions of ``rpa_harness.spec.interface``; a target whose validators have other rules or
wording declares its own table (``RPA_HARNESS_RULES``) from the same breakers and its own messages and
stages. Messages are built for inputs passed as jax arrays, which is how the harness calls every target (a
jax scalar renders as ``Array(7, dtype=int32)``).
"""

import dataclasses
import functools
import math
from collections.abc import Callable

import numpy as np
from hypothesis import strategies as st

from rpa_harness.spec import interface as spec
from rpa_harness.spec.interface import JaxInt
from rpa_harness.strategies.capabilities import Capabilities
from rpa_harness.strategies.case import Case
from rpa_harness.strategies.valid import valid_cases

__all__ = [  # what an adapter imports (docs/targets.md)
    "Rule",
    "RULES",
    "STAGES",
    "UPSTREAM_SAME",
    "UPSTREAM_ASSERTS",
    "UPSTREAM_ACCEPTS",
    "variants",
    "check_table",
    "InvalidCase",
    "invalid_cases",
    "break_num_seqs_shape",
    "break_head_dim",
    "break_kv_lens_shape",
    "break_cu_q_lens_shape",
    "break_index_dtype",
    "break_head_divisibility",
    "break_combined_kv_heads",
    "break_kv_block_range",
    "break_scale_type",
    "break_num_seqs_over_max",
    "break_negative_num_seqs",
    "break_page_capacity_any_slot",
    "break_page_capacity_live",
    "break_too_many_tokens",
    "break_q_len_over_kv_len",
    "break_q_len_zero",
    "break_cu_q_lens_order",
    "break_page_index",
]

STAGES = ("static", "dynamic")  # raised by ragged_paged_attention itself, or by dynamic_validate_inputs

# What upstream does with an input that breaks a rule of the specification's table.
UPSTREAM_SAME = "raises the same ValueError"
UPSTREAM_ASSERTS = "raises a bare AssertionError"
UPSTREAM_ACCEPTS = "accepts it (the kernel then reads out of bounds or runs on garbage)"


@dataclasses.dataclass(frozen=True)
class Rule:
    """One validation rule: where it fires, how to break it, and the message expected for it.

    ``breaks(arrays, options, case, param)`` mutates copies of the inputs (``param % variants`` picks the
    variant, ``param // variants`` any other choice, such as which sequence) and returns the violation's
    facts as a dict; ``message(**facts)`` is the error the validator must raise.
    ``upstream`` says what upstream's validator does with the input (the specification's table only; None
    in a target's own table, which is not compared with upstream).
    """

    stage: str
    breaks: Callable[[dict, dict, Case, int], dict]
    message: Callable[..., str]
    upstream: str | None = None
    # How many distinct violations the breaker makes (``param % variants`` picks one; 0: what the breaker
    # declares with ``@variants``, else 1). The validation property draws every one on every run.
    variants: int = 0

    def __post_init__(self):
        if self.stage not in STAGES:
            raise ValueError(f"Rule(stage={self.stage!r}): choose one of {STAGES}.")
        if not self.variants:
            object.__setattr__(self, "variants", getattr(self.breaks, "variants", 1))

    def apply(self, arrays: dict, options: dict, case: Case, param: int) -> str:
        """Breaks the rule on ``arrays``/``options`` in place; returns the expected message."""
        return self.message(**self.breaks(arrays, options, case, param))


# --- Helpers for breakers ----------------------------------------------------------------------------------


def live_sequence(arrays, case, q_len=0, kv_len=0):
    """Makes sure at least one sequence is live; returns num_seqs. A new one gets (q_len, kv_len)."""
    num_seqs = case.num_seqs
    if num_seqs == 0:
        num_seqs = 1
        arrays["num_seqs"][0] = 1
        arrays["cu_q_lens"][:2] = (0, q_len)
        set_kv_len(arrays, case, 0, kv_len)
    return num_seqs


def set_kv_len(arrays, case, seq, kv_len):
    """Sets a live sequence's kv_len and gives every page it now reads a valid page index."""
    arrays["kv_lens"][seq] = kv_len
    row = arrays["page_indices"][seq, : math.ceil(kv_len / case.page_size)]
    row[(row < 0) | (row >= case.total_num_pages)] = 0


def first_q_len_range_violation(arrays) -> dict:
    """The facts of the first live sequence that breaks ``0 < q_len <= kv_len`` (validators that check the
    range sequence by sequence report that one)."""
    cu, kv = arrays["cu_q_lens"], arrays["kv_lens"]
    for seq in range(int(arrays["num_seqs"][0])):
        q_len = int(cu[seq + 1]) - int(cu[seq])
        if not 0 < q_len <= int(kv[seq]):
            return dict(q_len=q_len, kv_len=int(kv[seq]), seq=seq)
    raise AssertionError("the rule's mutation left every q_len in range")


# --- Shared breakers: each returns the facts of its violation ---------------------------------------------


def variants(count: int):
    """Declares a breaker's variants: ``param % count`` picks one of ``count`` distinct violations (the one
    at the boundary of the rule first), ``param // count`` the breaker's other choices (which sequence,
    which page), which need not each be drawn."""

    def declare(breaks):
        breaks.variants = count
        return breaks

    return declare


@variants(3)
def break_num_seqs_shape(arrays, options, case, param):
    shape = [(2,), (), (1, 1)][param % 3]
    arrays["num_seqs"] = np.full(shape, case.num_seqs, np.int32)
    return dict(shape=shape)


def break_head_dim(arrays, options, case, param):
    """q's head_dim halved: q and the cache disagree."""
    head_dim = case.head_dim // 2
    arrays["q"] = dataclasses.replace(case, head_dim=head_dim, value_head_dim=None).arrays()["q"]
    return dict(q_head_dim=head_dim, kv_head_dim=case.head_dim)


@variants(2)
def break_kv_lens_shape(arrays, options, case, param):
    length = case.max_num_seqs + (1 if param % 2 else -1)
    arrays["kv_lens"] = np.resize(arrays["kv_lens"], length)
    return dict(shape=(length,), max_num_seqs=case.max_num_seqs)


@variants(2)
def break_cu_q_lens_shape(arrays, options, case, param):
    length = case.max_num_seqs + (2 if param % 2 else 0)
    arrays["cu_q_lens"] = np.resize(arrays["cu_q_lens"], length)
    return dict(shape=(length,), max_num_seqs=case.max_num_seqs)


@variants(9)
def break_index_dtype(arrays, options, case, param):
    name = ("kv_lens", "page_indices", "cu_q_lens")[param % 9 % 3]
    dtype = np.dtype((np.int16, np.uint32, np.float32)[param % 9 // 3])
    arrays[name] = arrays[name].astype(dtype)
    return {f"{n}_dtype": arrays[n].dtype for n in ("kv_lens", "page_indices", "cu_q_lens")}


@variants(2)
def break_head_divisibility(arrays, options, case, param):
    num_kv_heads = case.num_kv_heads
    if num_kv_heads == 1:  # every head count divides by 1: use two kv heads
        num_kv_heads = 2
        arrays["kv_pages"] = dataclasses.replace(case, num_kv_heads=2).arrays()["kv_pages"]
    num_q_heads = num_kv_heads * (1 + param % 2) + 1
    arrays["q"] = dataclasses.replace(case, num_q_heads=num_q_heads).arrays()["q"]
    return dict(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads)


def break_combined_kv_heads(arrays, options, case, param):
    """One combined head more: K gets ``num_kv_heads + 1`` heads, V ``num_kv_heads``."""
    kv_pages = arrays["kv_pages"]
    arrays["kv_pages"] = np.concatenate([kv_pages, kv_pages[:, :, :1]], axis=2)
    return dict(
        num_combined_kv_heads=kv_pages.shape[2] + 1,
        num_kv_heads=case.num_kv_heads,
        tokens=case.max_num_batched_tokens,
        head_dim=case.head_dim,
    )


def _option_breaker(name, values):
    def breaks(arrays, options, case, param):
        options[name] = values[param % len(values)]
        return dict(value=options[name])

    breaks.__name__ = f"break_{name}"
    breaks.variants = len(values)
    return breaks


break_sliding_window = _option_breaker("sliding_window", (0, -1, -2))
break_soft_cap = _option_breaker("soft_cap", (0.0, -0.0))
break_query_block = _option_breaker("num_queries_per_block", (0, -1))
break_vmem_limit = _option_breaker("vmem_limit_bytes", (0, -1, -(2**20)))
break_kv_block_sign = _option_breaker("num_kv_pages_per_block", (0, -1))


@variants(3)
def break_kv_block_range(arrays, options, case, param):
    """num_kv_pages_per_block non-positive or past pages_per_seq."""
    options["num_kv_pages_per_block"] = (0, -1, case.pages_per_seq + 1)[param % 3]
    return dict(value=options["num_kv_pages_per_block"], pages_per_seq=case.pages_per_seq)


def break_scale_type(name):
    def breaks(arrays, options, case, param):
        options[name] = (1, 2, np.float32(0.5))[param % 3]
        return dict(name=name, value=options[name])

    breaks.__name__ = f"break_{name}_type"
    breaks.variants = 3
    return breaks


@variants(3)
def break_num_seqs_over_max(arrays, options, case, param):
    num_seqs = case.max_num_seqs + 1 + param % 3
    arrays["num_seqs"] = np.array([num_seqs], np.int32)
    return dict(num_seqs=num_seqs, max_num_seqs=case.max_num_seqs)


@variants(2)
def break_negative_num_seqs(arrays, options, case, param):
    num_seqs = -1 - param % 2
    arrays["num_seqs"][0] = num_seqs
    # A validator that does not check the sign reads cu_q_lens[num_seqs] with wrap-around (upstream's):
    # keep that entry a plausible total so that such a validator accepts the input outright instead of
    # failing elsewhere.
    wrapped = case.max_num_seqs + 1 + num_seqs
    if wrapped > case.num_seqs:
        arrays["cu_q_lens"][wrapped] = 0
    return dict(num_seqs=num_seqs)


@variants(4)
def break_page_capacity_any_slot(arrays, options, case, param):
    """A kv_len past the page table's capacity in a live sequence or a padding slot (upstream checks the
    largest kv_len of every slot): one key past the capacity or a whole page past it, in the first slot or
    the last."""
    variant = param % 4
    slot = (0, case.max_num_seqs - 1)[variant // 2]
    arrays["kv_lens"][slot] = case.kv_capacity + (1, case.page_size)[variant % 2]
    max_kv_len = int(arrays["kv_lens"].max())
    return dict(
        pages_per_seq=case.pages_per_seq,
        min_pages=math.ceil(max_kv_len / case.page_size),
        max_kv_len=max_kv_len,
        page_size=case.page_size,
    )


@variants(2)
def break_page_capacity_live(arrays, options, case, param):
    """A kv_len past the page table's capacity in a live sequence: one key past it, or a whole page."""
    num_seqs = live_sequence(arrays, case, q_len=1, kv_len=1)
    seq = param // 2 % num_seqs
    kv_len = case.kv_capacity + (1, case.page_size)[param % 2]
    arrays["kv_lens"][seq] = kv_len
    return dict(
        pages=math.ceil(kv_len / case.page_size),
        pages_per_seq=case.pages_per_seq,
        seq=seq,
        kv_len=kv_len,
        page_size=case.page_size,
    )


@variants(3)
def break_too_many_tokens(arrays, options, case, param):
    num_seqs = live_sequence(arrays, case)
    last = num_seqs - 1
    total = case.max_num_batched_tokens + 1 + param % 3
    arrays["cu_q_lens"][num_seqs] = total
    q_len = total - int(arrays["cu_q_lens"][last])
    set_kv_len(arrays, case, last, max(q_len, int(arrays["kv_lens"][last])))
    return dict(total=total, max_num_batched_tokens=case.max_num_batched_tokens)


@variants(2)
def break_q_len_over_kv_len(arrays, options, case, param):
    num_seqs = live_sequence(arrays, case, q_len=1, kv_len=1)
    cu = arrays["cu_q_lens"]
    with_queries = [i for i in range(num_seqs) if cu[i + 1] > cu[i]]
    if not with_queries:  # give the first sequence one query row (rows are free: every q_len is 0)
        cu[1 : num_seqs + 1] += 1
        set_kv_len(arrays, case, 0, max(1, int(arrays["kv_lens"][0])))
        with_queries = [0]
    seq = with_queries[param // 2 % len(with_queries)]
    q_len = int(cu[seq + 1] - cu[seq])
    kv_len = q_len - 1 if param % 2 == 0 else param // 2 % q_len  # one key short, or any number short
    arrays["kv_lens"][seq] = kv_len
    return dict(q_len=q_len, kv_len=kv_len, seq=seq)


def break_q_len_zero(arrays, options, case, param):
    """A live sequence with no query rows (later sequences keep theirs, shifted)."""
    num_seqs = live_sequence(arrays, case, q_len=1, kv_len=1)
    seq = param % num_seqs
    cu = arrays["cu_q_lens"]
    cu[seq + 1 : num_seqs + 1] -= cu[seq + 1] - cu[seq]
    return dict(q_len=0, kv_len=int(arrays["kv_lens"][seq]), seq=seq)


@variants(3)
def break_cu_q_lens_order(arrays, options, case, param):
    """The last live sequence's cu_q_lens entry below the one before it: a negative q_len."""
    num_seqs = live_sequence(arrays, case, q_len=1, kv_len=1)
    last = num_seqs - 1  # the last sequence, so that no later sequence's q_len grows
    q_len = -1 - param % 3
    arrays["cu_q_lens"][num_seqs] = arrays["cu_q_lens"][last] + q_len
    return dict(q_len=q_len, kv_len=int(arrays["kv_lens"][last]), seq=last)


@variants(3)
def break_page_index(arrays, options, case, param):
    """A page a live sequence reads, out of [0, total_num_pages)."""
    num_seqs = live_sequence(arrays, case, q_len=0, kv_len=1)
    readers = [i for i in range(num_seqs) if arrays["kv_lens"][i] > 0]
    if not readers:
        set_kv_len(arrays, case, 0, 1)
        readers = [0]
    seq = readers[param // 3 % len(readers)]
    kv_len = int(arrays["kv_lens"][seq])
    page = param // 3 // len(readers) % math.ceil(kv_len / case.page_size)
    value = (case.total_num_pages, -1, case.total_num_pages + 1000)[param % 3]
    arrays["page_indices"][seq, page] = value
    return dict(
        seq=seq, page=page, value=value, total_num_pages=case.total_num_pages, kv_len=kv_len,
        page_size=case.page_size,
    )  # fmt: skip


# --- The specification's table ----------------------------------------------------------------------------


def _same(stage, breaks, message):
    return Rule(stage, breaks, message, UPSTREAM_SAME)


RULES: dict[str, Rule] = {
    # Upstream's static checks, in upstream's order.
    "num_seqs shape": _same("static", break_num_seqs_shape, spec.num_seqs_shape_message),
    "head_dim mismatch": _same(
        "static",
        break_head_dim,
        lambda q_head_dim, kv_head_dim: spec.head_dim_mismatch_message(q_head_dim, kv_head_dim),
    ),
    "kv_lens shape": _same("static", break_kv_lens_shape, spec.kv_lens_shape_message),
    "cu_q_lens shape": _same("static", break_cu_q_lens_shape, spec.cu_q_lens_shape_message),
    "index dtype": _same("static", break_index_dtype, spec.index_dtype_message),
    "heads not divisible": _same("static", break_head_divisibility, spec.heads_not_divisible_message),
    "sliding_window not positive": _same(
        "static", break_sliding_window, functools.partial(spec.not_positive_message, "sliding_window")
    ),
    "soft_cap zero": _same("static", break_soft_cap, lambda value: spec.soft_cap_zero_message(value)),
    "num_kv_pages_per_block out of range": _same(
        "static",
        break_kv_block_range,
        lambda value, pages_per_seq: spec.kv_block_out_of_range_message(value, pages_per_seq),
    ),
    "num_queries_per_block not positive": _same(
        "static", break_query_block, functools.partial(spec.not_positive_message, "num_queries_per_block")
    ),
    "vmem_limit_bytes not positive": _same(
        "static", break_vmem_limit, functools.partial(spec.not_positive_message, "vmem_limit_bytes")
    ),
    # Upstream's dynamic checks.
    "num_seqs over max_num_seqs": _same(
        "dynamic",
        break_num_seqs_over_max,
        lambda num_seqs, max_num_seqs: spec.num_seqs_over_max_message(JaxInt(num_seqs), max_num_seqs),
    ),
    "too few pages per sequence": _same(
        "dynamic",
        break_page_capacity_any_slot,
        lambda pages_per_seq, min_pages, max_kv_len, page_size: spec.too_few_pages_message(
            pages_per_seq, JaxInt(min_pages), JaxInt(max_kv_len), page_size
        ),
    ),
    "too many q tokens": _same("dynamic", break_too_many_tokens, spec.too_many_tokens_message),
    "q_len over kv_len": _same(
        "dynamic",
        break_q_len_over_kv_len,
        lambda q_len, kv_len, seq: spec.q_len_over_kv_len_message(JaxInt(q_len), JaxInt(kv_len), seq),
    ),
    # Ours only: upstream asserts or accepts.
    "odd combined kv heads": Rule(
        "static",
        break_combined_kv_heads,
        lambda num_combined_kv_heads, **_: spec.odd_combined_kv_heads_message(num_combined_kv_heads),
        UPSTREAM_ASSERTS,
    ),
    "k_scale not a float": Rule(
        "static", break_scale_type("k_scale"), spec.scale_not_float_message, UPSTREAM_ASSERTS
    ),
    "v_scale not a float": Rule(
        "static", break_scale_type("v_scale"), spec.scale_not_float_message, UPSTREAM_ASSERTS
    ),
    "negative num_seqs": Rule(
        "dynamic",
        break_negative_num_seqs,
        lambda num_seqs: spec.negative_num_seqs_message(JaxInt(num_seqs)),
        UPSTREAM_ACCEPTS,
    ),
    "decreasing cu_q_lens": Rule(
        "dynamic",
        break_cu_q_lens_order,
        lambda q_len, kv_len, seq: spec.negative_q_len_message(JaxInt(q_len), seq),
        UPSTREAM_ACCEPTS,
    ),
    "page index out of range": Rule(
        "dynamic",
        break_page_index,
        lambda seq, page, value, total_num_pages, kv_len, page_size: spec.page_out_of_range_message(
            seq, page, value, total_num_pages, kv_len
        ),
        UPSTREAM_ACCEPTS,
    ),
}
UPSTREAM_RULES = tuple(name for name, rule in RULES.items() if rule.upstream == UPSTREAM_SAME)


def check_table(table, where: str) -> dict[str, Rule]:
    """A declared rule table as a dict of ``Rule``; raises ValueError saying what is wrong with it."""
    if not isinstance(table, dict) or not table:
        raise ValueError(
            f"{where}: a rule table is a non-empty dict of rule name -> rpa_harness.strategies.violations.Rule, "
            f"got {type(table).__name__}"
        )
    wrong = [name for name, rule in table.items() if not isinstance(rule, Rule)]
    if wrong:
        raise ValueError(f"{where}: {wrong} are not rpa_harness.strategies.violations.Rule objects")
    return table


@dataclasses.dataclass(frozen=True)
class InvalidCase:
    """A valid case with exactly one rule of ``table`` broken; ``param`` picks the variant of the violation."""

    case: Case
    rule: str
    param: int = 0
    table: dict = dataclasses.field(default_factory=lambda: RULES, repr=False, compare=False)

    def inputs(self) -> tuple[dict[str, np.ndarray], dict, str]:
        """(arrays, options, expected message) with the violation applied."""
        arrays = self.case.arrays()
        options = self.case.options()
        message = self.table[self.rule].apply(arrays, options, self.case, self.param)
        return arrays, options, message

    @property
    def stage(self) -> str:
        return self.table[self.rule].stage


@st.composite
def invalid_cases(
    draw,
    capabilities: Capabilities | None = None,
    *,
    table=None,
    rules=None,
    variant: int | None = None,
    selection: tuple[str, ...] | None = None,
) -> InvalidCase:
    """An input that breaks exactly one of ``rules`` (default: every rule of ``table``, the specification's
    ``RULES`` unless given); the base case is drawn inside ``capabilities`` without options. ``variant``:
    that variant of the rule (``Rule.variants``), its other choices drawn. ``selection``: the run's buckets."""
    table = RULES if table is None else table
    rule = draw(st.sampled_from(tuple(table) if rules is None else rules))
    count = table[rule].variants
    if variant is not None and not 0 <= variant < count:
        raise ValueError(f"invalid_cases(variant={variant}): rule {rule!r} has variants 0..{count - 1}")
    capabilities = Capabilities() if capabilities is None else capabilities
    case = draw(valid_cases(capabilities, with_options=False, selection=selection))
    # small: every variant of a rule comes up often
    param = draw(st.integers(0, 63)) if variant is None else variant + count * draw(st.integers(0, 15))
    return InvalidCase(case, rule, param, table)
