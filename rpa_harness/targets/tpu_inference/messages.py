"""tpu-inference RPA v3's validation messages, restated from its source (imports no kernel): the family's,
as the kernels with v3's validators (its forks, batched RPA, MLA v1) word theirs as it does.

Source: ``static_validate_inputs`` and ``dynamic_validate_inputs`` in
``tpu_inference/kernels/ragged_paged_attention/v3/kernel.py`` (PyPI ``tpu-inference`` 0.32.0). v3 renders
its messages with ``f"{x=}"``, so each function here takes the values as v3 has them: shapes as tuples,
dtypes as ``numpy.dtype`` (``dtype('int16')``), metadata entries as jax scalars (``Array(3, dtype=int32)``)
where v3 indexes a jax array, plain ints where it reads a shape. ``rules.RULES`` breaks each rule through
the v3 target's upstream-style interface and expects these messages.

v3's rules differ from upstream's: it requires ``0 < q_len <= kv_len`` for every live sequence, checks
pages only of live sequences, has no upper bound on the KV block size, no rule on ``num_seqs``'s shape
(it takes ``distribution`` instead) and none on the scales' types; its block sizes are checked as the
tuples ``(bq, bkv, bq_chunk, bkv_chunk)`` the v3 target maps the upstream block options to.
"""

import numpy as np

from rpa_harness.spec.interface import JaxInt


def jax_int_vector(values) -> str:
    """A 1-D int32 jax array as ``repr`` shows it: ``Array([ 0,  0, -1], dtype=int32)``."""
    return f"Array({np.array2string(np.asarray(values, np.int32), separator=', ')}, dtype=int32)"


# Static rules (raised while ragged_paged_attention traces), in v3's order.


def kv_shape_mismatch_message(k_shape, v_shape) -> str:
    return f"Expected k.shape={tuple(k_shape)!r} to be equal to v.shape={tuple(v_shape)!r}"


def head_dim_mismatch_message(q_head_dim, k_head_dim) -> str:
    return (
        f"Expected q.shape[2]={q_head_dim} to be equal to k.shape[2]={k_head_dim} and v.shape[2]={k_head_dim}"
    )


def heads_not_divisible_message(num_q_heads, num_kv_heads) -> str:
    return f"Expected actual_num_q_heads={num_q_heads} to be divisible by actual_num_kv_heads={num_kv_heads}."


def index_dtype_message(kv_lens_dtype, page_indices_dtype, cu_q_lens_dtype) -> str:
    dtypes = [np.dtype(d) for d in (kv_lens_dtype, page_indices_dtype, cu_q_lens_dtype, np.int32)]
    return (
        f"Expected int32 dtype for kv_lens.dtype={dtypes[0]!r}, page_indices.dtype={dtypes[1]!r},"
        f" cu_q_lens.dtype={dtypes[2]!r}, distribution.dtype={dtypes[3]!r}"
    )


def page_indices_not_divisible_message(num_page_indices, max_num_seqs) -> str:
    return f"Expected num_page_indices={num_page_indices} to be divisible by max_num_seqs={max_num_seqs}."


def cu_q_lens_shape_message(shape, max_num_seqs) -> str:
    return f"Expected cu_q_lens.shape={tuple(shape)!r} to be ({max_num_seqs + 1},)."


def page_size_packing_message(page_size, kv_packing) -> str:
    return f"page_size={page_size} must be divisible by kv_packing={kv_packing}."


def not_positive_message(name, value) -> str:
    """sliding_window, chunk_prefill_size and vmem_limit_bytes (the same wording as upstream's)."""
    return f"{name}={value!r} must be positive."


def soft_cap_zero_message(soft_cap) -> str:
    return f"soft_cap={soft_cap!r} must not be 0.0."


def query_block_message(prefix, bq_chunk, bq) -> str:
    return f"{prefix} bq_csz={bq_chunk} and bq_sz={bq} must satisfy (0 < bq_csz and bq_sz % bq_csz == 0)."


def kv_block_message(prefix, bkv_chunk, bkv) -> str:
    return (
        f"{prefix} bkv_csz={bkv_chunk} and bkv_sz={bkv} must satisfy (0 < bkv_csz and bkv_sz % bkv_csz == 0)."
    )


# Dynamic rules (dynamic_validate_inputs), in v3's order.


def invalid_distribution_message(distribution) -> str:
    return f"Invalid distribution: distribution={jax_int_vector(distribution)}"


def num_seqs_over_max_message(num_seqs, max_num_seqs) -> str:
    return f"num_seqs={num_seqs} must be <= max_num_seqs={max_num_seqs}"


def too_many_tokens_message(total, max_num_tokens) -> str:
    return f"Total q tokens {total} must be <= max_num_tokens={max_num_tokens}."


def q_len_range_message(q_len, kv_len, seq) -> str:
    return f"Require 0 < q_len={JaxInt(q_len)!r} <= kv_len={JaxInt(kv_len)!r} at sequence {seq}."


def too_few_pages_message(page_cnt, pages_per_seq, seq, kv_len, page_size) -> str:
    return (
        f"Require page_cnt={JaxInt(page_cnt)!r} <= pages_per_seq={pages_per_seq} at sequence {seq} where"
        f" kv_len={JaxInt(kv_len)!r} and page_size={page_size}."
    )


def page_out_of_range_message(page_idx, total_num_pages, seq, kv_len, page_size) -> str:
    return (
        f"Require 0 <= page_idx={JaxInt(page_idx)!r} < total_num_pages={total_num_pages} at sequence"
        f" {seq} where kv_len={JaxInt(kv_len)!r} and page_size={page_size}."
    )


def skip_kv_mask_causal_message() -> str:
    return "Can not skip kv mask when using causal mask."
