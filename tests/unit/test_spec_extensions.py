"""The extension options (rpa_harness.spec.interface.EXTENSION_NAMES: q_scale, mask_value_meaning,
attention_sink) stay out of upstream's interface and are computed by both judges.

Upstream's kernel and ours keep upstream's signature: neither takes an extension keyword, and the
strategies draw one only for a target whose capabilities declare it.
"""

import dataclasses
import inspect

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rpa_harness import kernel, reference
from rpa_harness.reference.variants import contract_attention
from rpa_harness.spec.interface import EXTENSION_NAMES, MASK_REPLACES, OPTION_NAMES, Options, check_extensions
from rpa_harness.strategies.capabilities import Capabilities
from rpa_harness.strategies.case import Case
from rpa_harness.strategies.options import SINK_LOGITS
from rpa_harness.strategies.valid import valid_cases
from rpa_harness.targets.bundled import RPA_HARNESS_CAPABILITIES as OUR_KERNEL
from rpa_harness.targets.upstream import RPA_HARNESS_CAPABILITIES as UPSTREAM_KERNEL

# What tpu-inference v3's head_dim-64 kernel declares (rpa_harness/targets/tpu_inference_v3_hd64/), without
# importing it, for every head_dim.
EXTENDED = Capabilities(
    mask_value_meaning=MASK_REPLACES, q_scale=True, page_size_multiple_of_kv_packing=True, attention_sink=True
)
TINY = Case(max_num_batched_tokens=8, max_num_seqs=1, pages_per_seq=3, total_num_pages=4, page_size=4,
            num_q_heads=1, num_kv_heads=1, head_dim=64, q_lens=(2,), kv_lens=(3,), poison=False)  # fmt: skip


def test_our_kernel_keeps_upstream_signature():
    parameters = inspect.signature(kernel.ragged_paged_attention).parameters
    assert not set(EXTENSION_NAMES) & set(parameters)
    assert set(OPTION_NAMES) <= set(parameters)
    arrays = TINY.arrays()
    with pytest.raises(TypeError, match="q_scale"):
        kernel.ragged_paged_attention(**arrays, q_scale=0.5)


@pytest.mark.parametrize("capabilities", [OUR_KERNEL, UPSTREAM_KERNEL], ids=["ours", "upstream"])
@settings(max_examples=60, deadline=None)
@given(data=__import__("hypothesis").strategies.data())
def test_extensions_are_drawn_only_when_declared(capabilities, data):
    for pooled in (False, True):
        case = data.draw(valid_cases(capabilities, pooled=pooled))
        assert not set(EXTENSION_NAMES) & set(case.options())


@settings(max_examples=40, deadline=None)
@given(case=valid_cases(EXTENDED))
def test_reference_matches_oracle_with_extensions(case):
    """The jnp reference and the float32 calibration variant agree with the float64 oracle on the extension
    semantics too, within the float32 contract."""
    arrays, options = case.arrays(), case.options()
    expected = reference.oracle(**arrays, **options)
    for label, actual in (
        ("reference", reference.ragged_paged_attention(**arrays, **options)),
        ("float32 variant", contract_attention(**arrays, **options)),
    ):
        comparison = reference.compare(actual, expected, label=label)
        assert comparison.ok, f"{case.describe()}\n{comparison}"


def test_replacing_mask_value_weights_masked_keys():
    """Replaced, a masked logit is mask_value itself: with 3 keys and query rows at positions 1 and 2,
    row 0 (position 1) gives key 2 the weight exp(mask_value) / sum (logits made 0 by a zero query)."""
    case = dataclasses.replace(TINY, mask_value=0.0, mask_value_meaning=MASK_REPLACES)
    arrays = case.arrays()
    arrays["q"][:] = 0.0  # every live logit 0: masked ones replaced by 0 too, so all weights equal
    out = reference.oracle(**arrays, **case.options()).out
    v = arrays["kv_pages"][arrays["page_indices"][0, 0], :3, 1].astype(np.float64)
    np.testing.assert_allclose(out[0, 0], v.mean(axis=0), rtol=1e-12)
    added = reference.oracle(**arrays, **dataclasses.replace(case, mask_value_meaning="added").options()).out
    np.testing.assert_allclose(added[0, 0], v.mean(axis=0), rtol=1e-12)  # 0 added: no mask at all
    default = reference.oracle(**arrays, **dataclasses.replace(case, mask_value=None).options()).out
    np.testing.assert_allclose(default[0, 0], v[:2].mean(axis=0), rtol=1e-12)  # finfo.min: masked


def test_q_scale_clips_to_the_kv_range_and_casts():
    """q / q_scale beyond fp8 e4m3fn's 448 is clipped to 448, then q is cast to fp8; logits times q_scale."""
    from rpa_harness.reference.float64 import quantised_query

    q = np.array([1.0, -10.0, 0.3], np.float32)
    got = quantised_query(q, 0.01, np.dtype(ml_dtypes.float8_e4m3fn))
    expected = np.array([100.0, -448.0, 30.0], np.float32).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    np.testing.assert_array_equal(got, expected)
    assert Options(q_scale=0.5).extension_keywords() == {"q_scale": 0.5}


# Two KV heads of two q heads, a prefill of 3 rows over 6 keys: every row sees a different key count.
SINKS = Case(max_num_batched_tokens=8, max_num_seqs=1, pages_per_seq=3, total_num_pages=4, page_size=4,
             num_q_heads=4, num_kv_heads=2, head_dim=64, q_lens=(3,), kv_lens=(6,), sm_scale=0.125,
             attention_sink=(-1.0, 0.5, 3.0, float("-inf")), poison=False)  # fmt: skip


def _softmax_with_a_zero_value_column(case: Case) -> np.ndarray:
    """[q_len, heads, dim]: each head's softmax over [sink, logits] applied to [0, values], in float64."""
    arrays = case.arrays()
    q = arrays["q"][: case.num_tokens].astype(np.float64)
    kv = (
        arrays["kv_pages"][arrays["page_indices"][0]].reshape(-1, 4, 64)[: case.kv_lens[0]].astype(np.float64)
    )
    group = case.num_q_heads // case.num_kv_heads
    k, v = np.repeat(kv[:, 0::2], group, axis=1), np.repeat(kv[:, 1::2], group, axis=1)
    logits = np.einsum("qhd,khd->hqk", q, k) * case.sm_scale
    positions = case.kv_lens[0] - case.q_lens[0] + np.arange(case.q_lens[0])
    logits = np.where(np.arange(case.kv_lens[0])[None, None, :] > positions[None, :, None], -np.inf, logits)
    sinks = np.broadcast_to(np.asarray(case.attention_sink)[:, None, None], (*logits.shape[:2], 1))
    with_sink = np.concatenate([sinks, logits], axis=-1)
    weights = np.exp(with_sink - with_sink.max(axis=-1, keepdims=True))
    probs = weights / weights.sum(axis=-1, keepdims=True)
    values = np.concatenate([np.zeros((1, *v.shape[1:])), v])
    return np.einsum("hqk,khd->qhd", probs, values)


def test_a_sink_is_a_softmax_column_whose_value_is_zero():
    """The oracle's sinks against an independent statement of them: one more logit per head in the softmax,
    with a value of 0."""
    out = reference.oracle(**SINKS.arrays(), **SINKS.options()).out[: SINKS.num_tokens]
    np.testing.assert_allclose(out, _softmax_with_a_zero_value_column(SINKS), rtol=1e-12, atol=1e-15)
    without = reference.oracle(**SINKS.arrays(), **dataclasses.replace(SINKS, attention_sink=None).options())
    assert not np.allclose(out[:, :3], without.out[: SINKS.num_tokens, :3], rtol=1e-3)  # the sinks weigh


def test_a_sink_of_minus_inf_is_no_sink_and_a_dominating_one_takes_every_weight():
    case = dataclasses.replace(SINKS, attention_sink=(float("-inf"), -1e30, 1e4, float("-inf")))
    arrays = case.arrays()
    out = reference.oracle(**arrays, **case.options()).out
    without = reference.oracle(**arrays, **dataclasses.replace(case, attention_sink=None).options()).out
    np.testing.assert_array_equal(out[:3, [0, 1, 3]], without[:3, [0, 1, 3]])
    assert not out[:3, 2].any()  # exp(s - 1e4) is 0 in float64: no key keeps a weight
    jnp_out = np.asarray(reference.ragged_paged_attention(**arrays, **case.options()))
    jnp_without = np.asarray(
        reference.ragged_paged_attention(**arrays, **dataclasses.replace(case, attention_sink=None).options())
    )
    np.testing.assert_array_equal(jnp_out[:3, [0, 1, 3]], jnp_without[:3, [0, 1, 3]])
    assert not jnp_out[:3, 2].any()


@pytest.mark.parametrize(
    ("sinks", "message"),
    [
        ((0.0, 1.0), "attention_sink has 2 logits but q has num_q_heads=4; pass one logit per q head."),
        ([0.0] * 4, "attention_sink=[0.0, 0.0, 0.0, 0.0] (list) must be None or a tuple of Python floats"),
        (
            (0.0, 1, 2.0, 3.0),
            "attention_sink=(0.0, 1, 2.0, 3.0) (tuple) must be None or a tuple of Python floats",
        ),
    ],
    ids=["too few", "a list", "an int"],
)
def test_sink_rules_name_the_value_and_the_fix(sinks, message):
    with pytest.raises(ValueError) as raised:
        check_extensions(Options(attention_sink=sinks), 4)
    assert str(raised.value).startswith(message)
    with pytest.raises(ValueError):
        reference.oracle(**SINKS.arrays(), **dataclasses.replace(SINKS, attention_sink=sinks).options())


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_sinks_are_drawn_per_q_head_for_a_target_that_declares_them(data):
    case = data.draw(valid_cases(EXTENDED, pooled=data.draw(st.booleans())))
    if case.attention_sink is not None:
        assert len(case.attention_sink) == case.num_q_heads
        assert set(case.attention_sink) <= set(SINK_LOGITS)
        assert Case.from_json(case.to_json()) == case  # a tuple again, hashable


# ---- tpu-inference v3's options: non-causal attention, the accumulator dtype, and the tuning ones ----

V3_OPTIONS = Capabilities(
    mask_value_meaning=MASK_REPLACES,
    page_size_multiple_of_kv_packing=True,
    empty_sequences=False,
    non_causal=True,
    out_dtype=True,
    skip_kv_mask=True,
    chunk_prefill_size=True,
    update_kv_cache=True,
)


def _softmax_over_every_key(case: Case, arrays: dict) -> np.ndarray:
    """Float64 attention in which each query of a sequence sees all its keys, straight from the arrays."""
    q = arrays["q"].astype(np.float64)
    kv = arrays["kv_pages"].astype(np.float64)
    out = np.zeros(q.shape)
    group = case.num_q_heads // case.num_kv_heads
    start = 0
    for i, (q_len, kv_len) in enumerate(zip(case.q_lens, case.kv_lens, strict=True)):
        pages = arrays["page_indices"][i, : -(-kv_len // case.page_size)]
        keys = kv[pages].reshape(-1, 2 * case.num_kv_heads, case.head_dim)[:kv_len]
        for h in range(case.num_q_heads):
            k, v = keys[:, 2 * (h // group)], keys[:, 2 * (h // group) + 1]
            logits = case.sm_scale * q[start : start + q_len, h] @ k.T
            weights = np.exp(logits - logits.max(axis=-1, keepdims=True))
            out[start : start + q_len, h] = (weights / weights.sum(axis=-1, keepdims=True)) @ v
        start += q_len
    return out


def test_non_causal_attention_sees_every_key_of_its_sequence():
    case = dataclasses.replace(TINY, q_lens=(3,), kv_lens=(5,), use_causal_mask=False)
    arrays = case.arrays()
    expected = _softmax_over_every_key(case, arrays)
    result = reference.oracle(**arrays, **case.options())
    assert np.allclose(result.out[:3], expected[:3], rtol=1e-12, atol=1e-12)
    causal = reference.oracle(**arrays, **dataclasses.replace(case, use_causal_mask=True).options())
    assert not np.allclose(causal.out[:2], expected[:2])  # the first two queries see fewer keys causally
    jnp_out = reference.ragged_paged_attention(**arrays, **case.options())
    assert reference.compare(jnp_out, result, label="reference").ok


@settings(max_examples=40, deadline=None)
@given(case=valid_cases(V3_OPTIONS))
def test_v3_options_are_judged_within_their_contracts(case):
    """With the v3 options drawn: the jnp reference is within the float32 contract, and the float32
    variant that keeps its accumulators in ``out_dtype`` (rounding its result to it) is within the
    accumulator contract, whose bound follows ``out_dtype``."""
    arrays, options = case.arrays(), case.options()
    expected = reference.oracle(**arrays, **options)
    jnp_out = reference.ragged_paged_attention(**arrays, **options)
    assert reference.compare(jnp_out, expected, label="reference").ok
    variant = contract_attention(**arrays, precision=("accumulators-in-output-dtype",), **options)
    comparison = reference.compare(
        variant, expected, label="accumulator variant", precision=("accumulators-in-output-dtype",)
    )
    assert comparison.ok, f"{case.describe()}\n{comparison}"


def test_out_dtype_widens_the_bound_to_its_rounding():
    """bfloat16 accumulators for float32 queries: the result is rounded to bfloat16 before it is stored,
    so the bound is at least half a bfloat16 ulp, where float32 accumulators give float32's."""
    case = dataclasses.replace(TINY, mask_value_meaning=MASK_REPLACES, mask_value=None)
    arrays = case.arrays()
    narrow = reference.oracle(**arrays, **dataclasses.replace(case, out_dtype="bfloat16").options())
    wide = reference.oracle(**arrays, **case.options())
    owned = narrow.owned_rows
    half_bf16_ulp = reference.tolerance.half_ulp(narrow.out[owned], ml_dtypes.bfloat16)
    narrow_bound = reference.tolerance.error_bound(narrow)[owned]
    assert (narrow_bound >= half_bf16_ulp).all()
    assert (narrow_bound > reference.tolerance.error_bound(wide)[owned]).all()


@settings(max_examples=60, deadline=None)
@given(case=valid_cases(V3_OPTIONS))
def test_v3_options_are_drawn_within_their_preconditions(case):
    """skip_kv_mask comes with non-causal attention, an explicit KV block and kv_lens of whole blocks; a
    chunk size is the q_len of the first sequence after the decodes where there is one."""
    if case.skip_kv_mask:
        assert not case.use_causal_mask and case.num_kv_pages_per_block is not None
        block = case.num_kv_pages_per_block * case.page_size
        assert all(kv % block == 0 for kv in case.kv_lens)
        assert all(0 < q <= kv for q, kv in zip(case.q_lens, case.kv_lens, strict=True))
    if case.chunk_prefill_size is not None:
        decodes = next((i for i, q in enumerate(case.q_lens) if q != 1), case.num_seqs)
        if decodes < case.num_seqs:
            assert case.q_lens[decodes] == case.chunk_prefill_size
    case.arrays()  # the layout fits its cache


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(skip_kv_mask=True), "skip_kv_mask=True with use_causal_mask=True"),
        (dict(chunk_prefill_size=0), "chunk_prefill_size=0 must be None or a positive int"),
        (dict(chunk_prefill_size=2.0), "chunk_prefill_size=2.0 must be None or a positive int"),
        (dict(out_dtype="float16"), "out_dtype='float16' must be None or one of"),
        (dict(use_causal_mask=0), "use_causal_mask=0 (int) must be True or False"),
    ],
)
def test_v3_option_rules(changes, message):
    with pytest.raises(ValueError, match=__import__("re").escape(message)):
        check_extensions(Options(**changes), 1)
