"""Deliberately invalid inputs: the spec table of every validation rule, and a strategy per rule.

Each rule takes a valid case and breaks exactly one documented constraint. ``RULES`` maps a rule to
where it is raised (``static``: by ``ragged_paged_attention`` itself; ``dynamic``: by
``dynamic_validate_inputs``), what upstream does with it, and a function that makes the violation and
returns the exact ``ValueError`` message expected for it, rendered by the message function of
``rpa_harness.spec.interface`` that the validators raise (the wording is stated once). Messages are built for inputs
passed as jax arrays, which is how the harness calls every target (a jax scalar renders as
``Array(7, dtype=int32)``).
"""

import dataclasses
import math
from collections.abc import Callable

import numpy as np
from hypothesis import strategies as st
from rpa_harness.spec import interface as spec
from rpa_harness.spec import tpu_inference_v3 as v3spec
from rpa_harness.strategies.case import Case
from rpa_harness.strategies.valid import OUR_KERNEL, Capabilities, make_config, valid_cases

# What upstream does with an input that breaks a rule.
UPSTREAM_SAME = "raises the same ValueError"
UPSTREAM_ASSERTS = "raises a bare AssertionError"
UPSTREAM_ACCEPTS = "accepts it (the kernel then reads out of bounds or runs on garbage)"


@dataclasses.dataclass(frozen=True)
class _JaxInt:
    """An int32 as the validators see it when the input is a jax array: its repr is jax's."""

    value: int

    def __repr__(self) -> str:
        return f"Array({self.value}, dtype=int32)"


@dataclasses.dataclass(frozen=True)
class Rule:
    """One validation rule: where it fires, what upstream does, and how to break it."""

    stage: str  # "static" or "dynamic"
    upstream: str
    # break_(arrays, options, case, param) mutates copies of the inputs; returns the expected message.
    break_: Callable[[dict, dict, Case, int], str]


def _num_seqs_shape(arrays, options, case, param):
    shape = [(2,), (), (1, 1)][param % 3]
    arrays["num_seqs"] = np.full(shape, case.num_seqs, np.int32)
    return spec.num_seqs_shape_message(shape)


def _head_dim_mismatch(arrays, options, case, param):
    head_dim = case.head_dim // 2
    arrays["q"] = dataclasses.replace(case, head_dim=head_dim).arrays()["q"]
    return spec.head_dim_mismatch_message(head_dim, case.head_dim)


def _kv_lens_shape(arrays, options, case, param):
    length = case.max_num_seqs + (1 if param % 2 else -1)
    arrays["kv_lens"] = np.resize(arrays["kv_lens"], length)
    return spec.kv_lens_shape_message((length,), case.max_num_seqs)


def _cu_q_lens_shape(arrays, options, case, param):
    length = case.max_num_seqs + (2 if param % 2 else 0)
    arrays["cu_q_lens"] = np.resize(arrays["cu_q_lens"], length)
    return spec.cu_q_lens_shape_message((length,), case.max_num_seqs)


def _index_dtype(arrays, options, case, param):
    name = ("kv_lens", "page_indices", "cu_q_lens")[param % 3]
    dtype = np.dtype((np.int16, np.uint32, np.float32)[param // 3 % 3])
    arrays[name] = arrays[name].astype(dtype)
    return spec.index_dtype_message(*(arrays[n].dtype for n in ("kv_lens", "page_indices", "cu_q_lens")))


def _heads_not_divisible(arrays, options, case, param):
    num_kv_heads = case.num_kv_heads
    if num_kv_heads == 1:  # every head count divides by 1: use two kv heads
        num_kv_heads = 2
        arrays["kv_pages"] = dataclasses.replace(case, num_kv_heads=2).arrays()["kv_pages"]
    num_q_heads = num_kv_heads * (1 + param % 2) + 1
    arrays["q"] = dataclasses.replace(case, num_q_heads=num_q_heads).arrays()["q"]
    return spec.heads_not_divisible_message(num_q_heads, num_kv_heads)


def _sliding_window(arrays, options, case, param):
    options["sliding_window"] = -(param % 3)
    return spec.not_positive_message("sliding_window", options["sliding_window"])


def _soft_cap(arrays, options, case, param):
    options["soft_cap"] = (0.0, -0.0)[param % 2]
    return spec.soft_cap_zero_message(options["soft_cap"])


def _kv_block(arrays, options, case, param):
    options["num_kv_pages_per_block"] = (0, -1, case.pages_per_seq + 1)[param % 3]
    return spec.kv_block_out_of_range_message(options["num_kv_pages_per_block"], case.pages_per_seq)


def _query_block(arrays, options, case, param):
    options["num_queries_per_block"] = -(param % 2)
    return spec.not_positive_message("num_queries_per_block", options["num_queries_per_block"])


def _vmem_limit(arrays, options, case, param):
    options["vmem_limit_bytes"] = (0, -1, -(2**20))[param % 3]
    return spec.not_positive_message("vmem_limit_bytes", options["vmem_limit_bytes"])


def _num_seqs_over_max(arrays, options, case, param):
    num_seqs = case.max_num_seqs + 1 + param % 3
    arrays["num_seqs"] = np.array([num_seqs], np.int32)
    return spec.num_seqs_over_max_message(_JaxInt(num_seqs), case.max_num_seqs)


def _too_few_pages(arrays, options, case, param):
    slot = param % case.max_num_seqs  # a live sequence or a padding slot: upstream checks every slot
    arrays["kv_lens"][slot] = case.kv_capacity + 1 + param % case.page_size
    max_kv_len = int(arrays["kv_lens"].max())
    min_pages_per_seq = _JaxInt(math.ceil(max_kv_len / case.page_size))
    return spec.too_few_pages_message(
        case.pages_per_seq, min_pages_per_seq, _JaxInt(max_kv_len), case.page_size
    )


def _live_sequence(arrays, case, q_len=0, kv_len=0):
    """Makes sure at least one sequence is live; returns num_seqs. A new one gets (q_len, kv_len)."""
    num_seqs = case.num_seqs
    if num_seqs == 0:
        num_seqs = 1
        arrays["num_seqs"][0] = 1
        arrays["cu_q_lens"][:2] = (0, q_len)
        _set_kv_len(arrays, case, 0, kv_len)
    return num_seqs


def _set_kv_len(arrays, case, seq, kv_len):
    """Sets a live sequence's kv_len and gives every page it now reads a valid page index."""
    arrays["kv_lens"][seq] = kv_len
    row = arrays["page_indices"][seq, : math.ceil(kv_len / case.page_size)]
    row[(row < 0) | (row >= case.total_num_pages)] = 0


def _too_many_tokens(arrays, options, case, param):
    num_seqs = _live_sequence(arrays, case)
    last = num_seqs - 1
    total = case.max_num_batched_tokens + 1 + param % 3
    arrays["cu_q_lens"][num_seqs] = total
    q_len = total - int(arrays["cu_q_lens"][last])
    _set_kv_len(arrays, case, last, max(q_len, int(arrays["kv_lens"][last])))
    return spec.too_many_tokens_message(total, case.max_num_batched_tokens)


def _q_len_over_kv_len(arrays, options, case, param):
    num_seqs = _live_sequence(arrays, case, q_len=1, kv_len=1)
    cu = arrays["cu_q_lens"]
    with_queries = [i for i in range(num_seqs) if cu[i + 1] > cu[i]]
    if not with_queries:  # give the first sequence one query row (rows are free: every q_len is 0)
        cu[1 : num_seqs + 1] += 1
        _set_kv_len(arrays, case, 0, max(1, int(arrays["kv_lens"][0])))
        with_queries = [0]
    seq = with_queries[param % len(with_queries)]
    q_len = int(cu[seq + 1] - cu[seq])
    kv_len = q_len - 1 - param // len(with_queries) % q_len
    arrays["kv_lens"][seq] = kv_len
    return spec.q_len_over_kv_len_message(_JaxInt(q_len), _JaxInt(kv_len), seq)


def _odd_kv_heads(arrays, options, case, param):
    kv_pages = arrays["kv_pages"]
    arrays["kv_pages"] = np.concatenate([kv_pages, kv_pages[:, :, :1]], axis=2)
    return spec.odd_combined_kv_heads_message(kv_pages.shape[2] + 1)


def _scale_not_float(name):
    def break_(arrays, options, case, param):
        value = (1, 2, np.float32(0.5))[param % 3]
        options[name] = value
        return spec.scale_not_float_message(name, value)

    return break_


def _negative_num_seqs(arrays, options, case, param):
    num_seqs = -1 - param % 2
    arrays["num_seqs"][0] = num_seqs
    # Upstream reads cu_q_lens[num_seqs] with wrap-around: keep that entry a plausible total so that
    # upstream accepts the input outright (the documented difference) instead of failing elsewhere.
    wrapped = case.max_num_seqs + 1 + num_seqs
    if wrapped > case.num_seqs:
        arrays["cu_q_lens"][wrapped] = 0
    return spec.negative_num_seqs_message(_JaxInt(num_seqs))


def _decreasing_cu_q_lens(arrays, options, case, param):
    num_seqs = _live_sequence(arrays, case)
    last = num_seqs - 1  # the last sequence, so that no later sequence's q_len grows
    q_len = -1 - param % 3
    arrays["cu_q_lens"][num_seqs] = arrays["cu_q_lens"][last] + q_len
    return spec.negative_q_len_message(_JaxInt(q_len), last)


def _page_out_of_range(arrays, options, case, param):
    num_seqs = _live_sequence(arrays, case, q_len=0, kv_len=1)
    readers = [i for i in range(num_seqs) if arrays["kv_lens"][i] > 0]
    if not readers:
        _set_kv_len(arrays, case, 0, 1)
        readers = [0]
    seq = readers[param % len(readers)]
    kv_len = int(arrays["kv_lens"][seq])
    page = param // len(readers) % math.ceil(kv_len / case.page_size)
    value = (case.total_num_pages, -1, case.total_num_pages + 1000)[param % 3]
    arrays["page_indices"][seq, page] = value
    return spec.page_out_of_range_message(seq, page, value, case.total_num_pages, kv_len)


RULES: dict[str, Rule] = {
    # Upstream's static checks, in upstream's order.
    "num_seqs shape": Rule("static", UPSTREAM_SAME, _num_seqs_shape),
    "head_dim mismatch": Rule("static", UPSTREAM_SAME, _head_dim_mismatch),
    "kv_lens shape": Rule("static", UPSTREAM_SAME, _kv_lens_shape),
    "cu_q_lens shape": Rule("static", UPSTREAM_SAME, _cu_q_lens_shape),
    "index dtype": Rule("static", UPSTREAM_SAME, _index_dtype),
    "heads not divisible": Rule("static", UPSTREAM_SAME, _heads_not_divisible),
    "sliding_window not positive": Rule("static", UPSTREAM_SAME, _sliding_window),
    "soft_cap zero": Rule("static", UPSTREAM_SAME, _soft_cap),
    "num_kv_pages_per_block out of range": Rule("static", UPSTREAM_SAME, _kv_block),
    "num_queries_per_block not positive": Rule("static", UPSTREAM_SAME, _query_block),
    "vmem_limit_bytes not positive": Rule("static", UPSTREAM_SAME, _vmem_limit),
    # Upstream's dynamic checks.
    "num_seqs over max_num_seqs": Rule("dynamic", UPSTREAM_SAME, _num_seqs_over_max),
    "too few pages per sequence": Rule("dynamic", UPSTREAM_SAME, _too_few_pages),
    "too many q tokens": Rule("dynamic", UPSTREAM_SAME, _too_many_tokens),
    "q_len over kv_len": Rule("dynamic", UPSTREAM_SAME, _q_len_over_kv_len),
    # Ours only: upstream asserts or accepts.
    "odd combined kv heads": Rule("static", UPSTREAM_ASSERTS, _odd_kv_heads),
    "k_scale not a float": Rule("static", UPSTREAM_ASSERTS, _scale_not_float("k_scale")),
    "v_scale not a float": Rule("static", UPSTREAM_ASSERTS, _scale_not_float("v_scale")),
    "negative num_seqs": Rule("dynamic", UPSTREAM_ACCEPTS, _negative_num_seqs),
    "decreasing cu_q_lens": Rule("dynamic", UPSTREAM_ACCEPTS, _decreasing_cu_q_lens),
    "page index out of range": Rule("dynamic", UPSTREAM_ACCEPTS, _page_out_of_range),
}
UPSTREAM_RULES = tuple(name for name, rule in RULES.items() if rule.upstream == UPSTREAM_SAME)


# --- tpu-inference v3's rules (spec/tpu_inference_v3.py), broken through the v3 target's upstream-style
# interface: the target maps the arrays to v3's (new tokens split from the cache, a packed cache, flat page
# indices, distribution = (decodes, decodes, num_seqs), block sizes (bq, bkv, bq_chunk, bkv_chunk) from
# num_queries_per_block and num_kv_pages_per_block, the chunk half a block when that is whole) and v3's
# validators see the result. Base cases are drawn inside v3's capabilities (every live q_len > 0).

V3_OWN = "v3's own rule"


def _v3_kv_shapes_differ(arrays, options, case, param):
    _odd_kv_heads(arrays, options, case, param)  # 2 * kv_heads + 1 combined heads: K gets one head more
    rows = case.max_num_batched_tokens
    return v3spec.kv_shape_mismatch_message(
        (rows, case.num_kv_heads + 1, case.head_dim), (rows, case.num_kv_heads, case.head_dim)
    )


def _v3_head_dim_mismatch(arrays, options, case, param):
    _head_dim_mismatch(arrays, options, case, param)
    return v3spec.head_dim_mismatch_message(case.head_dim // 2, case.head_dim)


def _v3_heads_not_divisible(arrays, options, case, param):
    _heads_not_divisible(arrays, options, case, param)
    num_kv_heads = arrays["kv_pages"].shape[2] // 2
    return v3spec.heads_not_divisible_message(arrays["q"].shape[1], num_kv_heads)


def _v3_index_dtype(arrays, options, case, param):
    _index_dtype(arrays, options, case, param)
    return v3spec.index_dtype_message(*(arrays[n].dtype for n in ("kv_lens", "page_indices", "cu_q_lens")))


def _v3_kv_lens_shape(arrays, options, case, param):
    length = case.max_num_seqs + (1 if param % 2 or case.max_num_seqs == 1 else -1)
    arrays["kv_lens"] = np.resize(arrays["kv_lens"], length)
    num_page_indices = case.max_num_seqs * case.pages_per_seq  # v3 takes max_num_seqs from kv_lens
    if num_page_indices % length:
        return v3spec.page_indices_not_divisible_message(num_page_indices, length)
    return v3spec.cu_q_lens_shape_message((case.max_num_seqs + 1,), length)


def _v3_cu_q_lens_shape(arrays, options, case, param):
    length = case.max_num_seqs + (2 if param % 2 else 0)
    arrays["cu_q_lens"] = np.resize(arrays["cu_q_lens"], length)
    return v3spec.cu_q_lens_shape_message((length,), case.max_num_seqs)


def _v3_page_size_packing(arrays, options, case, param):
    """The same layout in a packed KV dtype with a page size that is not a multiple of its packing."""
    kv_dtype, page_size, packing = (("bfloat16", 1, 2), ("float8_e4m3fn", 2, 4))[param % 2]
    layout = make_config("tiny", page_size, case.num_kv_heads, case.num_q_heads // case.num_kv_heads,
                         case.head_dim, case.q_dtype, kv_dtype)  # fmt: skip
    pages_per_seq = math.ceil(case.kv_capacity / page_size)
    layout.update(
        max_num_batched_tokens=case.max_num_batched_tokens,
        max_num_seqs=case.max_num_seqs,
        pages_per_seq=pages_per_seq,
        total_num_pages=case.max_num_seqs * pages_per_seq + 1,
    )
    arrays.update(dataclasses.replace(case, **layout).arrays())
    return v3spec.page_size_packing_message(page_size, packing)


def _v3_query_block(arrays, options, case, param):
    options["num_queries_per_block"] = bq = -(param % 2)  # a non-positive block is its own chunk
    return v3spec.query_block_message("decode", bq, bq)


def _v3_kv_block(arrays, options, case, param):
    options["num_kv_pages_per_block"] = pages = -(param % 2)
    bkv = pages * case.page_size
    return v3spec.kv_block_message("decode", bkv, bkv)


def _v3_negative_num_seqs(arrays, options, case, param):
    num_seqs = -1 - param % 2
    arrays["num_seqs"][0] = num_seqs
    return v3spec.invalid_distribution_message((0, 0, num_seqs))  # no live sequence, so no decodes


def _v3_num_seqs_over_max(arrays, options, case, param):
    num_seqs = case.max_num_seqs + 1 + param % 3
    arrays["num_seqs"] = np.array([num_seqs], np.int32)
    return v3spec.num_seqs_over_max_message(num_seqs, case.max_num_seqs)


def _v3_too_many_tokens(arrays, options, case, param):
    _too_many_tokens(arrays, options, case, param)
    total = int(arrays["cu_q_lens"][int(arrays["num_seqs"][0])])
    return v3spec.too_many_tokens_message(total, case.max_num_batched_tokens)


def _first_q_len_violation(arrays) -> str:
    """v3 checks 0 < q_len <= kv_len sequence by sequence: the message of the first that breaks it."""
    cu, kv = arrays["cu_q_lens"], arrays["kv_lens"]
    for i in range(int(arrays["num_seqs"][0])):
        q_len = int(cu[i + 1]) - int(cu[i])
        if not 0 < q_len <= int(kv[i]):
            return v3spec.q_len_range_message(q_len, int(kv[i]), i)
    raise AssertionError("the rule's mutation left every q_len in range")


def _v3_q_len_over_kv_len(arrays, options, case, param):
    _q_len_over_kv_len(arrays, options, case, param)
    return _first_q_len_violation(arrays)


def _v3_q_len_zero(arrays, options, case, param):
    num_seqs = _live_sequence(arrays, case, q_len=1, kv_len=1)
    seq = param % num_seqs
    cu = arrays["cu_q_lens"]
    cu[seq + 1 : num_seqs + 1] -= cu[seq + 1] - cu[seq]  # later sequences keep their rows, shifted
    return _first_q_len_violation(arrays)


def _v3_decreasing_cu_q_lens(arrays, options, case, param):
    num_seqs = _live_sequence(arrays, case, q_len=1, kv_len=1)
    last = num_seqs - 1
    arrays["cu_q_lens"][num_seqs] = arrays["cu_q_lens"][last] - 1 - param % 3
    return _first_q_len_violation(arrays)


def _v3_too_few_pages(arrays, options, case, param):
    num_seqs = _live_sequence(arrays, case, q_len=1, kv_len=1)
    seq = param % num_seqs  # v3 checks only live sequences
    kv_len = case.kv_capacity + 1 + param % case.page_size
    arrays["kv_lens"][seq] = kv_len
    return v3spec.too_few_pages_message(
        math.ceil(kv_len / case.page_size), case.pages_per_seq, seq, kv_len, case.page_size
    )


def _v3_page_out_of_range(arrays, options, case, param):
    num_seqs = _live_sequence(arrays, case, q_len=1, kv_len=1)
    seq = param % num_seqs
    kv_len = int(arrays["kv_lens"][seq])
    page = param // num_seqs % math.ceil(kv_len / case.page_size)
    value = (case.total_num_pages, -1, case.total_num_pages + 1000)[param % 3]
    arrays["page_indices"][seq, page] = value
    return v3spec.page_out_of_range_message(value, case.total_num_pages, seq, kv_len, case.page_size)


V3_RULES: dict[str, Rule] = {
    # v3's static checks, in v3's order.
    "k and v shapes differ": Rule("static", V3_OWN, _v3_kv_shapes_differ),
    "head_dim mismatch": Rule("static", V3_OWN, _v3_head_dim_mismatch),
    "heads not divisible": Rule("static", V3_OWN, _v3_heads_not_divisible),
    "index dtype": Rule("static", V3_OWN, _v3_index_dtype),
    "kv_lens shape": Rule("static", V3_OWN, _v3_kv_lens_shape),
    "cu_q_lens shape": Rule("static", V3_OWN, _v3_cu_q_lens_shape),
    "page_size not a multiple of the KV packing": Rule("static", V3_OWN, _v3_page_size_packing),
    "sliding_window not positive": Rule("static", V3_OWN, _sliding_window),
    "soft_cap zero": Rule("static", V3_OWN, _soft_cap),
    "num_queries_per_block not positive": Rule("static", V3_OWN, _v3_query_block),
    "num_kv_pages_per_block not positive": Rule("static", V3_OWN, _v3_kv_block),
    "vmem_limit_bytes not positive": Rule("static", V3_OWN, _vmem_limit),
    # v3's dynamic checks, in v3's order.
    "negative num_seqs": Rule("dynamic", V3_OWN, _v3_negative_num_seqs),
    "num_seqs over max_num_seqs": Rule("dynamic", V3_OWN, _v3_num_seqs_over_max),
    "too many q tokens": Rule("dynamic", V3_OWN, _v3_too_many_tokens),
    "q_len over kv_len": Rule("dynamic", V3_OWN, _v3_q_len_over_kv_len),
    "q_len zero": Rule("dynamic", V3_OWN, _v3_q_len_zero),
    "decreasing cu_q_lens": Rule("dynamic", V3_OWN, _v3_decreasing_cu_q_lens),
    "too few pages per sequence": Rule("dynamic", V3_OWN, _v3_too_few_pages),
    "page index out of range": Rule("dynamic", V3_OWN, _v3_page_out_of_range),
}

# The rule tables a target can declare (Capabilities.validation_rules).
TABLES: dict[str, dict[str, Rule]] = {"upstream": RULES, v3spec.RULES_NAME: V3_RULES}


def rules_for(capabilities: Capabilities) -> dict[str, Rule]:
    """The rules, with their messages, the target's validators are held to."""
    return TABLES[capabilities.validation_rules]


@dataclasses.dataclass(frozen=True)
class InvalidCase:
    """A valid case with exactly one rule broken; ``param`` picks the variant of the violation."""

    case: Case
    rule: str
    param: int = 0
    table: str = "upstream"  # a key of TABLES

    def inputs(self) -> tuple[dict[str, np.ndarray], dict, str]:
        """(arrays, options, expected message) with the violation applied."""
        arrays = self.case.arrays()
        options = self.case.options()
        message = TABLES[self.table][self.rule].break_(arrays, options, self.case, self.param)
        return arrays, options, message

    @property
    def stage(self) -> str:
        return TABLES[self.table][self.rule].stage


@st.composite
def invalid_cases(draw, capabilities: Capabilities = OUR_KERNEL, rules=None) -> InvalidCase:
    """An input that breaks exactly one of ``rules`` (default: every rule of the target's table); the base
    case is drawn without options."""
    table = rules_for(capabilities)
    rule = draw(st.sampled_from(tuple(table) if rules is None else rules))
    case = draw(valid_cases(capabilities, with_options=False))
    # small: every variant of a rule comes up often
    return InvalidCase(case, rule, draw(st.integers(0, 63)), capabilities.validation_rules)
