"""Float64 NumPy oracle for ragged paged attention, with what the tolerance model needs.

Inputs are upcast exactly (ml_dtypes for bf16 and fp8). The one rounding the specification prescribes is
reproduced: with ``k_scale`` (``v_scale``) the keys (values) are multiplied by the scale in float32 and
rounded to q's dtype before use; with ``q_scale`` (an extension: a quantised query) q is divided by it in
q's dtype, clipped to the KV dtype's finite range and cast to the KV dtype, and the logits are multiplied
by it (with IEEE division; where a compiler's quotient, one float32 ulp away, would quantise differently,
the result says how far the logits may move: ``quantised_query_doubt``). ``mask_value`` is added to a masked
logit or replaces it, as ``mask_value_meaning`` says. An ``attention_sink`` logit joins its head's softmax
denominator with no value. Everything else (logits, soft cap, mask, softmax, P @ V) is float64, and the
output is not rounded: the tolerance model accounts for the rounding a kernel does.

Only metadata of the first ``num_seqs`` sequences is read, and of those only the pages holding keys below
kv_len, so garbage page indices and NaN in page tails, unused pages or unowned query rows never matter.
"""

import dataclasses

import ml_dtypes
import numpy as np

from rpa_harness.reference.tolerance import (
    key_error_units,
    rounded_logit_roundings,
    rounded_logit_units,
    sink_error_units,
    unit_roundoff,
)
from rpa_harness.spec.interface import (
    MASK_REPLACES,
    Options,
    check_extensions,
    static_validate_inputs,
    takes_extended_options,
)

# Upper bound on the elements of one float64 work array: a [kv heads, rows, keys] block of logits, or
# one chunk of K or V ([kv heads, keys, dim]). About twenty such arrays are alive at once, so the working
# set stays a few hundred MiB whatever the shapes; what grows with the case is the result (7 x [T, H, D]).
_MAX_BLOCK_ELEMENTS = 1 << 21
# Longest key chunk: past this, more keys per matrix product buy no speed.
_MAX_CHUNK_KEYS = 8192


@dataclasses.dataclass(frozen=True)
class OracleResult:
    """The float64 output and, per output element, the quantities the error bound is made of."""

    out: np.ndarray  # float64 [T, num_q_heads, head_dim]; NaN in rows no sequence owns
    out_dtype: np.dtype  # the dtype the specification returns (q's)
    accumulator_dtype: np.dtype  # the dtype of the softmax statistics and the result before the output
    # dtype (the ``out_dtype`` option, else q's)
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
    soft_cap: float  # 0 for none: a capped logit is within (-soft_cap, soft_cap)
    key_dtype: np.dtype  # K as the kernel multiplies it: q's dtype when k_scale is set, else the KV dtype
    value_dtype: np.dtype  # V likewise (v_scale)
    dot_sensitivity: np.ndarray  # float64 [T, H, D]: bound on sum_k p_k A_k |v_k - o|
    max_dot_abs: np.ndarray  # float64 [T, H, D]: max of A_k over keys with p_k > 0 (constant along D)
    value_underflow: (
        np.ndarray
    )  # float64 [T, H, D]: sum_k min(p_k, half the value dtype's smallest subnormal) (|v_k| + |o|)
    cache_underflow: np.ndarray  # float64 [T, H, D]: the same for the KV cache's dtype (v_scale or not)
    # For a running max stored and rescaled in the accumulator dtype (unit roundoff u = ``rescale_unit``):
    # with r_k the row's running max over whole pages through key k's page, m = max_k s_k, and n_k the
    # number of pages after k's where the running max rises (a KV block of whole pages rises at most as often):
    rescale_unit: float
    rescale_excess: np.ndarray  # float64 [T, H, D]: sum_k p_k (a_k - 1) (|v_k| + |o|), a_k = 1 if n_k = 0,
    # else (1 + u)^(2 n_k) exp(u (m - r_k + u (|m| + |r_k|)))
    max_rises: np.ndarray  # float64 [T, H, D]: the row's number of rises, >= every n_k (constant along D)
    # Where the quantised query is in doubt (``quantised_query_doubt``: delta_i per element), each logit is
    # known only to Q_k = |scale| sum_i delta_i |k_i|:
    query_doubt_sensitivity: np.ndarray  # float64 [T, H, D]: bound on sum_k p_k Q_k |v_k - o|
    max_query_doubt: np.ndarray  # float64 [T, H, D]: max of Q_k over keys with p_k > 0 (constant along D)
    # For logits and weights computed in the accumulator dtype, each weight off by a factor within
    # exp(+-u rho_k) (rho_k: ``rounded_logit_units``):
    rounded_logit_sensitivity: np.ndarray  # float64 [T, H, D]: sum_k p_k rho_k (|v_k| + |o|)
    max_rounded_logit_units: np.ndarray  # float64 [T, H, D]: max of rho_k over keys with p_k > 0
    # The values' hull, which bounds the output whatever its weights' errors (``tolerance.hull_error``):
    # over the sequence's keys [0, kv_len), and 0 where a sink takes weight without a value,
    value_spread: np.ndarray  # float64 [T, H, D]: max_k |v_k - o|
    max_abs_value: np.ndarray  # float64 [T, H, D]: max_k |v_k|

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


def _value_dtype(kv_dtype, scale, q_dtype) -> np.dtype:
    return np.dtype(q_dtype if scale is not None else kv_dtype)


def _half_smallest_subnormal(dtype) -> float:
    return float(ml_dtypes.finfo(dtype).smallest_subnormal) / 2


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


def _quantise(quotient, q_dtype, kv_dtype) -> np.ndarray:
    """A float32 quotient q / q_scale as the query the logits use: rounded to q's dtype, clipped to the KV
    dtype's finite range, cast to it (float64)."""
    info = ml_dtypes.finfo(kv_dtype)
    rounded = quotient.astype(q_dtype).astype(np.float64)
    return np.clip(rounded, float(info.min), float(info.max)).astype(kv_dtype).astype(np.float64)


def _float32_quotient(q, q_scale) -> np.ndarray:
    scale = np.float32(np.asarray(q_scale, q.dtype))
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        return q.astype(np.float32) / scale


def quantised_query(q, q_scale, kv_dtype) -> np.ndarray:
    """q as the logits use it (float64): itself, or with ``q_scale`` divided by the scale in q's dtype (the
    scale rounded to q's dtype first, the quotient computed in float32 and rounded to q's dtype, as jax
    does for a narrow float and a Python scalar), clipped to the KV dtype's finite range, cast to it.

    The quotient here is IEEE's. A compiler need not compute it so: XLA divides by a constant as a
    multiplication by its reciprocal, one float32 ulp away in about a third of the quotients. Where that
    ulp moves the quantised value, ``quantised_query_doubt`` says by how much."""
    q = np.asarray(q)
    if q_scale is None:
        return _as_float64(q)
    return _quantise(_float32_quotient(q, q_scale), q.dtype, kv_dtype)


def quantised_query_doubt(q, q_scale, kv_dtype) -> np.ndarray | None:
    """Per element of q, how far the quantised query may lie from ``quantised_query``'s when the float32
    quotient is one ulp off IEEE's (either way): zero except where that ulp crosses a rounding boundary of
    q's dtype or the KV dtype. None without ``q_scale`` or when no element is in doubt."""
    q = np.asarray(q)
    if q_scale is None:
        return None
    quotient = _float32_quotient(q, q_scale)
    used = _quantise(quotient, q.dtype, kv_dtype)
    doubt = np.zeros(used.shape)
    with np.errstate(invalid="ignore"):
        for direction in (-np.inf, np.inf):
            moved = _quantise(np.nextafter(quotient, np.float32(direction)), q.dtype, kv_dtype)
            doubt = np.maximum(doubt, np.nan_to_num(np.abs(moved - used), nan=0.0))
    return doubt if doubt.any() else None


@dataclasses.dataclass(frozen=True)
class _Scores:
    """The score semantics of one call: the logit scale (sm_scale, times q_scale when q was quantised), the
    soft cap, the mask value for the output dtype and whether it replaces a masked logit or is added."""

    scale: float
    soft_cap: float | None
    mask_value: float
    replaces: bool


def _logits(q_rows, k, masked, semantics: _Scores, q_doubt=None):
    """The per-element math of one block of logits; every score semantic of the specification is here.

    ``q_rows`` [kv heads, rows, dim] and ``k`` [kv heads, keys, dim] are float64 (q as ``quantised_query``
    gives it, K as the specification reads it, see ``_scaled``), ``masked`` [rows, keys] is True where the
    causal mask or the sliding window hides the key. Returns ``(raw, logits, dot_abs, doubt)``, each [kv
    heads, rows, keys]: ``raw = scale * q.k`` before the soft cap; ``logits`` after the soft cap and the mask
    (upstream adds ``mask_value`` to a masked logit, a replacing mask substitutes it); ``dot_abs = |scale| *
    sum_i |q_i k_i|``, the dot product's condition, which the error bound needs; ``doubt = |scale| * sum_i
    delta_i |k_i|`` for ``q_doubt`` (delta, as ``q_rows``; the soft cap's slope is at most 1), else None.
    """
    raw = semantics.scale * (q_rows @ k.transpose(0, 2, 1))
    abs_k = np.abs(k).transpose(0, 2, 1)
    dot_abs = abs(semantics.scale) * (np.abs(q_rows) @ abs_k)
    doubt = None if q_doubt is None else abs(semantics.scale) * (q_doubt @ abs_k)
    soft_cap = semantics.soft_cap
    logits = raw if soft_cap is None else soft_cap * np.tanh(raw / soft_cap)
    if semantics.replaces:  # a replaced logit is the constant itself: no product error is carried into it
        return (
            np.where(masked, 0.0, raw),
            np.where(masked, semantics.mask_value, logits),
            np.where(masked, 0.0, dot_abs),
            None if doubt is None else np.where(masked, 0.0, doubt),
        )
    return raw, logits + np.where(masked, semantics.mask_value, 0.0), dot_abs, doubt


@dataclasses.dataclass(frozen=True)
class _KeyChunk:
    """Consecutive keys of one sequence, upcast once: positions and float64 K, V, |V|, V^2."""

    positions: np.ndarray  # int [keys]
    k: np.ndarray  # [kv heads, keys, dim]
    v: np.ndarray
    abs_v: np.ndarray
    v_squared: np.ndarray


def _key_chunks(kv_pages, pages, kv_len, chunk_keys, options: Options, q_dtype) -> list[_KeyChunk]:
    """The sequence's keys ``[0, kv_len)`` in chunks of ``chunk_keys`` (a multiple of the page size), read
    from its pages only (page tails past kv_len are never read)."""
    _, page_size, num_combined_kv_heads, head_dim = kv_pages.shape
    chunks = []
    for first in range(0, kv_len, chunk_keys):
        last = min(kv_len, first + chunk_keys)
        kv = kv_pages[pages[first // page_size : -(-last // page_size)]]
        kv = kv.reshape(-1, num_combined_kv_heads, head_dim)[: last - first]
        k = _scaled(kv[:, 0::2], options.k_scale, q_dtype).transpose(1, 0, 2)
        v = _scaled(kv[:, 1::2], options.v_scale, q_dtype).transpose(1, 0, 2)
        chunks.append(_KeyChunk(np.arange(first, last), k, v, np.abs(v), v * v))
    return chunks


def _deviation_bound(weight_total, weighted_v_squared, weighted_v, weighted_abs_v, o):
    """Bound on sum_k w_k |v_k - o| (w >= 0) from the weighted sums: the smaller of the triangle inequality
    and Cauchy-Schwarz, sqrt(sum w * sum w (v - o)^2)."""
    spread = weighted_v_squared - 2 * o * weighted_v + o * o * weight_total
    cauchy_schwarz = np.sqrt(weight_total * np.maximum(spread, 0.0))
    triangle = weighted_abs_v + np.abs(o) * weight_total
    return np.minimum(cauchy_schwarz, triangle)


def _page_maxima(logits, page_size):
    """Max over each whole page of the keys (the last axis, starting on a page boundary)."""
    short = -logits.shape[-1] % page_size
    if short:
        logits = np.concatenate([logits, np.full((*logits.shape[:-1], short), -np.inf)], axis=-1)
    return logits.reshape(*logits.shape[:-1], -1, page_size).max(axis=-1)


def _rescale_exponents(page_maxima, top, rescale_unit):
    """Per page, log a_k of ``OracleResult.rescale_excess`` for the keys on it, and the row's rises."""
    running = np.maximum.accumulate(page_maxima, axis=-1)
    rises = np.zeros(running.shape, np.int64)
    rises[..., 1:] = running[..., 1:] > running[..., :-1]
    later = rises.sum(axis=-1, keepdims=True) - np.cumsum(rises, axis=-1)
    u = rescale_unit
    with np.errstate(invalid="ignore", over="ignore"):
        climb = top - running + u * (np.abs(top) + np.abs(running))
        exponents = np.where(later > 0, 2 * later * np.log1p(u) + u * climb, 0.0)
    return exponents, rises.sum(axis=-1, keepdims=True)


def _attend(
    q_rows,
    query_positions,
    chunks,
    options: Options,
    semantics: _Scores,
    subnormals: tuple[float, float],
    page_size,
    rescale_unit,
    q_doubt=None,
    sinks=None,
):
    """Float64 attention of a block of rows over a sequence's key chunks, with the bound ingredients.

    ``q_rows`` [kv heads, rows, dim] (``q_doubt`` as it, or None), ``query_positions`` [rows, 1], ``sinks``
    [kv heads, rows, 1] each row's sink logit (or None). Two passes over the chunks: the first
    finds each row's max logit and softmax denominator (online, exact to float64 rounding), the second
    accumulates every weighted sum the result needs, so no [rows, kv_len] array is ever whole. A sink is a
    key of value 0 before the first: it joins the max, the denominator and the weight errors.
    ``subnormals``: half the smallest subnormal of V's dtype and of the cache's (the underflow terms).
    Returns the ``OracleResult`` quantities for these rows, each [kv heads, rows, dim].
    """
    value_subnormal, cache_subnormal = subnormals
    head_dim = q_rows.shape[-1]
    roundings = rounded_logit_roundings(
        k_scale=options.k_scale, q_scale=options.q_scale, soft_cap=options.soft_cap
    )

    def logits_of(chunk):
        keys = chunk.positions[None, :]
        masked = (keys > query_positions) & options.use_causal_mask
        if options.sliding_window is not None:
            masked |= query_positions - options.sliding_window >= keys
        return _logits(q_rows, chunk.k, masked, semantics, q_doubt)

    rows_shape = (*q_rows.shape[:2], 1)
    top = np.full(rows_shape, -np.inf) if sinks is None else sinks
    denominator = np.zeros(rows_shape) if sinks is None else np.where(np.isneginf(sinks), 0.0, 1.0)
    single = None
    page_maxima = [] if sinks is None else [sinks]  # the sink: a page before the first
    # [kv heads, 1, dim]: the values' extremes over the keys, 0 among them with a sink (the values' hull).
    extremes_shape, start = (q_rows.shape[0], 1, head_dim), 0.0 if sinks is not None else np.inf
    lowest, highest = np.full(extremes_shape, start), np.full(extremes_shape, -start)
    for chunk in chunks:
        lowest = np.minimum(lowest, chunk.v.min(axis=1, keepdims=True))
        highest = np.maximum(highest, chunk.v.max(axis=1, keepdims=True))
        scores = logits_of(chunk)
        page_maxima.append(_page_maxima(scores[1], page_size))
        new_top = np.maximum(top, scores[1].max(axis=-1, keepdims=True))
        denominator = denominator * np.exp(top - new_top) + np.exp(scores[1] - new_top).sum(
            axis=-1, keepdims=True
        )
        top = new_top
        if len(chunks) == 1:
            single = scores
    page_exponents, rises = _rescale_exponents(np.concatenate(page_maxima, axis=-1), top, rescale_unit)
    if sinks is not None:
        page_exponents = page_exponents[..., 1:]

    out_shape = q_rows.shape
    pv, abs_pv, flushable_pv = np.zeros(out_shape), np.zeros(out_shape), np.zeros(out_shape)
    # Weighted sums for the two deviation bounds: weights p * eps (logits) and p * A (dot products).
    sums = {
        name: np.zeros(out_shape)
        for name in (
            "e_vv",
            "e_v",
            "e_abs",
            "a_vv",
            "a_v",
            "a_abs",
            "small_abs",
            "cache_small_abs",
            "rescale_abs",
            "rounded_abs",
        )
    }
    totals = {name: np.zeros(rows_shape) for name in ("e", "a", "small", "cache_small", "rescale", "rounded")}
    max_rounded = np.zeros(rows_shape)
    cache_apart = cache_subnormal != value_subnormal  # with a v_scale, V's dtype is q's
    max_dot_abs = np.zeros(rows_shape)
    doubt_sums = {name: np.zeros(out_shape) for name in ("vv", "v", "abs")}
    doubt_total, max_doubt = np.zeros(rows_shape), np.zeros(rows_shape)
    if sinks is not None:  # value 0: only the weight total of the logit deviation bound
        with np.errstate(invalid="ignore"):
            sink_probs = np.where(np.isneginf(sinks), 0.0, np.exp(sinks - top) / denominator)
            totals["e"] += np.where(sink_probs > 0, sink_probs * sink_error_units(top - sinks), 0.0)
            sink_rho = np.where(sink_probs > 0, rounded_logit_units(0.0, sinks, top - sinks, (0, 0)), 0.0)
            totals["rounded"] += sink_probs * sink_rho
            max_rounded = np.maximum(max_rounded, sink_rho)
    for chunk in chunks:
        raw, logits, dot_abs, doubt = single if single is not None else logits_of(chunk)
        weights = np.exp(logits - top)
        probs = weights / denominator
        with np.errstate(invalid="ignore", over="ignore"):
            eps = key_error_units(dot_abs, raw, logits, top - logits, head_dim)
            by_eps = np.where(probs > 0, probs * eps, 0.0)
            rho = np.where(probs > 0, rounded_logit_units(raw, logits, top - logits, roundings), 0.0)
            by_rho = probs * rho
        live_dot_abs = np.where(probs > 0, dot_abs, 0.0)
        by_dot = probs * live_dot_abs
        with np.errstate(invalid="ignore", over="ignore"):  # pages no live key is on may have no finite bound
            excess = np.expm1(page_exponents[..., chunk.positions // page_size])
            by_rescale = np.where(probs > 0, probs * excess, 0.0)
        small = np.minimum(probs, value_subnormal)
        cache_small = np.minimum(probs, cache_subnormal) if cache_apart else small
        flushable = np.where(weights < 2.0**-125, probs, 0.0)
        # One matrix product per value operand, the weight blocks stacked along the rows (weights in
        # the flush range are rare: that block joins only when some exist; the cache's underflow only
        # where its dtype is not V's).
        n = probs.shape[1]
        any_flushable = bool(flushable.any())
        on_abs = (
            np.concatenate(
                [
                    probs,
                    by_eps,
                    by_dot,
                    small,
                    by_rescale,
                    by_rho,
                    *([cache_small] if cache_apart else []),
                    *([flushable] if any_flushable else []),
                ],
                axis=1,
            )  # fmt: skip
            @ chunk.abs_v
        )
        on_v = np.concatenate([probs, by_eps, by_dot], axis=1) @ chunk.v
        on_vv = np.concatenate([by_eps, by_dot], axis=1) @ chunk.v_squared
        pv += on_v[:, :n]
        abs_pv += on_abs[:, :n]
        sums["e_abs"] += on_abs[:, n : 2 * n]
        sums["a_abs"] += on_abs[:, 2 * n : 3 * n]
        sums["small_abs"] += on_abs[:, 3 * n : 4 * n]
        sums["rescale_abs"] += on_abs[:, 4 * n : 5 * n]
        sums["rounded_abs"] += on_abs[:, 5 * n : 6 * n]
        sums["cache_small_abs"] += on_abs[:, 6 * n : 7 * n] if cache_apart else on_abs[:, 3 * n : 4 * n]
        if any_flushable:
            flushable_pv += on_abs[:, (7 if cache_apart else 6) * n :]
        sums["e_v"] += on_v[:, n : 2 * n]
        sums["a_v"] += on_v[:, 2 * n :]
        sums["e_vv"] += on_vv[:, :n]
        sums["a_vv"] += on_vv[:, n:]
        totals["e"] += by_eps.sum(axis=-1, keepdims=True)
        totals["a"] += by_dot.sum(axis=-1, keepdims=True)
        totals["small"] += small.sum(axis=-1, keepdims=True)
        totals["cache_small"] += cache_small.sum(axis=-1, keepdims=True)
        totals["rescale"] += by_rescale.sum(axis=-1, keepdims=True)
        totals["rounded"] += by_rho.sum(axis=-1, keepdims=True)
        max_rounded = np.maximum(max_rounded, rho.max(axis=-1, keepdims=True))
        max_dot_abs = np.maximum(max_dot_abs, live_dot_abs.max(axis=-1, keepdims=True))
        if doubt is not None:  # rare (a few elements of q in doubt): its own products
            live_doubt = np.where(probs > 0, doubt, 0.0)
            by_doubt = probs * live_doubt
            doubt_sums["abs"] += by_doubt @ chunk.abs_v
            doubt_sums["v"] += by_doubt @ chunk.v
            doubt_sums["vv"] += by_doubt @ chunk.v_squared
            doubt_total += by_doubt.sum(axis=-1, keepdims=True)
            max_doubt = np.maximum(max_doubt, live_doubt.max(axis=-1, keepdims=True))

    o = pv
    return dict(
        out=o,
        abs_pv=abs_pv,
        flushable_pv=flushable_pv,
        logit_sensitivity=_deviation_bound(totals["e"], sums["e_vv"], sums["e_v"], sums["e_abs"], o),
        dot_sensitivity=_deviation_bound(totals["a"], sums["a_vv"], sums["a_v"], sums["a_abs"], o),
        max_dot_abs=np.broadcast_to(max_dot_abs, out_shape),
        value_underflow=sums["small_abs"] + np.abs(o) * totals["small"],
        cache_underflow=sums["cache_small_abs"] + np.abs(o) * totals["cache_small"],
        rescale_excess=sums["rescale_abs"] + np.abs(o) * totals["rescale"],
        max_rises=np.broadcast_to(rises.astype(np.float64), out_shape),
        query_doubt_sensitivity=_deviation_bound(
            doubt_total, doubt_sums["vv"], doubt_sums["v"], doubt_sums["abs"], o
        ),
        max_query_doubt=np.broadcast_to(max_doubt, out_shape),
        rounded_logit_sensitivity=sums["rounded_abs"] + np.abs(o) * totals["rounded"],
        max_rounded_logit_units=np.broadcast_to(max_rounded, out_shape),
        value_spread=np.maximum(highest - o, o - lowest),
        max_abs_value=np.broadcast_to(np.maximum(np.abs(lowest), np.abs(highest)), out_shape),
    )


def _chunk_sizes(num_q_heads, num_kv_heads, head_dim, page_size, kv_len) -> tuple[int, int]:
    """(keys per chunk, query tokens per row block) keeping every work array under _MAX_BLOCK_ELEMENTS."""
    keys = min(_MAX_CHUNK_KEYS, _MAX_BLOCK_ELEMENTS // (num_kv_heads * head_dim))
    keys = max(page_size, keys // page_size * page_size)
    keys = min(keys, -(-kv_len // page_size) * page_size)
    return keys, max(1, _MAX_BLOCK_ELEMENTS // (num_q_heads * keys))


@takes_extended_options
def oracle(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, options: Options) -> OracleResult:
    """Float64 ragged paged attention; the kernel's signature plus the extension options (block and VMEM
    options are ignored).

    Streamed: each sequence's query rows are taken in blocks and its keys in page-aligned chunks, so the
    memory beyond the inputs and the result is bounded whatever kv_len is.
    """
    static_validate_inputs(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options.keywords())
    check_extensions(options, q.shape[1])
    options = options.semantics()
    q = np.asarray(q)
    kv_pages = np.asarray(kv_pages)
    semantics = _Scores(
        scale=options.sm_scale * (1.0 if options.q_scale is None else options.q_scale),
        soft_cap=options.soft_cap,
        mask_value=options.mask_value_for(q.dtype),
        replaces=options.mask_value_meaning == MASK_REPLACES,
    )
    q_used = quantised_query(q, options.q_scale, kv_pages.dtype)
    q_doubt = quantised_query_doubt(q, options.q_scale, kv_pages.dtype)
    kv_lens = np.asarray(kv_lens).astype(np.int64)
    cu_q_lens = np.asarray(cu_q_lens).astype(np.int64)
    page_indices = np.asarray(page_indices).astype(np.int64)
    n = int(np.asarray(num_seqs)[0])
    num_tokens, num_q_heads, head_dim = q.shape
    total_num_pages, page_size, num_combined_kv_heads, _ = kv_pages.shape
    pages_per_seq = page_indices.shape[1]
    num_kv_heads = num_combined_kv_heads // 2
    group = num_q_heads // num_kv_heads
    # [kv heads, group, 1]: head h = kv_head * group + g, as the query blocks below are laid out.
    sinks = None
    if options.attention_sink is not None:
        sinks = (
            np.asarray(options.attention_sink, np.float32).astype(np.float64).reshape(num_kv_heads, group, 1)
        )
    _check_live_metadata(
        num_tokens, page_size, pages_per_seq, total_num_pages, kv_lens, cu_q_lens, page_indices, n
    )

    shape = (num_tokens, num_q_heads, head_dim)
    quantities = ("out", "abs_pv", "flushable_pv", "logit_sensitivity", "dot_sensitivity", "max_dot_abs",
                  "value_underflow", "cache_underflow", "rescale_excess", "max_rises", "query_doubt_sensitivity",
                  "max_query_doubt", "rounded_logit_sensitivity", "max_rounded_logit_units", "value_spread",
                  "max_abs_value")  # fmt: skip
    results = {name: np.zeros(shape) for name in quantities}
    results["out"][:] = np.nan
    value_dtype = _value_dtype(kv_pages.dtype, options.v_scale, q.dtype)
    subnormals = (_half_smallest_subnormal(value_dtype), _half_smallest_subnormal(kv_pages.dtype))
    accumulator_dtype = options.accumulator_dtype(q.dtype)
    rescale_unit = unit_roundoff(accumulator_dtype)
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
        chunk_keys, block = _chunk_sizes(num_q_heads, num_kv_heads, head_dim, page_size, kv_len)
        pages = page_indices[i]
        whole = kv_len <= chunk_keys  # one chunk: upcast once for every row block

        def chunks(pages=pages, kv_len=kv_len, chunk_keys=chunk_keys):
            return _key_chunks(kv_pages, pages, kv_len, chunk_keys, options, q.dtype)

        sequence_chunks = chunks() if whole else None
        for first in range(0, q_len, block):
            last = min(q_len, first + block)
            rows = slice(q_start + first, q_start + last)
            # [kv heads, group * rows, dim], rows fastest within a group.
            q_block = (
                q_used[rows]
                .reshape(last - first, num_kv_heads, group, head_dim)
                .transpose(1, 2, 0, 3)
                .reshape(num_kv_heads, group * (last - first), head_dim)
            )
            positions = np.tile(kv_len - q_len + np.arange(first, last), group)[:, None]
            doubt_block = None
            if q_doubt is not None and q_doubt[rows].any():
                doubt_block = (
                    q_doubt[rows]
                    .reshape(last - first, num_kv_heads, group, head_dim)
                    .transpose(1, 2, 0, 3)
                    .reshape(q_block.shape)
                )
            block_sinks = None if sinks is None else np.repeat(sinks, last - first, axis=1)
            block_results = _attend(
                q_block,
                positions,
                sequence_chunks or chunks(),
                options,
                semantics,
                subnormals,
                page_size,
                rescale_unit,
                doubt_block,
                block_sinks,
            )
            to_rows = (num_kv_heads, group, last - first, head_dim)
            for name, value in block_results.items():
                results[name][rows] = (
                    value.reshape(to_rows).transpose(2, 0, 1, 3).reshape(last - first, -1, head_dim)
                )

    return OracleResult(
        out_dtype=q.dtype,
        accumulator_dtype=accumulator_dtype,
        q_dtype=q.dtype,
        kv_dtype=kv_pages.dtype,
        row_sequence=row_sequence,
        row_token=row_token,
        row_kv_len=row_kv_len,
        page_size=page_size,
        soft_cap=0.0 if options.soft_cap is None else abs(float(options.soft_cap)),
        key_dtype=_value_dtype(kv_pages.dtype, options.k_scale, q.dtype),
        value_dtype=value_dtype,
        rescale_unit=rescale_unit,
        **results,
    )
