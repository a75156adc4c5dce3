"""Explicit examples of our Pallas kernel against upstream's reference, under both TPU interpreters.

Every example poisons what the kernel must not read or let through: unused pages, the tails of the last
pages and query rows past the live tokens hold NaN, and page-table entries past a sequence's pages and the
metadata slots past ``num_seqs`` hold garbage (negative, past the end of the cache, both int32 extremes).
Inputs are ``Case``s like every other test's.

Two judges. The tolerance model (``reference.compare`` against the float64 oracle). And upstream's
``ref_ragged_paged_attention`` run in float64 on the exact values the kernel uses: q and the cache upcast to
float64 (exact), with K and V first put through the kernel's scaling (float32 multiply, cast to q's dtype).
The kernel computes in float32, so it must agree within 1e-5 of the output scale; a bfloat16 output may
additionally sit one rounding step (half a bfloat16 ulp, 2**-8 relative, of the float32 value) away.

Examples that share shapes and static options share one compilation per interpreter; the reference runs
as one program per example (``tests.references``).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from rpa_harness import reference
from rpa_harness.kernel.pallas_rpa import ragged_paged_attention
from rpa_harness.strategies.case import DTYPES, Case
from tests.cases import GARBAGE, INTERPRETERS
from tests.references import upstream_in_one_program

RELATIVE_TOLERANCE = 1e-5
# The shapes most examples share (one compilation per interpreter for all their layouts).
SHARED = Case(
    max_num_batched_tokens=30,
    max_num_seqs=6,
    pages_per_seq=5,
    total_num_pages=6 * 5 + 3,
    page_size=16,
    num_q_heads=4,
    num_kv_heads=2,
    head_dim=128,
    garbage_values=GARBAGE,
)


def example(seqs, **fields) -> Case:
    """SHARED with the ragged layout ``seqs`` ((q_len, kv_len) per live sequence) and ``fields`` changed;
    three spare pages beyond what the page table can address."""
    q_lens, kv_lens = (tuple(lens) for lens in zip(*seqs, strict=True))
    case = dataclasses.replace(SHARED, q_lens=q_lens, kv_lens=kv_lens, **fields)
    return dataclasses.replace(case, total_num_pages=case.max_num_seqs * case.pages_per_seq + 3)


def _run_kernel(case, arrays, interpreter):
    with pltpu.force_tpu_interpret_mode(interpreter):
        out = ragged_paged_attention(**{name: jnp.asarray(a) for name, a in arrays.items()}, **case.options())
        return np.asarray(out.astype(jnp.float32), np.float64)


def _as_used_by_kernel(x, scale, q_dtype):
    """The float64 values the kernel computes with: scaled in float32 and cast to q's dtype, if scaled."""
    x = x.astype(np.float32)
    if scale is not None:
        x = (x * np.float32(scale)).astype(q_dtype).astype(np.float32)
    return x.astype(np.float64)


def _reference(case, arrays):
    options = case.options()
    k_scale, v_scale = options.pop("k_scale", None), options.pop("v_scale", None)
    options.pop("num_kv_pages_per_block", None)
    options.pop("num_queries_per_block", None)
    q_dtype = DTYPES[case.q_dtype]
    kv = np.empty(arrays["kv_pages"].shape, np.float64)
    kv[:, :, 0::2] = _as_used_by_kernel(arrays["kv_pages"][:, :, 0::2], k_scale, q_dtype)
    kv[:, :, 1::2] = _as_used_by_kernel(arrays["kv_pages"][:, :, 1::2], v_scale, q_dtype)
    with jax.enable_x64(True):
        return np.asarray(upstream_in_one_program(arrays, arrays["q"].astype(np.float64), kv, **options))


EXAMPLES = {
    # Same shapes and options: one compilation per interpreter for all of these layouts.
    "decode_only": example(((1, 1), (1, 17), (1, 80), (1, 33))),
    "prefill_only": example(((16, 16), (9, 9), (5, 5))),
    "mixed_prefill_decode": example(((1, 40), (6, 18), (12, 79), (1, 1))),
    "q_len_zero_first_middle_last": example(((0, 10), (3, 20), (0, 5), (9, 33), (0, 80))),
    "full_batch_fills_all_tokens_and_pages": example(((5, 80),) * 6),
    # A query block of 5 tokens: sequences straddle blocks, some blocks hold several sequences, the last
    # block runs past the tokens. KV blocks of 2 pages do not divide pages_per_seq=5: the third block of a
    # full sequence covers one page only and must not copy past the page table.
    "straddling_query_blocks_non_dividing_kv_blocks_sliding_window": example(
        ((1, 40), (7, 30), (9, 65), (1, 80)),
        max_num_batched_tokens=21,
        num_queries_per_block=5,
        num_kv_pages_per_block=2,
        sliding_window=12,
    ),
    # Large logits make the cap bite; mask_value=-1.0 keeps masked keys in the softmax, as upstream does.
    "soft_cap_custom_mask_value_sm_scale": example(
        ((1, 50), (9, 30), (4, 77)), kv_value_scale=3.0, soft_cap=4.0, mask_value=-1.0, sm_scale=0.3
    ),
    "fp8_e4m3_with_kv_scales": example(
        ((1, 50), (9, 30), (4, 77)),
        kv_dtype="float8_e4m3fn",
        kv_value_scale=20.0,
        k_scale=0.05,
        v_scale=0.125,
    ),
    "fp8_e5m2_with_kv_scales_bf16_q": example(
        ((1, 50), (9, 30), (4, 77)),
        q_dtype="bfloat16",
        kv_dtype="float8_e5m2",
        kv_value_scale=20.0,
        k_scale=0.05,
        v_scale=0.125,
    ),
    # Unscaled fp8 is upcast, never rounded further; 3 bf16 query heads per KV head do not fill packed rows.
    "fp8_e4m3_without_scales_bf16_q_odd_gqa_group": example(
        ((1, 50), (9, 30), (4, 77)), q_dtype="bfloat16", kv_dtype="float8_e4m3fn", num_q_heads=6
    ),
    "bf16_q_and_kv": example(((1, 50), (9, 30), (4, 77)), q_dtype="bfloat16", kv_dtype="bfloat16"),
    "gqa_8_to_1_head_dim_64_page_size_1": example(
        ((1, 9), (6, 13), (3, 3)),
        max_num_batched_tokens=12,
        page_size=1,
        pages_per_seq=16,
        num_q_heads=8,
        num_kv_heads=1,
        head_dim=64,
    ),
    # 8 float32 KV heads, 2 query heads each: two head blocks of 4 KV heads (grid axis 0 has 2 steps).
    "two_head_blocks_head_dim_256": example(
        ((1, 50), (9, 30), (4, 77)), max_num_batched_tokens=16, num_q_heads=16, num_kv_heads=8, head_dim=256
    ),
}

_reference_cache = {}


def _expected(name):
    if name not in _reference_cache:
        case = EXAMPLES[name]
        arrays = case.arrays()
        _reference_cache[name] = (
            arrays,
            _reference(case, arrays),
            reference.oracle(**arrays, **case.options()),
        )
    return _reference_cache[name]


@pytest.mark.parametrize("interpreter", list(INTERPRETERS))
@pytest.mark.parametrize("name", list(EXAMPLES))
def test_kernel_matches_upstream_reference_in_float64(name, interpreter):
    case = EXAMPLES[name]
    arrays, expected, oracle_result = _expected(name)
    output = _run_kernel(case, arrays, INTERPRETERS[interpreter])
    comparison = reference.compare(
        output.astype(DTYPES[case.q_dtype]), oracle_result, label=f"kernel on {name}"
    )
    assert comparison.ok, str(comparison)
    actual = output[: case.num_tokens]

    assert expected.shape == actual.shape
    assert not np.isnan(actual).any(), f"NaN in live rows {np.unique(np.argwhere(np.isnan(actual))[:, 0])}"
    tolerance = RELATIVE_TOLERANCE * np.abs(expected).max()
    if case.q_dtype == "bfloat16":
        tolerance = tolerance + 2.0**-8 * np.abs(expected)
    error = np.abs(actual - expected)
    worst = np.unravel_index(np.argmax(error - tolerance), error.shape)
    assert (error <= tolerance).all(), (
        f"{name}: |kernel - reference| = {error[worst]:.3g} > {np.broadcast_to(tolerance, error.shape)[worst]:.3g}"
        f" at (token, head, dim) = {worst}; kernel {actual[worst]!r}, reference {expected[worst]!r}"
    )


def test_examples_cover_what_they_claim():
    """The layouts exercise what the names say (a typo in a layout would silently weaken an example)."""
    assert all(q == 1 for q in EXAMPLES["decode_only"].q_lens)
    prefill = EXAMPLES["prefill_only"]
    assert prefill.q_lens == prefill.kv_lens
    full = EXAMPLES["full_batch_fills_all_tokens_and_pages"]
    assert full.num_seqs == full.max_num_seqs and full.num_tokens == full.max_num_batched_tokens
    assert all(kv == full.kv_capacity for kv in full.kv_lens)
    straddle = EXAMPLES["straddling_query_blocks_non_dividing_kv_blocks_sliding_window"]
    assert straddle.pages_per_seq % straddle.num_kv_pages_per_block != 0
    assert straddle.max_num_batched_tokens % straddle.num_queries_per_block != 0
    assert any(kv == straddle.kv_capacity for kv in straddle.kv_lens)
    assert all(case.garbage_values == GARBAGE and case.poison for case in EXAMPLES.values())


def test_cpu_call_outside_interpret_mode_raises_one_clear_error():
    if jax.default_backend() != "cpu":
        pytest.skip("only a CPU backend refuses the kernel outside interpret mode")
    arrays = EXAMPLES["decode_only"].arrays()
    with pytest.raises(RuntimeError, match="force_tpu_interpret_mode") as raised:
        ragged_paged_attention(**{name: jnp.asarray(a) for name, a in arrays.items()})
    assert "Only interpret mode is supported" not in str(raised.value)
