"""tpu-inference v3's rule table: the shared rule-breaking strategies with v3's stages and messages. It is
the family's base table: a kernel with v3's validators takes its rules from it (``in_order``), each with its
own where it words or breaks one otherwise.

The rules are broken through the v3 target's upstream-style interface: the target maps the arrays to v3's
(new tokens split from the cache, a packed cache, flat page indices, distribution = (decodes, decodes,
num_seqs), block sizes (bq, bkv, bq_chunk, bkv_chunk) from num_queries_per_block and num_kv_pages_per_block,
the chunk half a block when that is whole) and v3's validators see the result. Base cases are drawn inside
v3's capabilities (every live q_len > 0). Only five rules need a breaker of v3's own: the kv_lens shape (v3
reads max_num_seqs from it), the page size of a packed cache, the sign-only block checks, the page
capacity of live sequences only, and a page index out of range read by a sequence with a query row.
"""

import dataclasses
import math

import numpy as np

from rpa_harness.strategies import violations as shared
from rpa_harness.strategies.shapes import make_config
from rpa_harness.strategies.violations import Rule
from rpa_harness.targets.tpu_inference import messages


@shared.variants(2)
def _kv_lens_shape(arrays, options, case, param):
    length = case.max_num_seqs + (1 if param % 2 or case.max_num_seqs == 1 else -1)
    arrays["kv_lens"] = np.resize(arrays["kv_lens"], length)
    return dict(
        length=length, max_num_seqs=case.max_num_seqs, num_page_indices=case.max_num_seqs * case.pages_per_seq
    )


def _kv_lens_shape_message(length, max_num_seqs, num_page_indices):
    """v3 takes max_num_seqs from kv_lens: the page table's size or cu_q_lens's shape disagrees with it."""
    if num_page_indices % length:
        return messages.page_indices_not_divisible_message(num_page_indices, length)
    return messages.cu_q_lens_shape_message((max_num_seqs + 1,), length)


@shared.variants(2)
def _page_size_packing(arrays, options, case, param):
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
    return dict(page_size=page_size, kv_packing=packing)


def _skip_kv_mask_with_causal_mask(arrays, options, case, param):
    """The KV mask skipped under the causal mask (v3's first check)."""
    options.update(use_causal_mask=True, skip_kv_mask=True)
    return {}


@shared.variants(3)
def _break_chunk_prefill_size(arrays, options, case, param):
    options["chunk_prefill_size"] = (0, -1, -8)[param % 3]
    return dict(value=options["chunk_prefill_size"])


@shared.variants(3)
def _page_index_of_a_sequence_with_a_query_row(arrays, options, case, param):
    """The shared breaker; the sequence it makes live when none is gets a query row (v3 checks 0 < q_len
    before the page table)."""
    facts = shared.break_page_index(arrays, options, case, param)
    if case.num_seqs == 0:
        arrays["cu_q_lens"][1] = 1
    return facts


def _in_range_checked(breaks):
    """v3 checks ``0 < q_len <= kv_len`` sequence by sequence: the facts of the first that breaks it."""

    @shared.variants(getattr(breaks, "variants", 1))
    def checked(arrays, options, case, param):
        breaks(arrays, options, case, param)
        return shared.first_q_len_range_violation(arrays)

    return checked


def _kv_shapes_message(num_combined_kv_heads, num_kv_heads, tokens, head_dim):
    """2 * kv_heads + 1 combined heads: K gets one head more than V."""
    return messages.kv_shape_mismatch_message(
        (tokens, num_kv_heads + 1, head_dim), (tokens, num_kv_heads, head_dim)
    )


def _range_message(q_len, kv_len, seq):
    return messages.q_len_range_message(q_len, kv_len, seq)


def not_positive(name: str):
    """v3's message for option ``name`` given a value that is not positive."""
    return lambda value: messages.not_positive_message(name, value)


RULES: dict[str, Rule] = {
    # v3's static checks, in v3's order.
    "skip_kv_mask with the causal mask": Rule(
        "static", _skip_kv_mask_with_causal_mask, messages.skip_kv_mask_causal_message
    ),
    "k and v shapes differ": Rule("static", shared.break_combined_kv_heads, _kv_shapes_message),
    "head_dim mismatch": Rule(
        "static",
        shared.break_head_dim,
        lambda q_head_dim, kv_head_dim: messages.head_dim_mismatch_message(q_head_dim, kv_head_dim),
    ),
    "heads not divisible": Rule(
        "static", shared.break_head_divisibility, messages.heads_not_divisible_message
    ),
    "index dtype": Rule("static", shared.break_index_dtype, messages.index_dtype_message),
    "kv_lens shape": Rule("static", _kv_lens_shape, _kv_lens_shape_message),
    "cu_q_lens shape": Rule("static", shared.break_cu_q_lens_shape, messages.cu_q_lens_shape_message),
    "page_size not a multiple of the KV packing": Rule(
        "static", _page_size_packing, messages.page_size_packing_message
    ),
    "sliding_window not positive": Rule(
        "static",
        shared.break_sliding_window,
        not_positive("sliding_window"),
    ),
    "soft_cap zero": Rule(
        "static", shared.break_soft_cap, lambda value: messages.soft_cap_zero_message(value)
    ),
    "chunk_prefill_size not positive": Rule(
        "static",
        _break_chunk_prefill_size,
        not_positive("chunk_prefill_size"),
    ),
    "num_queries_per_block not positive": Rule(
        "static", shared.break_query_block, lambda value: messages.query_block_message("decode", value, value)
    ),
    "num_kv_pages_per_block not positive": Rule(
        "static",
        lambda arrays, options, case, param: dict(
            shared.break_kv_block_sign(arrays, options, case, param), page_size=case.page_size
        ),
        lambda value, page_size: messages.kv_block_message("decode", value * page_size, value * page_size),
        variants=shared.break_kv_block_sign.variants,
    ),
    "vmem_limit_bytes not positive": Rule(
        "static",
        shared.break_vmem_limit,
        not_positive("vmem_limit_bytes"),
    ),
    # v3's dynamic checks, in v3's order.
    "negative num_seqs": Rule(
        "dynamic",
        shared.break_negative_num_seqs,
        lambda num_seqs: messages.invalid_distribution_message(
            (0, 0, num_seqs)
        ),  # no live sequence: no decodes
    ),
    "num_seqs over max_num_seqs": Rule(
        "dynamic", shared.break_num_seqs_over_max, messages.num_seqs_over_max_message
    ),
    "too many q tokens": Rule(
        "dynamic",
        shared.break_too_many_tokens,
        lambda total, max_num_batched_tokens: messages.too_many_tokens_message(total, max_num_batched_tokens),
    ),
    "q_len over kv_len": Rule("dynamic", _in_range_checked(shared.break_q_len_over_kv_len), _range_message),
    "q_len zero": Rule("dynamic", _in_range_checked(shared.break_q_len_zero), _range_message),
    "decreasing cu_q_lens": Rule("dynamic", _in_range_checked(shared.break_cu_q_lens_order), _range_message),
    "too few pages per sequence": Rule(
        "dynamic",
        shared.break_page_capacity_live,
        lambda pages, pages_per_seq, seq, kv_len, page_size: messages.too_few_pages_message(
            pages, pages_per_seq, seq, kv_len, page_size
        ),
    ),
    "page index out of range": Rule(
        "dynamic",
        _page_index_of_a_sequence_with_a_query_row,
        lambda seq, page, value, total_num_pages, kv_len, page_size: messages.page_out_of_range_message(
            value, total_num_pages, seq, kv_len, page_size
        ),
    ),
}

# The block options checked as upstream names them (``num_kv_pages_per_block=-1 must be positive.``) instead
# of v3's block-size tuples: the early releases', the head_dim-64 kernel's and MLA v1's validators.
UPSTREAM_BLOCK_OPTION_RULES: dict[str, Rule] = {
    "num_kv_pages_per_block not positive": Rule(
        "static", shared.break_kv_block_sign, not_positive("num_kv_pages_per_block")
    ),
    "num_queries_per_block not positive": Rule(
        "static", shared.break_query_block, not_positive("num_queries_per_block")
    ),
}


def in_order(order: tuple[str, ...], own: dict[str, Rule]) -> dict[str, Rule]:
    """The rule table of a kernel with v3's validators that checks ``order``'s rules in that order: its
    ``own`` rule by a name where it words or breaks it otherwise, v3's elsewhere."""
    return {name: own.get(name) or RULES[name] for name in order}
