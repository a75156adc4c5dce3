"""The rule table of tpu-inference's head_dim-64 kernel: v3's table (``tpu_inference.rules``) with this
kernel's differences, in its validators' order.

Broken through the hd64 target's upstream-style interface, as v3's are through v3's. Its own: the sink's
length (one logit per q head), head_dim 64, and the block options checked as upstream names them
(``num_kv_pages_per_block=0 must be positive.``, the KV block first) instead of v3's block-size tuples.
"""

import dataclasses

from rpa_harness.strategies import violations as shared
from rpa_harness.strategies.violations import Rule
from rpa_harness.targets.tpu_inference import rules as family_rules
from rpa_harness.targets.tpu_inference_v3_hd64 import messages

WIDER_HEAD_DIM = 128


@shared.variants(2)
def _break_sink_length(arrays, options, case, param):
    """One sink logit more than q heads, or one fewer."""
    length = case.num_q_heads + 1 if param % 2 or case.num_q_heads == 1 else case.num_q_heads - 1
    options["attention_sink"] = (0.0,) * length
    return dict(length=length, num_q_heads=case.num_q_heads)


def _break_head_dim_64(arrays, options, case, param):
    """q and the cache with head_dim 128: consistent, and not the kernel's."""
    arrays.update(dataclasses.replace(case, head_dim=WIDER_HEAD_DIM).arrays())
    return dict(head_dim=WIDER_HEAD_DIM)


_OWN = {
    "attention_sink length": Rule("static", _break_sink_length, messages.attention_sink_length_message),
    "head_dim not 64": Rule("static", _break_head_dim_64, messages.head_dim_not_64_message),
    **family_rules.UPSTREAM_BLOCK_OPTION_RULES,
}
# The kernel's order: after v3's head_dim mismatch come the sink's length and head_dim 64; the KV block is
# checked before the query block.
_ORDER = (
    "k and v shapes differ", "head_dim mismatch", "attention_sink length", "head_dim not 64",
    "heads not divisible", "index dtype", "kv_lens shape", "cu_q_lens shape",
    "page_size not a multiple of the KV packing", "sliding_window not positive", "soft_cap zero",
    "chunk_prefill_size not positive", "num_kv_pages_per_block not positive", "num_queries_per_block not positive",
    "vmem_limit_bytes not positive", "negative num_seqs", "num_seqs over max_num_seqs", "too many q tokens",
    "q_len over kv_len", "q_len zero", "decreasing cu_q_lens", "too few pages per sequence",
    "page index out of range",
)  # fmt: skip
RULES = family_rules.in_order(_ORDER, _OWN)
