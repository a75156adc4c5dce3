"""The rule table of v3 as tpu-inference 0.11.1 to 0.13.x ship it: v3's table (``rules.RULES``) with the
early validators' differences, in their order.

Their ``static_validate_inputs`` and ``dynamic_validate_inputs`` word every message as 0.18.0 on does but
for the block options, which they check as upstream names them (``num_kv_pages_per_block=-1 must be
positive.``, the KV block first) instead of v3's block-size tuples, and they have no ``skip_kv_mask`` (so no
rule on it). Broken through the v3 target's upstream-style interface, as v3's rules are.
"""

from rpa_harness.targets.tpu_inference import rules as family_rules

_ORDER = (
    "k and v shapes differ", "head_dim mismatch", "heads not divisible", "index dtype", "kv_lens shape",
    "cu_q_lens shape", "page_size not a multiple of the KV packing", "sliding_window not positive",
    "soft_cap zero", "chunk_prefill_size not positive", "num_kv_pages_per_block not positive",
    "num_queries_per_block not positive", "vmem_limit_bytes not positive", "negative num_seqs",
    "num_seqs over max_num_seqs", "too many q tokens", "q_len over kv_len", "q_len zero", "decreasing cu_q_lens",
    "too few pages per sequence", "page index out of range",
)  # fmt: skip
RULES = family_rules.in_order(_ORDER, family_rules.UPSTREAM_BLOCK_OPTION_RULES)
