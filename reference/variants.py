"""Float32 NumPy attention that makes the precision choices the contracts allow, for calibrating them.

``contract_attention(..., precision=...)`` is an online-softmax (flash) attention over KV blocks of whole
pages, written from the specification and vectorised over heads, query rows and the keys of a block. Each
contract in ``precision`` switches on the choice it names, the way production kernels make it:

- probabilities-in-value-dtype: the block's unnormalised weights are rounded to V's dtype for P @ V (the
  normaliser is summed from the float32 weights);
- probabilities-in-cache-dtype: the same, rounded to the KV cache's dtype whatever v_scale;
- accumulators-in-output-dtype: flash attention with its running state in the output dtype: the block's
  row max is rounded to the output dtype before it updates the stored max, the weights are float32 against
  that max, the row sum and P @ V are rounded, the rescale factor is exp of the difference of the two stored
  maxima, both in the output dtype, and each of l = alpha l + row sum and acc = alpha acc + P @ V rounds
  the product and the sum (a target that declares it says where its kernel does so);
- softmax-in-output-dtype: the float32 q.K product rounded to the output dtype, then each scaling and
  the soft cap's steps, the masked logits, the subtraction of the max and the weights rounded to it;
- bf16-matmul / bf16x3-matmul: float32 operands of both products rounded to bf16 / split into bf16 hi + lo
  (three products, lo * lo dropped), float32 accumulation;
- approx-reciprocal: the output is acc * (1 / l) * (1 + rho) with |rho| = the stated maximum (sign drawn per
  row), the worst an approximate reciprocal may do;
- approx-reciprocal-for-narrow-output: that choice for an output narrower than float32 only;
- tpu-transcendentals: every float32 exp, tanh and division off by the stated number of ulps (a relative
  error of that many u32, sign drawn per element), the worst a TPU's may do.

The options are the specification's, its extensions included (``q_scale``, ``mask_value_meaning``,
``attention_sink``: the running max starts at the sink and the running sum at its weight 1, as kernels
with sinks initialise them). Keys past
kv_len never enter; rows past cu_q_lens[num_seqs] are zeros. ``kv_pages_per_block`` (default 1,
the most roundings per key) sets the KV block.
"""

import ml_dtypes
import numpy as np

from rpa_harness.reference.float64 import quantised_query
from rpa_harness.reference.tolerance import (
    ACCUMULATORS_IN_OUTPUT_DTYPE,
    APPROX_RECIPROCAL,
    APPROX_RECIPROCAL_ERROR,
    APPROX_RECIPROCAL_FOR_NARROW_OUTPUT,
    BF16_MATMUL,
    BF16X3_MATMUL,
    PROBABILITIES_IN_CACHE_DTYPE,
    PROBABILITIES_IN_VALUE_DTYPE,
    SOFTMAX_IN_OUTPUT_DTYPE,
    TPU_DIVIDE_ULPS,
    TPU_EXP_ULPS,
    TPU_TANH_ULPS,
    TPU_TRANSCENDENTALS,
    U32,
    parse_precision,
)
from rpa_harness.spec.interface import MASK_REPLACES, Options

F32 = np.dtype(np.float32)
BF16 = np.dtype(ml_dtypes.bfloat16)


def _round(x, dtype):
    """x rounded to ``dtype`` and back to float32 (a no-op for float32)."""
    return x if np.dtype(dtype) == F32 else x.astype(dtype).astype(np.float32)


def _product(a, b, subscripts, passes):
    """float32 einsum whose float32 operands go through bf16: 1 pass (rounded) or 3 (hi + lo split)."""
    if passes == 1:
        return np.einsum(subscripts, _round(a, BF16), _round(b, BF16))
    if passes == 3:
        a_hi, b_hi = _round(a, BF16), _round(b, BF16)
        a_lo, b_lo = _round(a - a_hi, BF16), _round(b - b_hi, BF16)
        return (
            np.einsum(subscripts, a_hi, b_hi)
            + np.einsum(subscripts, a_hi, b_lo)
            + np.einsum(subscripts, a_lo, b_hi)
        )
    return np.einsum(subscripts, a, b)


def _scaled(x, scale, q_dtype):
    """K or V as the specification reads it (float32 times the scale, rounded to q's dtype), as float32."""
    x = x.astype(np.float32)
    return x if scale is None else (x * np.float32(scale)).astype(q_dtype).astype(np.float32)


def contract_attention(
    q,
    kv_pages,
    kv_lens,
    page_indices,
    cu_q_lens,
    num_seqs,
    *,
    precision=(),
    kv_pages_per_block=1,
    seed=0,
    sm_scale=1.0,
    sliding_window=None,
    soft_cap=None,
    mask_value=None,
    k_scale=None,
    v_scale=None,
    q_scale=None,
    mask_value_meaning=Options.mask_value_meaning,
    attention_sink=None,
    use_causal_mask=True,
    out_dtype=None,
    **unused_block_and_tuning_options,
):
    """Ragged paged attention in float32 NumPy with the choices of ``precision``; returns q's dtype (the
    result rounded to ``out_dtype`` first where that is narrower)."""
    precision = parse_precision(precision)
    q = np.asarray(q)
    semantics = Options(mask_value=mask_value, mask_value_meaning=mask_value_meaning, out_dtype=out_dtype)
    mask_value = semantics.mask_value_for(q.dtype)
    accumulator_dtype = semantics.accumulator_dtype(q.dtype)
    score_scale = np.float32(sm_scale * (1.0 if q_scale is None else q_scale))
    kv_pages = np.asarray(kv_pages)
    out_dtype = accumulator_dtype  # what the accumulators are kept in and the result is rounded to
    value_dtype = q.dtype if v_scale is not None else kv_pages.dtype
    passes = 3 if BF16X3_MATMUL in precision else 1 if BF16_MATMUL in precision else 0
    keep_out_dtype = ACCUMULATORS_IN_OUTPUT_DTYPE in precision
    rounded_softmax = SOFTMAX_IN_OUTPUT_DTYPE in precision
    scalings = [np.float32(f) for f in (sm_scale, q_scale) if f is not None]
    rng = np.random.default_rng(seed)
    chip = TPU_TRANSCENDENTALS in precision

    def off_by(x, ulps):
        """``x`` with the relative error of a TPU operation that many ulps from correctly rounded."""
        if not chip:
            return x
        sign = rng.choice(np.array([-1.0, 1.0], np.float32), size=np.shape(x))
        return (x * (1.0 + sign * ulps * U32)).astype(np.float32)

    num_tokens, num_q_heads, head_dim = q.shape
    _, page_size, num_combined, _ = kv_pages.shape
    group = num_q_heads // (num_combined // 2)
    block_keys = kv_pages_per_block * page_size
    out = np.zeros(q.shape, np.float32)
    for i in range(int(np.asarray(num_seqs)[0])):
        start, end = (int(x) for x in np.asarray(cu_q_lens)[i : i + 2])
        kv_len = int(np.asarray(kv_lens)[i])
        if end == start or kv_len == 0:
            continue
        pages = np.asarray(page_indices)[i, : -(-kv_len // page_size)]
        kv = kv_pages[pages].reshape(-1, num_combined, head_dim)[:kv_len]
        k = np.repeat(_scaled(kv[:, 0::2], k_scale, q.dtype), group, axis=1)  # [keys, heads, dim]
        v = np.repeat(_scaled(kv[:, 1::2], v_scale, q.dtype), group, axis=1)
        rows = quantised_query(q[start:end], q_scale, kv_pages.dtype).astype(np.float32)  # [rows, heads, dim]
        positions = kv_len - (end - start) + np.arange(end - start)
        m = np.full((num_q_heads, end - start, 1), -np.inf, np.float32)
        total = np.zeros((num_q_heads, end - start, 1), np.float32)
        if attention_sink is not None:
            m[...] = np.asarray(attention_sink, np.float32)[:, None, None]
            total[...] = np.where(np.isneginf(m), np.float32(0.0), np.float32(1.0))
        acc = np.zeros((num_q_heads, end - start, head_dim), np.float32)
        for first in range(0, kv_len, block_keys):
            keys = np.arange(first, min(kv_len, first + block_keys))
            if rounded_softmax:
                logits = _round(_product(rows, k[keys], "qhd,khd->hqk", passes), out_dtype)
                for factor in scalings:
                    logits = _round(logits * factor, out_dtype)
                if soft_cap is not None:
                    cap = np.float32(soft_cap)
                    logits = _round(
                        cap * _round(np.tanh(_round(logits / cap, out_dtype)), out_dtype), out_dtype
                    )
            else:
                logits = _product(rows, k[keys], "qhd,khd->hqk", passes) * score_scale
                if soft_cap is not None:
                    quotient = off_by(logits / np.float32(soft_cap), TPU_DIVIDE_ULPS)
                    logits = np.float32(soft_cap) * off_by(np.tanh(quotient), TPU_TANH_ULPS)
            masked = (keys[None, :] > positions[:, None]) & use_causal_mask
            if sliding_window is not None:
                masked |= positions[:, None] - sliding_window >= keys[None, :]
            if mask_value_meaning == MASK_REPLACES:
                logits = np.where(masked, np.float32(mask_value), logits)
            else:
                logits = logits + np.where(masked, np.float32(mask_value), np.float32(0.0))
            block_max = logits.max(axis=-1, keepdims=True)
            if keep_out_dtype:
                block_max = _round(block_max, out_dtype)
            m_new = np.maximum(m, block_max)
            if rounded_softmax:
                logits = _round(logits, out_dtype)  # a replaced logit: the mask value in the output dtype
                m_new = np.maximum(m, _round(block_max, out_dtype))
                weights = _round(np.exp(_round(logits - m_new, out_dtype)), out_dtype)
            else:
                weights = off_by(np.exp(logits - m_new), TPU_EXP_ULPS)
            row_sum = weights.sum(axis=-1, keepdims=True)
            if PROBABILITIES_IN_VALUE_DTYPE in precision:
                weights = _round(weights, value_dtype)
            if PROBABILITIES_IN_CACHE_DTYPE in precision:
                weights = _round(weights, kv_pages.dtype)
            block_pv = _product(weights, v[keys], "hqk,khd->hqd", passes)
            if keep_out_dtype:
                rescale = _round(np.exp(_round(m - m_new, out_dtype)), out_dtype)
                total = _round(_round(rescale * total, out_dtype) + _round(row_sum, out_dtype), out_dtype)
                acc = _round(_round(rescale * acc, out_dtype) + _round(block_pv, out_dtype), out_dtype)
            else:
                rescale = off_by(np.exp(m - m_new), TPU_EXP_ULPS)
                total = rescale * total + row_sum
                acc = rescale * acc + block_pv
            m = m_new
        if APPROX_RECIPROCAL in precision or (
            APPROX_RECIPROCAL_FOR_NARROW_OUTPUT in precision and out_dtype != F32
        ):
            sign = rng.choice(np.array([-1.0, 1.0], np.float32), size=total.shape)
            rows_out = acc * (
                (np.float32(1.0) / total) * (np.float32(1.0) + sign * np.float32(APPROX_RECIPROCAL_ERROR))
            )
        else:
            rows_out = off_by(acc / total, TPU_DIVIDE_ULPS)
        out[start:end] = rows_out.transpose(1, 0, 2)
    return out.astype(out_dtype).astype(q.dtype)
