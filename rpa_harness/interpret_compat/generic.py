"""Patches for the generic (HLO) interpreter (``force_tpu_interpret_mode(True)``), which runs a kernel's
grid as a loop over its state-discharged jaxpr.

Gap ``generic-literal-indices``: masked ``pltpu.store`` / ``pl.load`` on ``ref.at[<python int>]``: the
literal reaches the Pallas ``load_p`` / ``swap_p`` discharge rules as ``TypedInt``, which has no ``.shape``.

Gap ``generic-view-stores``: stores and DMAs through a reshaped or bitcast ref raise
``NotImplementedError: Unsupported transform: ReshapeTransform(...)`` (``state.discharge.transform_swap_array``),
and ``pltpu.store`` through any transformed ref writes back an array of the transformed shape (the
``swap_p`` discharge rule).

Gap ``generic-scalar-prefetch-state``: writes to scalar-prefetch refs are dropped between grid steps: each
step starts from the operands as passed, where on TPU (and in the TPU interpreter) they live in SMEM for the
whole call. Upstream's RPA kernel hands the next grid step its sequence and KV-buffer index this way, so
without the patch it reads the other, stale buffer of its double buffer (wrong rows, no error).

Gap ``generic-narrow-float-bits`` (a cost, not an error): XLA CPU computes a ``dynamic-slice`` or
``dynamic-update-slice`` of an 8- or 16-bit float buffer by converting the *whole* buffer to a wider float
and back, so every page DMA into an fp8 KV scratch converts the scratch and the source (float8_e4m3fn
through f16 in software: a pooled fp8 RPA call took 190 ms instead of 3 ms). The patched accesses move the
bits as unsigned integers of the same width instead; the values are bit-identical.

Gap ``generic-clamped-reads``: a read of several elements from a data-dependent start that runs past its
ref (``ref[pl.ds(i, n)]``, strided or not, through views or not) is discharged as ``lax.dynamic_slice``,
which moves the start back until the slice fits, so every element comes from another position (v3's
default blocks on v5e read their last KV chunk 8 rows past a 104-row buffer and got keys 48-103 at
positions 56-111). A TPU reads each element where it is, and whatever memory holds past the buffer. The
patched read does the same, reading NaN past the ref (every bit set for an integer dtype: NaN in any float
view of it), so that a kernel that uses such a value shows NaN and one that masks it is right.

Gap ``generic-dynamic-size-copies``: a DMA of a data-dependent size (``pl.ds(start, traced_size)``, as in
tpu-inference's RPA v3) fails in the ``dma_start`` discharge rule (``state.discharge.transform_array`` ->
``_index_array`` -> ``lax.dynamic_slice``: "Shapes must be 1D sequences of concrete values"; the ``dma_wait``
rule sizes its semaphore decrement the same way). The patched rules move a static window instead: along an
axis of data-dependent size, as long as the shorter end of the copy allows (the ref's extent there, or the
other end's static slice), and write back only the elements of ``[start, start + size)``, bit for bit; the
rest of the window is written back unchanged. DMA semaphores count the copied elements, as for static
copies. Supported: local copies whose data-dependent slices (stride 1) are in each ref's last indexer; an
out-of-range copy is clipped to the window (the generic interpreter checks no bounds).

Gap ``generic-memory-space-operands``: an operand placed in a memory space
(``pltpu.with_memory_space_constraint(x, pltpu.HBM)``, as tpu-inference's RPA v3 does for its inputs on TPU
v7 and later) fails in the interpreter's grid loop: "memory_space of all inputs passed to
`dynamic_update_slice` must be the same" (the operand is ``<hbm>``, the block the kernel wrote is not). The
patched interpreter takes its operands in the default memory space, which is where the generic interpreter
keeps every array anyway; the values are unchanged.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from rpa_harness.interpret_compat import patching
from rpa_harness.interpret_compat import views as view_algebra
from rpa_harness.interpret_compat.patching import (
    InternalsMoved,
    Patch,
    parameter_names,
    require,
    require_attributes,
    require_parameters,
)

if TYPE_CHECKING:  # at run time jax's internals are read where a patch needs them (``_internals``)
    from jax._src.state.indexing import NDIndexer


_internals = patching.private_modules(
    {
        "core": "jax._src.core",
        "literals": "jax._src.literals",
        "tree_util": "jax._src.tree_util",
        "pallas_core": "jax._src.pallas.core",
        "hlo_interpreter": "jax._src.pallas.hlo_interpreter",
        "primitives": "jax._src.pallas.primitives",
        "tpu_primitives": "jax._src.pallas.mosaic.primitives",
        "discharge": "jax._src.state.discharge",
        "indexing": "jax._src.state.indexing",
        "state_primitives": "jax._src.state.primitives",
        "state_types": "jax._src.state.types",
        "state_utils": "jax._src.state.utils",
    }
)


def _run_generic(kernel, out_shape, *operands, **call_options):
    """``kernel`` on the generic interpreter, unpatched (a probe runs before any patch is applied)."""

    def call(*args):
        return pl.pallas_call(kernel, out_shape=out_shape, **call_options)(*args)

    with pltpu.force_tpu_interpret_mode(True):
        return np.asarray(jax.jit(call)(*operands))


def _fails_with(run: Callable[[], object], message: str) -> bool:
    """Whether ``run`` raises an error containing ``message`` (the gap); other errors propagate."""
    try:
        run()
    except Exception as error:  # noqa: BLE001 - the message decides
        if message in str(error):
            return True
        raise
    return False


def _rows_1_and_2(shape):
    row = jax.lax.broadcasted_iota(jnp.int32, shape, 0)
    return (row >= 1) & (row < 3)


# ---------------------------------------------------------------------------------------------------------
# Discharge rules: 0.10 calls them as rule(in_avals, out_avals, *args_flat, args_tree=...), later jax as
# rule(ctx, *args_flat, args_tree=...) with ctx.in_avals.


def _leading_and_flat(args: tuple, args_tree) -> tuple[tuple, list]:
    split = len(args) - args_tree.num_leaves
    return args[:split], list(args[split:])


def _leading_for(leading: tuple, num_args: int) -> tuple:
    """The rule's leading arguments for a call with ``num_args`` flat arguments of unknown aval."""
    if len(leading) == 2:
        return [None] * num_args, leading[1]
    (context,) = leading
    return (context.replace(in_avals=[None] * num_args, should_discharge=[True] + [False] * (num_args - 1)),)


def _rule_internals(*primitive_names: str) -> None:
    internals = _internals()
    rules = internals.discharge._discharge_rules
    for name in primitive_names:
        primitive = getattr(internals.primitives, name)
        require(primitive in rules, f"no discharge rule for {name}")
        parameters = parameter_names(rules[primitive])
        require("args_tree" in parameters, f"the {name} discharge rule takes no args_tree")
        leading = [p for p in parameters if p not in ("args_flat", "args_tree", "_", "params")]
        require(
            leading in (["in_avals", "out_avals"], ["ctx"]),
            f"the {name} discharge rule takes ({', '.join(parameters)})",
        )


# ---------------------------------------------------------------------------------------------------------
# Gap generic-literal-indices.


def _literal_indices_probe() -> bool:
    def kernel(x_ref, o_ref):
        o_ref[...] = jnp.zeros_like(o_ref)
        pltpu.store(o_ref.at[1], x_ref[1], mask=_rows_1_and_2((2, 128)))

    x = jnp.ones((4, 2, 128), jnp.float32)
    return _fails_with(
        lambda: _run_generic(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), x),
        "'TypedInt' object has no attribute 'shape'",
    )


def _literal_indices_internals() -> None:
    require_attributes(_internals().literals, "TypedInt")
    _rule_internals("load_p", "swap_p")


def _untyped_literals(args_flat) -> list:
    """Turn literal ``TypedInt`` scalars into 0-d arrays, which the Pallas discharge rules expect."""
    typed_int = _internals().literals.TypedInt
    return [np.asarray(int(arg), dtype=arg.dtype) if isinstance(arg, typed_int) else arg for arg in args_flat]


def _with_untyped_literals(original_rule: Callable) -> Callable:
    @functools.wraps(original_rule)
    def rule(*args, args_tree, **params):
        leading, args_flat = _leading_and_flat(args, args_tree)
        return original_rule(*leading, *_untyped_literals(args_flat), args_tree=args_tree, **params)

    return rule


def _literal_indices_patches() -> list[Patch]:
    internals = _internals()
    rules = internals.discharge._discharge_rules
    return [
        Patch.wrapping(rules, primitive, _with_untyped_literals)
        for primitive in (internals.primitives.load_p, internals.primitives.swap_p)
    ]


# ---------------------------------------------------------------------------------------------------------
# Gap generic-view-stores.


def _view_stores_probe() -> bool:
    x = jnp.arange(2 * 8 * 128, dtype=jnp.float32).reshape(2, 8, 128)
    out_shape = jax.ShapeDtypeStruct(x.shape, x.dtype)

    def store_through_view(x_ref, o_ref):
        o_ref.reshape(16, 128)[...] = x_ref[...].reshape(16, 128)

    def masked_store_through_view(x_ref, o_ref):
        o_ref[...] = jnp.zeros_like(o_ref)
        pltpu.store(o_ref.reshape(16, 128), x_ref[...].reshape(16, 128), mask=_rows_1_and_2((16, 128)))

    if _fails_with(lambda: _run_generic(store_through_view, out_shape, x), "Unsupported transform"):
        return True
    try:
        got = _run_generic(masked_store_through_view, out_shape, x)
    except Exception:  # noqa: BLE001 - a crash of the unpatched rule is the gap too
        return True
    expected = np.where(np.asarray(_rows_1_and_2((16, 128))), np.asarray(x).reshape(16, 128), 0.0)
    return not np.array_equal(got.reshape(16, 128), expected)


def _view_stores_internals() -> None:
    internals = _internals()
    require_attributes(internals.discharge, "transform_array", "transform_swap_array")
    require_attributes(internals.state_utils, "bitcast")
    require_parameters(
        internals.discharge.transform_swap_array, ["x", "transforms", "val"], "transform_swap_array"
    )
    require_parameters(internals.discharge.transform_array, ["x", "transforms"], "transform_array")
    require_attributes(internals.indexing.NDIndexer, "make_trivial_indexer")
    _rule_internals("swap_p")


def _jax_view(value, transform):
    if view_algebra.is_reshape(transform):
        return value.reshape(transform.shape)
    return _internals().state_utils.bitcast(value, transform.dtype)


def _jax_unview(value, transform, before):
    if view_algebra.is_reshape(transform):
        return value.reshape(before.shape)
    return _internals().state_utils.bitcast(value, before.dtype)


def _transform_swap_array_through_views(original: Callable) -> Callable:
    """Splits the transforms at each view, lets the original handle the indexer runs and undoes the view
    (reshape back, TPU-layout bitcast back) in between."""
    discharge = _internals().discharge

    @functools.wraps(original)
    def transform_swap_array(x, transforms, val):
        head, rest = view_algebra.split_at_first_view(transforms)
        if not rest:
            return original(x, transforms, val)
        view, tail = rest[0], rest[1:]
        region = discharge.transform_array(x, head)
        old_value, new_viewed = transform_swap_array(_jax_view(region, view), tail, val)
        _, new_x = original(x, head, _jax_unview(new_viewed, view, region))
        return old_value, new_x

    return transform_swap_array


def _swap_rule_writing_back(original_rule: Callable) -> Callable:
    """``swap_p`` with transforms before its final indexer (e.g. ``pltpu.store(ref.reshape(...), ...)``):
    run the rule on the transformed region and write that back through the earlier transforms."""
    internals = _internals()

    @functools.wraps(original_rule)
    def rule(*args, args_tree, **params):
        leading, args_flat = _leading_and_flat(args, args_tree)
        ref, transforms, val, mask = args_tree.unflatten(args_flat)
        transforms = list(transforms)
        if transforms and view_algebra.is_indexer(transforms[-1]):
            *earlier, last = transforms
        else:
            earlier, last = transforms, None
        if not earlier:
            return original_rule(*args, args_tree=args_tree, **params)
        region = internals.discharge.transform_array(ref, earlier)
        if last is None:
            last = internals.indexing.NDIndexer.make_trivial_indexer(region.shape)
        region_flat, region_tree = internals.tree_util.tree_flatten((region, (last,), val, mask))
        (new_region, *_), out = original_rule(
            *_leading_for(leading, len(region_flat)), *region_flat, args_tree=region_tree, **params
        )
        _, new_ref = internals.discharge.transform_swap_array(ref, earlier, new_region)
        return (new_ref,) + (None,) * (len(args_flat) - 1), out

    return rule


def _view_stores_patches() -> list[Patch]:
    internals = _internals()
    rules = internals.discharge._discharge_rules
    swap_p = internals.primitives.swap_p
    return [
        Patch.wrapping(internals.discharge, "transform_swap_array", _transform_swap_array_through_views),
        Patch.wrapping(rules, swap_p, _swap_rule_writing_back),
    ]


# ---------------------------------------------------------------------------------------------------------
# Gap generic-scalar-prefetch-state.

PROBE_STEPS = 6


def count_steps_in_scalar_prefetch(counter_ref, o_ref):
    """Each grid step records the counter and increments it in scalar-prefetch memory."""
    o_ref[0, pl.program_id(0)] = counter_ref[0]
    counter_ref[0] = counter_ref[0] + 1


def run_step_counter(start: int) -> np.ndarray:
    """What each of PROBE_STEPS grid steps saw in a scalar-prefetch counter that starts at ``start``."""

    def call(counter):
        return pl.pallas_call(
            count_steps_in_scalar_prefetch,
            out_shape=jax.ShapeDtypeStruct((1, PROBE_STEPS), jnp.int32),
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=1,
                grid=(PROBE_STEPS,),
                in_specs=[],
                out_specs=pl.BlockSpec((1, PROBE_STEPS), lambda i, counter: (0, 0), memory_space=pltpu.SMEM),
            ),
        )(counter)

    # jax passes the mode on as pallas_call's interpret=, which takes True (the generic interpreter); its
    # annotation admits InterpretParams only.
    with pltpu.force_tpu_interpret_mode(True):  # type: ignore[arg-type]
        return np.asarray(jax.jit(call)(jnp.array([start], jnp.int32)))[0]


def _scalar_prefetch_probe() -> bool:
    seen = run_step_counter(start=10)
    if np.array_equal(seen, np.arange(10, 10 + PROBE_STEPS)):
        return False
    if np.array_equal(seen, np.full(PROBE_STEPS, 10)):
        return True
    raise InternalsMoved(f"a scalar-prefetch step counter starting at 10 saw {seen.tolist()}")


def _scalar_prefetch_internals() -> None:
    interpreter = _internals().hlo_interpreter
    require_attributes(interpreter, "kernel_to_hlo_jaxpr")
    require_parameters(
        interpreter.kernel_to_hlo_jaxpr,
        ["jaxpr", "consts", "grid_mapping"],
        "hlo_interpreter.kernel_to_hlo_jaxpr",
    )


def _kernel_jaxpr_carrying_scalar_prefetch(original_kernel_to_hlo_jaxpr: Callable) -> Callable:
    """Appends one scratch buffer per scalar-prefetch operand: the step reads the operands as passed when
    every program id is 0 (the start of a run, and of each vmapped instance) and the carried values
    otherwise, and writes its final values back into those buffers. ``index_map`` functions still see the
    operands as passed (none of upstream's read a mutated one)."""
    internals = _internals()

    @functools.wraps(original_kernel_to_hlo_jaxpr)
    def kernel_to_hlo_jaxpr(jaxpr, consts, grid_mapping):
        step, step_consts, scratch_avals = original_kernel_to_hlo_jaxpr(jaxpr, consts, grid_mapping)
        num_scalars = grid_mapping.num_index_operands
        if not num_scalars:
            return step, step_consts, scratch_avals
        closed = hasattr(step, "jaxpr")  # later jax returns the ClosedJaxpr, 0.10 its jaxpr
        step_jaxpr = step.jaxpr if closed else step
        scalar_avals = [var.aval for var in step_jaxpr.invars[:num_scalars]]
        num_program_ids = len(grid_mapping.grid) - len(grid_mapping.vmapped_dims)

        def step_with_carried_scalars(*operands):
            passed, blocks_and_scratch, carried = (
                operands[:num_scalars],
                operands[num_scalars:-num_scalars],
                operands[-num_scalars:],
            )
            first_step = functools.reduce(
                jnp.logical_and,
                [internals.primitives.program_id(axis) == 0 for axis in range(num_program_ids)],
                jnp.bool_(True),
            )
            scalars = [
                jax.lax.select(jnp.broadcast_to(first_step, value.shape), value, previous)
                for value, previous in zip(passed, carried, strict=True)
            ]
            outputs = internals.core.eval_jaxpr(step_jaxpr, step_consts, *scalars, *blocks_and_scratch)
            return (*outputs, *outputs[:num_scalars])

        operand_avals = [*(var.aval for var in step_jaxpr.invars), *scalar_avals]
        with grid_mapping.trace_env():
            carrying = jax.make_jaxpr(step_with_carried_scalars)(*operand_avals)
        new_step = carrying if closed else carrying.jaxpr
        return new_step, carrying.consts, [*scratch_avals, *scalar_avals]

    return kernel_to_hlo_jaxpr


def _scalar_prefetch_patches() -> list[Patch]:
    interpreter = _internals().hlo_interpreter
    return [Patch.wrapping(interpreter, "kernel_to_hlo_jaxpr", _kernel_jaxpr_carrying_scalar_prefetch)]


# ---------------------------------------------------------------------------------------------------------
# Gap generic-narrow-float-bits.


def narrow_float_store_converts() -> bool:
    """Whether XLA CPU converts a float8_e4m3fn buffer to f16 around a dynamic-update-slice."""

    def store_rows(buffer, row):
        return jax.lax.fori_loop(
            0, buffer.shape[0], lambda i, b: jax.lax.dynamic_update_slice(b, row, (i, 0)), buffer
        )

    buffer = jnp.zeros((8, 128), jnp.float8_e4m3fn)
    hlo = jax.jit(store_rows).lower(buffer, buffer[:1]).compile().as_text()
    assert hlo is not None  # None only where a backend has no text for its executables; XLA CPU has
    return "f16[8,128]" in hlo


def _narrow_float_internals() -> None:
    discharge = _internals().discharge
    require_attributes(discharge, "transform_array", "transform_swap_array")
    require_parameters(discharge.transform_swap_array, ["x", "transforms", "val"], "transform_swap_array")
    require_parameters(discharge.transform_array, ["x", "transforms"], "transform_array")


def _moves_bits(x, transforms) -> np.dtype | None:
    """The unsigned dtype to move ``x`` as, when it is an 8- or 16-bit float accessed without views."""
    if getattr(x, "dtype", None) is None or view_algebra.split_at_first_view(transforms)[1]:
        return None
    dtype = jnp.dtype(x.dtype)
    if not jnp.issubdtype(dtype, jnp.floating) or dtype.itemsize >= 4:
        return None
    return jnp.dtype(f"uint{8 * dtype.itemsize}")


def _transform_array_moving_bits(original: Callable) -> Callable:
    @functools.wraps(original)
    def transform_array(x, transforms):
        bits = _moves_bits(x, transforms)
        if bits is None:
            return original(x, transforms)
        return jax.lax.bitcast_convert_type(
            original(jax.lax.bitcast_convert_type(x, bits), transforms), x.dtype
        )

    return transform_array


def _transform_swap_array_moving_bits(original: Callable) -> Callable:
    @functools.wraps(original)
    def transform_swap_array(x, transforms, val):
        bits = _moves_bits(x, transforms)
        if bits is None:
            return original(x, transforms, val)
        old_bits, new_bits = original(
            jax.lax.bitcast_convert_type(x, bits), transforms, jax.lax.bitcast_convert_type(val, bits)
        )
        return jax.lax.bitcast_convert_type(old_bits, x.dtype), jax.lax.bitcast_convert_type(
            new_bits, x.dtype
        )

    return transform_swap_array


def _narrow_float_patches() -> list[Patch]:
    """Wrappers on the read and the write path, around the view-store one (gap generic-clamped-reads wraps
    the read path around this one)."""
    discharge = _internals().discharge
    return [
        Patch.wrapping(discharge, "transform_array", _transform_array_moving_bits),
        Patch.wrapping(discharge, "transform_swap_array", _transform_swap_array_moving_bits),
    ]


# ---------------------------------------------------------------------------------------------------------
# Gap generic-dynamic-size-copies.

DYNAMIC_SIZE_ERROR = "Shapes must be 1D sequences of concrete values"


def copy_rows_of_dynamic_size(copy_ref, x_hbm, o_ref, semaphore):
    """``o[dst : dst + size] = x[src : src + size]`` by one DMA, with ``(src, dst, size)`` read from SMEM;
    every other row of the output is set to -1 first."""
    o_ref[...] = jnp.full(o_ref.shape, -1, o_ref.dtype)
    src, dst, size = copy_ref[0], copy_ref[1], copy_ref[2]
    copy = pltpu.make_async_copy(x_hbm.at[pl.ds(src, size)], o_ref.at[pl.ds(dst, size)], semaphore)
    copy.start()
    copy.wait()


def run_dynamic_size_copy(x, out_rows: int, src: int, dst: int, size: int, *, interpret=True) -> np.ndarray:
    """``copy_rows_of_dynamic_size`` on ``x`` into an ``out_rows``-row output, under ``interpret``."""

    def call(copy, x):
        return pl.pallas_call(
            copy_rows_of_dynamic_size,
            out_shape=jax.ShapeDtypeStruct((out_rows, *x.shape[1:]), x.dtype),
            in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM), pl.BlockSpec(memory_space=pl.ANY)],
            scratch_shapes=[pltpu.SemaphoreType.DMA(())],
        )(copy, x)

    with pltpu.force_tpu_interpret_mode(interpret):
        return np.asarray(jax.jit(call)(jnp.array([src, dst, size], jnp.int32), x))


def _dynamic_size_probe() -> bool:
    x = jnp.arange(16 * 128, dtype=jnp.float32).reshape(16, 128)
    try:
        got = run_dynamic_size_copy(x, 8, src=5, dst=2, size=3)
    except Exception as error:  # noqa: BLE001 - the message decides
        if DYNAMIC_SIZE_ERROR in str(error):
            return True
        raise
    expected = np.full((8, 128), -1.0, np.float32)
    expected[2:5] = np.asarray(x)[5:8]
    return not np.array_equal(got, expected)


def _dma_rules() -> dict:
    """The discharge-rule table that holds the DMA rules: partial rules on 0.10, plain rules later."""
    internals = _internals()
    start, wait = internals.tpu_primitives.dma_start_p, internals.tpu_primitives.dma_wait_p
    for name in ("_partial_discharge_rules", "_discharge_rules"):
        rules = getattr(internals.discharge, name, {})
        if start in rules and wait in rules:
            return rules
    raise InternalsMoved("no discharge rule table holds both dma_start and dma_wait")


def _dynamic_size_internals() -> None:
    internals = _internals()
    require_attributes(internals.tpu_primitives, "dma_start_p", "dma_wait_p")
    rules = _dma_rules()
    for primitive in (internals.tpu_primitives.dma_start_p, internals.tpu_primitives.dma_wait_p):
        parameters = parameter_names(rules[primitive])
        require("tree" in parameters, f"the {primitive} discharge rule takes no tree")
        leading = parameters[: parameters.index("args")] if "args" in parameters else parameters
        require(
            leading in (["should_discharge", "in_avals", "out_avals"], ["ctx"]),
            f"the {primitive} discharge rule takes ({', '.join(parameters)})",
        )
    require_attributes(internals.state_types, "TransformedRef")
    require_attributes(internals.indexing, "Slice", "NDIndexer")
    require_attributes(internals.indexing.Slice, "is_dynamic_size", "start", "size", "stride")
    require_attributes(internals.state_primitives, "ref_set")
    require_attributes(internals.primitives, "_transform_semaphore")
    require_parameters(
        internals.primitives._transform_semaphore,
        ["ref_value", "transforms", "ref_aval"],
        "pallas primitives._transform_semaphore",
    )
    require_attributes(internals.pallas_core, "SEMAPHORE_MAX_VALUE", "SEMAPHORE_INTERPRET_DTYPE")
    require_attributes(internals.discharge, "transform_array", "transform_swap_array")


def _ref_and_transforms(ref) -> tuple:
    if isinstance(ref, _internals().state_types.TransformedRef):
        return ref.ref, tuple(ref.transforms)
    return ref, ()


def _is_dynamic_size_indexer(transform) -> bool:
    slice_class = _internals().indexing.Slice
    return view_algebra.is_indexer(transform) and any(
        isinstance(index, slice_class) and index.is_dynamic_size for index in transform.indices
    )


def _has_dynamic_size(transforms) -> bool:
    """Whether a copy descriptor's transforms give it a data-dependent size; only its last may."""
    transforms = tuple(transforms)
    if not any(_is_dynamic_size_indexer(transform) for transform in transforms):
        return False
    if any(_is_dynamic_size_indexer(transform) for transform in transforms[:-1]):
        raise NotImplementedError(
            "interpret_compat (generic-dynamic-size-copies): a data-dependent copy size (pl.ds with a traced "
            f"length) is supported in a ref's last indexer only; got the transforms {transforms}. Index with "
            "the data-dependent slice last."
        )
    return True


def _value_slices(indexer) -> list:
    """The indexer's slices, one per axis of the value it selects (its scalar indices drop their axes)."""
    slice_class = _internals().indexing.Slice
    slices = []
    for index in indexer.indices:
        if isinstance(index, slice_class):
            slices.append(index)
        elif np.shape(index) != ():
            raise NotImplementedError(
                "interpret_compat (generic-dynamic-size-copies): a copy with a data-dependent size and an "
                f"array index ({indexer}) is not supported; index with scalars and slices."
            )
    return slices


@dataclasses.dataclass(frozen=True)
class _Side:
    """One end of a copy: the ref's value, the transforms before its last indexer, and per axis of the
    copied value the static length of the window the interpreter moves, the window's start in the ref's
    axis and where the copy's first element sits in the window (``offset``; 0 for static axes)."""

    value: object
    earlier: tuple
    indexer: NDIndexer | None
    lengths: list
    starts: list
    offsets: list
    sizes: list  # per value axis: the copy's size there (traced where data-dependent)


def _side(ref, transforms) -> tuple:
    """(value, transforms before the last indexer, the last indexer or None, the ref's extents there)."""
    value = ref[...]
    if transforms and view_algebra.is_indexer(transforms[-1]):
        earlier, indexer = transforms[:-1], transforms[-1]
        region_shape = _internals().discharge.transform_array(value, earlier).shape
        return value, earlier, indexer, region_shape
    return value, transforms, None, None


def _copy_sides(src, dst) -> tuple[_Side, _Side, list[bool]]:
    """Both ends of a copy with every data-dependent size widened to a static window: along such an axis
    the window is as long as the shorter of the two ends allows (the ref's extent where the size is
    data-dependent, the slice where it is static), placed as far as possible at the copy's start and
    moved back to stay inside the ref. Returns the ends and which value axes have a data-dependent size."""
    ends = []
    for ref, transforms in (src, dst):
        value, earlier, indexer, region_shape = _side(ref, transforms)
        if indexer is None:
            shape = _internals().discharge.transform_array(value, earlier).shape
            ends.append((value, earlier, None, [(None, int(n), None) for n in shape]))
            continue
        axes = []
        for index, extent in zip(indexer.indices, region_shape, strict=True):
            if not isinstance(index, _internals().indexing.Slice):
                continue
            if index.is_dynamic_size:
                if index.stride != 1:
                    raise NotImplementedError(
                        "interpret_compat (generic-dynamic-size-copies): a data-dependent copy size with "
                        f"stride {index.stride} is not supported (stride 1 only)."
                    )
                axes.append((index, int(extent), index.size))
            else:
                axes.append((index, int(index.size), None))
        _value_slices(indexer)  # rejects array indices
        ends.append((value, earlier, indexer, axes))
    (_, _, _, src_axes), (_, _, _, dst_axes) = ends
    if len(src_axes) != len(dst_axes):
        raise ValueError(
            f"interpret_compat (generic-dynamic-size-copies): a copy between values of rank {len(src_axes)} "
            f"and {len(dst_axes)}."
        )
    dynamic = [src[2] is not None or dst[2] is not None for src, dst in zip(src_axes, dst_axes, strict=True)]
    sizes = [
        (dst[2] if dst[2] is not None else src[2]) if is_dynamic else dst[1]
        for src, dst, is_dynamic in zip(src_axes, dst_axes, dynamic, strict=True)
    ]
    sides = []
    for (value, earlier, indexer, axes), other in ((ends[0], dst_axes), (ends[1], src_axes)):
        lengths: list[int] = []
        starts: list[int | jax.Array | None] = []  # None: the whole axis
        offsets: list[int | jax.Array] = []
        for (index, extent_or_length, size), (_, other_length, _) in zip(axes, other, strict=True):
            if size is None:  # a static axis: the window is the slice itself
                lengths.append(extent_or_length)
                starts.append(None if index is None else index.start)
                offsets.append(0)
                continue
            length = min(extent_or_length, other_length)
            start = jnp.clip(jnp.asarray(index.start, jnp.int32), 0, extent_or_length - length)
            lengths.append(length)
            starts.append(start)
            offsets.append(jnp.asarray(index.start, jnp.int32) - start)
        sides.append(_Side(value, earlier, indexer, lengths, starts, offsets, sizes))
    return sides[0], sides[1], dynamic


def _window_transforms(side: _Side) -> tuple:
    """The side's transforms with each data-dependent slice replaced by its static window."""
    if side.indexer is None:
        return side.earlier
    slice_class = _internals().indexing.Slice
    indices, axis = [], 0
    for index in side.indexer.indices:
        if not isinstance(index, slice_class):
            indices.append(index)
            continue
        if index.is_dynamic_size:
            index = slice_class(side.starts[axis], side.lengths[axis], 1)
        indices.append(index)
        axis += 1
    return (*side.earlier, dataclasses.replace(side.indexer, indices=tuple(indices)))


def _as_bits(value):
    dtype = jnp.dtype(value.dtype)
    if jnp.issubdtype(dtype, jnp.floating):
        return jax.lax.bitcast_convert_type(value, jnp.dtype(f"uint{8 * dtype.itemsize}"))
    return value


def _masked_copy(src: _Side, dst: _Side, dynamic: list[bool]):
    """The destination ref's new value: its window with the copied elements replaced, bit for bit."""
    discharge = _internals().discharge
    dst_transforms = _window_transforms(dst)
    moved = _as_bits(discharge.transform_array(src.value, _window_transforms(src)))
    kept = discharge.transform_array(dst.value, dst_transforms)
    kept_bits = _as_bits(kept)
    inside = jnp.ones(kept.shape, bool)
    for axis, is_dynamic in enumerate(dynamic):
        if not is_dynamic:
            continue
        element = jnp.arange(dst.lengths[axis], dtype=jnp.int32) - dst.offsets[axis]  # copy element per slot
        moved = jnp.take(moved, jnp.clip(src.offsets[axis] + element, 0, src.lengths[axis] - 1), axis=axis)
        shape = [1] * kept.ndim
        shape[axis] = dst.lengths[axis]
        inside = inside & ((element >= 0) & (element < dst.sizes[axis])).reshape(shape)
    merged = jax.lax.bitcast_convert_type(jnp.where(inside, moved, kept_bits), kept.dtype)
    return discharge.transform_swap_array(dst.value, dst_transforms, merged)[1]


def _element_count(sizes) -> jax.Array:
    """A DMA semaphore's increment for a copy of ``sizes`` (capped as the interpreter caps it)."""
    core = _internals().pallas_core
    count = functools.reduce(jnp.multiply, [jnp.asarray(size, jnp.int32) for size in sizes], jnp.int32(1))
    return jnp.minimum(count, core.SEMAPHORE_MAX_VALUE).astype(core.SEMAPHORE_INTERPRET_DTYPE)


def _semaphore_plus(semaphore, transforms, aval, delta):
    internals = _internals()
    current = internals.primitives._transform_semaphore(semaphore, transforms, aval)
    return internals.discharge.transform_swap_array(semaphore, transforms, current + delta)[1]


def _discharge_context(leading: tuple) -> tuple[list, list]:
    """(should_discharge, in_avals) per flat argument, from a 0.10 partial rule's or a later rule's leading
    arguments."""
    if len(leading) == 3:
        should_discharge, in_avals, _ = leading
        return list(should_discharge), list(in_avals)
    (context,) = leading
    return list(context.should_discharge), list(context.in_avals)


def _ref_position(roles, role: int):
    """The flat position of the ref of argument ``role`` (src, dst, dst_sem, src_sem), None when absent."""
    entry = roles[role]
    return None if entry is None else _ref_and_transforms(entry)[0]


def _write(new_vals: list, position: int, should_discharge: list, ref, new_value) -> None:
    """A discharged ref gets its new value in the rule's result; any other is written in place."""
    if should_discharge[position]:
        new_vals[position] = new_value
    else:
        _internals().state_primitives.ref_set(ref, None, new_value)


def _dma_start_of_dynamic_size(original_rule: Callable) -> Callable:
    """Local DMAs with a data-dependent size run as masked copies of a static window; others as before."""

    @functools.wraps(original_rule)
    def rule(*args, tree, **params):
        leading, flat = _leading_and_flat(args, tree)
        src, dst, dst_sem, src_sem, device_id = tree.unflatten(flat)
        src_ref, src_transforms = _ref_and_transforms(src)
        dst_ref, dst_transforms = _ref_and_transforms(dst)
        if not (_has_dynamic_size(src_transforms) or _has_dynamic_size(dst_transforms)):
            return original_rule(*args, tree=tree, **params)
        if device_id is not None or params.get("add"):
            raise NotImplementedError(
                "interpret_compat (generic-dynamic-size-copies): remote or accumulating DMAs with a "
                "data-dependent size are not supported on the generic interpreter; use the TPU interpreter."
            )
        should_discharge, in_avals = _discharge_context(leading)
        roles = tree.unflatten(list(range(len(flat))))
        src_side, dst_side, dynamic = _copy_sides((src_ref, src_transforms), (dst_ref, dst_transforms))
        new_vals = [None] * len(flat)
        new_dst = _masked_copy(src_side, dst_side, dynamic)
        _write(new_vals, _ref_position(roles, 1), should_discharge, dst_ref, new_dst)
        count = _element_count(dst_side.sizes)
        for role, semaphore in ((2, dst_sem), (3, src_sem)):
            if semaphore is None:
                continue
            position = _ref_position(roles, role)
            sem_ref, sem_transforms = _ref_and_transforms(semaphore)
            new_count = _semaphore_plus(sem_ref[...], sem_transforms, in_avals[position], count)
            _write(new_vals, position, should_discharge, sem_ref, new_count)
        return new_vals, []

    return rule


def _dma_wait_of_dynamic_size(original_rule: Callable) -> Callable:
    """A wait on a descriptor with a data-dependent size takes that many elements off its semaphore."""

    @functools.wraps(original_rule)
    def rule(*args, tree, **params):
        leading, flat = _leading_and_flat(args, tree)
        _, dst, dst_sem, _, _ = tree.unflatten(flat)
        dst_ref, dst_transforms = _ref_and_transforms(dst)
        if not _has_dynamic_size(dst_transforms):
            return original_rule(*args, tree=tree, **params)
        should_discharge, in_avals = _discharge_context(leading)
        new_vals = [None] * len(flat)
        position = _ref_position(tree.unflatten(list(range(len(flat)))), 2)
        if position is None or not should_discharge[position]:
            return new_vals, []  # as the original: only a discharged semaphore changes
        sem_ref, sem_transforms = _ref_and_transforms(dst_sem)
        count = _element_count([index.size for index in _value_slices(dst_transforms[-1])])
        new_vals[position] = _semaphore_plus(sem_ref, sem_transforms, in_avals[position], -count)
        return new_vals, []

    return rule


def _dynamic_size_patches() -> list[Patch]:
    internals = _internals()
    rules = _dma_rules()
    start, wait = internals.tpu_primitives.dma_start_p, internals.tpu_primitives.dma_wait_p
    return [
        Patch.wrapping(rules, start, _dma_start_of_dynamic_size),
        Patch.wrapping(rules, wait, _dma_wait_of_dynamic_size),
    ]


# ---------------------------------------------------------------------------------------------------------
# Gap generic-clamped-reads.


def read_rows_from(start_ref, x_ref, o_ref):
    """``o = x[start : start + len(o)]``, ``start`` read from SMEM (a data-dependent start)."""
    o_ref[...] = x_ref[pl.ds(start_ref[0], o_ref.shape[0])]


def run_read_rows_from(x, start: int, rows: int) -> np.ndarray:
    """``read_rows_from`` on ``x`` for ``rows`` rows from row ``start``, on the generic interpreter."""

    def call(start, x):
        return pl.pallas_call(
            read_rows_from,
            out_shape=jax.ShapeDtypeStruct((rows, *x.shape[1:]), x.dtype),
            in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM), pl.BlockSpec()],
        )(start, x)

    with pltpu.force_tpu_interpret_mode(True):  # type: ignore[arg-type]  # see run_step_counter
        return np.asarray(jax.jit(call)(jnp.array([start], jnp.int32), x))


def _clamped_reads_probe() -> bool:
    x = jnp.arange(16 * 128, dtype=jnp.float32).reshape(16, 128)
    got = run_read_rows_from(x, start=12, rows=8)
    if np.array_equal(got[:4], np.asarray(x)[12:]):
        return False  # the rows in bounds are read where they are
    if np.array_equal(got, np.asarray(x)[8:]):
        return True
    raise InternalsMoved(
        f"reading 8 rows from row 12 of a 16-row ref returned rows {(got[:, 0] // 128).tolist()}"
    )


def _clamped_reads_internals() -> None:
    internals = _internals()
    require_attributes(internals.discharge, "transform_array")
    require_parameters(internals.discharge.transform_array, ["x", "transforms"], "transform_array")
    require_attributes(internals.indexing, "Slice", "NDIndexer")
    require_attributes(
        internals.indexing.Slice, "is_dynamic_start", "is_dynamic_size", "start", "size", "stride"
    )


def _reads_several_from_a_data_dependent_start(transform) -> bool:
    """An indexer with a slice of several elements from a data-dependent start, static sizes and no array
    index: the reads a clamped start moves onto other elements. A single element read outside a ref (a
    scalar index) is outside whole: clamped, it returns some element of the ref, as arbitrary as what a
    TPU reads there, so those are left to jax."""
    if not view_algebra.is_indexer(transform):
        return False
    slice_class = _internals().indexing.Slice
    several = False
    for index in transform.indices:
        if isinstance(index, slice_class):
            if index.is_dynamic_size:
                return False  # the dynamic-size copies widen these to static windows first
            several = several or (index.is_dynamic_start and index.size > 1)
        elif np.shape(index) != ():
            return False  # an array index: a gather, left to jax
    return several


def _value_outside(dtype) -> np.ndarray:
    """What a read outside a ref returns: NaN for a float, every bit set for any other dtype (NaN too for a
    float view of those bits, as v3's bfloat16 KV buffer read as uint32 is)."""
    if jnp.issubdtype(dtype, jnp.floating):
        return np.array(np.nan, dtype)
    return np.invert(np.zeros((), dtype))


def _clamp(low: int, value, high: int):
    """``value`` (a data-dependent index) as int32, within ``[low, high]``."""
    return jax.lax.clamp(np.int32(low), jax.lax.convert_element_type(value, jnp.int32), np.int32(high))


def _read_in_place(x, indexer):
    """``x[indexer]`` as a TPU reads it: each element of a slice from its own position, the positions outside
    the ref (past its end or before its start) read as ``_value_outside``. A window that holds every
    position inside the ref is sliced at a start kept inside it; along each axis of a slice of several
    elements from a data-dependent start the window is padded with that value by the slice's reach on both
    sides and sliced again where the slice's first position falls, so no ``lax.dynamic_slice`` clamps a
    start onto other elements. A data-dependent scalar index is clamped into the ref. An 8- or 16-bit float
    moves as bits (gap ``generic-narrow-float-bits``); any other dtype as it is (a bitcast would copy the
    whole ref)."""
    slice_class = _internals().indexing.Slice
    window_starts, windows, pads, offsets, reaches, strides, squeezed = [], [], [], [], [], [], []
    for axis, (index, extent) in enumerate(zip(indexer.indices, x.shape, strict=True)):
        if isinstance(index, slice_class):
            start, size, stride = index.start, index.size, index.stride
        else:
            start, size, stride = index, 1, 1
            squeezed.append(axis)
        reach = (size - 1) * stride + 1 if size else 0  # from the first position read to the last
        pad, offset = (0, 0, 0), 0
        if isinstance(start, (int, np.integer)):  # static: in bounds, as jax checks when it traces
            window_start, window = int(start), reach
        elif size <= 1:  # one element: outside whole when outside, clamped as jax clamps it
            window_start, window = _clamp(0, start, extent - size), size
        else:
            start = jax.lax.convert_element_type(start, jnp.int32)
            window = min(reach, extent)
            window_start = _clamp(0, start, extent - window)
            pad = (reach, reach, 0)
            offset = _clamp(0, jax.lax.sub(jax.lax.add(start, np.int32(reach)), window_start), window + reach)
        window_starts.append(window_start)
        windows.append(window)
        pads.append(pad)
        offsets.append(offset)
        reaches.append(reach)
        strides.append(stride)
    bits = _moves_bits(x, ())
    fill = _value_outside(x.dtype) if bits is None else _value_outside(x.dtype).view(bits)
    value = jax.lax.dynamic_slice(
        x if bits is None else jax.lax.bitcast_convert_type(x, bits), window_starts, windows
    )
    if any(pad != (0, 0, 0) for pad in pads):
        value = jax.lax.dynamic_slice(jax.lax.pad(value, fill, pads), offsets, reaches)
    if any(stride != 1 for stride in strides):
        value = jax.lax.slice(value, [0] * value.ndim, reaches, strides)
    value = jax.lax.squeeze(value, squeezed)
    return value if value.dtype == x.dtype else jax.lax.bitcast_convert_type(value, x.dtype)


def _transform_array_reading_in_place(original: Callable) -> Callable:
    @functools.wraps(original)
    def transform_array(x, transforms):
        transforms = tuple(transforms or ())
        if not any(_reads_several_from_a_data_dependent_start(transform) for transform in transforms):
            return original(x, transforms)
        result = x
        for transform in transforms:
            if _reads_several_from_a_data_dependent_start(transform):
                result = _read_in_place(result, transform)
            else:
                result = original(result, (transform,))
        return result

    return transform_array


def _clamped_reads_patches() -> list[Patch]:
    """Wraps the read path outside the narrow-float one: its own reads move 8- and 16-bit floats as bits."""
    discharge = _internals().discharge
    return [Patch.wrapping(discharge, "transform_array", _transform_array_reading_in_place)]


# ---------------------------------------------------------------------------------------------------------
# Gap generic-memory-space-operands.

MEMORY_SPACE_ERROR = "memory_space of all inputs passed to `dynamic_update_slice` must be the same"


def add_one_to_an_hbm_operand(x) -> np.ndarray:
    """``x + 1`` by a kernel whose operand is constrained to HBM, on the generic interpreter."""

    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] + 1

    def call(x):
        x = pltpu.with_memory_space_constraint(x, pltpu.HBM)
        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x)

    with pltpu.force_tpu_interpret_mode(True):  # type: ignore[arg-type]  # see run_step_counter
        return np.asarray(jax.jit(call)(x))


def _memory_space_probe() -> bool:
    x = jnp.ones((8, 128), jnp.float32)
    return _fails_with(lambda: add_one_to_an_hbm_operand(x), MEMORY_SPACE_ERROR)


def _memory_space_internals() -> None:
    internals = _internals()
    require_attributes(internals.hlo_interpreter, "pallas_call_hlo_interpret")
    require_attributes(internals.pallas_core, "with_memory_space_constraint_p")
    require_attributes(internals.core, "MemorySpace", "Tracer")
    require_attributes(internals.core.MemorySpace, "Device")


def _in_default_memory_space(x):
    """``x`` as an operand in the default memory space (a no-op in the lowering)."""
    core = _internals().core
    memory_space = getattr(getattr(x, "aval", None), "memory_space", core.MemorySpace.Device)
    if not isinstance(x, core.Tracer) or memory_space == core.MemorySpace.Device:
        return x
    return _internals().pallas_core.with_memory_space_constraint_p.bind(
        x, memory_space=core.MemorySpace.Device
    )


def _interpret_in_default_memory_space(original: Callable) -> Callable:
    @functools.wraps(original)
    def interpret(*args, **params):
        return original(*map(_in_default_memory_space, args), **params)

    return interpret


def _memory_space_patches() -> list[Patch]:
    interpreter = _internals().hlo_interpreter
    return [Patch.wrapping(interpreter, "pallas_call_hlo_interpret", _interpret_in_default_memory_space)]


GAPS = patching.gap_table(
    "generic",
    # (name, symptom, probe, check_internals, patches), in the order install() applies them: a later
    # gap's patch may wrap an earlier one's
    ("generic-literal-indices", "masked store/load on ref.at[<int>]: 'TypedInt' object has no attribute 'shape'",
     _literal_indices_probe, _literal_indices_internals, _literal_indices_patches),
    ("generic-view-stores", "stores and DMAs through ref.reshape/ref.bitcast: 'Unsupported transform: ReshapeTransform'",
     _view_stores_probe, _view_stores_internals, _view_stores_patches),
    ("generic-scalar-prefetch-state", "writes to scalar-prefetch refs are dropped between grid steps (stale values, no error)",
     _scalar_prefetch_probe, _scalar_prefetch_internals, _scalar_prefetch_patches),
    ("generic-narrow-float-bits", "every access to an 8/16-bit float buffer converts the whole buffer (slow, not wrong)",
     narrow_float_store_converts, _narrow_float_internals, _narrow_float_patches),
    ("generic-clamped-reads", "a read that runs past its ref from a data-dependent start (ref[pl.ds(i, n)]): lax.dynamic_slice moves the start back inside the ref, so every element comes from the wrong position (silently wrong)",
     _clamped_reads_probe, _clamped_reads_internals, _clamped_reads_patches),
    ("generic-dynamic-size-copies", "DMAs of a data-dependent size (pl.ds with a traced length): 'Shapes must be 1D sequences of concrete values'",
     _dynamic_size_probe, _dynamic_size_internals, _dynamic_size_patches),
    ("generic-memory-space-operands", f"operands constrained to a memory space (pltpu.with_memory_space_constraint): '{MEMORY_SPACE_ERROR}'",
     _memory_space_probe, _memory_space_internals, _memory_space_patches),
)  # fmt: skip
(
    LITERAL_INDICES,
    VIEW_STORES,
    SCALAR_PREFETCH_STATE,
    NARROW_FLOAT_BITS,
    CLAMPED_READS,
    DYNAMIC_SIZE_COPIES,
    MEMORY_SPACE_OPERANDS,
) = GAPS
