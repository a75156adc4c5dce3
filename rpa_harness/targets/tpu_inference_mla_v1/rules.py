"""MLA v1's rule table: v3's rules where MLA v1's validators share v3's checks and messages (its dynamic
checks are v3's, word for word), its own where they differ (the query's and the key's widths, block sizes
that must be given and positive). Rules about several KV heads and K/V shapes have no MLA counterpart: a
latent cache has one KV head and no separate value."""

from rpa_harness.strategies import violations as shared
from rpa_harness.strategies.violations import Rule
from rpa_harness.targets.tpu_inference import rules as family_rules
from rpa_harness.targets.tpu_inference_mla_v1.adapter import latent_dim


def head_dim_mismatch_message(q_head_dim, kv_head_dim) -> str:
    """The query is split where the key is (at lkv): whichever half then disagrees is reported."""
    lkv = latent_dim(kv_head_dim)
    if q_head_dim < lkv:
        return f"Expected ql_nope.shape[2]={q_head_dim} to be equal to new_kv_c.shape[1]={lkv}"
    return f"Expected q_pe.shape[2]={q_head_dim - lkv} to be equal to new_k_pe.shape[1]={kv_head_dim - lkv}"


_OWN: dict[str, Rule] = {
    "head_dim mismatch": Rule("static", shared.break_head_dim, head_dim_mismatch_message),
    **family_rules.UPSTREAM_BLOCK_OPTION_RULES,
}
# In MLA v1's order: its own rules where they differ from v3's, v3's rule by that name elsewhere.
_ORDER = (
    "head_dim mismatch", "index dtype", "kv_lens shape", "cu_q_lens shape", "sliding_window not positive",
    "soft_cap zero", "chunk_prefill_size not positive", "num_kv_pages_per_block not positive",
    "num_queries_per_block not positive", "vmem_limit_bytes not positive", "negative num_seqs",
    "num_seqs over max_num_seqs", "too many q tokens", "q_len over kv_len", "q_len zero",
    "decreasing cu_q_lens", "too few pages per sequence", "page index out of range",
)  # fmt: skip

RULES = family_rules.in_order(_ORDER, _OWN)
