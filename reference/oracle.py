"""Float64 NumPy oracle for ragged paged attention, with what the tolerance model needs.

Inputs are upcast exactly (ml_dtypes for bf16 and fp8). The one rounding the specification prescribes is
reproduced: with ``k_scale`` (``v_scale``) the keys (values) are multiplied by the scale in float32 and
rounded to q's dtype before use; with ``q_scale`` (an extension, tpu-inference v3's) q is divided by it in
q's dtype, clipped to the KV dtype's finite range and cast to the KV dtype, and the logits are multiplied
by it. ``mask_value`` is added to a masked logit or replaces it, as ``mask_value_meaning`` says. Everything else (logits, soft cap, mask, softmax, P @ V) is float64, and
the output is not rounded: the tolerance model accounts for the rounding a kernel does.

Only metadata of the first ``num_seqs`` sequences is read, and of those only the pages holding keys below
kv_len, so garbage page indices and NaN in page tails, unused pages or unowned query rows never matter.
"""

import dataclasses

import ml_dtypes
import numpy as np

from rpa_harness.reference.tolerance import key_error_units
from rpa_harness.spec.interface import (
    MASK_REPLACES,
    Options,
    check_extensions,
    static_validate_inputs,
    takes_extended_options,
)

# Upper bound on the elements of one [heads, rows, keys] float64 block.
_MAX_BLOCK_ELEMENTS = 1 << 21


@dataclasses.dataclass(frozen=True)
class OracleResult:
    """The float64 output and, per output element, the quantities the error bound is made of."""

    out: np.ndarray  # float64 [T, num_q_heads, head_dim]; NaN in rows no sequence owns
    out_dtype: np.dtype  # the dtype the specification returns (q's)
    q_dtype: np.dtype
    kv_dtype: np.dtype
    row_sequence: np.ndarray  # int [T]: owning sequence, -1 past cu_q_lens[num_seqs]
    row_token: np.ndarray  # int [T]: index within that sequence's query rows, -1 if unowned
    row_kv_len: np.ndarray  # int [T]: kv_len of the owning sequence, 0 if unowned
    abs_pv: np.ndarray  # float64 [T, H, D]: sum_k p_k |v_k|
    logit_sensitivity: np.ndarray  # float64 [T, H, D]: bound on sum_k p_k eps_k |v_k - o| (units of u32)
    flushable_pv: (
        np.ndarray
    )  # float64 [T, H, D]: sum of p_k |v_k| over keys whose weight is below f32's normal range
    # What the precision contracts other than float32 need (``rpa_harness.reference.tolerance.CONTRACTS``):
    page_size: int
    key_dtype: np.dtype  # K as the kernel multiplies it: q's dtype when k_scale is set, else the KV dtype
    value_dtype: np.dtype  # V likewise (v_scale)
    dot_sensitivity: np.ndarray  # float64 [T, H, D]: bound on sum_k p_k A_k |v_k - o|
    max_dot_abs: np.ndarray  # float64 [T, H, D]: max of A_k over keys with p_k > 0 (constant along D)
    value_underflow: (
        np.ndarray
    )  # float64 [T, H, D]: sum_k min(p_k, half the value dtype's smallest subnormal) (|v_k| + |o|)

    @property
    def owned_rows(self) -> np.ndarray:
        return self.row_sequence >= 0


def _as_float64(x):
    return np.asarray(x).astype(np.float64)


def _scaled(x, scale, q_dtype):
    """K or V as the specification reads them: float32 times the scale, rounded to q's dtype."""
    if scale is None:
        return _as_float64(x)
    return _as_float64((np.asarray(x).astype(np.float32) * np.float32(scale)).astype(q_dtype))


def quantised_query(q, q_scale, kv_dtype) -> np.ndarray:
    """q as the logits use it (float64): itself, or with ``q_scale`` divided by the scale in q's dtype (the
    scale rounded to q's dtype first, the quotient computed in float32 and rounded to q's dtype, as jax
    does for a narrow float and a Python scalar), clipped to the KV dtype's finite range, cast to it."""
    q = np.asarray(q)
    if q_scale is None:
        return _as_float64(q)
    scale = np.float32(np.asarray(q_scale, q.dtype))
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        quotient = (q.astype(np.float32) / scale).astype(q.dtype).astype(np.float64)
    info = ml_dtypes.finfo(kv_dtype)
    return np.clip(quotient, float(info.min), float(info.max)).astype(kv_dtype).astype(np.float64)


def _value_dtype(kv_dtype, scale, q_dtype) -> np.dtype:
    return np.dtype(q_dtype if scale is not None else kv_dtype)


def _half_smallest_subnormal(dtype) -> float:
    return float(ml_dtypes.finfo(dtype).smallest_subnormal) / 2


def _weighted_deviation(weights, v, o):
    """Bound on sum_k weights_k |v_k - o| (weights >= 0): the smaller of the triangle inequality and
    Cauchy-Schwarz, sqrt(sum w * sum w (v - o)^2)."""
    weight_total = weights.sum(axis=-1, keepdims=True)
    spread = weights @ (v * v) - 2 * o * (weights @ v) + o * o * weight_total
    cauchy_schwarz = np.sqrt(weight_total * np.maximum(spread, 0.0))
    triangle = weights @ np.abs(v) + np.abs(o) * weight_total
    return np.minimum(cauchy_schwarz, triangle)


def _check_live_metadata(num_tokens, page_size, pages_per_seq, total_num_pages, kv_lens, cu_q_lens, pages, n):
    """Raises ValueError if the live metadata would make the oracle read outside its inputs."""
    if not 0 <= n <= len(kv_lens):
        raise ValueError(f"num_seqs[0]={n} must be in [0, {len(kv_lens)}] (max_num_seqs).")
    if cu_q_lens[0] < 0 or cu_q_lens[n] > num_tokens:
        raise ValueError(
            f"cu_q_lens[0]={cu_q_lens[0]} and cu_q_lens[num_seqs]={cu_q_lens[n]} must lie in [0, {num_tokens}] "
            "(max_num_batched_tokens)."
        )
    for i in range(n):
        q_len, kv_len = cu_q_lens[i + 1] - cu_q_lens[i], kv_lens[i]
        if not 0 <= q_len <= kv_len <= pages_per_seq * page_size:
            raise ValueError(
                f"sequence {i}: need 0 <= q_len <= kv_len <= pages_per_seq * page_size, got q_len={q_len}, "
                f"kv_len={kv_len}, capacity {pages_per_seq * page_size}."
            )
        used = pages[i, : -(-kv_len // page_size)]
        if used.size and not (0 <= used.min() and used.max() < total_num_pages):
            raise ValueError(
                f"sequence {i}: page_indices[{i}, :{used.size}]={used.tolist()} must lie in "
                f"[0, {total_num_pages}) (total_num_pages)."
            )


@takes_extended_options
def oracle(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, options: Options) -> OracleResult:
    """Float64 ragged paged attention; the kernel's signature plus the extension options (block and VMEM
    options are ignored)."""
    static_validate_inputs(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options.keywords())
    check_extensions(options)
    options = options.semantics()
    sm_scale, sliding_window, soft_cap = options.sm_scale, options.sliding_window, options.soft_cap
    k_scale, v_scale, q_scale = options.k_scale, options.v_scale, options.q_scale
    mask_value = options.mask_value_for(np.asarray(q).dtype)
    replaces = options.mask_value_meaning == MASK_REPLACES
    logit_scale = sm_scale * (1.0 if q_scale is None else q_scale)
    q = np.asarray(q)
    q_used = quantised_query(q, q_scale, np.asarray(kv_pages).dtype)
    kv_pages = np.asarray(kv_pages)
    kv_lens = np.asarray(kv_lens).astype(np.int64)
    cu_q_lens = np.asarray(cu_q_lens).astype(np.int64)
    page_indices = np.asarray(page_indices).astype(np.int64)
    n = int(np.asarray(num_seqs)[0])
    num_tokens, num_q_heads, head_dim = q.shape
    total_num_pages, page_size, num_combined_kv_heads, _ = kv_pages.shape
    pages_per_seq = page_indices.shape[1]
    num_kv_heads = num_combined_kv_heads // 2
    group = num_q_heads // num_kv_heads
    _check_live_metadata(
        num_tokens, page_size, pages_per_seq, total_num_pages, kv_lens, cu_q_lens, page_indices, n
    )

    shape = (num_tokens, num_q_heads, head_dim)
    out = np.full(shape, np.nan)
    abs_pv = np.zeros(shape)
    flushable_pv = np.zeros(shape)
    sensitivity = np.zeros(shape)
    dot_sensitivity = np.zeros(shape)
    max_dot_abs = np.zeros(shape)
    value_underflow = np.zeros(shape)
    value_dtype = _value_dtype(kv_pages.dtype, v_scale, q.dtype)
    value_subnormal = _half_smallest_subnormal(value_dtype)
    row_sequence = np.full(num_tokens, -1)
    row_token = np.full(num_tokens, -1)
    row_kv_len = np.zeros(num_tokens, np.int64)

    for i in range(n):
        q_start, q_end, kv_len = int(cu_q_lens[i]), int(cu_q_lens[i + 1]), int(kv_lens[i])
        q_len = q_end - q_start
        row_sequence[q_start:q_end] = i
        row_token[q_start:q_end] = np.arange(q_len)
        row_kv_len[q_start:q_end] = kv_len
        if q_len == 0:
            continue
        pages = page_indices[i, : -(-kv_len // page_size)]
        kv = kv_pages[pages].reshape(-1, num_combined_kv_heads, head_dim)[:kv_len]
        # [kv heads, keys, dim]
        k = _scaled(kv[:, 0::2], k_scale, q.dtype).transpose(1, 0, 2)
        v = _scaled(kv[:, 1::2], v_scale, q.dtype).transpose(1, 0, 2)
        keys = np.arange(kv_len)
        block = max(1, _MAX_BLOCK_ELEMENTS // (num_q_heads * kv_len))
        for first in range(0, q_len, block):
            last = min(q_len, first + block)
            rows = slice(q_start + first, q_start + last)
            # [kv heads, group * rows, dim], rows fastest within a group.
            q_block = q_used[rows].reshape(last - first, num_kv_heads, group, head_dim)
            q_block = q_block.transpose(1, 2, 0, 3).reshape(num_kv_heads, group * (last - first), head_dim)
            raw = logit_scale * (q_block @ k.transpose(0, 2, 1))
            dot_abs = abs(logit_scale) * (np.abs(q_block) @ np.abs(k).transpose(0, 2, 1))
            logits = raw if soft_cap is None else soft_cap * np.tanh(raw / soft_cap)
            positions = np.tile(kv_len - q_len + np.arange(first, last), group)[:, None]
            masked = keys[None, :] > positions
            if sliding_window is not None:
                masked |= positions - sliding_window >= keys[None, :]
            if replaces:  # a replaced logit is the constant itself: no product error is carried into it
                logits = np.where(masked, mask_value, logits)
                raw = np.where(masked, 0.0, raw)
                dot_abs = np.where(masked, 0.0, dot_abs)
            else:
                logits = logits + np.where(masked, mask_value, 0.0)
            top = logits.max(axis=-1, keepdims=True)
            weights = np.exp(logits - top)
            probs = weights / weights.sum(axis=-1, keepdims=True)
            o = probs @ v
            with np.errstate(invalid="ignore", over="ignore"):
                eps = key_error_units(dot_abs, raw, logits, top - logits, head_dim)
                weighted = np.where(probs > 0, probs * eps, 0.0)
            live_dot_abs = np.where(probs > 0, dot_abs, 0.0)
            small_probs = np.minimum(probs, value_subnormal)
            to_rows = (num_kv_heads, group, last - first, head_dim)
            for target, value in (
                (out, o),
                (abs_pv, probs @ np.abs(v)),
                (flushable_pv, np.where(weights < 2.0**-125, probs, 0.0) @ np.abs(v)),
                (sensitivity, _weighted_deviation(weighted, v, o)),
                (dot_sensitivity, _weighted_deviation(probs * live_dot_abs, v, o)),
                (max_dot_abs, np.broadcast_to(live_dot_abs.max(axis=-1, keepdims=True), o.shape)),
                (value_underflow, small_probs @ np.abs(v) + np.abs(o) * small_probs.sum(-1, keepdims=True)),
            ):
                target[rows] = (
                    value.reshape(to_rows).transpose(2, 0, 1, 3).reshape(last - first, -1, head_dim)
                )

    return OracleResult(
        out=out,
        out_dtype=q.dtype,
        q_dtype=q.dtype,
        kv_dtype=kv_pages.dtype,
        row_sequence=row_sequence,
        row_token=row_token,
        row_kv_len=row_kv_len,
        abs_pv=abs_pv,
        logit_sensitivity=sensitivity,
        flushable_pv=flushable_pv,
        page_size=page_size,
        key_dtype=_value_dtype(kv_pages.dtype, k_scale, q.dtype),
        value_dtype=value_dtype,
        dot_sensitivity=dot_sensitivity,
        max_dot_abs=max_dot_abs,
        value_underflow=value_underflow,
    )
