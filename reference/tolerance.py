"""Per-element error bounds for ragged paged attention, and the comparison a kernel developer reads.

Model
-----
The float64 oracle sees exactly the inputs the kernel sees: q, K and V upcast exactly (bf16 and fp8 are
subsets of float32), and K/V rounded through ``float32 * scale -> q dtype`` when a scale is given, because
that rounding is part of the specification. So the q and KV dtypes add no error of their own; what a
correct kernel may lose is (a) float32 rounding in the logits, softmax and accumulation, and (b) the final
rounding to the output dtype (q's dtype). For output element ``o`` of a query row with kv length ``n``:

    bound = e32 + flush + n * 2**-126 + half_ulp_out(|o| + e32) + tiny_out
    e32   = u32 * ( S + (3 n + 16) * (sum_k p_k |v_k| + |o|) )
    S     >= sum_k p_k eps_k |v_k - o|      (the oracle's ``logit_sensitivity``)
    eps_k = d * A_k + 4 |r_k| + 2 |s_k| + 2 (m - s_k) + 8      (``key_error_units``)

with u32 = 2**-24, d = head_dim, r_k = sm_scale * q.k (before the soft cap), A_k = |sm_scale| * sum_i
|q_i k_i| (the dot product's condition), s_k the logit after soft cap and mask, m = max_k s_k, p the exact
softmax. Where each term comes from:

============================  ===============================================================
term                          float32 operations it covers (worst case, first order)
============================  ===============================================================
d * A_k                       q.k: d products and d-1 additions (bf16/fp8 products are exact)
4 |r_k|                       sm_scale multiply; soft cap divide, tanh, multiply (|cap tanh| <= |r|)
2 |s_k|                       adding the mask value (matters only for a finite custom mask)
2 (m - s_k)                   subtracting the (running) max; online-softmax rescaling telescopes to it
8                             exp and the final normalisation
(3 n + 16) (sum p|v| + |o|)   P @ V and the denominator summed over n keys, per-block rescaling
flush + n * 2**-126            weights exp(s_k - m) < 2**-125 and products p_k v_k below float32's
                              normal range may be flushed to zero (``flush`` = sum p_k |v_k| over
                              those keys, the oracle's ``flushable_pv``): absolute, ~1e-38
half_ulp_out(|o| + e32)       round-to-nearest into the output dtype (f32: 2**-24, bf16: 2**-8 rel.)
tiny_out                      a result flushed to zero (smallest normal of the output dtype)
============================  ===============================================================

A relative error eps_k on the softmax weight of key k moves the output by sum_k p_k eps_k (v_k - o), which is
why ``S`` weighs |v_k - o| (the oracle bounds it by the smaller of sum p eps (|v| + |o|) and the
Cauchy-Schwarz bound sqrt(sum p eps * sum p eps (v - o)^2)). The model assumes float32 matrix products are
done at float32 precision (as on CPU and in Mosaic's f32 matmul), exact division and an exp within a few ulp;
a kernel that rounds probabilities, accumulators or softmax to bf16, or uses an approximate reciprocal, is
outside the specification and is meant to fail.

Measured (``benchmarks/tolerance_calibration.py``, unit-normal data): float32 bounds are 2e-5..7e-5 with
sm_scale = 1/sqrt(d), i.e. >= 1000x below upstream's 0.15 + 0.15 |o|; with sm_scale = 1 at d = 128 (logits
of std ~11) the d * A_k term dominates and the bound reaches ~1.6e-3 where the output cancels (~100x). In
bfloat16 the bound is half an ulp plus ~1e-4, >= 48x below upstream's. The jnp reference reaches error/bound
<= 0.05 in float32 and <= 0.998 in bfloat16 (round-to-nearest uses almost all of its half ulp).
"""

import dataclasses

import ml_dtypes
import numpy as np

U32 = 2.0**-24
TINY32 = 2.0**-126  # smallest normal float32: XLA on CPU flushes results below it to zero


def key_error_units(dot_abs, raw_logit, logit, gap, head_dim):
    """Relative error a float32 pipeline may put on one key's softmax weight, in units of u32 (eps_k)."""
    return head_dim * dot_abs + 4.0 * np.abs(raw_logit) + 2.0 * np.abs(logit) + 2.0 * gap + 8.0


def half_ulp(x, dtype):
    """Half a unit in the last place of |x| in ``dtype`` (subnormal spacing below the normal range)."""
    info = ml_dtypes.finfo(dtype)
    magnitude = np.abs(np.asarray(x, np.float64))
    _, exponent = np.frexp(magnitude)
    exponent = np.where(magnitude > 0, exponent - 1, int(info.minexp))
    return np.ldexp(0.5, np.maximum(exponent, int(info.minexp)) - int(info.nmant))


def error_bound(result, out_dtype=None):
    """Per-element bound ``[T, num_q_heads, head_dim]`` for ``result`` (an ``OracleResult``); NaN in rows
    no sequence owns. ``out_dtype`` defaults to the specified output dtype, q's."""
    out_dtype = np.dtype(result.out_dtype if out_dtype is None else out_dtype)
    magnitude = np.abs(result.out)
    accumulation = (3.0 * result.row_kv_len + 16.0)[:, None, None] * (result.abs_pv + magnitude)
    e32 = U32 * (result.logit_sensitivity + accumulation)
    underflow = result.flushable_pv + result.row_kv_len[:, None, None] * TINY32
    return e32 + underflow + half_ulp(magnitude + e32, out_dtype) + float(ml_dtypes.finfo(out_dtype).tiny)


@dataclasses.dataclass(frozen=True)
class Mismatch:
    """One output element, located in the ragged batch."""

    sequence: int
    token: int  # index within the sequence's query rows
    row: int  # index into the output's first axis
    head: int
    dim: int
    actual: float
    expected: float
    error: float
    bound: float

    @property
    def ratio(self) -> float:
        return self.error / self.bound


@dataclasses.dataclass(frozen=True)
class Comparison:
    """Outcome of comparing an output with the float64 oracle over the rows some sequence owns."""

    label: str
    num_checked: int
    num_over: int  # finite elements whose error exceeds the bound
    nonfinite: int  # NaN or Inf in owned rows: always a failure
    max_ratio: float  # largest error / bound (inf if any element is non-finite)
    worst: Mismatch | None  # element with the largest error / bound (the first non-finite one if any)
    actual_dtype: np.dtype
    expected_dtype: np.dtype
    q_dtype: np.dtype
    kv_dtype: np.dtype

    @property
    def ok(self) -> bool:
        return self.num_over == 0 and self.nonfinite == 0 and self.actual_dtype == self.expected_dtype

    def __str__(self) -> str:
        verdict = "ok" if self.ok else "FAIL"
        lines = [
            f"{self.label} vs float64 oracle: {verdict}: {self.num_over} of {self.num_checked} elements over "
            f"the bound, {self.nonfinite} non-finite, max error/bound {self.max_ratio:.3g}"
        ]
        if self.worst is not None:
            w = self.worst
            lines.append(
                f"  worst: sequence {w.sequence}, token {w.token} (row {w.row}), head {w.head}, dim {w.dim}: "
                f"{self.label} {w.actual:.9g}, oracle {w.expected:.9g}, error {w.error:.3g}, bound {w.bound:.3g}"
            )
        dtype_note = (
            "" if self.actual_dtype == self.expected_dtype else f" but got {self.actual_dtype}: wrong"
        )
        lines.append(
            f"  output dtype {self.expected_dtype}{dtype_note} (q {self.q_dtype}, kv {self.kv_dtype}); "
            "rows past cu_q_lens[num_seqs] not checked"
        )
        return "\n".join(lines)


def compare(actual, result, *, label="kernel") -> Comparison:
    """Checks ``actual`` (``[T, num_q_heads, head_dim]``, any array type) against an ``OracleResult``."""
    actual_dtype = np.dtype(getattr(actual, "dtype", np.float64))
    values = np.asarray(actual).astype(np.float64)
    if values.shape != result.out.shape:
        raise ValueError(
            f"{label} output has shape {values.shape} but the oracle's is {result.out.shape} "
            "([max_num_batched_tokens, num_q_heads, head_dim]); pass the kernel's full output."
        )
    rows = np.flatnonzero(result.row_sequence >= 0)
    got = values[rows]
    expected = result.out[rows]
    bound = error_bound(result)[rows]
    finite = np.isfinite(got)
    error = np.abs(got - expected)
    ratio = np.where(finite, error / bound, np.inf)
    worst = None
    if ratio.size:
        r, head, dim = np.unravel_index(int(np.argmax(ratio)), ratio.shape)
        row = int(rows[r])
        worst = Mismatch(
            sequence=int(result.row_sequence[row]),
            token=int(result.row_token[row]),
            row=row,
            head=int(head),
            dim=int(dim),
            actual=float(got[r, head, dim]),
            expected=float(expected[r, head, dim]),
            error=float(error[r, head, dim]),
            bound=float(bound[r, head, dim]),
        )
    return Comparison(
        label=label,
        num_checked=int(ratio.size),
        num_over=int(np.count_nonzero(finite & (ratio > 1.0))),
        nonfinite=int(np.count_nonzero(~finite)),
        max_ratio=float(ratio.max()) if ratio.size else 0.0,
        worst=worst,
        actual_dtype=actual_dtype,
        expected_dtype=np.dtype(result.out_dtype),
        q_dtype=np.dtype(result.q_dtype),
        kv_dtype=np.dtype(result.kv_dtype),
    )
