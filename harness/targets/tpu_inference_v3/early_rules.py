"""The rule table of v3 as tpu-inference 0.11.1 to 0.13.x ship it: v3's table (``rules.RULES``) with the
early validators' differences, in their order.

Their ``static_validate_inputs`` and ``dynamic_validate_inputs`` word every message as 0.18.0 on does but
for the block options, which they check as upstream names them (``num_kv_pages_per_block=-1 must be
positive.``, the KV block first) instead of v3's block-size tuples, and they have no ``skip_kv_mask`` (so no
rule on it). Broken through the v3 target's upstream-style interface, as v3's rules are.
"""

from rpa_harness.strategies import violations as shared
from rpa_harness.strategies.violations import Rule
from rpa_harness.targets.tpu_inference_v3 import messages
from rpa_harness.targets.tpu_inference_v3.rules import RULES as V3_RULES


def _not_positive(name):
    return lambda value: messages.not_positive_message(name, value)


_OWN = {
    "num_kv_pages_per_block not positive": Rule(
        "static", shared.break_kv_block_sign, _not_positive("num_kv_pages_per_block")
    ),
    "num_queries_per_block not positive": Rule(
        "static", shared.break_query_block, _not_positive("num_queries_per_block")
    ),
}
_ORDER = (
    "k and v shapes differ", "head_dim mismatch", "heads not divisible", "index dtype", "kv_lens shape",
    "cu_q_lens shape", "page_size not a multiple of the KV packing", "sliding_window not positive",
    "soft_cap zero", "chunk_prefill_size not positive", "num_kv_pages_per_block not positive",
    "num_queries_per_block not positive", "vmem_limit_bytes not positive", "negative num_seqs",
    "num_seqs over max_num_seqs", "too many q tokens", "q_len over kv_len", "q_len zero", "decreasing cu_q_lens",
    "too few pages per sequence", "page index out of range",
)  # fmt: skip
RULES: dict[str, Rule] = {name: _OWN.get(name) or V3_RULES[name] for name in _ORDER}
