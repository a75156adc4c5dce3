"""The jnp reference, the float64 oracle and the tolerance model, checked against each other, against hand
computation, against upstream's reference, and against deliberately imprecise variants."""

import math

import ml_dtypes
import numpy as np
import pytest

from rpa_harness.reference import compare, error_bound, oracle, ragged_paged_attention
from rpa_harness.reference.jnp_reference import _ragged_paged_attention
from rpa_harness.strategies.case import Case
from tests.cases import BF16, E4M3, E5M2, F32, build_case
from tests.references import upstream_in_one_program


def check_reference(arrays, **options):
    result = oracle(**arrays, **options)
    comparison = compare(ragged_paged_attention(**arrays, **options), result, label="jnp reference")
    assert comparison.ok, str(comparison)
    return result, comparison


SCENARIOS = {
    "decode": dict(q_lens=(1, 1, 1), kv_lens=(9, 1, 16)),
    "prefill": dict(q_lens=(13, 6), kv_lens=(13, 6)),
    "mixed": dict(q_lens=(1, 7, 3), kv_lens=(30, 7, 12)),
    "q_len_0": dict(q_lens=(0, 4, 0), kv_lens=(5, 9, 0)),
    "page_size_1": dict(q_lens=(2, 5), kv_lens=(3, 11), page_size=1),
    "gqa_8_to_1": dict(q_lens=(3, 2), kv_lens=(17, 4), num_q_heads=8, num_kv_heads=1),
    "mha_head_dim_128": dict(q_lens=(4, 1), kv_lens=(10, 21), num_q_heads=2, num_kv_heads=2, head_dim=128),
    "bf16": dict(q_lens=(1, 7, 3), kv_lens=(30, 7, 12), q_dtype=BF16, kv_dtype=BF16),
    "bf16_q_f32_kv": dict(q_lens=(5, 2), kv_lens=(9, 20), q_dtype=BF16, kv_dtype=F32),
    "f32_q_bf16_kv": dict(q_lens=(5, 2), kv_lens=(9, 20), q_dtype=F32, kv_dtype=BF16),
    "no_garbage": dict(q_lens=(2, 3), kv_lens=(8, 3), garbage=False, spare_seqs=0, spare_rows=0),
}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_reference_matches_oracle_on_layouts(name):
    check_reference(
        build_case(1, **SCENARIOS[name]), sm_scale=1 / math.sqrt(SCENARIOS[name].get("head_dim", 32))
    )


OPTION_SCENARIOS = {
    "window": dict(sliding_window=3),
    "window_1": dict(sliding_window=1),
    "soft_cap": dict(soft_cap=2.5, sm_scale=1.0),
    "window_soft_cap": dict(sliding_window=5, soft_cap=10.0),
    "mask_value_none": dict(mask_value=None),
    "mask_value_custom": dict(mask_value=-1.0),
    "mask_value_custom_window": dict(mask_value=-2.0, sliding_window=2),
    "scales": dict(k_scale=0.37, v_scale=1.9),
}


@pytest.mark.parametrize("name", sorted(OPTION_SCENARIOS))
def test_reference_matches_oracle_with_options(name):
    arrays = build_case(2, q_lens=(1, 7, 3), kv_lens=(30, 7, 12))
    check_reference(arrays, **{"sm_scale": 0.25, **OPTION_SCENARIOS[name]})


@pytest.mark.parametrize("kv_dtype", [E4M3, E5M2], ids=str)
@pytest.mark.parametrize("q_dtype", [F32, BF16], ids=str)
def test_reference_matches_oracle_for_fp8_with_and_without_scales(q_dtype, kv_dtype):
    arrays = build_case(3, q_lens=(2, 5), kv_lens=(11, 5), q_dtype=q_dtype, kv_dtype=kv_dtype)
    check_reference(arrays, sm_scale=0.2)
    check_reference(arrays, sm_scale=0.2, k_scale=0.6, v_scale=3.3)


def test_custom_mask_value_changes_the_result_and_none_means_default():
    arrays = build_case(4, q_lens=(6,), kv_lens=(6,))
    default = oracle(**arrays)
    assert np.array_equal(oracle(**arrays, mask_value=None).out, default.out, equal_nan=True)
    custom = oracle(**arrays, mask_value=-1.0)
    # Row 0 sees only key 0 under a hard mask; with mask -1 the later keys leak in with weight e^(s-1).
    first_values = arrays["kv_pages"][arrays["page_indices"][0, 0], 0, 1::2]
    np.testing.assert_array_equal(default.out[0], np.repeat(first_values, 2, axis=0))
    assert not np.allclose(custom.out[:5], default.out[:5])


def test_oracle_by_hand():
    """One sequence, kv_len 2, q_len 2, one head, head_dim 2: every number worked out on paper."""
    q = np.array([[[1.0, 0.0]], [[2.0, 1.0]], [[np.nan, np.nan]]], np.float32)
    kv_pages = np.full((2, 2, 2, 2), np.nan, np.float32)
    kv_pages[1, 0] = [[1.0, 0.0], [3.0, 5.0]]  # key 0, value 0
    kv_pages[1, 1] = [[0.0, 1.0], [-1.0, 7.0]]  # key 1, value 1
    arrays = dict(
        q=q,
        kv_pages=kv_pages,
        kv_lens=np.array([2, 99], np.int32),
        page_indices=np.array([[1, -5], [7, 7]], np.int32),
        cu_q_lens=np.array([0, 2, -3], np.int32),
        num_seqs=np.array([1], np.int32),
    )
    v0, v1 = np.array([3.0, 5.0]), np.array([-1.0, 7.0])
    result = oracle(**arrays, sm_scale=0.5)
    np.testing.assert_array_equal(result.out[0, 0], v0)  # position 0 sees key 0 only
    p0 = math.exp(1.0) / (math.exp(1.0) + math.exp(0.5))  # logits 0.5 * (2, 1)
    np.testing.assert_allclose(result.out[1, 0], p0 * v0 + (1 - p0) * v1, rtol=1e-15)
    assert np.isnan(result.out[2]).all() and result.row_sequence.tolist() == [0, 0, -1]
    assert result.row_token.tolist() == [0, 1, -1] and result.row_kv_len.tolist() == [2, 2, 0]
    # Row 0 with mask_value=-1: key 1 enters with logit 0 - 1 against key 0's 0.5.
    p0_custom = math.exp(0.5) / (math.exp(0.5) + math.exp(-1.0))
    custom = oracle(**arrays, sm_scale=0.5, mask_value=-1.0)
    np.testing.assert_allclose(custom.out[0, 0], p0_custom * v0 + (1 - p0_custom) * v1, rtol=1e-15)
    # sliding_window=1 masks key 0 for position 1 (1 - 1 >= 0): row 1 becomes v1.
    np.testing.assert_array_equal(oracle(**arrays, sliding_window=1).out[1, 0], v1)
    # soft cap 1: logits tanh(1), tanh(0.5) for row 1 (sm_scale 0.5).
    w = np.exp([math.tanh(1.0), math.tanh(0.5)])
    capped = oracle(**arrays, sm_scale=0.5, soft_cap=1.0)
    np.testing.assert_allclose(capped.out[1, 0], (w[0] * v0 + w[1] * v1) / w.sum(), rtol=1e-15)
    check_reference(arrays, sm_scale=0.5)
    check_reference(arrays, sm_scale=0.5, mask_value=-1.0)


def test_oracle_quantities_for_the_precision_contracts_by_hand():
    """Row 1 of the hand case: keys 0 and 1 with weights p0, 1 - p0; dot conditions A = 0.5 * (|2*1|, |1*1|)."""
    q = np.array([[[1.0, 0.0]], [[2.0, 1.0]]], np.float32)
    kv_pages = np.zeros((1, 2, 2, 2), np.float32)
    kv_pages[0, 0] = [[1.0, 0.0], [3.0, 5.0]]
    kv_pages[0, 1] = [[0.0, 1.0], [-1.0, 7.0]]
    arrays = dict(
        q=q,
        kv_pages=kv_pages,
        kv_lens=np.array([2], np.int32),
        page_indices=np.array([[0]], np.int32),
        cu_q_lens=np.array([0, 2], np.int32),
        num_seqs=np.array([1], np.int32),
    )
    result = oracle(**arrays, sm_scale=0.5)
    p = np.array([math.exp(1.0), math.exp(0.5)]) / (math.exp(1.0) + math.exp(0.5))
    values = np.array([[3.0, 5.0], [-1.0, 7.0]])
    dot_abs = np.array([1.0, 0.5])
    o = p @ values
    exact = (p * dot_abs) @ np.abs(values - o)
    assert result.page_size == 2 and result.key_dtype == F32 and result.value_dtype == F32
    np.testing.assert_array_equal(result.max_dot_abs[1, 0], [1.0, 1.0])
    assert (result.dot_sensitivity[1, 0] >= exact * (1 - 1e-12)).all()
    assert (result.dot_sensitivity[1, 0] <= (p * dot_abs) @ (np.abs(values) + np.abs(o)) * (1 + 1e-12)).all()
    assert (result.value_underflow < 2.0**-140).all()  # float32 V: half its smallest subnormal is 2**-150
    # fp8 V with a scale is read in q's dtype; without one, in the KV dtype, where tiny weights underflow.
    fp8 = dict(arrays, kv_pages=kv_pages.astype(E4M3), q=q.astype(BF16))
    assert oracle(**fp8, v_scale=2.0).value_dtype == BF16 and oracle(**fp8).value_dtype == E4M3
    peaked = oracle(**dict(fp8, q=(q * 30).astype(BF16)))  # row 1 weights ~ (1, e^-30)
    assert 0 < peaked.value_underflow[1, 0, 0] <= 2.0**-10 * (1 + 7 + 5)


def test_oracle_reproduces_the_scale_rounding_to_q_dtype():
    """k_scale: fp8 -> float32 * scale (float32 rounding) -> q's dtype; a value off the bf16 grid shows it."""
    kv_pages = np.zeros((1, 1, 2, 1), E4M3)
    kv_pages[0, 0, 1, 0] = 1.125  # V
    arrays = dict(
        q=np.ones((1, 1, 1), BF16),
        kv_pages=kv_pages,
        kv_lens=np.array([1], np.int32),
        page_indices=np.array([[0]], np.int32),
        cu_q_lens=np.array([0, 1], np.int32),
        num_seqs=np.array([1], np.int32),
    )
    v_scale = 0.3
    expected = float(np.array(np.float32(1.125) * np.float32(v_scale)).astype(BF16))
    assert expected != 1.125 * v_scale
    assert oracle(**arrays, v_scale=v_scale).out[0, 0, 0] == expected
    assert float(np.asarray(ragged_paged_attention(**arrays, v_scale=v_scale))[0, 0, 0]) == expected


def test_oracle_rejects_live_metadata_it_cannot_read():
    arrays = build_case(5, q_lens=(2, 3), kv_lens=(4, 6))
    arrays["page_indices"][1, 0] = 10_000
    with pytest.raises(ValueError, match=r"sequence 1: page_indices\[1, :2\]=\[10000, "):
        oracle(**arrays)
    arrays = build_case(5, q_lens=(2, 3), kv_lens=(4, 2))
    with pytest.raises(ValueError, match="sequence 1: need 0 <= q_len <= kv_len.*q_len=3, kv_len=2"):
        oracle(**arrays)


def test_reference_compiles_once_across_ragged_layouts():
    layouts = [((1, 1, 1, 1), (40, 3, 17, 1)), ((20,), (37,)), ((0, 9, 2), (4, 9, 30)), ((), ())]
    shapes = dict(
        q=(23, 6, 16),
        kv_pages=(31, 4, 6, 16),
        kv_lens=(5,),
        page_indices=(5, 10),
        cu_q_lens=(6,),
        num_seqs=(1,),
    )
    before = _ragged_paged_attention._cache_size()
    for seed, (q_lens, kv_lens) in enumerate(layouts):
        arrays = build_case(seed, q_lens, kv_lens, num_q_heads=6, num_kv_heads=3, head_dim=16, spare_pages=0)
        arrays["num_seqs"] = np.array([len(q_lens)], np.int32)
        arrays = {name: _padded(arrays[name], shapes[name]) for name in shapes}
        check_reference(arrays, sm_scale=0.3)
    assert _ragged_paged_attention._cache_size() == before + 1


def _padded(array, shape):
    """``array`` grown to ``shape`` with NaN (floats) or 0 (ints) at the end of each axis."""
    fill = np.nan if np.issubdtype(array.dtype, np.floating) else 0
    out = np.full(shape, fill, array.dtype)
    out[tuple(slice(0, s) for s in array.shape)] = array
    return out


UPSTREAM_CASES = {
    "f32_mask_custom_window": dict(
        q_dtype=F32, kv_dtype=F32, options=dict(mask_value=-1.0, sliding_window=3)
    ),
    "bf16_q_soft_cap": dict(q_dtype=BF16, kv_dtype=F32, options=dict(soft_cap=4.0, sm_scale=0.3)),
    "fp8_with_scales": dict(q_dtype=F32, kv_dtype=E4M3, options=dict(k_scale=0.5, v_scale=1.5)),
}


def upstream_reference(arrays, result, **options):
    """Upstream's reference output, padded with NaN to the full row count (it returns only owned rows)."""
    theirs = np.asarray(upstream_in_one_program(arrays, arrays["q"], arrays["kv_pages"], **options))
    padded = np.full(result.out.shape, np.nan, theirs.dtype)
    padded[: theirs.shape[0]] = theirs
    return padded


@pytest.mark.parametrize("name", sorted(UPSTREAM_CASES))
def test_upstream_reference_agrees_where_it_is_exact(name):
    """Upstream is exact (float32 P @ V) when V, after any v_scale, is float32."""
    spec = UPSTREAM_CASES[name]
    arrays = build_case(6, (1, 4), (9, 4), q_dtype=spec["q_dtype"], kv_dtype=spec["kv_dtype"])
    result = oracle(**arrays, **spec["options"])
    theirs = upstream_reference(arrays, result, **spec["options"])
    assert compare(theirs, result, label="upstream reference").ok
    ours = np.asarray(ragged_paged_attention(**arrays, **spec["options"])).astype(np.float64)
    owned = result.owned_rows
    gap = np.abs(ours[owned] - theirs[owned].astype(np.float64))
    assert (gap <= 2 * error_bound(result)[owned]).all()


ROUNDED_P_CASES = {
    "fp8_cache_without_v_scale": dict(
        q_dtype=F32, kv_dtype=E4M3, options=dict(sm_scale=0.2), mantissa_bits=3
    ),
    "bf16_values": dict(q_dtype=BF16, kv_dtype=BF16, options=dict(sm_scale=0.2), mantissa_bits=7),
    "v_scale_to_bf16_q": dict(q_dtype=BF16, kv_dtype=E5M2, options=dict(v_scale=0.7), mantissa_bits=7),
}


@pytest.mark.parametrize("name", sorted(ROUNDED_P_CASES))
def test_upstream_reference_rounds_probabilities_to_the_value_dtype(name):
    """The documented exception: upstream casts P to V's dtype (fp8 without v_scale, else bf16 for bf16 V or a
    v_scale into a bf16 q). The specification keeps P in float32; the tolerance model must see the difference."""
    spec = ROUNDED_P_CASES[name]
    arrays = build_case(7, (1, 4), (9, 4), q_dtype=spec["q_dtype"], kv_dtype=spec["kv_dtype"])
    result = oracle(**arrays, **spec["options"])
    comparison = compare(upstream_reference(arrays, result, **spec["options"]), result, label="upstream")
    assert not comparison.ok and comparison.max_ratio > 2, str(comparison)
    # The error is the size of a rounding in V's dtype, not a layout or masking difference.
    worst = comparison.worst
    assert worst.error < 2.0 ** -spec["mantissa_bits"] * (1 + abs(worst.expected))
    assert compare(ragged_paged_attention(**arrays, **spec["options"]), result).ok


def float32_attention(arrays, *, sm_scale, k_scale=None, bug=None):
    """A float32 NumPy attention built independently; ``bug`` switches one precision or masking error in."""
    q, kv_pages = arrays["q"], arrays["kv_pages"]
    num_q_heads, head_dim = q.shape[1:]
    page_size, num_combined = kv_pages.shape[1:3]
    group = num_q_heads // (num_combined // 2)
    out = np.zeros(q.shape, np.float32)
    for i in range(int(arrays["num_seqs"][0])):
        start, end = arrays["cu_q_lens"][i : i + 2]
        kv_len = int(arrays["kv_lens"][i])
        pages = arrays["page_indices"][i, : -(-kv_len // page_size)]
        kv = kv_pages[pages].reshape(-1, num_combined, head_dim)[:kv_len]
        k = kv[:, 0::2].astype(np.float32)
        if k_scale is not None:
            scaled = k if bug == "k_scale_ignored" else k * np.float32(k_scale)
            k = scaled.astype(q.dtype).astype(np.float32)
        k = np.repeat(k, group, axis=1)
        v = np.repeat(kv[:, 1::2].astype(np.float32), group, axis=1)
        logits = np.einsum("qhd,khd->hqk", q[start:end].astype(np.float32), k) * np.float32(sm_scale)
        positions = kv_len - (end - start) + np.arange(end - start)
        visible_up_to = positions + (1 if bug == "causal_off_by_one" else 0)
        logits = np.where(np.arange(kv_len) > visible_up_to[:, None], np.float32(-3e38), logits)
        softmax_dtype = BF16 if bug == "softmax_bf16" else np.float32
        logits = logits.astype(softmax_dtype)
        weights = np.exp((logits - logits.max(-1, keepdims=True)).astype(softmax_dtype)).astype(softmax_dtype)
        probs = (weights / weights.sum(-1, keepdims=True, dtype=softmax_dtype)).astype(softmax_dtype)
        if bug == "pv_bf16":
            acc = np.zeros((num_q_heads, end - start, head_dim), BF16)
            for key in range(kv_len):
                acc = (acc + probs[:, :, key, None].astype(BF16) * v[key, :, None, :].astype(BF16)).astype(
                    BF16
                )
            rows = acc.astype(np.float32)
        else:
            rows = np.einsum("hqk,khd->hqd", probs.astype(np.float32), v)
        out[start:end] = rows.transpose(1, 0, 2)
    return out.astype(q.dtype)


BUGS = {
    "softmax_bf16": dict(sm_scale=0.25),
    "pv_bf16": dict(sm_scale=0.25),
    "k_scale_ignored": dict(sm_scale=0.25, k_scale=0.5),
    "causal_off_by_one": dict(sm_scale=0.25),
}


@pytest.mark.parametrize("q_dtype", [F32, BF16], ids=str)
@pytest.mark.parametrize("bug", sorted(BUGS))
def test_tolerance_catches_imprecise_variants(bug, q_dtype):
    kv_dtype = E4M3 if bug == "k_scale_ignored" else q_dtype
    arrays = build_case(
        8, (1, 9, 4), (40, 9, 22), q_dtype=q_dtype, kv_dtype=kv_dtype, num_q_heads=4, head_dim=64
    )
    result = oracle(**arrays, **BUGS[bug])
    correct = compare(float32_attention(arrays, **BUGS[bug]), result, label="float32 NumPy attention")
    assert correct.ok, str(correct)  # the harness is sound, so the failure below is the bug's
    buggy = compare(float32_attention(arrays, **BUGS[bug], bug=bug), result, label=bug)
    assert not buggy.ok and buggy.num_over > 0, str(buggy)


def test_bounds_are_far_tighter_than_upstream_tolerances():
    """Upstream's tests use atol = rtol = 0.15 (f32 cache) and 0.2 (bf16/fp8 cache)."""
    for dtype, upstream_tol, factor in ((F32, 0.15, 100), (BF16, 0.2, 5)):
        arrays = build_case(9, (1, 12, 5), (33, 12, 20), q_dtype=dtype, kv_dtype=dtype, head_dim=128)
        result = oracle(**arrays, sm_scale=128**-0.5)
        owned = result.owned_rows
        bound = error_bound(result)[owned]
        assert (bound * factor <= upstream_tol * (1 + np.abs(result.out[owned]))).all()


def test_report_locates_the_wrong_element():
    arrays = build_case(10, (3, 0, 6, 2), (5, 2, 6, 9))
    result, _ = check_reference(arrays, sm_scale=0.3)
    out = np.array(ragged_paged_attention(**arrays, sm_scale=0.3))
    row = 3 + 4  # sequence 2 starts at row 3 (sequence 1 has no rows); token 4
    out[row, 2, 5] += 0.01
    comparison = compare(out, result, label="kernel")
    assert not comparison.ok and comparison.num_over == 1 and comparison.nonfinite == 0
    worst = comparison.worst
    assert (worst.sequence, worst.token, worst.row, worst.head, worst.dim) == (2, 4, row, 2, 5)
    assert worst.ratio > 1 and worst.actual == out[row, 2, 5]
    assert "sequence 2, token 4 (row 7), head 2, dim 5" in str(comparison)
    assert "FAIL: 1 of 1408 elements over the bound" in str(comparison)
    out[row, 2, 5] = np.nan
    comparison = compare(out, result)
    assert comparison.nonfinite == 1 and comparison.max_ratio == np.inf and not comparison.ok
    assert (comparison.worst.sequence, comparison.worst.token) == (2, 4)


def test_report_ignores_unowned_rows_and_checks_the_dtype():
    arrays = build_case(11, (2, 3), (4, 6), spare_rows=4)
    result, _ = check_reference(arrays)
    out = np.array(ragged_paged_attention(**arrays))
    out[5:] = np.nan
    assert compare(out, result).ok
    wrong_dtype = compare(out.astype(BF16).astype(np.float64), result)
    assert not wrong_dtype.ok and "but got float64: wrong" in str(wrong_dtype)
    with pytest.raises(ValueError, match=r"output has shape \(4, 4, 32\) but the oracle's is \(9, 4, 32\)"):
        compare(out[:4], result)


ORACLE_QUANTITIES = ("out", "abs_pv", "flushable_pv", "logit_sensitivity", "dot_sensitivity", "max_dot_abs",
                     "value_underflow")  # fmt: skip


@pytest.mark.parametrize(
    "extensions",
    [
        {},
        dict(mask_value=-2.0, mask_value_meaning="replaces", q_scale=0.3),
        dict(attention_sink=(30.0, float("-inf"), -1.0, 2.0)),
    ],
    ids=["upstream's semantics", "v3's: replaced mask, q_scale", "attention sinks"],
)
def test_oracle_in_key_chunks_equals_the_oracle_in_one_chunk(monkeypatch, extensions):
    """Long sequences are streamed in key chunks (production shapes); small cases never are, so force it."""
    from rpa_harness.reference import float64 as oracle_module

    case = Case(
        max_num_batched_tokens=16, max_num_seqs=2, pages_per_seq=8, total_num_pages=17, page_size=4,
        num_q_heads=4, num_kv_heads=2, head_dim=64, q_dtype="bfloat16", kv_dtype="float8_e4m3fn",
        q_lens=(3, 1), kv_lens=(29, 17), sliding_window=20, soft_cap=30.0, **extensions,
    )  # fmt: skip
    whole = oracle(**case.arrays(), **case.options())
    monkeypatch.setattr(oracle_module, "_MAX_CHUNK_KEYS", case.page_size)
    assert oracle_module._chunk_sizes(4, 2, 64, case.page_size, 29)[0] == case.page_size
    chunked = oracle(**case.arrays(), **case.options())
    for name in ORACLE_QUANTITIES:  # the bound's ingredients differ in float64 rounding (cancellation)
        np.testing.assert_allclose(
            getattr(chunked, name), getattr(whole, name), rtol=1e-12 if name == "out" else 1e-8, atol=1e-300,
            equal_nan=True, err_msg=name,
        )  # fmt: skip


@pytest.mark.parametrize("q_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("q_scale", [1e-4, 0.3, 0.01])
def test_the_quantised_query_doubt_covers_a_compilers_quotient(q_dtype, kv_dtype, q_scale):
    """XLA divides by a constant as a multiplication by its reciprocal: wherever its quantised query differs
    from the IEEE one the oracle uses, the difference is within the oracle's doubt, which is rare."""
    import jax
    import jax.numpy as jnp

    from rpa_harness.reference.float64 import quantised_query, quantised_query_doubt

    q = np.random.default_rng(0).standard_normal(1 << 16).astype(np.float32)
    q = q.astype(getattr(ml_dtypes, q_dtype, q_dtype))
    info = jnp.finfo(getattr(jnp, kv_dtype))
    quotient = jax.jit(lambda x: x / q_scale)(q)
    compiled = np.asarray(jnp.clip(quotient, float(info.min), float(info.max)).astype(info.dtype)).astype(
        np.float64
    )
    ieee = quantised_query(q, q_scale, getattr(ml_dtypes, kv_dtype))
    doubt = quantised_query_doubt(q, q_scale, getattr(ml_dtypes, kv_dtype))
    doubt = np.zeros_like(ieee) if doubt is None else doubt
    differ = compiled != ieee
    assert np.all(np.abs(compiled - ieee)[differ] <= doubt[differ]), np.flatnonzero(differ)[:5]
    # A bfloat16 q over a bfloat16-rounded scale often lands within an ulp of a bfloat16 midpoint.
    assert np.count_nonzero(doubt) <= q.size // (100 if q_dtype == "float32" else 20)


def test_a_query_in_doubt_widens_the_bound_of_its_rows_only():
    """The case where a bfloat16 ulp of one quantised element moved a 1e4-scaled logit past the float32
    bound: the compiler's quantisation (the jnp reference, jitted) is judged right, and only the rows that
    read the doubted element get a wider bound."""
    case = Case(
        max_num_batched_tokens=32, max_num_seqs=4, pages_per_seq=49, total_num_pages=199, page_size=2,
        num_q_heads=12, num_kv_heads=4, head_dim=256, q_dtype="float32", kv_dtype="bfloat16",
        q_lens=(1, 1, 11), kv_lens=(19, 18, 34), q_scale=1e-4, mask_value_meaning="replaces", seed=158,
    )  # fmt: skip
    arrays, options = case.arrays(), case.options()
    result = oracle(**arrays, **options)
    assert compare(ragged_paged_attention(**arrays, **options), result).ok
    doubted_rows = np.flatnonzero(result.max_query_doubt.max(axis=(1, 2)) > 0)
    assert doubted_rows.size and set(doubted_rows) <= set(range(case.num_tokens))
    widened = result.query_doubt_sensitivity.max(axis=(1, 2)) > 0
    assert set(np.flatnonzero(widened)) <= set(doubted_rows)


# stacked RPA's contract on bfloat16 queries, an fp8 e5m2 cache of large values under a soft cap: raw logits
# in the thousands, which bfloat16 knows only to tens, so any weights are possible (a case its strategies draw).
LARGE_LOGITS = Case(
    max_num_batched_tokens=8, max_num_seqs=2, pages_per_seq=2, total_num_pages=7, page_size=128, num_q_heads=6,
    num_kv_heads=2, head_dim=256, q_dtype="bfloat16", kv_dtype="float8_e5m2", q_lens=(1,), kv_lens=(206,),
    soft_cap=30.0, k_scale=2.0, mask_value_meaning="replaces", seed=351, values="large",
)  # fmt: skip
SOFTMAX_IN_BFLOAT16 = ("float32", "accumulators-in-output-dtype", "softmax-in-output-dtype")


def test_the_values_hull_caps_a_bound_that_large_logits_explode():
    """The weights' exponential error terms exceed 1e40 here; the output is still a convex combination of
    the values, so the bound is at most their spread (with slack for the accumulation), and an output
    outside the values' range fails."""
    result = oracle(**LARGE_LOGITS.arrays(), **LARGE_LOGITS.options())
    owned = result.owned_rows
    bound = error_bound(result, precision=SOFTMAX_IN_BFLOAT16)[owned]
    spread = result.value_spread[owned]
    assert np.isfinite(bound).all() and (bound <= 1.1 * spread + 0.1).all(), (bound.max(), spread.max())
    assert (result.value_spread[owned] >= np.abs(result.out[owned])).all()  # the hull holds o and every v
    assert compare(result.out.astype(BF16), result, precision=SOFTMAX_IN_BFLOAT16).ok
    outside = result.out.copy()
    outside[owned] += 2 * result.max_abs_value[owned]
    comparison = compare(outside.astype(BF16), result, precision=SOFTMAX_IN_BFLOAT16)
    assert comparison.num_over == comparison.num_checked, str(comparison)
