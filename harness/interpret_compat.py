"""Run-time compatibility layer for jax's Pallas TPU interpreters.

jax's CPU interpreters for Pallas TPU kernels cannot run the upstream ragged paged attention kernel: they
lack support for two ref transforms and check masked stores against the wrong extent. This module patches
the *interpreters* (never a kernel) so that real TPU kernels run on CPU with the interpreters' own checks
(out-of-bounds detection, race detection, NaN-poisoned memory) still in force.

Gaps closed, each by one patch (see the ``_patch_*`` functions for how to drop each one):

1. TPU interpreter, ``ref.reshape(...)`` (``ReshapeTransform``) on loads, stores, swaps and DMAs:
   ``AttributeError: 'ReshapeTransform' object has no attribute 'indices'``.
2. TPU interpreter, ``ref.bitcast(...)`` (``BitcastTransform``): same error.
3. TPU interpreter, masked stores: the in-bounds check clears the mask only along axis 0, so a valid mask
   on e.g. a ``(4, 2, 128)`` ref raises "Out-of-bounds masked swap".
4. Generic interpreter (``force_tpu_interpret_mode(True)``), masked ``pltpu.store``/``pl.load`` on a ref
   indexed with a Python int: ``AttributeError: 'TypedInt' object has no attribute 'shape'``.
5. Generic interpreter, stores and DMAs through a reshaped or bitcast ref:
   ``NotImplementedError: Unsupported transform: ReshapeTransform(...)``, and ``pltpu.store`` through any
   transformed ref writes back an array of the transformed shape.
6. Generic interpreter, writes to scalar-prefetch refs are dropped between grid steps: each step starts
   from the operands as passed, where on TPU (and in the TPU interpreter) they live in SMEM for the whole
   call. Upstream's RPA kernel hands the next grid step its sequence and KV-buffer index this way, so
   without the patch it reads the other, stale buffer of its double buffer (wrong rows, no error).

One patch cuts a cost instead of closing a gap:

7. Generic interpreter, loads, stores and DMAs of 8- and 16-bit float refs: XLA CPU computes a
   ``dynamic-slice`` or ``dynamic-update-slice`` of such a buffer by converting the *whole* buffer to a
   wider float and back, so every page DMA into an fp8 KV scratch converts the scratch and the source
   (float8_e4m3fn through f16 in software: a pooled fp8 RPA call took 190 ms instead of 3 ms). The
   access moves the bits as unsigned integers of the same width instead; the values are bit-identical.

Bitcast layout (verified): a ref bitcast that changes the element width packs along the *second-minor*
axis, as on TPU memory: bf16 ``[2n, m]`` -> uint32 ``[n, m]`` where word ``(i, j)`` holds row ``2i`` in
bits 0-15 and row ``2i + 1`` in bits 16-31 (fp8 -> uint32: rows ``4i .. 4i + 3`` in bytes 0..3). This is
what (a) upstream's ``strided_load_kv`` relies on (``b << 16`` yields the even, K rows), (b) jax's own
``jax._src.state.utils.bitcast`` ("only valid on TPU") and the value-level ``pltpu.bitcast`` lowering
compute, and (c) ``tests/test_interpret_compat.py`` checks with explicit bit arithmetic. It is *not*
numpy's ``view`` on the last axis.

Race detection and views: an access through a reshape/bitcast view is reported to the race detector as an
access to the whole region the view was taken of (the ref before its first reshape/bitcast), a superset
of the elements touched. Stores through a view read that region and write it back whole (no race-read is
recorded for the read); with several cores writing disjoint parts of one viewed region at once, enable
``detect_races`` to see such overlaps rather than rely on the result.

Install before tracing: the interpreters bind these functions when a kernel is traced, so ``install`` and
``uninstall`` clear jax's caches when they change anything.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import core as jax_core
from jax._src import dtypes as jax_dtypes
from jax._src import literals as jax_literals
from jax._src import tree_util as jax_tree_util
from jax._src.pallas import hlo_interpreter
from jax._src.pallas import primitives as pallas_primitives
from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpreter
from jax._src.pallas.mosaic.interpret import shared_memory as tpu_shared_memory
from jax._src.pallas.mosaic.interpret import utils as tpu_interpret_utils
from jax._src.pallas.mosaic.interpret import vector_clock as tpu_vector_clock
from jax._src.state import discharge as state_discharge
from jax._src.state import indexing as state_indexing
from jax._src.state import types as state_types
from jax._src.state import utils as state_utils

SUPPORTED_JAX_VERSIONS: frozenset[str] = frozenset({"0.10.2"})
"""jax versions whose interpreter internals these patches were written against and tested on."""

_VIEW_TRANSFORMS = (state_types.ReshapeTransform, state_types.BitcastTransform)


@dataclasses.dataclass
class _Patch:
    """One replaced attribute (or dict entry) and what to put back."""

    owner: Any
    name: Any
    replacement: Any
    original: Any = None

    def apply(self) -> None:
        self.original = self._get()
        self._set(self.replacement)

    def revert(self) -> None:
        if self._get() is not self.replacement:
            warnings.warn(
                f"interpret_compat: {self.owner!r}.{self.name} was replaced by someone else after install();"
                " leaving it as it is.",
                stacklevel=3,
            )
            return
        self._set(self.original)

    def _get(self) -> Any:
        return self.owner[self.name] if isinstance(self.owner, dict) else getattr(self.owner, self.name)

    def _set(self, value: Any) -> None:
        if isinstance(self.owner, dict):
            self.owner[self.name] = value
        else:
            setattr(self.owner, self.name, value)


_lock = threading.Lock()
_applied: list[_Patch] = []
_warned_unsupported = False


def is_installed() -> bool:
    """Whether the patches are currently applied."""
    return bool(_applied)


def install() -> bool:
    """Apply all patches (idempotent). Returns whether the layer is active.

    On a jax version outside ``SUPPORTED_JAX_VERSIONS`` nothing is patched, a warning is issued once, and
    False is returned: the interpreters' internals change between releases, so patching blindly could
    corrupt results instead of failing loudly.
    """
    global _warned_unsupported
    with _lock:
        if _applied:
            return True
        if jax.__version__ not in SUPPORTED_JAX_VERSIONS:
            if not _warned_unsupported:
                _warned_unsupported = True
                warnings.warn(
                    f"interpret_compat: jax {jax.__version__} is not in SUPPORTED_JAX_VERSIONS "
                    f"{sorted(SUPPORTED_JAX_VERSIONS)}; the interpreter patches stay off. Run "
                    "tests/test_interpret_compat.py on this version and add it if they pass.",
                    stacklevel=2,
                )
            return False
        patches = [
            *_patch_tpu_view_transforms(),
            *_patch_masked_swap_bounds(),
            *_patch_generic_literal_indices(),
            *_patch_generic_stores(),
            *_patch_generic_scalar_prefetch_state(),
        ]
        for patch in patches:
            patch.apply()
        _applied.extend(patches)
        jax.clear_caches()
        return True


def uninstall() -> None:
    """Restore the interpreters' original functions (no-op when not installed)."""
    with _lock:
        if not _applied:
            return
        for patch in reversed(_applied):
            patch.revert()
        _applied.clear()
        jax.clear_caches()


# ---------------------------------------------------------------------------------------------------------
# Views on NumPy values: what a reshape / bitcast / indexer chain reads and how a write goes back through it.


def _split_at_first_view(transforms) -> tuple[tuple, tuple]:
    """(leading indexers, rest starting at the first reshape/bitcast); rest is empty without views."""
    transforms = tuple(transforms or ())
    for position, transform in enumerate(transforms):
        if isinstance(transform, _VIEW_TRANSFORMS):
            return transforms[:position], transforms[position:]
    return transforms, ()


def _bit_width(dtype) -> int:
    bits = jax_dtypes.itemsize_bits(dtype)
    if bits < 8:
        raise NotImplementedError(
            f"interpret_compat: bitcast of sub-byte dtype {np.dtype(dtype)} is not supported on CPU; "
            "use 8-bit or wider dtypes in interpreted kernels."
        )
    return bits


def tpu_bitcast(value: np.ndarray, dtype) -> np.ndarray:
    """Reinterpret ``value`` as ``dtype`` with TPU's layout: width changes pack along the second-minor axis."""
    dtype = np.dtype(dtype)
    source_bits, target_bits = _bit_width(value.dtype), _bit_width(dtype)
    value = np.ascontiguousarray(value)
    if source_bits == target_bits:
        return value.view(dtype)
    if value.ndim < 2:
        raise ValueError(
            f"A bitcast from {value.dtype} to {dtype} changes the element width and needs a ref of rank >= 2, "
            f"got shape {value.shape}."
        )
    *leading, rows, cols = value.shape
    if source_bits < target_bits:
        packing = target_bits // source_bits
        if rows % packing:
            raise ValueError(
                f"Cannot bitcast {value.dtype}{list(value.shape)} to {dtype}: the second-minor dimension "
                f"{rows} is not a multiple of the packing {packing}."
            )
        grouped = value.reshape(*leading, rows // packing, packing, cols).swapaxes(-1, -2)
        return np.ascontiguousarray(grouped).view(dtype)[..., 0]
    packing = source_bits // target_bits
    pieces = value.view(dtype).reshape(*leading, rows, cols, packing).swapaxes(-1, -2)
    return np.ascontiguousarray(pieces).reshape(*leading, rows * packing, cols)


def _numpy_index(indexer: state_indexing.NDIndexer) -> tuple[int | slice, ...]:
    return tuple(
        index
        if isinstance(index, int)
        else slice(index.start, index.start + index.size * index.stride, index.stride)
        for index in indexer.indices
    )


def _index_extents(indexer: state_indexing.NDIndexer) -> list[tuple[int, int] | None]:
    """Per dimension, the lowest and highest position the indexer touches (None if it touches none)."""
    extents: list[tuple[int, int] | None] = []
    for index in indexer.indices:
        if isinstance(index, int):
            extents.append((index, index))
        elif index.size == 0:
            extents.append(None)
        else:
            extents.append((index.start, index.start + (index.size - 1) * index.stride))
    return extents


def _is_out_of_bounds(indexer: state_indexing.NDIndexer, shape: tuple[int, ...]) -> bool:
    return any(
        extent is not None and (extent[0] < 0 or extent[1] >= size)
        for extent, size in zip(_index_extents(indexer), shape, strict=True)
    )


def _index_padded(value: np.ndarray, indexer: state_indexing.NDIndexer, fill) -> np.ndarray:
    """Index ``value``, reading ``fill`` wherever the indexer leaves its bounds."""
    padding, shifted = [], []
    for extent, size, index in zip(_index_extents(indexer), value.shape, indexer.indices, strict=True):
        before = 0 if extent is None else max(0, -extent[0])
        after = 0 if extent is None else max(0, extent[1] + 1 - size)
        padding.append((before, after))
        if isinstance(index, int):
            shifted.append(index + before)
        else:
            start = index.start + before
            shifted.append(slice(start, start + index.size * index.stride, index.stride))
    return np.pad(value, padding, constant_values=fill)[tuple(shifted)]


def _view_once(value: np.ndarray, transform) -> np.ndarray:
    if isinstance(transform, state_types.ReshapeTransform):
        return value.reshape(transform.shape)
    if isinstance(transform, state_types.BitcastTransform):
        return tpu_bitcast(value, transform.dtype)
    return value[_numpy_index(transform)]


class _ViewOutOfBounds(Exception):
    """An indexer after a reshape/bitcast leaves the bounds of the view it indexes."""

    def __init__(self, indexer, view_shape: tuple[int, ...]):
        super().__init__(indexer, view_shape)
        self.indexer = indexer
        self.view_shape = view_shape


def _read_view(region: np.ndarray, views: tuple, *, fill=None) -> np.ndarray:
    """Apply ``views`` to ``region``; out-of-bounds indexing raises, or reads ``fill`` when one is given."""
    value = region
    for transform in views:
        if isinstance(transform, state_indexing.NDIndexer) and _is_out_of_bounds(transform, value.shape):
            if fill is None:
                raise _ViewOutOfBounds(transform, value.shape)
            value = _index_padded(value, transform, fill)
        else:
            value = _view_once(value, transform)
    return value


def _write_view(region: np.ndarray, views: tuple, new_value: np.ndarray) -> np.ndarray:
    """A copy of ``region`` with ``new_value`` written through ``views``."""
    stages = [region]
    for transform in views:
        if isinstance(transform, state_indexing.NDIndexer) and _is_out_of_bounds(transform, stages[-1].shape):
            raise _ViewOutOfBounds(transform, stages[-1].shape)
        stages.append(_view_once(stages[-1], transform))
    written = np.asarray(new_value, dtype=stages[-1].dtype).reshape(stages[-1].shape)
    for transform, before in zip(reversed(views), reversed(stages[:-1]), strict=True):
        if isinstance(transform, state_types.ReshapeTransform):
            written = written.reshape(before.shape)
        elif isinstance(transform, state_types.BitcastTransform):
            written = tpu_bitcast(written, before.dtype)
        else:
            updated = before.copy()
            updated[_numpy_index(transform)] = written
            written = updated
    return written


# ---------------------------------------------------------------------------------------------------------
# Gaps 1 and 2: reshape / bitcast views in the TPU interpreter.


def _location(device_id, local_core_id, memory_space, buffer_id) -> str:
    space = tpu_interpreter.TPU_MEMORY_SPACE_NAMES[int(memory_space)]
    return f"({int(device_id)} {int(local_core_id)} {space} {int(buffer_id)})"


def _region_shape(read_range, buffer_shape) -> tuple[int, ...]:
    shape = []
    for position, size in enumerate(buffer_shape):
        if position >= len(read_range):
            shape.append(size)
        elif isinstance(read_range[position], slice):
            part = read_range[position]
            shape.append(len(range(part.start, part.stop, part.step)))
    return tuple(shape)


def _read_region_unrecorded(device_id, local_core_id, memory_space, buffer_id, prefix, what: str):
    """The region a view was taken of, read without a race-detector record (it precedes a recorded write)."""
    shared_memory = tpu_interpreter._get_shared_memory()
    space = tpu_interpreter.TPU_MEMORY_SPACE_NAMES[int(memory_space)]
    key = (
        space,
        int(buffer_id),
        int(device_id),
        tpu_interpreter._local_core_id_or_zero_if_hbm(int(local_core_id), space),
    )
    read_range = tpu_interpret_utils.to_range(jax.tree.map(int, prefix))
    global_core_id = shared_memory.get_global_core_id(int(device_id), int(local_core_id))
    content, (buffer_shape, _), _ = shared_memory.get_buffer_content(
        key, read_range, global_core_id, increment_clock=False
    )
    expected_shape = _region_shape(read_range, buffer_shape)
    if content is None or content.shape != expected_shape:
        raise ValueError(
            f"Out-of-bounds {what} of {_location(device_id, local_core_id, memory_space, buffer_id)}: the "
            f"reshaped/bitcast ref covers [{read_range}] but the buffer has shape {tuple(buffer_shape)}."
        )
    return content


def _view_error(error: _ViewOutOfBounds, what: str, location: str, views) -> str:
    return (
        f"Out-of-bounds {what} of {location} through a reshape/bitcast view: indexing "
        f"{_numpy_index(error.indexer)} into a view of shape {error.view_shape} (view transforms: {views})."
    )


def _get_through_views(original_get: Callable) -> Callable:
    @tpu_interpreter.fail_on_exception
    def get(token, device_id, local_core_id, memory_space, buffer_id, transforms, *args, **kwargs):
        prefix, views = _split_at_first_view(transforms)
        if not views:
            return original_get(
                token, device_id, local_core_id, memory_space, buffer_id, transforms, *args, **kwargs
            )
        token, region = original_get(
            token, device_id, local_core_id, memory_space, buffer_id, prefix, *args, **kwargs
        )
        views = jax.tree.map(int, views)
        shared_memory = tpu_interpreter._get_shared_memory()
        fill = None
        if shared_memory.out_of_bounds_reads != "raise":
            fill = tpu_interpret_utils.get_uninitialized_value(
                region.dtype, shared_memory.uninitialized_memory
            )
        try:
            return token, _read_view(region, views, fill=fill)
        except _ViewOutOfBounds as error:
            location = _location(device_id, local_core_id, memory_space, buffer_id)
            raise IndexError(_view_error(error, "read", location, views)) from None

    return get


def _store_through_views(original_store: Callable) -> Callable:
    @tpu_interpreter.fail_on_exception
    def store(token, device_id, local_core_id, memory_space, buffer_id, transforms, val, *args, **kwargs):
        prefix, views = _split_at_first_view(transforms)
        if not views:
            return original_store(
                token, device_id, local_core_id, memory_space, buffer_id, transforms, val, *args, **kwargs
            )
        views = jax.tree.map(int, views)
        region = _read_region_unrecorded(device_id, local_core_id, memory_space, buffer_id, prefix, "write")
        try:
            updated = _write_view(region, views, np.asarray(val))
        except _ViewOutOfBounds as error:
            location = _location(device_id, local_core_id, memory_space, buffer_id)
            raise ValueError(_view_error(error, "write", location, views)) from None
        return original_store(
            token, device_id, local_core_id, memory_space, buffer_id, prefix, updated, *args, **kwargs
        )

    return store


def _swap_through_views(original_swap: Callable) -> Callable:
    @tpu_interpreter.fail_on_exception
    def swap(token, device_id, local_core_id, memory_space, buffer_id, transforms, val, mask, **kwargs):
        prefix, views = _split_at_first_view(transforms)
        if not views:
            return original_swap(
                token, device_id, local_core_id, memory_space, buffer_id, transforms, val, mask, **kwargs
            )
        views = jax.tree.map(int, views)
        location = _location(device_id, local_core_id, memory_space, buffer_id)
        region = _read_region_unrecorded(device_id, local_core_id, memory_space, buffer_id, prefix, "swap")
        try:
            new_value = np.asarray(val)
            if mask is not None:
                new_value = np.where(np.asarray(mask), new_value, _read_view(region, views))
            updated = _write_view(region, views, new_value)
        except _ViewOutOfBounds as error:
            raise ValueError(_view_error(error, "swap", location, views)) from None
        token, previous = original_swap(
            token, device_id, local_core_id, memory_space, buffer_id, prefix, updated, None, **kwargs
        )
        old_value = _read_view(previous, views)
        if mask is not None:
            old_value = np.where(np.asarray(mask), old_value, np.asarray(val))
        return token, old_value

    return swap


def _patch_tpu_view_transforms() -> list[_Patch]:
    """Gaps 1 and 2: let the TPU interpreter's load, store, swap and DMA accesses go through views.

    The interpreter reduces every ref transform to index ranges (``interpret.utils.to_range``), which only
    knows ``NDIndexer``. These wrappers hand the interpreter the indexers *before* the first reshape or
    bitcast (so its bounds, race and NaN machinery sees a plain region) and apply the views to that region
    in NumPy. DMAs call ``get.__wrapped__`` / ``store.__wrapped__``, so they are covered too.

    Drop when ``to_range`` (or its replacement) accepts ``ReshapeTransform`` and ``BitcastTransform``:
    ``test_gap_reshape_still_in_tpu_interpreter`` and ``test_gap_bitcast_still_in_tpu_interpreter`` then
    fail and say so.
    """
    replacements = {
        "get": _get_through_views(tpu_interpreter.get.__wrapped__),
        "store": _store_through_views(tpu_interpreter.store.__wrapped__),
        "swap": _swap_through_views(tpu_interpreter.swap.__wrapped__),
    }
    return [_Patch(tpu_interpreter, name, function) for name, function in replacements.items()]


# ---------------------------------------------------------------------------------------------------------
# Gap 3: masked swap bounds check in the TPU interpreter's shared memory.


def _masked_swap_checking_every_axis(original_swap_buffer_content: Callable) -> Callable:
    @functools.wraps(original_swap_buffer_content)
    def swap_buffer_content(
        self, key, rnge, value, mask, global_core_id, increment_clock=True, logging_info=None
    ):
        if mask is None:
            return original_swap_buffer_content(
                self, key, rnge, value, mask, global_core_id, increment_clock, logging_info
            )
        clock = None
        with self.lock:
            if self.detect_races and increment_clock:
                tpu_vector_clock.inc_vector_clock(self.clocks[global_core_id], global_core_id)
                clock = tpu_vector_clock.copy_vector_clock(self.clocks[global_core_id])
            buffer = self.mem[key]
            if not isinstance(buffer, tpu_shared_memory.Buffer):
                raise ValueError(f"Attempting to swap into allocation with key {key}, which is not a Buffer.")
            shape_and_dtype = tpu_shared_memory.ShapeAndDtype(buffer.logical_shape, buffer.dtype)
            try:
                current = buffer[rnge].copy()
            except IndexError:
                current = None
            if current is None:
                # Entirely out of bounds: an error only where the mask would write.
                return (None if mask.any() else value.copy()), shape_and_dtype, clock
            in_bounds = tuple(slice(0, size) for size in current.shape)
            outside = np.ones(mask.shape, dtype=bool)
            outside[in_bounds] = False
            if (outside & mask).any():
                return None, shape_and_dtype, clock
            previous = value.copy()
            previous[in_bounds] = np.where(mask[in_bounds], current, value[in_bounds])
            buffer.set_in_bounds_portion(rnge, np.where(mask[in_bounds], value[in_bounds], current))
            if self.enable_logging and logging_info is not None:
                self._log(
                    logging_info.format(
                        f"{key=}, {rnge=}, masked, in_bounds=True, {value.shape=}.",
                        line_prefix="`swap_buffer_content`",
                    )
                )
            return previous, shape_and_dtype, clock

    return swap_buffer_content


def _patch_masked_swap_bounds() -> list[_Patch]:
    """Gap 3: check a masked swap's mask against the in-bounds extent of *every* axis.

    ``SharedMemory.swap_buffer_content`` marks ``in_bounds_mask[extent_i:] = False`` for each axis ``i``,
    which always slices axis 0; any ref whose later axes are shorter than axis 0 gets a bogus
    "Out-of-bounds masked swap". Unmasked swaps still go to the original.

    Drop when ``test_gap_masked_swap_still_in_tpu_interpreter`` fails (jax then accepts a valid mask on a
    ``(4, 2, 128)`` ref).
    """
    original = tpu_shared_memory.SharedMemory.swap_buffer_content
    return [
        _Patch(
            tpu_shared_memory.SharedMemory, "swap_buffer_content", _masked_swap_checking_every_axis(original)
        )
    ]


# ---------------------------------------------------------------------------------------------------------
# Gaps 4 and 5: the generic (HLO) interpreter, which runs kernels through state discharge rules.


def _untyped_literals(args_flat) -> list:
    """Turn literal ``TypedInt`` scalars into 0-d arrays, which the Pallas discharge rules expect."""
    return [
        np.asarray(int(arg), dtype=arg.dtype) if isinstance(arg, jax_literals.TypedInt) else arg
        for arg in args_flat
    ]


def _load_rule_with_literal_indices(original_rule: Callable) -> Callable:
    @functools.wraps(original_rule)
    def rule(in_avals, out_avals, *args_flat, **params):
        return original_rule(in_avals, out_avals, *_untyped_literals(args_flat), **params)

    return rule


def _swap_rule_with_literal_indices(original_rule: Callable) -> Callable:
    """Also writes back through transforms that precede the final indexer (upstream returns them unwound)."""

    @functools.wraps(original_rule)
    def rule(in_avals, out_avals, *args_flat, args_tree, **params):
        args_flat = _untyped_literals(args_flat)
        ref, transforms, val, mask = args_tree.unflatten(args_flat)
        transforms = list(transforms)
        if transforms and isinstance(transforms[-1], state_indexing.NDIndexer):
            *earlier, last = transforms
        else:
            earlier, last = transforms, None
        if not earlier:
            return original_rule(in_avals, out_avals, *args_flat, args_tree=args_tree, **params)
        region = state_discharge.transform_array(ref, earlier)
        if last is None:
            last = state_indexing.NDIndexer.make_trivial_indexer(region.shape)
        region_flat, region_tree = jax_tree_util.tree_flatten((region, (last,), val, mask))
        (new_region, *_), out = original_rule(
            [None] * len(region_flat), out_avals, *region_flat, args_tree=region_tree, **params
        )
        _, new_ref = state_discharge.transform_swap_array(ref, earlier, new_region)
        return (new_ref,) + (None,) * (len(in_avals) - 1), out

    return rule


def _patch_generic_literal_indices() -> list[_Patch]:
    """Gap 4: masked ``pltpu.store`` / ``pl.load`` on ``ref.at[<python int>]`` in the generic interpreter.

    A literal index reaches the Pallas ``load_p`` / ``swap_p`` discharge rules as ``TypedInt``, which has no
    ``.shape``. The wrapper also fixes ``swap_p`` with transforms before its final indexer (e.g.
    ``pltpu.store(ref.reshape(...), ...)``), whose discharge returned the transformed array as the new ref.

    Drop when ``test_gap_literal_index_still_in_generic_interpreter`` fails.
    """
    rules = state_discharge._discharge_rules
    return [
        _Patch(
            rules, pallas_primitives.load_p, _load_rule_with_literal_indices(rules[pallas_primitives.load_p])
        ),
        _Patch(
            rules, pallas_primitives.swap_p, _swap_rule_with_literal_indices(rules[pallas_primitives.swap_p])
        ),
    ]


def _jax_view(value, transform):
    if isinstance(transform, state_types.ReshapeTransform):
        return value.reshape(transform.shape)
    return state_utils.bitcast(value, transform.dtype)


def _jax_unview(value, transform, before):
    if isinstance(transform, state_types.ReshapeTransform):
        return value.reshape(before.shape)
    return state_utils.bitcast(value, before.dtype)


def _transform_swap_array_through_views(original: Callable) -> Callable:
    @functools.wraps(original)
    def transform_swap_array(x, transforms, val):
        head, rest = _split_at_first_view(transforms)
        if not rest:
            return original(x, transforms, val)
        view, tail = rest[0], rest[1:]
        region = state_discharge.transform_array(x, head)
        old_value, new_viewed = transform_swap_array(_jax_view(region, view), tail, val)
        _, new_x = original(x, head, _jax_unview(new_viewed, view, region))
        return old_value, new_x

    return transform_swap_array


def _moves_bits(x, transforms) -> np.dtype | None:
    """The unsigned dtype to move ``x`` as, when it is an 8- or 16-bit float accessed without views."""
    if getattr(x, "dtype", None) is None or _split_at_first_view(transforms)[1]:
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


def _patch_generic_stores() -> list[_Patch]:
    """Gap 5 and cost 7: accesses in the generic interpreter (``state.discharge.transform_[swap_]array``).

    Gap 5: the original reads through views but its write-back loop only handles indexers. The view wrapper
    splits the transforms at each view, lets the original handle the indexer runs and undoes the view
    (reshape back, TPU-layout bitcast back) in between.

    Cost 7: the bits wrappers (outermost; on ``transform_array`` too, the read path of loads and DMA
    sources) read and store 8- and 16-bit float buffers as unsigned integers of the same width, so that
    XLA CPU does not convert the whole buffer around every access.

    Drop the view wrapper when ``test_gap_view_store_still_in_generic_interpreter`` fails, the bits wrappers
    when ``test_cost_narrow_float_store_still_in_xla_cpu`` does.
    """
    return [
        _Patch(
            state_discharge,
            "transform_array",
            _transform_array_moving_bits(state_discharge.transform_array),
        ),
        _Patch(
            state_discharge,
            "transform_swap_array",
            _transform_swap_array_moving_bits(
                _transform_swap_array_through_views(state_discharge.transform_swap_array)
            ),
        ),
    ]


# ---------------------------------------------------------------------------------------------------------
# Gap 6: scalar-prefetch state across grid steps in the generic interpreter.


def _kernel_jaxpr_carrying_scalar_prefetch(original_kernel_to_hlo_jaxpr: Callable) -> Callable:
    @functools.wraps(original_kernel_to_hlo_jaxpr)
    def kernel_to_hlo_jaxpr(jaxpr, consts, grid_mapping):
        step, step_consts, scratch_avals = original_kernel_to_hlo_jaxpr(jaxpr, consts, grid_mapping)
        num_scalars = grid_mapping.num_index_operands
        if not num_scalars:
            return step, step_consts, scratch_avals
        scalar_avals = [var.aval for var in step.invars[:num_scalars]]
        num_program_ids = len(grid_mapping.grid) - len(grid_mapping.vmapped_dims)

        def step_with_carried_scalars(*operands):
            passed, blocks_and_scratch, carried = (
                operands[:num_scalars],
                operands[num_scalars:-num_scalars],
                operands[-num_scalars:],
            )
            # The first step of a kernel run starts from the operands; later steps from the last writes.
            first_step = functools.reduce(
                jnp.logical_and,
                [pallas_primitives.program_id(axis) == 0 for axis in range(num_program_ids)],
                jnp.bool_(True),
            )
            scalars = [
                jax.lax.select(jnp.broadcast_to(first_step, value.shape), value, previous)
                for value, previous in zip(passed, carried, strict=True)
            ]
            outputs = jax_core.eval_jaxpr(step, step_consts, *scalars, *blocks_and_scratch)
            return (*outputs, *outputs[:num_scalars])

        operand_avals = [*(var.aval for var in step.invars), *scalar_avals]
        with grid_mapping.trace_env():
            carrying = jax.make_jaxpr(step_with_carried_scalars)(*operand_avals)
        return carrying.jaxpr, carrying.consts, [*scratch_avals, *scalar_avals]

    return kernel_to_hlo_jaxpr


def _patch_generic_scalar_prefetch_state() -> list[_Patch]:
    """Gap 6: keep writes to scalar-prefetch refs from one grid step to the next in the generic interpreter.

    ``hlo_interpreter.pallas_call_hlo_interpret`` loops over the grid carrying the blocks and the scratch
    buffers but passes the scalar-prefetch operands unchanged to every step and drops their updated
    values. The wrapper around ``kernel_to_hlo_jaxpr`` (the one step the loop evaluates) appends one
    scratch buffer per scalar-prefetch operand: the step reads the operands as passed when every program
    id is 0 (the start of a run, and of each vmapped instance) and the carried values otherwise, and
    writes its final values back into those buffers. ``index_map`` functions still see the operands as
    passed (none of upstream's read a mutated one).

    Drop when ``test_gap_scalar_prefetch_state_still_in_generic_interpreter`` fails.
    """
    return [
        _Patch(
            hlo_interpreter,
            "kernel_to_hlo_jaxpr",
            _kernel_jaxpr_carrying_scalar_prefetch(hlo_interpreter.kernel_to_hlo_jaxpr),
        )
    ]
