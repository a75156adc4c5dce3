"""The interpreter compatibility layer: each patched access path against the same kernel written without the
transform, the gaps it closes on the running jax (so we notice when jax closes them), and upstream's RPA
kernel end to end."""

import contextlib
import dataclasses
import functools
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as upstream

from rpa_harness import generations, interpret_compat, reference
from rpa_harness.device import INTERPRET, Backend, Deadlock, RaceDetected
from rpa_harness.interpret_compat import generic as generic_gaps
from rpa_harness.interpret_compat import products as product_gaps
from rpa_harness.interpret_compat import tpu as tpu_gaps
from rpa_harness.interpret_compat.patching import InternalsMoved
from tests.cases import sized_case
from tests.compat_layer import layer_installed, layer_off
from tests.references import upstream_in_one_program

INTERPRETERS = ["tpu", "generic"]


@pytest.fixture(autouse=True, scope="module")
def compat_layer():
    with layer_installed():
        yield


def interpret_params(interpreter: str):
    return pltpu.InterpretParams() if interpreter == "tpu" else True


def fresh_pallas_call(kernel, out_shape, scratch_shapes=(), in_specs=None):
    """A jitted function that builds the pallas_call when traced (fresh, so no stale jit cache): traced
    under an interpreter setting, it runs on that interpreter."""
    extra = {} if in_specs is None else {"in_specs": in_specs}

    def call(*operands):
        return pl.pallas_call(kernel, out_shape=out_shape, scratch_shapes=scratch_shapes, **extra)(*operands)

    return jax.jit(call)


def run(kernel, out_shape, *args, interpreter, scratch_shapes=(), in_specs=None):
    """Build and trace a fresh pallas_call under the chosen interpreter."""
    call = fresh_pallas_call(kernel, out_shape, scratch_shapes, in_specs)
    try:
        with pltpu.force_tpu_interpret_mode(interpret_params(interpreter)):
            return np.asarray(call(*args))
    except Exception:
        pltpu.reset_tpu_interpret_mode_state()
        raise


def random_array(shape, dtype, seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape).astype(np.float32), dtype)


def packed_words(narrow: np.ndarray) -> np.ndarray:
    """TPU packing by explicit bit arithmetic: word (i, j) holds rows k*i .. k*i+k-1, row k*i in the low bits."""
    width = narrow.dtype.itemsize * 8
    packing = 32 // width
    bits = narrow.view(np.dtype(f"uint{width}")).astype(np.uint32)
    return sum(bits[p::packing] << np.uint32(width * p) for p in range(packing)).astype(np.uint32)


def unpacked_rows(words: np.ndarray, dtype) -> np.ndarray:
    dtype = np.dtype(dtype)
    width = dtype.itemsize * 8
    packing = 32 // width
    rows = np.empty((words.shape[0] * packing, words.shape[1]), np.dtype(f"uint{width}"))
    for p in range(packing):
        rows[p::packing] = (words >> np.uint32(width * p)) & np.uint32((1 << width) - 1)
    return rows.view(dtype)


# --- reshape -------------------------------------------------------------------------------------------

X3 = random_array((2, 8, 128), jnp.float32)


@pytest.mark.parametrize("interpreter", INTERPRETERS)
@pytest.mark.parametrize("rows", [slice(4, 12), slice(1, 16, 2)], ids=["contiguous", "strided"])
def test_load_through_reshape(interpreter, rows):
    def with_view(x_ref, o_ref):
        o_ref[...] = x_ref.reshape(16, 128)[rows, :]

    def without_view(x_ref, o_ref):
        o_ref[...] = x_ref[...].reshape(16, 128)[rows, :]

    out_shape = jax.ShapeDtypeStruct((8, 128), jnp.float32)
    expected = run(without_view, out_shape, X3, interpreter=interpreter)
    np.testing.assert_array_equal(run(with_view, out_shape, X3, interpreter=interpreter), expected)
    np.testing.assert_array_equal(expected, np.asarray(X3).reshape(16, 128)[rows])


@pytest.mark.parametrize("interpreter", INTERPRETERS)
def test_store_through_reshape(interpreter):
    def with_view(x_ref, o_ref):
        o_ref[...] = x_ref[...]
        o_ref.reshape(16, 128)[6:10, :] = x_ref[0, 0:4, :] + 1.0

    def without_view(x_ref, o_ref):
        flat = x_ref[...].reshape(16, 128)
        o_ref[...] = flat.at[6:10, :].set(x_ref[0, 0:4, :] + 1.0).reshape(2, 8, 128)

    out_shape = jax.ShapeDtypeStruct(X3.shape, X3.dtype)
    expected = run(without_view, out_shape, X3, interpreter=interpreter)
    np.testing.assert_array_equal(run(with_view, out_shape, X3, interpreter=interpreter), expected)


@pytest.mark.parametrize("interpreter", INTERPRETERS)
def test_dma_into_reshaped_view(interpreter):
    def with_view(x_hbm, o_ref, buffer, semaphore):
        copy = pltpu.make_async_copy(x_hbm, buffer.reshape(2, 8, 128), semaphore)
        copy.start()
        copy.wait()
        o_ref[...] = buffer[...]

    def without_view(x_hbm, o_ref, buffer, semaphore):
        copy = pltpu.make_async_copy(x_hbm, buffer, semaphore)
        copy.start()
        copy.wait()
        o_ref[...] = buffer[...].reshape(16, 128)

    out_shape = jax.ShapeDtypeStruct((16, 128), jnp.float32)
    hbm = [pl.BlockSpec(memory_space=pl.ANY)]
    got = run(
        with_view,
        out_shape,
        X3,
        interpreter=interpreter,
        in_specs=hbm,
        scratch_shapes=[pltpu.VMEM((16, 128), jnp.float32), pltpu.SemaphoreType.DMA(())],
    )
    expected = run(
        without_view,
        out_shape,
        X3,
        interpreter=interpreter,
        in_specs=hbm,
        scratch_shapes=[pltpu.VMEM((2, 8, 128), jnp.float32), pltpu.SemaphoreType.DMA(())],
    )
    np.testing.assert_array_equal(got, expected)


# --- bitcast -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("interpreter", INTERPRETERS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float8_e4m3fn], ids=["bf16", "fp8"])
def test_bitcast_load_packs_second_minor_rows(interpreter, dtype):
    rows = 8 * (32 // (jnp.dtype(dtype).itemsize * 8))
    x = random_array((rows, 128), dtype, seed=1)

    def with_view(x_ref, o_ref):
        o_ref[...] = x_ref.bitcast(jnp.uint32)[...]

    def without_view(x_ref, o_ref):
        o_ref[...] = pltpu.bitcast(x_ref[...], jnp.uint32)

    out_shape = jax.ShapeDtypeStruct((8, 128), jnp.uint32)
    got = run(with_view, out_shape, x, interpreter=interpreter)
    np.testing.assert_array_equal(got, packed_words(np.asarray(x)))
    np.testing.assert_array_equal(got, run(without_view, out_shape, x, interpreter=interpreter))


@pytest.mark.parametrize("interpreter", INTERPRETERS)
def test_bitcast_load_strided_rows_like_upstream(interpreter):
    """Upstream's strided_load_kv: bitcast bf16 K/V rows to uint32, take every other word row, split halves."""
    x = random_array((32, 128), jnp.bfloat16, seed=2)

    def kernel(x_ref, k_ref, v_ref):
        words = x_ref.bitcast(jnp.uint32)[0::2, :]
        k_ref[...] = pltpu.bitcast(words << 16, jnp.float32)
        v_ref[...] = pltpu.bitcast(words & jnp.uint32(0xFFFF0000), jnp.float32)

    out_shape = (jax.ShapeDtypeStruct((8, 128), jnp.float32),) * 2
    with pltpu.force_tpu_interpret_mode(interpret_params(interpreter)):
        k, v = jax.jit(lambda a: pl.pallas_call(kernel, out_shape=out_shape)(a))(x)
    np.testing.assert_array_equal(np.asarray(k), np.asarray(x[0::4], np.float32))
    np.testing.assert_array_equal(np.asarray(v), np.asarray(x[1::4], np.float32))


@pytest.mark.parametrize("interpreter", INTERPRETERS)
@pytest.mark.parametrize("rows", [slice(0, 8), slice(2, 5)], ids=["whole", "part"])
def test_bitcast_store_unpacks_into_second_minor_rows(interpreter, rows):
    words = jnp.asarray(np.random.default_rng(3).integers(0, 2**32, (8, 128), dtype=np.uint32))
    base = random_array((16, 128), jnp.bfloat16, seed=4)

    def with_view(w_ref, b_ref, o_ref):
        o_ref[...] = b_ref[...]
        o_ref.bitcast(jnp.uint32)[rows, :] = w_ref[rows, :]

    def without_view(w_ref, b_ref, o_ref):
        packed = pltpu.bitcast(b_ref[...], jnp.uint32)
        o_ref[...] = pltpu.bitcast(
            jax.lax.dynamic_update_slice(packed, w_ref[rows, :], (rows.start, 0)), jnp.bfloat16
        )

    out_shape = jax.ShapeDtypeStruct((16, 128), jnp.bfloat16)
    got = run(with_view, out_shape, words, base, interpreter=interpreter)
    expected_words = packed_words(np.asarray(base))
    expected_words[rows] = np.asarray(words)[rows]
    np.testing.assert_array_equal(
        got.view(np.uint16), unpacked_rows(expected_words, ml_dtypes.bfloat16).view(np.uint16)
    )
    np.testing.assert_array_equal(
        got.view(np.uint16),
        run(without_view, out_shape, words, base, interpreter=interpreter).view(np.uint16),
    )


@pytest.mark.parametrize("interpreter", INTERPRETERS)
def test_bitcast_wide_to_narrow_load(interpreter):
    words = jnp.asarray(np.random.default_rng(5).integers(0, 2**32, (8, 128), dtype=np.uint32))

    def kernel(w_ref, o_ref):
        o_ref[...] = w_ref.bitcast(jnp.uint16)[...]

    got = run(kernel, jax.ShapeDtypeStruct((16, 128), jnp.uint16), words, interpreter=interpreter)
    np.testing.assert_array_equal(got, unpacked_rows(np.asarray(words), np.uint16))


def test_numpy_tpu_bitcast_round_trips_and_matches_jax_state_bitcast():
    from jax._src.state import utils as state_utils

    x = np.asarray(random_array((3, 16, 128), jnp.bfloat16, seed=6))
    words = interpret_compat.tpu_bitcast(x, np.uint32)
    assert words.shape == (3, 8, 128)
    np.testing.assert_array_equal(words, np.asarray(state_utils.bitcast(jnp.asarray(x), jnp.uint32)))
    np.testing.assert_array_equal(
        interpret_compat.tpu_bitcast(words, x.dtype).view(np.uint16), x.view(np.uint16)
    )


# --- masked stores -------------------------------------------------------------------------------------

Y3 = random_array((4, 2, 128), jnp.float32, seed=7)


def rows_1_and_2(shape):
    row = jax.lax.broadcasted_iota(jnp.int32, shape, 0)
    return (row >= 1) & (row < 3)


@pytest.mark.parametrize("interpreter", INTERPRETERS)
def test_masked_store_on_3d_ref(interpreter):
    def masked(x_ref, o_ref):
        o_ref[...] = jnp.zeros_like(o_ref)
        pltpu.store(o_ref, x_ref[...], mask=rows_1_and_2(o_ref.shape))

    def selected(x_ref, o_ref):
        o_ref[...] = jnp.zeros_like(o_ref)
        o_ref[...] = jnp.where(rows_1_and_2(o_ref.shape), x_ref[...], o_ref[...])

    out_shape = jax.ShapeDtypeStruct(Y3.shape, Y3.dtype)
    got = run(masked, out_shape, Y3, interpreter=interpreter)
    np.testing.assert_array_equal(got, run(selected, out_shape, Y3, interpreter=interpreter))
    assert not got[0].any() and not got[3].any() and np.array_equal(got[1:3], np.asarray(Y3)[1:3])


@pytest.mark.parametrize("interpreter", INTERPRETERS)
def test_masked_store_on_int_indexed_3d_ref(interpreter):
    """Upstream's masked_store(l_ref.at[kv_head_idx], ...) with a Python int head index."""

    def masked(x_ref, o_ref):
        o_ref[...] = jnp.zeros_like(o_ref)
        pltpu.store(o_ref.at[1], x_ref[1], mask=rows_1_and_2((2, 128)))

    def selected(x_ref, o_ref):
        o_ref[...] = jnp.zeros_like(o_ref)
        o_ref[1] = jnp.where(rows_1_and_2((2, 128)), x_ref[1], o_ref[1])

    out_shape = jax.ShapeDtypeStruct(Y3.shape, Y3.dtype)
    expected = run(selected, out_shape, Y3, interpreter=interpreter)
    np.testing.assert_array_equal(run(masked, out_shape, Y3, interpreter=interpreter), expected)


@pytest.mark.parametrize("interpreter", INTERPRETERS)
def test_masked_store_through_reshape(interpreter):
    def masked(x_ref, o_ref):
        o_ref[...] = jnp.zeros_like(o_ref)
        pltpu.store(o_ref.reshape(8, 128), x_ref[...].reshape(8, 128), mask=rows_1_and_2((8, 128)))

    def selected(x_ref, o_ref):
        flat = jnp.where(rows_1_and_2((8, 128)), x_ref[...].reshape(8, 128), 0.0)
        o_ref[...] = flat.reshape(o_ref.shape)

    out_shape = jax.ShapeDtypeStruct(Y3.shape, Y3.dtype)
    expected = run(selected, out_shape, Y3, interpreter=interpreter)
    np.testing.assert_array_equal(run(masked, out_shape, Y3, interpreter=interpreter), expected)


def test_masked_store_out_of_bounds_only_where_the_mask_is_false_is_allowed():
    def kernel(mask_rows_ref, o_ref):
        o_ref[...] = jnp.zeros_like(o_ref)
        row = jax.lax.broadcasted_iota(jnp.int32, (4, 2, 128), 0)
        mask = (row >= mask_rows_ref[0]) & (row < mask_rows_ref[1])
        # Rows 3..6 of a 4-row ref: only row 3 (local row 0) exists.
        pltpu.store(o_ref.at[pl.ds(mask_rows_ref[2], 4)], jnp.ones((4, 2, 128)), mask=mask)

    def call(mask_rows):
        return run(
            kernel,
            jax.ShapeDtypeStruct((4, 2, 128), jnp.float32),
            jnp.asarray(mask_rows, jnp.int32),
            interpreter="tpu",
            in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM)],
        )

    got = call([0, 1, 3])
    assert (got[3] == 1).all() and not got[:3].any()
    with pytest.raises(Exception, match="Out-of-bounds masked swap"):
        call([1, 3, 3])


# --- the interpreter's own checks still work through views ---------------------------------------------


def test_out_of_bounds_read_through_view_still_raises():
    def kernel(start_ref, x_ref, o_ref):
        o_ref[...] = x_ref.reshape(16, 128)[pl.ds(start_ref[0], 8), :]

    def call(start, x):
        spec = pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(1,),
            in_specs=[pl.BlockSpec((2, 8, 128), lambda i, s: (0, 0, 0))],
            out_specs=pl.BlockSpec((8, 128), lambda i, s: (0, 0)),
        )
        return pl.pallas_call(kernel, grid_spec=spec, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32))(
            start, x
        )

    with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):
        jitted = jax.jit(call)
        np.testing.assert_array_equal(
            np.asarray(jitted(jnp.asarray([8], jnp.int32), X3)), np.asarray(X3).reshape(16, 128)[8:]
        )
        with pytest.raises(Exception, match="Out-of-bounds read"):
            jitted(jnp.asarray([12], jnp.int32), X3).block_until_ready()
    pltpu.reset_tpu_interpret_mode_state()


def test_uninitialized_scratch_read_through_view_is_nan():
    def kernel(o_ref, scratch):
        scratch[0] = jnp.ones((8, 128), jnp.float32)
        o_ref[...] = scratch.reshape(16, 128)[...]

    got = run(
        kernel,
        jax.ShapeDtypeStruct((16, 128), jnp.float32),
        interpreter="tpu",
        scratch_shapes=[pltpu.VMEM((2, 8, 128), jnp.float32)],
    )
    assert (got[:8] == 1).all() and np.isnan(got[8:]).all()


@pytest.mark.parametrize("read_before_wait", [False, True], ids=["after-wait", "before-wait"])
def test_race_detection_sees_dma_and_reads_through_views(read_before_wait):
    def kernel(x_hbm, o_ref, buffer, semaphore):
        copy = pltpu.make_async_copy(x_hbm, buffer.reshape(2, 8, 128), semaphore)
        copy.start()
        if read_before_wait:
            o_ref[...] = buffer.reshape(2, 8, 128)[1]
        copy.wait()
        if not read_before_wait:
            o_ref[...] = buffer.reshape(2, 8, 128)[1]

    def call(x):
        return pl.pallas_call(
            kernel,
            out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
            in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
            scratch_shapes=[pltpu.VMEM((16, 128), jnp.float32), pltpu.SemaphoreType.DMA(())],
        )(x)

    if read_before_wait:
        with pytest.raises(RaceDetected):
            Backend(INTERPRET).run(jax.jit(call), X3)
    else:
        np.testing.assert_array_equal(Backend(INTERPRET).run(jax.jit(call), X3), np.asarray(X3)[1])


@pytest.mark.parametrize("slot_read", [0, 1], ids=["other-slot", "same-slot"])
def test_race_through_a_bitcast_double_buffer_is_reported_for_the_touched_slot_only(slot_read):
    """tpu-inference v3's pattern: DMA into one slot of a bf16 double buffer, then read a slot through a
    bitcast of the whole buffer. Reading the other slot is no race; reading the slot in flight is one."""

    def kernel(x_hbm, o_ref, buffer, semaphore):
        copy = pltpu.make_async_copy(x_hbm, buffer.at[1], semaphore)
        copy.start()
        o_ref[...] = buffer.bitcast(jnp.uint32)[slot_read]
        copy.wait()

    def call(x):
        return pl.pallas_call(
            kernel,
            out_shape=jax.ShapeDtypeStruct((8, 128), jnp.uint32),
            in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
            scratch_shapes=[pltpu.VMEM((2, 16, 128), jnp.bfloat16), pltpu.SemaphoreType.DMA(())],
        )(x)

    x = random_array((16, 128), jnp.bfloat16)
    if slot_read == 1:
        with pytest.raises(RaceDetected):
            Backend(INTERPRET).run(jax.jit(call), x)
    else:
        got = Backend(INTERPRET).run(jax.jit(call), x)
        assert got.shape == (8, 128)  # slot 0 is uninitialised scratch: only the absence of a race matters


def test_touched_box_follows_reshape_bitcast_and_indexing():
    from rpa_harness.interpret_compat.views import _touched_box

    rows_8_to_15_of_a_reshape = (("reshape", (32, 128)), ("index", ((8, 16, 1), (0, 128, 1))))
    assert _touched_box((2, 16, 128), 32, rows_8_to_15_of_a_reshape) == (
        slice(0, 1),
        slice(8, 16),
        slice(0, 128),
    )
    slot_1_of_a_packing_bitcast = (("bitcast", 32), ("index", (1,)))
    assert _touched_box((2, 16, 128), 16, slot_1_of_a_packing_bitcast) == (
        slice(1, 2),
        slice(0, 16),
        slice(0, 128),
    )
    words_4_to_7_as_halves = (("bitcast", 16), ("index", ((4, 8, 1),)))
    assert _touched_box((16, 128), 32, words_4_to_7_as_halves) == (slice(2, 4), slice(0, 128))
    assert _touched_box((2, 16, 128), 16, (("bitcast", 32),)) is None  # the whole region
    # No rows of a reshape (batched RPA's copy of a block whose write-back it skips: size 0): an empty box,
    # which races with nothing (tpu-empty-access-race), not the whole region, which races with every access.
    no_rows_of_a_reshape = (("reshape", (32, 128)), ("index", ((8, 8, 1), (0, 128, 1))))
    assert _touched_box((2, 16, 128), 32, no_rows_of_a_reshape) == (slice(0, 0), slice(0, 0), slice(0, 0))


# --- scalar-prefetch state across grid steps ------------------------------------------------------------


def count_steps_in_scalar_prefetch(counter_ref, o_ref):
    """Each grid step writes the counter it finds in SMEM, then increments it (upstream's RPA hands the next
    step its sequence and buffer index the same way)."""
    o_ref[...] = jnp.full(o_ref.shape, counter_ref[1], jnp.int32)
    counter_ref[1] = counter_ref[1] + 1


def run_step_counter(interpreter: str, start: int) -> np.ndarray:
    """Per grid step (2 x 3 grid, row-major), the counter value that step saw."""

    def call(counter):
        return pl.pallas_call(
            count_steps_in_scalar_prefetch,
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=1,
                in_specs=[],
                out_specs=pl.BlockSpec((8, 128), lambda i, j, counter: (i * 3 + j, 0)),
                grid=(2, 3),
            ),
            out_shape=jax.ShapeDtypeStruct((6 * 8, 128), jnp.int32),
        )(counter)

    with pltpu.force_tpu_interpret_mode(interpret_params(interpreter)):
        out = np.asarray(jax.jit(call)(jnp.asarray([-7, start], jnp.int32)))
    return out[::8, 0]


# --- float32 products at DEFAULT precision ---------------------------------------------------------------

PRODUCT_X = random_array((8, 128), jnp.float32, seed=1)
PRODUCT_Y = random_array((128, 128), jnp.float32, seed=2)
HIGHEST = jax.lax.Precision.HIGHEST
MATMUL = ((1,), (0,))
TIMES_ROW = ((1,), (1,))  # (m, k) by (1, k)


def through_bfloat16(x):
    return jnp.asarray(x).astype(jnp.bfloat16).astype(x.dtype)


def product_kernel(precision=None, in_a_loop=False, contracting=MATMUL):
    """A kernel writing the float32 product of its two inputs, in its body or in the body of a loop."""

    def times(x_ref, y_ref):
        return jax.lax.dot_general(
            x_ref[...],
            y_ref[...],
            (contracting, ((), ())),
            precision=precision,
            preferred_element_type=jnp.float32,
        )

    def kernel(x_ref, y_ref, o_ref):
        if in_a_loop:
            zeros = jnp.zeros(o_ref.shape, jnp.float32)
            o_ref[...] = jax.lax.fori_loop(0, 1, lambda _, total: total + times(x_ref, y_ref), zeros)
        else:
            o_ref[...] = times(x_ref, y_ref)

    return kernel


def product(x, y, *, interpreter, generation, precision=None, in_a_loop=False, contracting=MATMUL):
    kernel = product_kernel(precision, in_a_loop, contracting)
    columns = y.shape[1 - contracting[1][0]]
    with generations.emulated(generation):
        return run(
            kernel, jax.ShapeDtypeStruct((x.shape[0], columns), jnp.float32), x, y, interpreter=interpreter
        )


@pytest.mark.parametrize("interpreter", INTERPRETERS)
@pytest.mark.parametrize(
    "precision", [None, jax.lax.Precision.DEFAULT, HIGHEST], ids=["unset", "default", "highest"]
)
@pytest.mark.parametrize("in_a_loop", [False, True], ids=["body", "loop"])
def test_an_emulated_generation_multiplies_float32_operands_as_the_mxu_does(
    interpreter, precision, in_a_loop
):
    """Under an emulated generation a float32 product at DEFAULT is one bfloat16 pass (operands rounded,
    float32 accumulation), bit for bit; at HIGHEST, and with no generation emulated, the exact float32 one."""
    settings = {"interpreter": interpreter, "precision": precision, "in_a_loop": in_a_loop}
    exact = product(PRODUCT_X, PRODUCT_Y, generation="none", **settings)
    one_pass = product(
        through_bfloat16(PRODUCT_X), through_bfloat16(PRODUCT_Y), generation="none", **settings
    )
    assert not np.array_equal(exact, one_pass)  # the operands tell the two apart
    emulated = product(PRODUCT_X, PRODUCT_Y, generation="v5e", **settings)
    np.testing.assert_array_equal(emulated, exact if precision == HIGHEST else one_pass)
    np.testing.assert_array_equal(product(PRODUCT_X, PRODUCT_Y, generation="none", **settings), exact)


@pytest.mark.parametrize("interpreter", INTERPRETERS)
def test_an_emulated_generation_multiplies_at_high_in_three_bfloat16_passes(interpreter):
    """HIGH is Mosaic's bf16x3: each float32 operand as bfloat16 hi + lo, hi*hi + hi*lo + lo*hi."""
    x_hi, y_hi = through_bfloat16(PRODUCT_X), through_bfloat16(PRODUCT_Y)
    x_lo, y_lo = through_bfloat16(PRODUCT_X - x_hi), through_bfloat16(PRODUCT_Y - y_hi)
    passes = [
        product(x, y, interpreter=interpreter, generation="none")
        for x, y in ((x_hi, y_hi), (x_hi, y_lo), (x_lo, y_hi))
    ]
    three_passes = (passes[0] + passes[1]) + passes[2]
    high = jax.lax.Precision.HIGH
    emulated = product(PRODUCT_X, PRODUCT_Y, interpreter=interpreter, generation="v5e", precision=high)
    np.testing.assert_array_equal(emulated, three_passes)
    exact = product(PRODUCT_X, PRODUCT_Y, interpreter=interpreter, generation="none", precision=high)
    assert not np.array_equal(exact, three_passes)


@pytest.mark.parametrize("interpreter", INTERPRETERS)
def test_of_mixed_operands_the_float32_one_is_rounded(interpreter):
    narrow = PRODUCT_X.astype(jnp.bfloat16)
    exact = product(narrow, PRODUCT_Y, interpreter=interpreter, generation="none")
    one_pass = product(narrow, through_bfloat16(PRODUCT_Y), interpreter=interpreter, generation="none")
    assert not np.array_equal(exact, one_pass)
    np.testing.assert_array_equal(
        product(narrow, PRODUCT_Y, interpreter=interpreter, generation="v5e"), one_pass
    )


@pytest.mark.parametrize("interpreter", INTERPRETERS)
def test_a_mixed_matrix_vector_product_stays_exact_as_on_the_vpu(interpreter):
    """jax lowers an (m, k) by (1, k) contraction of operands not both float32 to a float32 multiply and
    reduction on the VPU: no bfloat16 pass to emulate."""
    row = PRODUCT_Y[:1]
    narrow = PRODUCT_X.astype(jnp.bfloat16)
    settings = {"interpreter": interpreter, "contracting": TIMES_ROW}
    exact = product(narrow, row, generation="none", **settings)
    assert not np.array_equal(exact, product(narrow, through_bfloat16(row), generation="none", **settings))
    np.testing.assert_array_equal(product(narrow, row, generation="v5e", **settings), exact)


def test_products_outside_the_kernel_stay_exact_under_emulation():
    """Only the interpreted kernel's products are the chip's: the jnp code around it is the CPU's."""
    kernel = product_kernel()
    out_shape = jax.ShapeDtypeStruct((8, 128), jnp.float32)

    def around(x, y):
        return jnp.dot(x, y) + pl.pallas_call(kernel, out_shape=out_shape)(x, y)

    with pltpu.force_tpu_interpret_mode(True), generations.emulated("v5e"):
        both = np.asarray(jax.jit(around)(PRODUCT_X, PRODUCT_Y))
    outside = np.asarray(jnp.dot(PRODUCT_X, PRODUCT_Y))
    inside = product(
        through_bfloat16(PRODUCT_X), through_bfloat16(PRODUCT_Y), interpreter="generic", generation="none"
    )
    np.testing.assert_array_equal(both, outside + inside)


@pytest.mark.parametrize("interpreter", INTERPRETERS)
def test_scalar_prefetch_writes_reach_the_next_grid_step(interpreter):
    np.testing.assert_array_equal(run_step_counter(interpreter, start=10), np.arange(10, 16))
    # A second run starts again from the operand it is given, not from the first run's last write.
    np.testing.assert_array_equal(run_step_counter(interpreter, start=10), np.arange(10, 16))
    np.testing.assert_array_equal(run_step_counter(interpreter, start=3), np.arange(3, 9))


# --- narrow floats: stores move bits ------------------------------------------------------------------


def gather_pages_in_reverse(x_hbm, o_ref, buffer, semaphore):
    for i in range(buffer.shape[0]):
        copy = pltpu.make_async_copy(x_hbm.at[buffer.shape[0] - 1 - i], buffer.at[i], semaphore)
        copy.start()
        copy.wait()
    o_ref[...] = buffer[...]


def run_page_gather(pages):
    """(output, optimized HLO) of gather_pages_in_reverse under the generic interpreter."""

    def call(x):
        return pl.pallas_call(
            gather_pages_in_reverse,
            out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
            in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
            scratch_shapes=[pltpu.VMEM(x.shape, x.dtype), pltpu.SemaphoreType.DMA(())],
        )(x)

    with pltpu.force_tpu_interpret_mode(True):
        compiled = jax.jit(call).lower(pages).compile()
        return np.asarray(compiled(pages)), compiled.as_text()


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.bfloat16], ids=str)
def test_narrow_float_dma_is_bit_exact_and_converts_nothing(dtype):
    pages = np.asarray(random_array((4, 16, 128), jnp.float32)).astype(dtype)
    pages[1, 3, :5] = np.nan  # NaN payloads survive only a bit-exact copy
    got, hlo = run_page_gather(jnp.asarray(pages))
    bits = f"uint{8 * np.dtype(dtype).itemsize}"
    np.testing.assert_array_equal(got.view(bits), pages[::-1].view(bits))
    assert " convert(" not in hlo, "an access to a narrow-float buffer still converts it"


# --- copies of a data-dependent size --------------------------------------------------------------------

PAGES = jnp.asarray(np.arange(16 * 128, dtype=np.float32).reshape(16, 128))
# (source rows, output rows, src, dst, size): a shorter output (v3's page fetch) and a longer one (its
# cache update), with copies at either end, empty and whole.
DYNAMIC_COPIES = [
    (16, 8, 5, 2, 3),
    (16, 8, 0, 0, 8),
    (16, 8, 8, 0, 8),
    (16, 8, 13, 5, 3),
    (16, 8, 15, 7, 1),
    (16, 8, 4, 4, 0),
    (16, 8, 9, 1, 7),
    (8, 16, 0, 13, 3),
    (8, 16, 5, 15, 1),
    (8, 16, 0, 8, 8),
    (8, 16, 2, 3, 6),
]


@pytest.mark.parametrize("interpreter", INTERPRETERS)
@pytest.mark.parametrize(
    "source_rows, out_rows, src, dst, size",
    DYNAMIC_COPIES,
    ids=["-".join(map(str, c)) for c in DYNAMIC_COPIES],
)
def test_dynamic_size_dma_copies_exactly_its_rows(interpreter, source_rows, out_rows, src, dst, size):
    """A DMA of x[src : src + size] into rows [dst, dst + size) of a -1-filled output: those rows hold the
    source rows, element for element, and every other element is still -1."""
    source = np.asarray(PAGES)[:source_rows]
    got = generic_gaps.run_dynamic_size_copy(
        jnp.asarray(source), out_rows, src=src, dst=dst, size=size, interpret=interpret_params(interpreter)
    )
    for row in range(out_rows):
        if dst <= row < dst + size:
            np.testing.assert_array_equal(got[row], source[src + row - dst], err_msg=f"row {row}")
        else:
            assert (got[row] == -1).all(), f"row {row} is outside the copy but changed: {got[row][:4]}"


def copy_rows_then_none_from(copy_ref, x_hbm, o_ref, semaphore):
    """Rows 0-3 of ``x`` by one DMA and zero rows from row ``copy_ref[0]`` by another on the same semaphore,
    then one wait for the four rows. The interpreter's wait runs the latest DMA first, so the empty one is
    read: v3's fetch of a KV block with ``update_kv_cache=False`` (its new tokens, none, from the row where
    the sequence's queries end, the end of the token buffer for the last sequence of a full batch)."""
    o_ref[...] = jnp.full(o_ref.shape, -1, o_ref.dtype)
    rows = pltpu.make_async_copy(x_hbm.at[pl.ds(0, 4)], o_ref.at[pl.ds(0, 4)], semaphore)
    rows.start()
    start, none = copy_ref[0], copy_ref[1]
    pltpu.make_async_copy(x_hbm.at[pl.ds(start, none)], o_ref.at[pl.ds(4, none)], semaphore).start()
    rows.wait()


def copy_of_no_rows_after_four(start: int) -> np.ndarray:
    """``copy_rows_then_none_from`` on the 8 rows of ``PAGES[:8]``, on the TPU interpreter."""

    def call(copy, x):
        return pl.pallas_call(
            copy_rows_then_none_from,
            out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
            in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM), pl.BlockSpec(memory_space=pl.ANY)],
            scratch_shapes=[pltpu.SemaphoreType.DMA(())],
        )(copy, x)

    try:
        with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):
            return np.asarray(jax.jit(call)(jnp.array([start, 0], jnp.int32), PAGES[:8]))
    except Exception:
        pltpu.reset_tpu_interpret_mode_state()
        raise


def test_a_copy_of_no_rows_from_the_end_of_its_source_is_in_bounds_and_one_past_it_is_not():
    got = copy_of_no_rows_after_four(8)
    np.testing.assert_array_equal(got[:4], np.asarray(PAGES)[:4])
    assert (got[4:] == -1).all()
    with pytest.raises(Exception, match="Out-of-bounds read"):
        copy_of_no_rows_after_four(9)


def wait_for_no_rows(copy_ref, x_hbm, o_ref, semaphore, unsignalled):
    """Rows 0-3 of ``x``, then a wait for a copy of ``copy_ref[0]`` rows, never started, on a semaphore
    nothing has signalled (batched RPA's wait for its new tokens' copy when a block has none): on a TPU a
    wait for nothing returns."""
    rows = pltpu.make_async_copy(x_hbm.at[pl.ds(0, 4)], o_ref.at[pl.ds(0, 4)], semaphore)
    rows.start()
    rows.wait()
    none = copy_ref[0]
    pltpu.make_async_copy(x_hbm.at[pl.ds(4, none)], o_ref.at[pl.ds(4, none)], unsignalled).wait()
    o_ref[pl.ds(4, 4)] = jnp.full((4, o_ref.shape[1]), -1, o_ref.dtype)


def wait_for_no_rows_with_race_detection() -> np.ndarray:
    """``wait_for_no_rows`` on ``PAGES[:8]`` on the TPU interpreter, race detection on (the checking backend)."""

    def call(copy, x):
        return pl.pallas_call(
            wait_for_no_rows,
            out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
            in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM), pl.BlockSpec(memory_space=pl.ANY)],
            scratch_shapes=[pltpu.SemaphoreType.DMA(()), pltpu.SemaphoreType.DMA(())],
        )(copy, x)

    try:
        with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams(detect_races=True)):
            return np.asarray(jax.jit(call)(jnp.array([0], jnp.int32), PAGES[:8]))
    except Exception:
        pltpu.reset_tpu_interpret_mode_state()
        raise


def test_a_wait_for_no_rows_returns_with_race_detection_on():
    got = wait_for_no_rows_with_race_detection()
    np.testing.assert_array_equal(got[:4], np.asarray(PAGES)[:4])
    assert (got[4:] == -1).all()


def copy_columns_and_count(copy_ref, x_hbm, o_ref, count_ref, buffer, semaphore):
    """v3's query fetch: two DMAs of data-dependent sizes into columns of one buffer (axis 1, like
    ``q_hbm_ref.at[:, pl.ds(start, size)]``), the semaphore's count after both starts, then one wait on a
    descriptor covering both (as v3 waits for its page copies) and the count after it."""
    buffer[...] = jnp.full(buffer.shape, 7, buffer.dtype)
    first, second, start = copy_ref[0], copy_ref[1], copy_ref[2]
    pltpu.make_async_copy(x_hbm.at[:, pl.ds(start, first)], buffer.at[:, pl.ds(0, first)], semaphore).start()
    pltpu.make_async_copy(
        x_hbm.at[:, pl.ds(start + first, second)], buffer.at[:, pl.ds(first, second)], semaphore
    ).start()
    count_ref[0] = pl.semaphore_read(semaphore)
    both = buffer.at[:, pl.ds(0, first + second)]
    pltpu.make_async_copy(both, both, semaphore).wait()
    count_ref[1] = pl.semaphore_read(semaphore)
    o_ref[...] = buffer[...]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float8_e4m3fn], ids=str)
def test_dynamic_size_dmas_along_axis_1_are_bit_exact_and_count_their_elements(dtype):
    x = np.asarray(random_array((2, 16, 128), jnp.float32, seed=8)).astype(dtype)
    x[1, 3, :5] = np.nan  # NaN payloads survive only a bit-exact copy
    first, second, start = 3, 2, 2

    def call(copy, x):
        return pl.pallas_call(
            copy_columns_and_count,
            out_shape=(
                jax.ShapeDtypeStruct((2, 8, 128), x.dtype),
                jax.ShapeDtypeStruct((2,), jnp.int32),
            ),
            in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM), pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=(pl.BlockSpec(memory_space=pltpu.VMEM), pl.BlockSpec(memory_space=pltpu.SMEM)),
            scratch_shapes=[pltpu.VMEM((2, 8, 128), x.dtype), pltpu.SemaphoreType.DMA(())],
        )(copy, x)

    with pltpu.force_tpu_interpret_mode(True):
        got, counts = jax.jit(call)(jnp.array([first, second, start], jnp.int32), jnp.asarray(x))
    bits = f"uint{8 * np.dtype(dtype).itemsize}"
    expected = np.full((2, 8, 128), 7, np.float32).astype(dtype)
    expected[:, : first + second] = x[:, start : start + first + second]
    np.testing.assert_array_equal(np.asarray(got).view(bits), expected.view(bits))
    # The generic interpreter counts a DMA semaphore in elements: both copies, then none left.
    np.testing.assert_array_equal(np.asarray(counts), [2 * (first + second) * 128, 0])


# --- reads that run past their ref (generic-clamped-reads) ---------------------------------------------


def read_from(x, start: int, rows: int, stride: int = 1, *, through_view: bool = False) -> np.ndarray:
    """``rows`` rows of ``x`` (16 rows, or a (2, 8, ...) ref read through a 16-row reshape) every ``stride``-th
    from row ``start``, read from SMEM (a data-dependent start), on the generic interpreter."""

    def kernel(start_ref, x_ref, o_ref):
        ref = x_ref.reshape(16, *x_ref.shape[2:]) if through_view else x_ref
        o_ref[...] = ref[pl.ds(start_ref[0], rows, stride)]

    out_shape = jax.ShapeDtypeStruct((rows, *x.shape[1 + through_view :]), x.dtype)
    in_specs = [pl.BlockSpec(memory_space=pltpu.SMEM), pl.BlockSpec()]
    return run(kernel, out_shape, jnp.array([start], jnp.int32), x, interpreter="generic", in_specs=in_specs)


def expected_read(rows_of_x: np.ndarray, start: int, rows: int, stride: int, outside) -> np.ndarray:
    """Row ``start + j * stride`` of ``rows_of_x`` for each j, ``outside`` where that row is not in it."""
    expected = np.full((rows, *rows_of_x.shape[1:]), outside, rows_of_x.dtype)
    for j in range(rows):
        if 0 <= start + j * stride < len(rows_of_x):
            expected[j] = rows_of_x[start + j * stride]
    return expected


# (start, rows, stride): inside, past the end, before the start, strided, entirely outside.
READS = [(4, 8, 1), (12, 8, 1), (-2, 8, 1), (3, 5, 3), (12, 8, 2), (-3, 4, 2), (40, 8, 1)]


@pytest.mark.parametrize("through_view", [False, True], ids=["ref", "view"])
@pytest.mark.parametrize("start, rows, stride", READS, ids=["-".join(map(str, r)) for r in READS])
def test_a_read_past_its_ref_reads_each_row_inside_from_its_own_position(start, rows, stride, through_view):
    """As on a TPU: rows inside the ref come from where they are, rows outside it read NaN, none of them
    moved onto rows inside (lax.dynamic_slice's clamped start)."""
    x = np.arange(16 * 128, dtype=np.float32).reshape(16, 128)
    source = jnp.asarray(x.reshape(2, 8, 128) if through_view else x)
    got = read_from(source, start, rows, stride, through_view=through_view)
    np.testing.assert_array_equal(got, expected_read(x, start, rows, stride, np.nan))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float8_e4m3fn, jnp.float8_e4m3fnuz], ids=str)
def test_a_read_past_a_narrow_float_ref_is_bit_exact_inside_and_nan_outside(dtype):
    x = np.asarray(random_array((16, 128), jnp.float32)).astype(dtype)
    x[13, :5] = np.nan  # a NaN payload inside survives only a bit-exact read
    got = read_from(jnp.asarray(x), 12, 8)
    bits = f"uint{8 * np.dtype(dtype).itemsize}"
    np.testing.assert_array_equal(got[:4].view(bits), x[12:].view(bits))
    assert np.isnan(got[4:].astype(np.float32)).all()


def test_a_read_past_an_integer_ref_reads_every_bit_set():
    """v3 reads its bfloat16 KV buffer through a uint32 view: rows past it read as every bit set, which is
    NaN in any float the kernel bitcasts them to."""
    x = np.arange(16 * 128, dtype=np.uint32).reshape(16, 128)
    got = read_from(jnp.asarray(x), 12, 8)
    np.testing.assert_array_equal(got, expected_read(x, 12, 8, 1, np.uint32(0xFFFFFFFF)))
    assert np.isnan(unpacked_rows(got[4:], jnp.bfloat16).astype(np.float32)).all()


# --- race history pruning --------------------------------------------------------------------------------

LONG_CALL_COPIES = 300  # ~1,800 recorded accesses before the last copy: many prunes happen before it


def double_buffered(kernel, semaphores: tuple[int, ...]):
    """``kernel`` as a jitted call on (n, 8, 128) float32 pages in HBM, with a double buffer of two pages in
    VMEM and DMA semaphores of shape ``semaphores``."""
    scratch_shapes = [pltpu.VMEM((2, 8, 128), jnp.float32), pltpu.SemaphoreType.DMA(semaphores)]
    page = jax.ShapeDtypeStruct((8, 128), jnp.float32)
    return fresh_pallas_call(kernel, page, scratch_shapes, in_specs=[pl.BlockSpec(memory_space=pl.ANY)])


def copies_then_a_last_one(race_at_the_end: bool):
    """LONG_CALL_COPIES page DMAs into alternating slots of a double buffer, each waited for and read,
    then one more DMA whose destination slot is read before (a race) or after its wait."""

    def kernel(x_hbm, o_ref, buffer, semaphore):
        o_ref[...] = jnp.zeros_like(o_ref)

        def copy_and_read(i, carry):
            copy = pltpu.make_async_copy(x_hbm.at[i % 2], buffer.at[i % 2], semaphore)
            copy.start()
            copy.wait()
            o_ref[...] += buffer[i % 2]
            return carry

        jax.lax.fori_loop(0, LONG_CALL_COPIES, copy_and_read, 0)
        last = pltpu.make_async_copy(x_hbm.at[0], buffer.at[1], semaphore)
        last.start()
        if race_at_the_end:
            o_ref[...] += buffer[1]
        last.wait()
        if not race_at_the_end:
            o_ref[...] += buffer[1]

    return double_buffered(kernel, semaphores=())


def a_race_then_copies(race: bool):
    """A DMA into slot 1 of a double buffer, started first and waited for last; its slot is read right after
    the start (a race) or after the wait; in between, LONG_CALL_COPIES DMAs into slot 0 of the same buffer,
    each waited for and read, so the buffer's history is pruned many times while the racing read is in it."""

    def kernel(x_hbm, o_ref, buffer, semaphores):
        o_ref[...] = jnp.zeros_like(o_ref)
        long_lived = pltpu.make_async_copy(x_hbm.at[1], buffer.at[1], semaphores.at[1])
        long_lived.start()
        if race:
            o_ref[...] += buffer[1]

        def copy_and_read(i, carry):
            copy = pltpu.make_async_copy(x_hbm.at[0], buffer.at[0], semaphores.at[0])
            copy.start()
            copy.wait()
            o_ref[...] += buffer[0]
            return carry

        jax.lax.fori_loop(0, LONG_CALL_COPIES, copy_and_read, 0)
        long_lived.wait()
        if not race:
            o_ref[...] += buffer[1]

    return double_buffered(kernel, semaphores=(2,))


@pytest.mark.parametrize("race", [True, False], ids=["read-before-wait", "read-after-wait"])
def test_an_early_race_seen_only_at_a_late_wait_is_still_reported(race):
    """The racing read is older than hundreds of accesses to its buffer when the DMA it races with writes:
    the DMA's clock, taken at its start, keeps the read in the history (it is live until the DMA completes;
    so while it is in flight nothing after its start is pruned)."""
    x = jnp.ones((2, 8, 128), jnp.float32)
    if race:
        with pytest.raises(RaceDetected):
            Backend(INTERPRET).run(a_race_then_copies(race=True), x)
    else:
        got = Backend(INTERPRET).run(a_race_then_copies(race=False), x)
        np.testing.assert_array_equal(got, np.full((8, 128), LONG_CALL_COPIES + 1, np.float32))


def race_history_sizes() -> list[int]:
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpreter

    races = tpu_interpreter.races
    return [len(races.reads[key]) + len(races.writes[key]) for key in {*races.reads, *races.writes}]


def test_a_race_late_in_a_long_call_is_still_reported():
    x = jnp.ones((2, 8, 128), jnp.float32)
    with pytest.raises(RaceDetected):
        Backend(INTERPRET).run(copies_then_a_last_one(race_at_the_end=True), x)


def test_a_long_call_without_a_race_passes_with_short_histories():
    x = jnp.ones((2, 8, 128), jnp.float32)
    got = Backend(INTERPRET).run(copies_then_a_last_one(race_at_the_end=False), x)
    np.testing.assert_array_equal(got, np.full((8, 128), LONG_CALL_COPIES + 1, np.float32))
    sizes = race_history_sizes()
    if gap_state("tpu-race-history") == interpret_compat.PATCHED:
        assert max(sizes) < 2 * tpu_gaps._PRUNE_FROM, f"race histories were not pruned: {sorted(sizes)}"


def test_a_call_that_raised_on_a_race_does_not_stop_later_pruning():
    """A DMA left in flight by a call that ended in RaceDetected never completes; it must not count as live
    in the next call (it did, and no history was pruned after any race)."""
    x = jnp.ones((2, 8, 128), jnp.float32)
    with pytest.raises(RaceDetected):  # raised at a DMA wait, so that DMA never completes
        Backend(INTERPRET).run(a_race_then_copies(race=True), x)
    test_a_long_call_without_a_race_passes_with_short_histories()


# --- which gaps this jax has: the probes agree with the interpreters (canaries for when jax closes a gap) ---


def gap_state(gap: str) -> str:
    return interpret_compat.gap_statuses()[gap].state


def test_every_gap_is_probed_and_patched_or_closed_on_this_jax():
    statuses = interpret_compat.gap_statuses()
    products = (product_gaps.TPU_PRODUCTS, product_gaps.GENERIC_PRODUCTS)
    assert set(statuses) == {gap.name for gap in (*tpu_gaps.GAPS, *generic_gaps.GAPS, *products)}
    table = "\n".join(f"  {name}: {status.state}" for name, status in statuses.items())
    print(f"interpret_compat on jax {jax.__version__}:\n{table}")
    assert interpret_compat.unpatched_gaps() == {}, f"jax {jax.__version__}:\n{table}"
    assert interpret_compat.install() is True


def assert_gap(gap: str, run_without_layer, error_text: str, *, whole_gap: bool = True):
    """Without the layer, ``run_without_layer`` fails with ``error_text`` exactly where the probe says this jax
    has ``gap``. ``whole_gap=False``: the run covers one part of the gap, which jax may close alone."""
    state = gap_state(gap)
    with layer_off():
        try:
            run_without_layer()
        except Exception as error:  # noqa: BLE001 - we inspect the message below
            if error_text not in str(error):
                raise
            assert state != interpret_compat.CLOSED, (
                f"the probe says jax {jax.__version__} closed {gap}, but it still fails with {error_text!r}"
            )
            return
    if state == interpret_compat.CLOSED or not whole_gap:
        what = "its patch" if state == interpret_compat.CLOSED else "the part of its patch for this case"
        warnings.warn(
            f"jax {jax.__version__} no longer fails with {error_text!r} ({gap}): {what} can go once this "
            "jax is the lowest supported version (pyproject.toml).",
            stacklevel=2,
        )
        return
    pytest.fail(
        f"jax {jax.__version__} no longer fails with {error_text!r}, but the probe for {gap} says it does "
        f"({state}): fix the probe in rpa_harness/interpret_compat."
    )


def assert_probe_agrees(gap: str, still_there: bool, closed: str):
    """For a gap no error shows (a cost, a missing check): the probe agrees with what the unpatched
    interpreter did (``still_there``); where jax has closed the gap, a warning says so (``closed``)."""
    assert still_there == (gap_state(gap) != interpret_compat.CLOSED)
    if not still_there:
        warnings.warn(
            f"jax {jax.__version__} {closed}: the {gap} patch can go once this jax is the lowest supported version.",
            stacklevel=2,
        )


def read_through_reshape(x_ref, o_ref):
    o_ref[...] = x_ref.reshape(16, 128)[...]


def read_through_bitcast(x_ref, o_ref):
    o_ref[...] = x_ref.bitcast(jnp.uint32)[...]


def store_masked(x_ref, o_ref):
    o_ref[...] = jnp.zeros_like(o_ref)
    pltpu.store(o_ref, x_ref[...], mask=rows_1_and_2(o_ref.shape))


def store_masked_at_a_literal_index(x_ref, o_ref):
    o_ref[...] = jnp.zeros_like(o_ref)
    pltpu.store(o_ref.at[1], x_ref[1], mask=rows_1_and_2((2, 128)))


def store_through_reshape(x_ref, o_ref):
    o_ref.reshape(16, 128)[...] = x_ref[...].reshape(16, 128)


# Kernels that fail without the layer where this jax has the gap: (gap, interpreter, kernel, input, output
# shape and dtype or None for the input's, the error, whether the kernel covers the whole gap or one part
# of it that jax may close alone).
FAILING_KERNELS = {
    "reshape-tpu": ("tpu-ref-views", "tpu", read_through_reshape, X3, ((16, 128), jnp.float32),
                    "'ReshapeTransform' object has no attribute 'indices'", False),
    "bitcast-tpu": ("tpu-ref-views", "tpu", read_through_bitcast, random_array((16, 128), jnp.bfloat16),
                    ((8, 128), jnp.uint32), "'BitcastTransform' object has no attribute 'indices'", False),
    "masked-swap-tpu": ("tpu-masked-swap", "tpu", store_masked, Y3, None, "Out-of-bounds masked swap", True),
    "literal-index-generic": ("generic-literal-indices", "generic", store_masked_at_a_literal_index, Y3, None,
                              "'TypedInt' object has no attribute 'shape'", True),
    "view-store-generic": ("generic-view-stores", "generic", store_through_reshape, X3, None,
                           "Unsupported transform: ReshapeTransform", False),
}  # fmt: skip


@pytest.mark.parametrize("name", list(FAILING_KERNELS))
def test_gap_still_in_the_interpreter(name):
    gap, interpreter, kernel, x, out, error_text, whole_gap = FAILING_KERNELS[name]
    out_shape = jax.ShapeDtypeStruct(*(out or (x.shape, x.dtype)))
    assert_gap(
        gap, lambda: run(kernel, out_shape, x, interpreter=interpreter), error_text, whole_gap=whole_gap
    )


def test_gap_empty_copy_at_end_still_in_tpu_interpreter():
    assert_gap("tpu-empty-copy-at-end", lambda: copy_of_no_rows_after_four(8), "Out-of-bounds read")


def test_gap_wait_for_nothing_still_in_tpu_interpreter():
    assert_gap("tpu-wait-for-nothing", wait_for_no_rows_with_race_detection, "CpuCallback error")


def test_an_access_of_no_elements_overlaps_nothing():
    """The race detector's overlap test, which the layer patches and the probe runs unpatched: an empty
    range overlaps nothing, any other range what it shares elements with (batched RPA's fetch of a query
    block of no tokens, beside the previous step's write-back: tests/targets/test_batched_rpa_target.py)."""
    from jax._src.pallas.mosaic.interpret import race_detection_state as races

    assert not races._slices_overlap(slice(0, 0, 1), slice(0, 8, 1))
    assert not races._slices_overlap(slice(0, 8, 1), slice(3, 3, 1))
    assert races._slices_overlap(slice(0, 4, 1), slice(3, 8, 1)) and races._slices_overlap(2, slice(0, 8, 1))
    assert not races._slices_overlap(slice(0, 4, 1), slice(4, 8, 1))
    assert races._ranges_overlap((slice(0, 4, 1), slice(0, 2, 1)), (slice(0, 4, 1), slice(1, 8, 1)))
    assert not races._ranges_overlap((slice(0, 4, 1), slice(0, 0, 1)), (slice(0, 4, 1), slice(0, 8, 1)))
    with layer_off():
        assert races._slices_overlap(slice(0, 0, 1), slice(0, 8, 1)) == (
            gap_state("tpu-empty-access-race") != interpret_compat.CLOSED
        )


def test_gap_masked_view_store_still_in_generic_interpreter():
    """The other part of generic-view-stores: ``swap_p`` writes back an array of the transformed shape."""

    def masked(x_ref, o_ref):
        o_ref[...] = jnp.zeros_like(o_ref)
        pltpu.store(o_ref.reshape(8, 128), x_ref[...].reshape(8, 128), mask=rows_1_and_2((8, 128)))

    expected = np.where(np.asarray(rows_1_and_2((8, 128))), np.asarray(Y3).reshape(8, 128), 0.0)

    def run_and_compare():
        got = run(masked, jax.ShapeDtypeStruct(Y3.shape, Y3.dtype), Y3, interpreter="generic")
        if not np.array_equal(got.reshape(8, 128), expected):
            raise AssertionError("masked store through a reshape wrote the wrong elements")

    assert_gap("generic-view-stores", run_and_compare, "", whole_gap=False)  # any failure is the gap


def test_gap_scalar_prefetch_state_still_in_generic_interpreter():
    with layer_off():
        seen = run_step_counter("generic", start=10)
    if np.array_equal(seen, np.full(6, 10)):
        assert gap_state("generic-scalar-prefetch-state") != interpret_compat.CLOSED
        return
    np.testing.assert_array_equal(seen, np.arange(10, 16))
    assert gap_state("generic-scalar-prefetch-state") == interpret_compat.CLOSED, (
        f"jax {jax.__version__} keeps scalar-prefetch writes across grid steps in the generic interpreter, "
        "but the probe says it does not: fix the probe."
    )
    warnings.warn(f"jax {jax.__version__} closed generic-scalar-prefetch-state", stacklevel=1)


def test_gap_dynamic_size_copy_still_in_generic_interpreter():
    assert_gap(
        "generic-dynamic-size-copies",
        lambda: generic_gaps.run_dynamic_size_copy(PAGES, 8, src=5, dst=2, size=3),
        generic_gaps.DYNAMIC_SIZE_ERROR,
    )


def test_gap_clamped_reads_still_in_generic_interpreter():
    """Without the layer, 8 rows from row 12 of a 16-row ref come back as rows 8-15."""
    x = jnp.arange(16 * 128, dtype=jnp.float32).reshape(16, 128)
    with layer_off():
        got = generic_gaps.run_read_rows_from(x, start=12, rows=8)
    assert_probe_agrees(
        "generic-clamped-reads",
        np.array_equal(got, np.asarray(x)[8:]),
        "reads the rows of a slice past its ref where they are",
    )


def test_gap_memory_space_operand_still_in_generic_interpreter():
    x = jnp.arange(8 * 128, dtype=jnp.float32).reshape(8, 128)
    assert_gap(
        "generic-memory-space-operands",
        lambda: generic_gaps.add_one_to_an_hbm_operand(x),
        generic_gaps.MEMORY_SPACE_ERROR,
    )


def test_an_operand_in_hbm_keeps_its_values_on_the_generic_interpreter():
    x = jnp.arange(8 * 128, dtype=jnp.float32).reshape(8, 128)
    np.testing.assert_array_equal(generic_gaps.add_one_to_an_hbm_operand(x), np.asarray(x) + 1)


def test_cost_narrow_float_store_still_in_xla_cpu():
    """XLA CPU still converts a float8_e4m3fn buffer to f16 and back around a dynamic-update-slice."""

    def store_rows(buffer, row):
        return jax.lax.fori_loop(
            0, buffer.shape[0], lambda i, b: jax.lax.dynamic_update_slice(b, row, (i, 0)), buffer
        )

    buffer = jnp.zeros((8, 128), jnp.float8_e4m3fn)
    hlo = jax.jit(store_rows).lower(buffer, buffer[:1]).compile().as_text()
    converts = "f16[8,128]" in hlo
    assert_probe_agrees(
        "generic-narrow-float-bits",
        converts,
        "has XLA CPU store into float8_e4m3fn buffers without converting them",
    )


def test_cost_race_history_still_unpruned_in_tpu_interpreter():
    """Without the layer the detector still keeps every access of a long call (gap tpu-race-history)."""
    with layer_off():
        unpatched = Backend(INTERPRET, interpreter_compat=False)
        unpatched.run(copies_then_a_last_one(race_at_the_end=False), jnp.ones((2, 8, 128)))
        unpruned = max(race_history_sizes()) > LONG_CALL_COPIES
    assert_probe_agrees("tpu-race-history", unpruned, "prunes its race histories")


def add_one(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1.0


@contextlib.contextmanager
def recording_callback_arguments(name: str):
    """Record the arguments of each call the TPU interpreter makes to its callback ``name`` (get, store...)."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpreter

    calls, original = [], getattr(tpu_interpreter, name)

    def recorded(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    setattr(tpu_interpreter, name, recorded)
    try:
        yield calls
    finally:
        setattr(tpu_interpreter, name, original)


def test_cost_callback_arguments_still_device_put_in_tpu_interpreter():
    """Without the layer the interpreter's callbacks still get their arguments as jax arrays (gap
    tpu-callback-arguments); with it, as NumPy copies: XLA hands a callback read-only views of buffers it
    reuses in the next call, which the interpreter must not keep."""
    x = jnp.ones((8, 128), jnp.float32)
    with layer_off(), recording_callback_arguments("store") as calls:
        run(add_one, jax.ShapeDtypeStruct((8, 128), jnp.float32), x, interpreter="tpu")
    device_put = isinstance(calls[0][-1], jax.Array)
    assert_probe_agrees("tpu-callback-arguments", device_put, "hands interpreter callbacks NumPy arrays")
    with recording_callback_arguments("store") as calls:
        got = run(add_one, jax.ShapeDtypeStruct((8, 128), jnp.float32), x, interpreter="tpu")
    np.testing.assert_array_equal(got, np.full((8, 128), 2.0, np.float32))
    stored = [args[-1] for args in calls]
    assert stored and all(isinstance(value, np.ndarray) and value.flags.writeable for value in stored)


def test_callbacks_other_than_the_interpreters_still_get_jax_arrays():
    from jax.experimental import io_callback

    received = []

    def record(value):
        received.append(value)
        return np.zeros((), np.float32)

    @jax.jit
    def call(x):
        return io_callback(record, jax.ShapeDtypeStruct((), jnp.float32), x)

    assert interpret_compat.is_installed()
    call(jnp.float32(1.0)).block_until_ready()
    assert isinstance(received[0], jax.Array)


@functools.cache
def jax_clock_order():
    """jax's own ordering test on two int32 clocks (taken with the layer off)."""
    from jax._src.pallas.mosaic.interpret import vector_clock

    with layer_off():
        if not hasattr(vector_clock, "NpVectorClock"):
            return vector_clock.ordered
        ordered = vector_clock.NpVectorClock.ordered

    def on_arrays(x, y):
        clocks = [vector_clock.NpVectorClock(len(x)), vector_clock.NpVectorClock(len(y))]
        clocks[0].clock[:], clocks[1].clock[:] = x, y
        return ordered(*clocks)

    return on_arrays


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(pairs=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 3)), min_size=1, max_size=5))
def test_clock_order_is_jaxs_relation(pairs):
    """Gap tpu-clock-order: the list-based test decides exactly jax's relation (small values: many ties)."""
    x, y = (np.array(values, np.int32) for values in zip(*pairs, strict=True))
    assert tpu_gaps._ordered(x, y) == jax_clock_order()(x, y)


# --- deadlocks: a wait nothing can signal raises at once instead of looping forever -----------------------


def wait_for_a_copy_never_started(x_hbm, o_ref, buffer, semaphore):
    pltpu.make_async_copy(x_hbm, buffer, semaphore).wait()
    o_ref[...] = buffer[...]


def wait_for_more_than_was_signalled(x_ref, o_ref, semaphore):
    pl.semaphore_signal(semaphore, 1)
    pl.semaphore_wait(semaphore, 2)
    o_ref[...] = x_ref[...]


def two_copies_then_their_waits(x_hbm, o_ref, buffers, semaphore):
    copies = [pltpu.make_async_copy(x_hbm.at[i], buffers.at[i], semaphore) for i in range(2)]
    for copy in copies:
        copy.start()
    for copy in copies:
        copy.wait()
    o_ref[...] = buffers[0] + buffers[1]


def run_checked(kernel, x, in_specs, scratch_shapes):
    """On the harness's checking backend, whose errors name races and deadlocks."""
    call = fresh_pallas_call(kernel, jax.ShapeDtypeStruct((8, 128), jnp.float32), scratch_shapes, in_specs)
    return Backend(INTERPRET).run(call, x)


def test_a_dma_wait_for_a_copy_never_started_is_a_deadlock_naming_the_wait():
    line = r"test_interpret_compat\.py:\d+ \(wait_for_a_copy_never_started\)"
    with pytest.raises(
        Deadlock, match=rf"a DMA wait at {line} needs 4096 \(bytes\), its semaphore's count is 0"
    ):
        run_checked(
            wait_for_a_copy_never_started,
            jnp.ones((8, 128), jnp.float32),
            [pl.BlockSpec(memory_space=pl.ANY)],
            [pltpu.VMEM((8, 128), jnp.float32), pltpu.SemaphoreType.DMA],
        )


def test_a_semaphore_wait_for_more_than_was_signalled_is_a_deadlock():
    with pytest.raises(Deadlock, match=r"a semaphore wait at .+ needs 2, its semaphore's count is 1 "):
        run_checked(
            wait_for_more_than_was_signalled,
            jnp.ones((8, 128), jnp.float32),
            None,
            [pltpu.SemaphoreType.REGULAR],
        )


def test_a_wait_that_copies_in_flight_will_signal_is_no_deadlock():
    """Two copies on one semaphore: the first wait runs a pending copy (the interpreter's DMAs execute at the
    wait), the second the other; neither is a wait nothing can signal."""
    x = random_array((2, 8, 128), jnp.float32)
    got = run_checked(
        two_copies_then_their_waits,
        x,
        [pl.BlockSpec(memory_space=pl.ANY)],
        [pltpu.VMEM((2, 8, 128), jnp.float32), pltpu.SemaphoreType.DMA],
    )
    np.testing.assert_array_equal(got, np.asarray(x[0] + x[1]))


def test_gap_deadlock_still_loops_in_tpu_interpreter():
    """Without the layer a wait nothing can signal goes round its loop again (gap tpu-deadlock; the probe runs
    it on a one-core stand-in for the shared memory); with the layer the same wait raises."""
    with layer_off():
        loops = tpu_gaps._deadlock_probe()
    assert_probe_agrees("tpu-deadlock", loops, "no longer waits forever on a semaphore nothing can signal")
    assert tpu_gaps._deadlock_probe() is False


# --- API -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("interpreter", INTERPRETERS)
def test_gap_default_precision_products_still_exact_in_the_interpreters(interpreter):
    with layer_off():
        emulated = product(PRODUCT_X, PRODUCT_Y, interpreter=interpreter, generation="v5e")
    exact = product(PRODUCT_X, PRODUCT_Y, interpreter=interpreter, generation="none", precision=HIGHEST)
    assert_probe_agrees(
        f"{interpreter}-default-precision-products",
        np.array_equal(emulated, exact),
        "computes a float32 product at DEFAULT as a TPU does (one bfloat16 pass)",
    )


def test_install_is_idempotent_and_uninstall_restores_the_interpreter():
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpreter

    installed_get = tpu_interpreter.get
    assert interpret_compat.install() and interpret_compat.install() and interpret_compat.is_installed()
    assert tpu_interpreter.get is installed_get
    assert installed_get.__wrapped__.__module__.startswith(interpret_compat.__name__)
    with layer_off():
        assert not interpret_compat.is_installed()
        assert tpu_interpreter.get.__wrapped__.__module__ == tpu_interpreter.__name__
    assert tpu_interpreter.get.__wrapped__.__module__.startswith(interpret_compat.__name__)


def test_a_gap_whose_internals_moved_stays_unpatched_warns_once_and_the_rest_applies(monkeypatch):
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpreter

    def moved():
        raise InternalsMoved("interpret_pallas_call.get takes (something_else)")

    with layer_off():
        monkeypatch.setattr(
            tpu_gaps,
            "GAPS",
            (dataclasses.replace(tpu_gaps.REF_VIEWS, check_internals=moved), *tpu_gaps.GAPS[1:]),
        )
        monkeypatch.setattr(interpret_compat, "_statuses", None)
        try:
            with pytest.warns(UserWarning, match=f"tpu-ref-views .* on jax {jax.__version__}"):
                assert interpret_compat.install() is False
            reasons = interpret_compat.unpatched_gaps()
            assert list(reasons) == ["tpu-ref-views"]
            assert interpret_compat.unpatched_gaps("tpu") == reasons
            assert interpret_compat.unpatched_gaps("generic") == {}
            assert "something_else" in reasons["tpu-ref-views"]
            assert tpu_interpreter.get.__wrapped__.__module__ == tpu_interpreter.__name__  # left alone
            assert interpret_compat.gap_statuses()["tpu-masked-swap"].state == interpret_compat.PATCHED
            interpret_compat.uninstall()
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                assert interpret_compat.install() is False
        finally:
            interpret_compat.uninstall()
            monkeypatch.undo()


def test_importing_the_layer_imports_no_private_jax_module():
    code = (
        "import sys, jax\n"
        "before = set(sys.modules)\n"
        "import rpa_harness.interpret_compat\n"
        "print(sorted(m for m in set(sys.modules) - before if m.startswith('jax._src')))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert result.stdout.strip() == "[]"


# --- upstream's kernel, end to end ---------------------------------------------------------------------


# One sequence layout and page geometry for both: upstream's reference runs op by op and compiles per
# shape, so shared shapes keep this file fast.
# A decode and a chunked prefill over 4 pages of 16 keys per sequence, a spare sequence slot, 16 query rows.
UPSTREAM_BASE = sized_case(
    (5, 1), (37, 9), page_size=16, spare_rows=10, spare_cache_pages=8, num_q_heads=8, num_kv_heads=1,
    head_dim=128, seed=11, sm_scale=128**-0.5,
    poison=False,  # upstream's reference reads whole pages; NaN there would reach its output
)  # fmt: skip
UPSTREAM_CONFIGS = {
    "f32-8q1kv-window-softcap-strided-path": dataclasses.replace(
        UPSTREAM_BASE, num_kv_pages_per_block=3, num_queries_per_block=4, sliding_window=12, soft_cap=20.0
    ),
    # Three KV blocks for sequence 0: the next query block's first KV block sits in buffer 1, which only
    # the buffer index carried in scalar-prefetch memory tells it (gap generic-scalar-prefetch-state).
    "f32-8q1kv-odd-kv-blocks-carried-buffer-index": dataclasses.replace(
        UPSTREAM_BASE, num_kv_pages_per_block=1, num_queries_per_block=4
    ),
    "bf16-kv-4q2kv-bitcast-path": dataclasses.replace(
        UPSTREAM_BASE,
        num_q_heads=4,
        num_kv_heads=2,
        kv_dtype="bfloat16",
        num_kv_pages_per_block=2,
        num_queries_per_block=8,
    ),
}


@pytest.mark.parametrize("config", list(UPSTREAM_CONFIGS))
def test_upstream_rpa_matches_its_reference_under_both_interpreters(config):
    case = UPSTREAM_CONFIGS[config]
    arrays, options = case.arrays(), case.options()
    reference_options = {
        k: v for k, v in options.items() if k not in ("num_kv_pages_per_block", "num_queries_per_block")
    }
    # Upstream's reference casts probabilities to the KV dtype; give it the same values in float32 instead.
    kv_pages = arrays["kv_pages"].astype(np.float32)
    upstream_expected = np.asarray(
        upstream_in_one_program(arrays, arrays["q"], kv_pages, **reference_options)
    )
    expected = reference.oracle(**arrays, **options)
    num_tokens = upstream_expected.shape[0]
    for interpreter in INTERPRETERS:
        with pltpu.force_tpu_interpret_mode(interpret_params(interpreter)):
            got = np.asarray(
                upstream.ragged_paged_attention(**{k: jnp.asarray(v) for k, v in arrays.items()}, **options)
            )
        comparison = reference.compare(got, expected, label=f"upstream on the {interpreter} interpreter")
        assert comparison.ok, str(comparison)
        np.testing.assert_allclose(
            got[:num_tokens], upstream_expected, rtol=1e-5, atol=2e-5, err_msg=interpreter
        )
