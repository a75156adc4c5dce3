"""The coverage labels a case carries in the run log and in Hypothesis' statistics."""

from hypothesis import event

from rpa_harness.spec.interface import (
    DEFAULT_MASK_VALUE,
)
from rpa_harness.strategies.buckets import LONG_BUCKET, PRODUCTION_BUCKET, LongCorner, is_packed
from rpa_harness.strategies.case import Case


def coverage_labels(case: Case) -> list[str]:
    """What a case exercises, as labels for ``--hypothesis-show-statistics``."""
    q, kv = case.q_lens, case.kv_lens
    live = [(a, b) for a, b in zip(q, kv, strict=True) if a > 0]
    decode = [a == 1 for a, _ in live]
    labels = [
        "batch: empty"
        if not live
        else "batch: decode"
        if all(decode)
        else "batch: prefill"
        if not any(decode)
        else "batch: mixed"
    ]
    if any(b % case.page_size for b in kv):
        labels.append("partial last page")
    block_tokens = (case.num_kv_pages_per_block or 1) * case.page_size
    if any(b > block_tokens for b in kv):
        labels.append("multi-block sequence")
    if case.num_queries_per_block and any(a > case.num_queries_per_block for a in q):
        labels.append("sequence spans query blocks")
    if case.num_kv_pages_per_block is None and case.num_queries_per_block is None:
        labels.append("block sizes: the kernel's defaults")
    if case.sliding_window is not None and any(b > case.sliding_window for b in kv):
        labels.append("window active")
    if case.soft_cap is not None:
        labels.append("soft cap")
    if case.kv_dtype.startswith("float8"):
        labels.append("fp8 KV" + (" scaled" if case.k_scale or case.v_scale else ""))
    if case.q_scale is not None:
        labels.append("q_scale")
    if case.attention_sink is not None:
        labels.append("attention sink")
    if case.value_head_dim is not None:
        labels.append(f"latent attention: value {case.value_head_dim} of key {case.head_dim} dims")
    if not case.use_causal_mask:
        labels.append("non-causal" + (", KV mask skipped" if case.skip_kv_mask else ""))
    if case.out_dtype is not None:
        labels.append(f"out_dtype {case.out_dtype} for {case.q_dtype} queries")
    if case.chunk_prefill_size is not None:
        decodes = next((i for i, q_len in enumerate(q) if q_len != 1), len(q))
        chunked = decodes < len(q) and q[decodes] == case.chunk_prefill_size
        labels.append("chunked prefill" + ("" if chunked else ": no sequence of its size"))
    if not case.update_kv_cache:
        labels.append("cache read, not written")
    if case.mask_value not in (None, DEFAULT_MASK_VALUE):
        labels.append(f"mask_value {case.mask_value_meaning}")
    labels.append(f"GQA ratio {case.num_q_heads // case.num_kv_heads}")
    if case.num_seqs < case.max_num_seqs:
        labels.append("padding slots")
    if case.num_tokens < case.max_num_batched_tokens:
        labels.append("padding rows")
    labels.append(f"values: {case.values}")
    production = PRODUCTION_BUCKET
    if case.max_num_seqs in production.seq_slots and case.max_num_batched_tokens in production.token_budgets:
        labels.append(
            f"production shape: T={case.max_num_batched_tokens} seqs={case.num_seqs}/{case.max_num_seqs} "
            f"rows={case.num_tokens} heads={case.num_q_heads}/{case.num_kv_heads} d={case.head_dim} "
            f"page={case.page_size} pages={sum(-(-kv // case.page_size) for kv in case.kv_lens)}/"
            f"{case.total_num_pages} max kv_len={max(case.kv_lens, default=0)} {case.q_dtype}/{case.kv_dtype}"
        )
    if (corner := long_corner_of(case)) is not None:
        labels.append(f"long corner: {corner.label}")
    for boundary in LONG_BUCKET.boundaries:
        if any(kv > boundary for kv in case.kv_lens):
            labels.append(f"context past 2^{boundary.bit_length() - 1} keys")
        if any(kv - q < boundary < kv for q, kv in zip(q, kv, strict=True)):
            labels.append(f"query positions across 2^{boundary.bit_length() - 1}")
    return labels


def long_corner_of(case: Case) -> LongCorner | None:
    """The long-bucket corner ``case`` lies in (its longest context within two keys up to a boundary, or
    past it by at most the token budget plus one), or None."""
    longest = max(case.kv_lens, default=0)
    for boundary in LONG_BUCKET.boundaries:
        if boundary - 2 <= longest <= boundary + case.max_num_batched_tokens + 1:
            own = case.num_kv_pages_per_block is None and case.num_queries_per_block is None
            return LongCorner(is_packed(case.q_dtype), boundary, longest > boundary, own)
    return None


def label_coverage(case: Case) -> None:
    for label in coverage_labels(case):
        event(label)
