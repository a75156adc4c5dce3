"""The target's kernel lowers to a Mosaic TPU custom call on every TPU generation the installed jax knows.

Runs against ``--rpa-target`` when the target opts in (``lowers_for_tpu``; the bundled kernel does): a few
hand-picked configurations on every generation, and, as a property, the production configurations the
nightly draws (``rpa_harness.strategies.valid.production_configs`` with its options and block sizes) for v5e and v6e.

Lowering runs Pallas' TPU lowering rules (block shapes, supported ops, memory spaces, DMA and semaphore
use) without a TPU; Mosaic's own layout passes run only when libtpu compiles the call, which needs a TPU.
Where the default device is a real TPU, each check lowers and compiles for that chip, and the checks of
other generations are skipped: emulating one there would describe the chip as another.
"""

import jax
import jax.numpy as jnp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rpa_harness.lowering import (
    emulation_skip_reason,
    generations_here,
    known_tpu_generations,
    lower_for_tpu,
    real_tpu_generation,
    register_tpu_generation,
)
from rpa_harness.properties.budget import ANY_CONFIG_EXAMPLES
from rpa_harness.strategies.buckets import BUCKETS, BucketError
from rpa_harness.strategies.options import options, production_block_sizes
from rpa_harness.strategies.shapes import production_configs, select_buckets
from rpa_harness.targets import DEFAULT_TARGET

KERNEL_NAME = "rpa_harness_ragged_paged_attention"


def _shapes(
    *,
    num_tokens=32,
    max_num_seqs=4,
    pages_per_seq=6,
    page_size=16,
    num_q_heads=4,
    num_kv_heads=2,
    head_dim=128,
    q_dtype=jnp.float32,
    kv_dtype=jnp.float32,
):
    i32 = jnp.int32
    return (
        jax.ShapeDtypeStruct((num_tokens, num_q_heads, head_dim), q_dtype),
        jax.ShapeDtypeStruct((max_num_seqs * pages_per_seq, page_size, 2 * num_kv_heads, head_dim), kv_dtype),
        jax.ShapeDtypeStruct((max_num_seqs,), i32),
        jax.ShapeDtypeStruct((max_num_seqs, pages_per_seq), i32),
        jax.ShapeDtypeStruct((max_num_seqs + 1,), i32),
        jax.ShapeDtypeStruct((1,), i32),
    )


CONFIGS = {
    "f32_defaults": (_shapes(), {}),
    "bf16_head_dim_256_page_32_window_soft_cap": (
        _shapes(q_dtype=jnp.bfloat16, kv_dtype=jnp.bfloat16, head_dim=256, page_size=32),
        dict(sliding_window=64, soft_cap=30.0, sm_scale=0.0625),
    ),
    "fp8_e4m3_scaled_head_dim_64_page_8": (
        _shapes(kv_dtype=jnp.float8_e4m3fn, head_dim=64, page_size=8),
        dict(k_scale=0.5, v_scale=0.25),
    ),
    "fp8_e5m2_scaled_bf16_q_odd_group": (
        _shapes(q_dtype=jnp.bfloat16, kv_dtype=jnp.float8_e5m2, num_q_heads=6),
        dict(k_scale=2.0, v_scale=0.5),
    ),
    "fp8_e4m3_unscaled_bf16_q": (_shapes(q_dtype=jnp.bfloat16, kv_dtype=jnp.float8_e4m3fn), {}),
    "two_head_blocks_8_kv_heads": (_shapes(num_q_heads=16, num_kv_heads=8), {}),
    "gqa_8_to_1_page_size_1": (_shapes(num_q_heads=8, num_kv_heads=1, page_size=1, pages_per_seq=64), {}),
    "page_size_64_bf16_q_f32_kv": (_shapes(q_dtype=jnp.bfloat16, page_size=64, pages_per_seq=3), {}),
    "non_dividing_blocks_vmem_limit_mask_value": (
        _shapes(num_tokens=37),
        dict(num_queries_per_block=5, num_kv_pages_per_block=4, vmem_limit_bytes=32 * 2**20, mask_value=-1.0),
    ),
}


def _assert_mosaic_call(text, target):
    assert "tpu_custom_call" in text
    if target.name == DEFAULT_TARGET:  # the bundled kernel names its Mosaic call; other targets may not
        assert KERNEL_NAME in text


LOWERS = pytest.mark.rpa_requires("lowers_for_tpu", reason="lowering to Mosaic is an opt-in property")


def _lowered_here(chip: str) -> str:
    """``chip``, where lowering for it is checked on this host; a skip with the reason elsewhere."""
    reason = emulation_skip_reason(chip)
    if reason:
        pytest.skip(reason)
    return chip


@LOWERS
@pytest.mark.parametrize("chip", known_tpu_generations())
def test_lowers_on_every_known_generation(target, chip):
    shapes, options = CONFIGS["f32_defaults"]
    _assert_mosaic_call(
        lower_for_tpu(target.module.ragged_paged_attention, *shapes, chip=_lowered_here(chip), **options),
        target,
    )


@LOWERS
@pytest.mark.parametrize("chip", ["v5e", "v6e"])
@pytest.mark.parametrize("config", [name for name in CONFIGS if name != "f32_defaults"])
def test_lowers_over_configurations(target, config, chip):
    shapes, options = CONFIGS[config]
    _assert_mosaic_call(
        lower_for_tpu(target.module.ragged_paged_attention, *shapes, chip=_lowered_here(chip), **options),
        target,
    )


def _config_shapes(config):
    """The six inputs of a static config (``rpa_harness.strategies.valid`` dict) as shapes."""
    i32, slots = jnp.int32, config["max_num_seqs"]
    return (
        jax.ShapeDtypeStruct(
            (config["max_num_batched_tokens"], config["num_q_heads"], config["head_dim"]),
            jnp.dtype(config["q_dtype"]),
        ),
        jax.ShapeDtypeStruct(
            (config["total_num_pages"], config["page_size"], 2 * config["num_kv_heads"], config["head_dim"]),
            jnp.dtype(config["kv_dtype"]),
        ),
        jax.ShapeDtypeStruct((slots,), i32),
        jax.ShapeDtypeStruct((slots, config["pages_per_seq"]), i32),
        jax.ShapeDtypeStruct((slots + 1,), i32),
        jax.ShapeDtypeStruct((1,), i32),
    )


@pytest.fixture(scope="session")
def production_capabilities(target):
    """The target's capabilities, where they hold production configurations (``select_buckets`` checks)."""
    try:
        select_buckets(target.capabilities, "production")
    except BucketError as error:
        pytest.skip(f"target {target.name} has no production configurations: {error}")
    return target.capabilities


@LOWERS
@settings(max_examples=ANY_CONFIG_EXAMPLES)
@given(data=st.data())
def test_production_configurations_lower_for_v5e_and_v6e(target, production_capabilities, data):
    capabilities = production_capabilities
    config = data.draw(production_configs(capabilities, BUCKETS["production"]), label="config")
    drawn = data.draw(options(config, capabilities), label="options")
    drawn.update(data.draw(production_block_sizes(config, capabilities), label="block sizes"))
    drawn = {name: value for name, value in drawn.items() if value is not None}
    for chip in generations_here(("v5e", "v6e")):  # on a real TPU: that chip
        _assert_mosaic_call(
            lower_for_tpu(target.module.ragged_paged_attention, *_config_shapes(config), chip=chip, **drawn),
            target,
        )


def test_known_generations_include_v5e_and_v6e():
    assert {"v5e", "v6e"} <= set(known_tpu_generations())


def test_unknown_generation_is_rejected_with_the_known_ones():
    if real_tpu_generation() is not None:
        pytest.skip("the default device is a real TPU: no generation is registered for it")
    with pytest.raises(ValueError, match="v5e"):
        register_tpu_generation("v99")
