"""Explicit examples of our Pallas kernel against upstream's reference, under both TPU interpreters.

Every example poisons what the kernel must not read or let through: unused pages, the tails of the last
pages, query rows past the live tokens and the metadata slots past ``num_seqs`` hold NaN or garbage
(page-table entries past a sequence's pages are negative or past the end of the cache).

The expected output is upstream's ``ref_ragged_paged_attention`` run in float64 on the exact values the
kernel uses: q and the cache upcast to float64 (exact), with K and V first put through the kernel's scaling
(float32 multiply, cast to q's dtype). The kernel computes in float32, so it must agree within 1e-5 of the
output scale; a bfloat16 output may additionally sit one rounding step (half a bfloat16 ulp, 2**-8 relative,
of the float32 value) away.

Examples that share shapes and static options share one compilation per interpreter; the reference is
jitted with the metadata as constants so that each example compiles it once.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu.ragged_paged_attention.kernel import ref_ragged_paged_attention

from kernel.pallas_rpa import ragged_paged_attention
from strategies.case import DTYPES

INTERPRETERS = {
    "tpu_interpreter": pltpu.InterpretParams(),
    "generic_interpreter": True,
}
# Page-table garbage for entries no sequence owns: negative, past the cache, and both int32 extremes.
GARBAGE_PAGES = (-1, -(2**31), 2**31 - 1, 10**6)
RELATIVE_TOLERANCE = 1e-5


@dataclasses.dataclass(frozen=True)
class Example:
    """Shapes, the ragged layout as (q_len, kv_len) per live sequence, options and the data seed."""

    seqs: tuple
    num_tokens: int = 30
    max_num_seqs: int = 6
    pages_per_seq: int = 5
    page_size: int = 16
    num_q_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 128
    q_dtype: str = "float32"
    kv_dtype: str = "float32"
    options: tuple = ()  # (name, value) pairs passed to the kernel
    value_scale: float = 1.0
    seed: int = 0

    def arrays(self):
        rng = np.random.default_rng(self.seed)
        n = len(self.seqs)
        q_lens = np.array([q for q, _ in self.seqs], np.int32)
        kv_lens_live = np.array([kv for _, kv in self.seqs], np.int32)
        total_num_pages = self.max_num_seqs * self.pages_per_seq + 3

        q = np.full((self.num_tokens, self.num_q_heads, self.head_dim), np.nan, np.float32)
        live_tokens = int(q_lens.sum())
        q[:live_tokens] = rng.standard_normal((live_tokens, self.num_q_heads, self.head_dim))

        kv = np.full(
            (total_num_pages, self.page_size, 2 * self.num_kv_heads, self.head_dim), np.nan, np.float32
        )
        page_indices = np.array(
            [GARBAGE_PAGES[i % len(GARBAGE_PAGES)] for i in range(self.max_num_seqs * self.pages_per_seq)],
            np.int32,
        ).reshape(self.max_num_seqs, self.pages_per_seq)
        free_pages = iter(rng.permutation(total_num_pages))
        for seq, kv_len in enumerate(kv_lens_live):
            for page_pos in range(-(-int(kv_len) // self.page_size)):
                page = next(free_pages)
                page_indices[seq, page_pos] = page
                filled = min(self.page_size, int(kv_len) - page_pos * self.page_size)
                kv[page, :filled] = self.value_scale * rng.standard_normal(kv[page, :filled].shape)

        kv_lens = np.array([7, 2**31 - 1, -3, 0] * self.max_num_seqs, np.int32)[: self.max_num_seqs]
        kv_lens[:n] = kv_lens_live
        cu_q_lens = np.array([-5, 2**31 - 1, 3] * (self.max_num_seqs + 1), np.int32)[: self.max_num_seqs + 1]
        cu_q_lens[: n + 1] = np.concatenate([[0], np.cumsum(q_lens)])
        return dict(
            q=q.astype(DTYPES[self.q_dtype]),
            kv_pages=kv.astype(DTYPES[self.kv_dtype]),
            kv_lens=kv_lens,
            page_indices=page_indices,
            cu_q_lens=cu_q_lens,
            num_seqs=np.array([n], np.int32),
        )


def _run_kernel(example, arrays, interpreter):
    with pltpu.force_tpu_interpret_mode(interpreter):
        out = ragged_paged_attention(*(jnp.asarray(a) for a in arrays.values()), **dict(example.options))
        return np.asarray(out.astype(jnp.float32), np.float64)


def _as_used_by_kernel(x, scale, q_dtype):
    """The float64 values the kernel computes with: scaled in float32 and cast to q's dtype, if scaled."""
    x = x.astype(np.float32)
    if scale is not None:
        x = (x * np.float32(scale)).astype(q_dtype).astype(np.float32)
    return x.astype(np.float64)


def _reference(example, arrays):
    options = dict(example.options)
    k_scale, v_scale = options.pop("k_scale", None), options.pop("v_scale", None)
    options.pop("num_kv_pages_per_block", None)
    options.pop("num_queries_per_block", None)
    q_dtype = DTYPES[example.q_dtype]
    kv = np.empty(arrays["kv_pages"].shape, np.float64)
    kv[:, :, 0::2] = _as_used_by_kernel(arrays["kv_pages"][:, :, 0::2], k_scale, q_dtype)
    kv[:, :, 1::2] = _as_used_by_kernel(arrays["kv_pages"][:, :, 1::2], v_scale, q_dtype)
    metadata = [arrays[name] for name in ("kv_lens", "page_indices", "cu_q_lens", "num_seqs")]
    with jax.enable_x64(True):
        reference = jax.jit(lambda q, kv: ref_ragged_paged_attention(q, kv, *metadata, **options))
        return np.asarray(reference(arrays["q"].astype(np.float64), kv))


EXAMPLES = {
    # Same shapes and options: one compilation per interpreter for all of these layouts.
    "decode_only": Example(seqs=((1, 1), (1, 17), (1, 80), (1, 33))),
    "prefill_only": Example(seqs=((16, 16), (9, 9), (5, 5))),
    "mixed_prefill_decode": Example(seqs=((1, 40), (6, 18), (12, 79), (1, 1))),
    "q_len_zero_first_middle_last": Example(seqs=((0, 10), (3, 20), (0, 5), (9, 33), (0, 80))),
    "full_batch_fills_all_tokens_and_pages": Example(seqs=((5, 80),) * 6),
    # A query block of 5 tokens: sequences straddle blocks, some blocks hold several sequences, the last
    # block runs past the tokens. KV blocks of 2 pages do not divide pages_per_seq=5: the third block of a
    # full sequence covers one page only and must not copy past the page table.
    "straddling_query_blocks_non_dividing_kv_blocks_sliding_window": Example(
        seqs=((1, 40), (7, 30), (9, 65), (1, 80)),
        num_tokens=21,
        options=(("num_queries_per_block", 5), ("num_kv_pages_per_block", 2), ("sliding_window", 12)),
    ),
    # Large logits make the cap bite; mask_value=-1.0 keeps masked keys in the softmax, as upstream does.
    "soft_cap_custom_mask_value_sm_scale": Example(
        seqs=((1, 50), (9, 30), (4, 77)),
        value_scale=3.0,
        options=(("soft_cap", 4.0), ("mask_value", -1.0), ("sm_scale", 0.3)),
    ),
    "fp8_e4m3_with_kv_scales": Example(
        seqs=((1, 50), (9, 30), (4, 77)),
        kv_dtype="float8_e4m3fn",
        value_scale=20.0,
        options=(("k_scale", 0.05), ("v_scale", 0.125)),
    ),
    "fp8_e5m2_with_kv_scales_bf16_q": Example(
        seqs=((1, 50), (9, 30), (4, 77)),
        q_dtype="bfloat16",
        kv_dtype="float8_e5m2",
        value_scale=20.0,
        options=(("k_scale", 0.05), ("v_scale", 0.125)),
    ),
    # Unscaled fp8 is upcast, never rounded further; 3 bf16 query heads per KV head do not fill packed rows.
    "fp8_e4m3_without_scales_bf16_q_odd_gqa_group": Example(
        seqs=((1, 50), (9, 30), (4, 77)), q_dtype="bfloat16", kv_dtype="float8_e4m3fn", num_q_heads=6
    ),
    "bf16_q_and_kv": Example(seqs=((1, 50), (9, 30), (4, 77)), q_dtype="bfloat16", kv_dtype="bfloat16"),
    "gqa_8_to_1_head_dim_64_page_size_1": Example(
        seqs=((1, 9), (6, 13), (3, 3)),
        num_tokens=12,
        page_size=1,
        pages_per_seq=16,
        num_q_heads=8,
        num_kv_heads=1,
        head_dim=64,
    ),
    # 8 float32 KV heads, 2 query heads each: two head blocks of 4 KV heads (grid axis 0 has 2 steps).
    "two_head_blocks_head_dim_256": Example(
        seqs=((1, 50), (9, 30), (4, 77)), num_tokens=16, num_q_heads=16, num_kv_heads=8, head_dim=256
    ),
}

_reference_cache = {}


def _expected(name):
    if name not in _reference_cache:
        example = EXAMPLES[name]
        arrays = example.arrays()
        _reference_cache[name] = (arrays, _reference(example, arrays))
    return _reference_cache[name]


@pytest.mark.parametrize("interpreter", list(INTERPRETERS))
@pytest.mark.parametrize("name", list(EXAMPLES))
def test_kernel_matches_upstream_reference_in_float64(name, interpreter):
    example = EXAMPLES[name]
    arrays, expected = _expected(name)
    live_rows = int(arrays["cu_q_lens"][len(example.seqs)])
    actual = _run_kernel(example, arrays, INTERPRETERS[interpreter])[:live_rows]

    assert expected.shape == actual.shape
    assert not np.isnan(actual).any(), f"NaN in live rows {np.unique(np.argwhere(np.isnan(actual))[:, 0])}"
    tolerance = RELATIVE_TOLERANCE * np.abs(expected).max()
    if example.q_dtype == "bfloat16":
        tolerance = tolerance + 2.0**-8 * np.abs(expected)
    error = np.abs(actual - expected)
    worst = np.unravel_index(np.argmax(error - tolerance), error.shape)
    assert (error <= tolerance).all(), (
        f"{name}: |kernel - reference| = {error[worst]:.3g} > {np.broadcast_to(tolerance, error.shape)[worst]:.3g}"
        f" at (token, head, dim) = {worst}; kernel {actual[worst]!r}, reference {expected[worst]!r}"
    )


def test_examples_cover_what_they_claim():
    """The layouts exercise what the names say (a typo in a layout would silently weaken an example)."""
    assert all(q == 1 for q, _ in EXAMPLES["decode_only"].seqs)
    assert all(q == kv for q, kv in EXAMPLES["prefill_only"].seqs)
    full = EXAMPLES["full_batch_fills_all_tokens_and_pages"]
    assert len(full.seqs) == full.max_num_seqs and sum(q for q, _ in full.seqs) == full.num_tokens
    assert all(kv == full.pages_per_seq * full.page_size for _, kv in full.seqs)
    straddle = EXAMPLES["straddling_query_blocks_non_dividing_kv_blocks_sliding_window"]
    options = dict(straddle.options)
    assert straddle.pages_per_seq % options["num_kv_pages_per_block"] != 0
    assert straddle.num_tokens % options["num_queries_per_block"] != 0
    assert any(kv == straddle.pages_per_seq * straddle.page_size for _, kv in straddle.seqs)


def test_cpu_call_outside_interpret_mode_raises_one_clear_error():
    if jax.default_backend() != "cpu":
        pytest.skip("only a CPU backend refuses the kernel outside interpret mode")
    arrays = EXAMPLES["decode_only"].arrays()
    with pytest.raises(RuntimeError, match="force_tpu_interpret_mode") as raised:
        ragged_paged_attention(*(jnp.asarray(a) for a in arrays.values()))
    assert "Only interpret mode is supported" not in str(raised.value)
