"""The seeded bugs: one realistic mistake each, written as a patch of our kernel's or the validators' source.

A patch names the file, the exact source text it replaces and the replacement. The text must occur
exactly once in the current source, so an edit of the kernel that moves or rewrites a patched line makes
the catalogue fail loudly (``tests/meta/test_mutants.py``) instead of silently testing an unchanged kernel.
"""

import dataclasses

KERNEL_FILE = "kernel/pallas_rpa.py"
VALIDATION_FILE = "spec/interface.py"


@dataclasses.dataclass(frozen=True)
class Mutant:
    name: str  # a Python identifier: the mutant runs as --rpa-target=mutants.NAME
    description: str
    file: str  # KERNEL_FILE or VALIDATION_FILE
    original: str  # exact source text, present exactly once in ``file``
    replacement: str
    also: tuple[tuple[str, str], ...] = ()  # further (original, replacement) patches of ``file``: more bugs

    @property
    def patches(self) -> tuple[tuple[str, str], ...]:
        return ((self.original, self.replacement), *self.also)

    @property
    def numeric(self) -> bool:
        """True when the bug is in the kernel's computation, False when it is in input validation."""
        return self.file == KERNEL_FILE


MUTANTS = (
    # Masking.
    Mutant(
        "causal_off_by_one",
        "causal mask also hides the diagonal: a query does not attend to its own key",
        KERNEL_FILE,
        "masked = key_pos > query_pos\n",
        "masked = key_pos >= query_pos\n",
    ),
    Mutant(
        "context_offset_ignored",
        "query positions count from 0 instead of kv_len - q_len: cached context is masked as future",
        KERNEL_FILE,
        "query_pos = kv_len - (q_end - q_start) + (row_token - q_start)",
        "query_pos = row_token - q_start",
    ),
    Mutant(
        "sliding_window_off_by_one",
        "sliding window keeps one key too many (> instead of >= at the window's far edge)",
        KERNEL_FILE,
        "query_pos - sliding_window >= key_pos",
        "query_pos - sliding_window > key_pos",
    ),
    Mutant(
        "soft_cap_after_mask",
        "soft cap applied after the mask: masked logits become -soft_cap and get probability",
        KERNEL_FILE,
        "            if soft_cap is not None:\n"
        "                logits = soft_cap * jnp.tanh(logits / soft_cap)\n"
        "            logits = jnp.where(key_valid, logits + mask_bias, -jnp.inf)\n",
        "            logits = jnp.where(key_valid, logits + mask_bias, -jnp.inf)\n"
        "            if soft_cap is not None:\n"
        "                logits = soft_cap * jnp.tanh(logits / soft_cap)\n",
    ),
    # Head and K/V layout.
    Mutant(
        "gqa_head_mapping",
        "query head i is paired with KV head i % num_kv_heads (repeat instead of repeat_interleave)",
        KERNEL_FILE,
        "q_ref[:, pl.ds(h * group, group), :]",
        "q_ref[:, pl.ds(h, group, stride=kv_heads_per_block), :]",
    ),
    Mutant(
        "kv_deinterleave_swapped",
        "K and V taken from the wrong halves of the interleaved combined-head axis",
        KERNEL_FILE,
        "            k = kv[:, 2 * h, :]\n            v = kv[:, 2 * h + 1, :]\n",
        "            k = kv[:, 2 * h + 1, :]\n            v = kv[:, 2 * h, :]\n",
    ),
    # Pages and padding.
    Mutant(
        "last_partial_page_dropped",
        "resident pages counted with floor division: the keys of a partial last page are never read",
        KERNEL_FILE,
        "num_pages = jnp.clip((kv_len + page_size - 1) // page_size, 0, pages_per_seq)",
        "num_pages = jnp.clip(kv_len // page_size, 0, pages_per_seq)",
    ),
    Mutant(
        "padded_tail_nan_leak",
        "V of keys past kv_len is not zeroed: NaN in a page tail leaks through 0 * NaN",
        KERNEL_FILE,
        "            v = jnp.where(key_valid_col, v, 0.0)\n",
        "",
    ),
    Mutant(
        "padded_seq_slots_processed",
        "sequences are visited up to max_num_seqs instead of num_seqs: padding slots' metadata is used",
        KERNEL_FILE,
        "return jnp.logical_and(seq < num_seqs, layout.q_start < block_end)",
        "return jnp.logical_and(seq < max_num_seqs, layout.q_start < block_end)",
    ),
    # Scales.
    Mutant(
        "sm_scale_ignored",
        "logits are never multiplied by sm_scale",
        KERNEL_FILE,
        "            logits = logits * sm_scale\n",
        "",
    ),
    Mutant(
        "k_scale_ignored",
        "quantised K is cast to q's dtype without multiplying by k_scale",
        KERNEL_FILE,
        "k = (k * k_scale).astype(q_ref.dtype)",
        "k = k.astype(q_ref.dtype)",
    ),
    Mutant(
        "v_scale_uses_k_scale",
        "copy-paste: V is dequantised with k_scale instead of v_scale",
        KERNEL_FILE,
        "v = (v * v_scale).astype(q_ref.dtype)",
        "v = (v * (1.0 if k_scale is None else k_scale)).astype(q_ref.dtype)",
    ),
    # Blocking.
    Mutant(
        "kv_block_count_floor",
        "KV blocks per sequence counted with floor division: a partial last KV block is skipped",
        KERNEL_FILE,
        "num_kv_blocks = (layout.num_pages + kv_pages_per_block - 1) // kv_pages_per_block",
        "num_kv_blocks = layout.num_pages // kv_pages_per_block",
    ),
    Mutant(
        "query_block_straddle",
        "a query block visits only sequences that start in it: the tail of a straddling sequence is lost",
        KERNEL_FILE,
        "rows_overlap = jnp.maximum(q_start, block_start) < jnp.minimum(q_end, block_end)",
        "rows_overlap = jnp.logical_and(q_start >= block_start, q_start < block_end)",
    ),
    Mutant(
        "dma_wrong_slot_computed",
        "double buffering: the block is computed from the slot being prefetched into, not the one waited on",
        KERNEL_FILE,
        "        attend(layout, kv_block, slot)\n",
        "        attend(layout, kv_block, next_slot)\n",
    ),
    Mutant(
        "dma_single_slot",
        "double buffering: the next block is prefetched into the slot still being computed on",
        KERNEL_FILE,
        "next_slot = 1 - slot",
        "next_slot = slot",
    ),
    Mutant(
        "dma_wait_one_page_short",
        "the block's DMA wait covers one page fewer than were copied: the last page is read before it lands",
        KERNEL_FILE,
        "        num_pages = pages_in_block(layout, kv_block)\n        for bit in",
        "        num_pages = pages_in_block(layout, kv_block) - 1\n        for bit in",
    ),
    Mutant(
        "dma_wait_one_page_long",
        "the block's DMA wait covers one page more than were copied: on a TPU the wait never returns",
        KERNEL_FILE,
        "        num_pages = pages_in_block(layout, kv_block)\n        for bit in",
        "        num_pages = pages_in_block(layout, kv_block) + 1\n        for bit in",
    ),
    # Softmax numerics.
    Mutant(
        "acc_not_rescaled",
        "online softmax: the running output is not rescaled when the running max grows",
        KERNEL_FILE,
        "acc_new = rescale * acc_all[h] + jnp.dot(",
        "acc_new = acc_all[h] + jnp.dot(",
    ),
    Mutant(
        "softmax_in_bfloat16",
        "probabilities are rounded to bfloat16 before the normaliser and P @ V",
        KERNEL_FILE,
        "probs = jnp.exp(logits - m_new)",
        "probs = jnp.exp(logits - m_new).astype(jnp.bfloat16).astype(jnp.float32)",
    ),
    Mutant(
        "softmax_in_q_dtype",
        "softmax in q's dtype: the exponent's argument and the weights rounded to it (bf16 for bf16 q)",
        KERNEL_FILE,
        "probs = jnp.exp(logits - m_new)",
        "probs = jnp.exp((logits - m_new).astype(q_ref.dtype)).astype(jnp.float32)",
    ),
    Mutant(
        "pv_in_bfloat16",
        "P @ V with bfloat16 operands and a bfloat16 result per KV block, also for a float32 V",
        KERNEL_FILE,
        "jnp.dot(\n                probs, v, precision=_product_precision(v.dtype), "
        "preferred_element_type=jnp.float32\n            )",
        "jnp.dot(\n                probs.astype(jnp.bfloat16), v.astype(jnp.bfloat16), preferred_element_type=jnp.bfloat16\n"
        "            ).astype(jnp.float32)",
    ),
    Mutant(
        "no_max_subtraction",
        "softmax without max subtraction: exp overflows for logits above ~88",
        KERNEL_FILE,
        "m_new = jnp.maximum(m_prev, jnp.max(logits, axis=1, keepdims=True))",
        "m_new = jnp.zeros_like(m_prev)",
    ),
    Mutant(
        "logits_in_q_dtype",
        "logits rounded to q's dtype (bfloat16) before the softmax instead of kept in float32",
        KERNEL_FILE,
        "            logits = logits * sm_scale\n",
        "            logits = (logits * sm_scale).astype(q_ref.dtype).astype(jnp.float32)\n",
    ),
    # Validation.
    Mutant(
        "num_seqs_limit_off_by_one",
        "num_seqs may exceed max_num_seqs by one",
        VALIDATION_FILE,
        "if n > max_num_seqs:",
        "if n > max_num_seqs + 1:",
    ),
    Mutant(
        "vmem_limit_zero_accepted",
        "vmem_limit_bytes=0 passes the positivity check (< 0 instead of <= 0)",
        VALIDATION_FILE,
        "if vmem_limit_bytes is not None and vmem_limit_bytes <= 0:",
        "if vmem_limit_bytes is not None and vmem_limit_bytes < 0:",
    ),
    Mutant(
        "q_len_over_kv_len_assert",
        "q_len > kv_len raises a bare AssertionError instead of the ValueError",
        VALIDATION_FILE,
        "raise ValueError(q_len_over_kv_len_message(",
        "raise AssertionError(q_len_over_kv_len_message(",
    ),
    Mutant(
        "too_few_pages_floor",
        "page-table capacity checked in whole pages with floor division: a partial extra page passes",
        VALIDATION_FILE,
        "if pages_per_seq * page_size < int(kv_lens_np.max()):",
        "if pages_per_seq < int(kv_lens_np.max()) // page_size:",
    ),
    Mutant(
        "too_many_tokens_reworded",
        "the total-q-tokens message reworded (callers matching upstream's text break)",
        VALIDATION_FILE,
        "must be less or equal to max_num_batched_tokens={max_num_batched_tokens!r}.",
        "must be at most max_num_batched_tokens={max_num_batched_tokens!r}.",
    ),
    Mutant(
        "head_dim_check_missing",
        "the q / K/V head_dim equality check is missing",
        VALIDATION_FILE,
        "    if head_dim_k != head_dim:\n        raise ValueError(head_dim_mismatch_message(head_dim, head_dim_k))\n",
        "",
    ),
    Mutant(
        "sliding_window_zero_accepted",
        "sliding_window=0 passes the positivity check",
        VALIDATION_FILE,
        "if sliding_window is not None and sliding_window <= 0:",
        "if sliding_window is not None and sliding_window < 0:",
    ),
    Mutant(
        "soft_cap_wrong_exception",
        "soft_cap=0.0 raises TypeError instead of ValueError",
        VALIDATION_FILE,
        "raise ValueError(soft_cap_zero_message(soft_cap))",
        "raise TypeError(soft_cap_zero_message(soft_cap))",
    ),
    Mutant(
        "kv_block_upper_bound_exclusive",
        "num_kv_pages_per_block == pages_per_seq is rejected (upper bound made exclusive)",
        VALIDATION_FILE,
        "not 0 < num_kv_pages_per_block <= pages_per_seq",
        "not 0 < num_kv_pages_per_block < pages_per_seq",
    ),
    Mutant(
        "kv_block_one_past_accepted",
        "num_kv_pages_per_block == pages_per_seq + 1 is accepted (the range check is off by one past the end)",
        VALIDATION_FILE,
        "not 0 < num_kv_pages_per_block <= pages_per_seq",
        "not 0 < num_kv_pages_per_block <= pages_per_seq + 1",
    ),
)

# Two bugs in one kernel, for the meta-test that distinct failures are reported apart
# (tests/meta/test_failure_identity.py): one in every single-page sequence (tiny cases), one only for query
# positions past 32,767 (int16 positions: long contexts). Not in MUTANTS: the kill rate counts one bug each.
TWO_BUGS = Mutant(
    "single_page_and_int16_positions",
    "a single-page sequence drops its last key, and query positions wrap in int16 past 32,767",
    KERNEL_FILE,
    "num_valid_keys = jnp.minimum(kv_len, layout.num_pages * page_size) - first_key\n",
    "num_valid_keys = jnp.minimum(kv_len, layout.num_pages * page_size) - first_key - "
    "(layout.num_pages == 1).astype(jnp.int32)\n",
    also=(
        (
            "query_pos = kv_len - (q_end - q_start) + (row_token - q_start)  # [rows, 1]",
            "query_pos = (kv_len - (q_end - q_start) + (row_token - q_start)).astype(jnp.int16).astype(jnp.int32)",
        ),
    ),
)
