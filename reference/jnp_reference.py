"""Ragged paged attention in plain ``jax.numpy``: the readable statement of the semantics.

Written from the specification, not from upstream's code. It is jitted with the options static and the
metadata traced, so it compiles once per static shape and option set, whatever the ragged layout. Memory
stays bounded: a ``fori_loop`` runs over the live sequences, gathers one sequence's keys and values at a
time, and an inner loop walks its query rows in fixed-size blocks; the largest temporary is the
``[rows, heads, keys]`` logit block.

The dtype path is the specification's: K (resp. V) is upcast to float32, multiplied by ``k_scale`` (resp.
``v_scale``) and rounded to q's dtype when a scale is given; logits, softmax and the P @ V accumulation are
float32 (inputs are upcast exactly, probabilities are never rounded); the output is cast to q's dtype.
With ``q_scale`` (an extension: a quantised query) q is divided by it in q's dtype, clipped to the KV
dtype's range and cast to the KV dtype, and the logits are multiplied by it; ``mask_value_meaning`` says
whether a masked logit gets ``mask_value`` added or is replaced by it; an ``attention_sink`` logit joins
its head's softmax denominator with no value. Keys at positions >= kv_len do not exist: they are zeroed before any product (so NaN poison in page tails
cannot leak) and take no part in the softmax. Rows past ``cu_q_lens[num_seqs]`` come out as zeros.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax

from rpa_harness.spec.interface import (
    MASK_REPLACES,
    Options,
    check_extensions,
    static_validate_inputs,
    takes_extended_options,
)

# Upper bound on the elements of one float32 logit block; the query block shrinks to stay under it.
_MAX_LOGIT_BLOCK_ELEMENTS = 1 << 22
_MAX_QUERY_BLOCK = 128


def _query_block_rows(max_num_batched_tokens, max_num_seqs, num_q_heads, max_kv_len):
    """Rows per query block: about the mean q_len (so decode rows do not pay for a long block), capped by
    memory. Every sequence wastes less than one block, so the work is at most twice the live rows."""
    rows = max(1, min(_MAX_QUERY_BLOCK, max_num_batched_tokens // max(1, max_num_seqs)))
    rows = min(rows, max(1, _MAX_LOGIT_BLOCK_ELEMENTS // (num_q_heads * max_kv_len)))
    return 1 << (rows.bit_length() - 1)


def _quantised_query(q, q_scale, kv_dtype):
    """q as the logits use it: divided by ``q_scale`` in q's dtype, clipped to the KV dtype's range, cast."""
    if q_scale is None:
        return q
    info = jnp.finfo(kv_dtype)
    return jnp.clip(q / q_scale, float(info.min), float(info.max)).astype(kv_dtype)


def _scaled(x, scale, q_dtype):
    """K or V as the specification reads it: scaled in float32 and rounded to q's dtype, if a scale is set."""
    if scale is None:
        return x
    return (x.astype(jnp.float32) * scale).astype(q_dtype)


@functools.partial(jax.jit, static_argnames=("options",))
def _ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, options: Options):
    """``options`` is ``Options.semantics()``: one compilation per shape and meaning, whatever the block sizes."""
    sm_scale, sliding_window, soft_cap = options.sm_scale, options.sliding_window, options.soft_cap
    k_scale, v_scale, q_scale = options.k_scale, options.v_scale, options.q_scale
    mask_value = options.mask_value_for(q.dtype)
    replaces = options.mask_value_meaning == MASK_REPLACES
    logit_scale = sm_scale * (1.0 if q_scale is None else q_scale)
    num_tokens, num_q_heads, head_dim = q.shape
    total_num_pages, page_size, num_combined_kv_heads, _ = kv_pages.shape
    max_num_seqs, pages_per_seq = page_indices.shape
    num_kv_heads = num_combined_kv_heads // 2
    group = num_q_heads // num_kv_heads
    sinks = None
    if options.attention_sink is not None:  # [kv heads, group, 1], the logits' head layout
        sinks = jnp.asarray(options.attention_sink, jnp.float32).reshape(num_kv_heads, group, 1)
    max_kv_len = pages_per_seq * page_size
    block = _query_block_rows(num_tokens, max_num_seqs, num_q_heads, max_kv_len)

    # Padding by one block lets every block be a full-size dynamic slice that is never shifted back.
    q_used = _quantised_query(q, q_scale, kv_pages.dtype)
    q_padded = jnp.concatenate([q_used, jnp.zeros((block, num_q_heads, head_dim), q_used.dtype)])
    out = jnp.zeros((num_tokens + block, num_q_heads, head_dim), jnp.float32)
    key_ids = jnp.arange(max_kv_len, dtype=jnp.int32)

    def attend_sequence(seq, out):
        q_start = cu_q_lens[seq]
        q_end = cu_q_lens[seq + 1]
        q_len = q_end - q_start
        kv_len = jnp.clip(kv_lens[seq], 0, max_kv_len)
        key_valid = key_ids < kv_len
        # Only the pages holding keys < kv_len are read; any other entry may be garbage.
        pages_needed = (kv_len + page_size - 1) // page_size
        pages = jnp.where(
            jnp.arange(pages_per_seq) < pages_needed, jnp.clip(page_indices[seq], 0, total_num_pages - 1), 0
        )
        kv = kv_pages[pages].reshape(max_kv_len, num_combined_kv_heads, head_dim)
        k = _scaled(kv[:, 0::2], k_scale, q.dtype).astype(jnp.float32)
        v = _scaled(kv[:, 1::2], v_scale, q.dtype).astype(jnp.float32)
        k = jnp.where(key_valid[:, None, None], k, 0.0)
        v = jnp.where(key_valid[:, None, None], v, 0.0)

        def attend_block(block_idx, out):
            first_row = q_start + block_idx * block
            rows = lax.dynamic_slice_in_dim(q_padded, first_row, block).astype(jnp.float32)
            rows = rows.reshape(block, num_kv_heads, group, head_dim)
            logits = jnp.einsum("bhgd,khd->bhgk", rows, k, precision=lax.Precision.HIGHEST) * logit_scale
            if soft_cap is not None:
                logits = soft_cap * jnp.tanh(logits / soft_cap)
            positions = kv_len - q_len + block_idx * block + jnp.arange(block, dtype=jnp.int32)
            masked = (key_ids[None, :] > positions[:, None]) & options.use_causal_mask
            if sliding_window is not None:
                masked |= positions[:, None] - sliding_window >= key_ids[None, :]
            if replaces:
                logits = jnp.where(masked[:, None, None, :], mask_value, logits)
            else:
                logits = logits + jnp.where(masked, mask_value, 0.0)[:, None, None, :]
            logits = jnp.where(key_valid, logits, -jnp.inf)
            top = jnp.max(logits, axis=-1, keepdims=True)
            if sinks is not None:
                top = jnp.maximum(top, sinks)
            weights = jnp.exp(logits - top)
            denominator = jnp.sum(weights, axis=-1, keepdims=True)
            if sinks is not None:
                denominator = denominator + jnp.exp(sinks - top)
            probs = weights / denominator
            rows_out = jnp.einsum("bhgk,khd->bhgd", probs, v, precision=lax.Precision.HIGHEST)
            rows_out = rows_out.reshape(block, num_q_heads, head_dim)
            row_valid = first_row + jnp.arange(block) < q_end
            previous = lax.dynamic_slice_in_dim(out, first_row, block)
            return lax.dynamic_update_slice_in_dim(
                out, jnp.where(row_valid[:, None, None], rows_out, previous), first_row, 0
            )

        num_blocks = (jnp.maximum(q_len, 0) + block - 1) // block
        return lax.fori_loop(0, num_blocks, attend_block, out)

    live_seqs = jnp.clip(num_seqs[0], 0, max_num_seqs)
    out = lax.fori_loop(0, live_seqs, attend_sequence, out)
    accumulator_dtype = options.accumulator_dtype(q.dtype)
    if jnp.dtype(accumulator_dtype).itemsize < jnp.dtype(q.dtype).itemsize:
        out = out.astype(accumulator_dtype)  # the result is rounded to it before it is stored in q's
    return out[:num_tokens].astype(q.dtype)


@takes_extended_options
def ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, options: Options):
    """Reference ragged paged attention, upstream's signature and semantics plus the extension options.

    The block-size and VMEM options are validated like the kernel's and otherwise ignored. Inputs are
    assumed dynamically valid (see ``spec.dynamic_validate_inputs``); metadata slots past ``num_seqs`` are
    never read.
    """
    static_validate_inputs(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options.keywords())
    check_extensions(options, q.shape[1])
    return _ragged_paged_attention(
        *(jnp.asarray(x) for x in (q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs)),
        options=options.semantics(),
    )
