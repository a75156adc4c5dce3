"""The harness's target for ``tests.flat_pages.kernel``: upstream's API mapped onto the kernel's, and its profile."""

import numpy as np

from rpa_harness.strategies import violations as shared
from rpa_harness.strategies.violations import Rule
from rpa_harness.targets import layouts
from tests.flat_pages import kernel

OPTION_NAMES = dict(
    sm_scale="scale", sliding_window="window", soft_cap="logit_cap", mask_value="mask_value",
    k_scale="k_scale", v_scale="v_scale", num_kv_pages_per_block="pages_per_block",
    num_queries_per_block="queries_per_block", vmem_limit_bytes="vmem_bytes",
)  # fmt: skip


def _kernel_inputs(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs):
    k_cache, v_cache = layouts.split_kv(kv_pages)
    flat = layouts.flat_page_list(
        page_indices, kv_lens, num_seqs, page_size=kv_pages.shape[1], pad_to=np.size(page_indices), clip=True
    )
    return q, k_cache, v_cache, kv_lens, flat.pages, flat.cu_kv_lens, cu_q_lens, int(num_seqs[0])


def ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options):
    inputs = _kernel_inputs(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs)
    renamed = {OPTION_NAMES[name]: value for name, value in options.items()}
    return kernel.paged_attention(*inputs, max_pages_per_seq=page_indices.shape[1], **renamed)


def dynamic_validate_inputs(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options):
    kernel.check_inputs(*_kernel_inputs(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs))


# The kernel's validators: which inputs they reject, where, and with which message.
RPA_HARNESS_RULES = {
    "head_dim mismatch": Rule(
        "static",
        shared.break_head_dim,
        lambda q_head_dim, kv_head_dim: f"head size mismatch: q has {q_head_dim}, the caches {kv_head_dim}",
    ),
    "heads not divisible": Rule(
        "static",
        shared.break_head_divisibility,
        lambda num_q_heads, num_kv_heads: (
            f"{num_q_heads} query heads cannot be grouped over {num_kv_heads} KV heads"
        ),
    ),
    "sliding_window not positive": Rule(
        "static",
        shared.break_sliding_window,
        lambda value: f"window must be a positive number of keys, got {value}",
    ),
    "soft_cap zero": Rule(
        "static", shared.break_soft_cap, lambda value: f"logit_cap must be non-zero, got {value}"
    ),
    "num_seqs over max_num_seqs": Rule(
        "dynamic",
        shared.break_num_seqs_over_max,
        lambda num_seqs, max_num_seqs: f"num_seqs={num_seqs} exceeds the {max_num_seqs} sequence slots",
    ),
    "too many q tokens": Rule(
        "dynamic",
        shared.break_too_many_tokens,
        lambda total, max_num_batched_tokens: (
            f"the sequences hold {total} query tokens, q has room for {max_num_batched_tokens}"
        ),
    ),
    "decreasing cu_q_lens": Rule(
        "dynamic",
        shared.break_cu_q_lens_order,
        lambda q_len, kv_len, seq: f"cu_q_lens decreases at sequence {seq}",
    ),
    "q_len over kv_len": Rule(
        "dynamic",
        shared.break_q_len_over_kv_len,
        lambda q_len, kv_len, seq: f"sequence {seq}: {q_len} queries but only {kv_len} keys",
    ),
    "too few pages per sequence": Rule(
        "dynamic",
        shared.break_page_capacity_live,
        lambda pages, pages_per_seq, seq, kv_len, page_size: (
            f"sequence {seq}: kv_len {kv_len} needs {pages} pages, the page list gives it {pages_per_seq}"
        ),
    ),
    "page index out of range": Rule(
        "dynamic",
        shared.break_page_index,
        lambda seq, page, value, total_num_pages, kv_len, page_size: (
            f"sequence {seq}'s page {page} is {value}, outside the cache's {total_num_pages} pages"
        ),
    ),
}
