"""Patches for the TPU interpreter (``force_tpu_interpret_mode(InterpretParams(...))``).

Gap ``tpu-ref-views``: ``ref.reshape(...)`` / ``ref.bitcast(...)`` on loads, stores, swaps and DMAs raise
``AttributeError: '<Reshape|Bitcast>Transform' object has no attribute 'indices'``: the interpreter reduces
every ref transform to index ranges (``interpret.utils.to_range``), which knows only ``NDIndexer``.

Gap ``tpu-masked-swap``: the in-bounds check of a masked swap clears the mask only along axis 0, so a valid
mask on e.g. a ``(4, 2, 128)`` ref raises "Out-of-bounds masked swap".

Gap ``tpu-race-history`` (a cost, not an error): the race detector keeps every access of a buffer and checks
each new one against all of them, so a DMA costs O(accesses so far); the patch prunes the accesses no later
access can race with (see ``_history_patches``).

Gap ``tpu-callback-arguments`` (a cost, not an error): every callback the interpreter makes (each load,
store, DMA, semaphore operation) first puts each of its arguments on the CPU device as a jax array
(``io_callback``'s implementation), and the callback turns them straight back into Python ints and NumPy
arrays: about half of the time spent in callbacks. The patch hands the interpreter's own callbacks NumPy
copies of their arguments instead (see ``_callback_arguments_patches``).

Gap ``tpu-clock-order`` (a cost, not an error): the race detector decides whether two accesses are ordered
with four NumPy reductions over their vector clocks, once per earlier access of the buffer; with clocks of
two entries that is most of what a race check costs. The patch decides the same relation on Python lists.

Gap ``tpu-deadlock`` (a missing check): a DMA or semaphore wait whose count is short while no DMA in flight
will signal it loops forever (sleeping 0.1 s per turn), so a kernel that waits for a copy it never started
stops the process until a watchdog kills it. With one core nothing else can ever signal that semaphore: the
patch raises ``DEADLOCK:`` at once, naming the kernel line that waits, the count it needs and the count it has.

Gap ``tpu-empty-copy-at-end``: a DMA of no elements whose source slice starts exactly at the end of its
buffer (``pl.ds(size, 0)``) is reported as an out-of-bounds read when a wait executes it: the
interpreter's reads clip their range with ``clip_range_to_shape``, which takes any slice starting at or
past a dimension's end for a range entirely out of bounds, the empty one included, while its writes
(``is_range_out_of_bounds_for_shape``) take the same empty slice as in bounds. The patch gives reads the
writes' rule: an empty slice starting at the end reads nothing (NumPy's ``x[n:n]``); one starting past the
end is still out of bounds.

Gap ``tpu-wait-for-nothing``: with race detection on, a wait for a copy of no elements on a semaphore that
nothing has signalled on that core fails ``assert clock is not None`` (``Semaphore.wait``): the count (0)
is reached at once, and the wait then takes the semaphore's vector clock, which only a signal sets. A TPU
returns from such a wait at once (batched and stacked RPA wait for their empty copies). The patch returns
from it without a clock: nothing has signalled, so there is no ordering to take.

Gap ``tpu-empty-access-race``: the race detector takes an access of no elements for one that overlaps
another whose range holds its start (``_slices_overlap``: ``start1 <= start2 < stop1``, with jax's own
question "Do we need to handle zero-length slices?"), so a copy of no rows raced with a write of the rows
around it (batched RPA's query fetch of no tokens while the previous step's output is written back). An
empty range touches nothing: the patch says it overlaps nothing.

Gap ``tpu-exit-state`` (a missing check): a TPU needs every DMA a kernel starts waited for, and every
semaphore back at 0, when the kernel ends; otherwise the chip halts (``RuntimeUnexpectedCoreHalt`` on a v5e),
in that call or the next. jax's exit check (``_validate``) only prints a semaphore's count, and in its
default ``on_wait`` mode a DMA runs when it is waited for, so one never waited is a task still queued on its
semaphore and not even printed. The patch raises ``WOULD HALT A TPU:`` at kernel exit, naming the kernel
line that started each such DMA and each count left (one device only, as jax's own TODO says: another
device would wait forever at the clean-up barrier). A DMA of no elements is left out: its wait needs 0
bytes, so the interpreter never runs it even when it is waited for.

Race detection and views: an access through a reshape/bitcast view is reported to the race detector as an
access to the smallest box of the region the view was taken of (the ref before its first reshape/bitcast)
that holds every element it touches (``views.touched_box``; an empty box for an access of no elements): taking one slot of a bitcast double buffer
records that slot only. Stores through a view read the region without a record and write back that box.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import inspect
import io
import os
import threading
import types
import weakref
from collections.abc import Callable

import jax
import numpy as np

from rpa_harness.interpret_compat import patching
from rpa_harness.interpret_compat import views as view_algebra
from rpa_harness.interpret_compat.patching import (
    Patch,
    parameter_names,
    require,
    require_attributes,
    require_parameters,
)

_ACCESS_PARAMETERS = ["token", "device_id", "local_core_id", "memory_space", "buffer_id", "transforms"]


_internals = patching.private_modules(
    {
        "interpreter": "jax._src.pallas.mosaic.interpret.interpret_pallas_call",
        "races": "jax._src.pallas.mosaic.interpret.race_detection_state",
        "shared_memory": "jax._src.pallas.mosaic.interpret.shared_memory",
        "utils": "jax._src.pallas.mosaic.interpret.utils",
        "indexing": "jax._src.state.indexing",
        "state_types": "jax._src.state.types",
    }
)


def _thread_argument(get_buffer_content: Callable) -> Callable:
    """How ``SharedMemory.get_buffer_content`` names the reading core: by thread key or global core id."""
    who = parameter_names(get_buffer_content)[3]
    if who == "thread":
        return lambda shared_memory, device_id, local_core_id: (device_id, local_core_id)
    require(who == "global_core_id", f"SharedMemory.get_buffer_content names the reader {who!r}")
    return lambda shared_memory, device_id, local_core_id: shared_memory.get_global_core_id(
        device_id, local_core_id
    )


# ---------------------------------------------------------------------------------------------------------
# Gap tpu-ref-views.


def _views_probe() -> bool:
    internals = _internals()
    reshape = internals.state_types.ReshapeTransform(shape=(1,))
    bitcast = internals.state_types.BitcastTransform(dtype=np.dtype(np.uint32))
    for view in (reshape, bitcast):
        try:
            internals.utils.to_range((view,))
        except Exception:  # noqa: BLE001 - any failure to reduce a view to a range is the gap
            return True
    return False


def _views_internals() -> None:
    internals = _internals()
    interpreter = internals.interpreter
    require_attributes(
        interpreter,
        "get",
        "store",
        "swap",
        "fail_on_exception",
        "_get_shared_memory",
        "TPU_MEMORY_SPACE_NAMES",
        "_local_core_id_or_zero_if_hbm",
    )
    require_attributes(internals.utils, "to_range", "get_uninitialized_value")
    require_attributes(internals.indexing.NDIndexer, "from_indices_shape")
    require_parameters(internals.indexing.Slice, ["start", "size", "stride"], "indexing.Slice")
    for name in ("get", "store", "swap"):
        function = getattr(interpreter, name)
        require(
            hasattr(function, "__wrapped__"),
            f"interpret_pallas_call.{name} is not a fail_on_exception wrapper",
        )
        require_parameters(function.__wrapped__, _ACCESS_PARAMETERS, f"interpret_pallas_call.{name}")
    require_parameters(
        interpreter.store.__wrapped__, [*_ACCESS_PARAMETERS, "val"], "interpret_pallas_call.store"
    )
    require_parameters(
        interpreter.swap.__wrapped__, [*_ACCESS_PARAMETERS, "val", "mask"], "interpret_pallas_call.swap"
    )
    get_buffer_content = internals.shared_memory.SharedMemory.get_buffer_content
    require_parameters(get_buffer_content, ["self", "key", "rnge", None], "SharedMemory.get_buffer_content")
    require(
        "increment_clock" in parameter_names(get_buffer_content), "get_buffer_content has no increment_clock"
    )
    _thread_argument(get_buffer_content)


def _location(memory_space_name: str, device_id, local_core_id, buffer_id) -> str:
    return f"({int(device_id)} {int(local_core_id)} {memory_space_name} {int(buffer_id)})"


def _region_shape(read_range, buffer_shape) -> tuple[int, ...]:
    shape = []
    for position, size in enumerate(buffer_shape):
        if position >= len(read_range):
            shape.append(size)
        elif isinstance(read_range[position], slice):
            part = read_range[position]
            shape.append(len(range(part.start, part.stop, part.step)))
    return tuple(shape)


def _view_error(error: view_algebra.ViewOutOfBounds, what: str, location: str, views) -> str:
    return (
        f"Out-of-bounds {what} of {location} through a reshape/bitcast view: indexing "
        f"{view_algebra.numpy_index(error.indexer)} into a view of shape {error.view_shape} "
        f"(view transforms: {views})."
    )


def _views_with_ints(transforms) -> tuple[tuple, tuple]:
    """``transforms`` split at the first reshape/bitcast: the indexers before it, and the views with their
    parameters as Python ints (empty without views)."""
    prefix, views = view_algebra.split_at_first_view(transforms)
    return prefix, jax.tree.map(int, views) if views else views


class _ViewedBuffers:
    """The TPU interpreter's buffers as the view patches reach them: a buffer's name in messages, the region
    a view was taken of, and the box of that region the views touch. A buffer is
    ``(device_id, local_core_id, memory_space, buffer_id)`` as the interpreter's accesses take them."""

    def __init__(self):
        internals = _internals()
        self.interpreter = internals.interpreter
        self._utils = internals.utils
        self._indexing = internals.indexing
        self._thread_of = _thread_argument(internals.shared_memory.SharedMemory.get_buffer_content)
        self._space_names = self.interpreter.TPU_MEMORY_SPACE_NAMES

    def location(self, device_id, local_core_id, memory_space, buffer_id) -> str:
        return _location(self._space_names[int(memory_space)], device_id, local_core_id, buffer_id)

    def read_region_unrecorded(self, buffer: tuple, prefix, what: str) -> np.ndarray:
        """The region a view was taken of, read without a race-detector record (a recorded write follows)."""
        device_id, local_core_id, memory_space, buffer_id = buffer
        shared_memory = self.interpreter._get_shared_memory()
        space = self._space_names[int(memory_space)]
        device_id, local_core_id = int(device_id), int(local_core_id)
        key = (
            space,
            int(buffer_id),
            device_id,
            self.interpreter._local_core_id_or_zero_if_hbm(local_core_id, space),
        )
        read_range = self._utils.to_range(jax.tree.map(int, prefix))
        content, (buffer_shape, _), _ = shared_memory.get_buffer_content(
            key, read_range, self._thread_of(shared_memory, device_id, local_core_id), increment_clock=False
        )
        if content is None or content.shape != _region_shape(read_range, buffer_shape):
            raise ValueError(
                f"Out-of-bounds {what} of {self.location(*buffer)}: the reshaped/bitcast ref covers "
                f"[{read_range}] but the buffer has shape {tuple(buffer_shape)}."
            )
        return content

    def narrowed(self, prefix, region: np.ndarray, views) -> tuple[tuple, tuple[slice, ...] | None]:
        """``prefix`` extended to the box of ``region`` the views touch, and that box (None: the whole)."""
        box = view_algebra.touched_box(region.shape, region.dtype, views)
        if box is None:
            return tuple(prefix), None
        slices = tuple(self._indexing.Slice(part.start, part.stop - part.start, 1) for part in box)
        return (*prefix, self._indexing.NDIndexer.from_indices_shape(slices, region.shape)), box


def _get_through_views(buffers: _ViewedBuffers, original_get: Callable) -> Callable:
    """``get`` that reads the region a view was taken of and applies the views to it in NumPy; with race
    detection on, only the box of the region the views touch is recorded as read."""
    utils = _internals().utils

    @buffers.interpreter.fail_on_exception
    def get(token, device_id, local_core_id, memory_space, buffer_id, transforms, *args, **kwargs):
        buffer = (device_id, local_core_id, memory_space, buffer_id)
        prefix, views = _views_with_ints(transforms)
        if not views:
            return original_get(token, *buffer, transforms, *args, **kwargs)
        where = buffers.location(*buffer)
        shared_memory = buffers.interpreter._get_shared_memory()
        region = None
        if shared_memory.detect_races:  # record a read of the touched box only
            try:
                region = buffers.read_region_unrecorded(buffer, prefix, "read")
            except ValueError:
                region = None  # out of bounds: the read of the whole region below reports it
        touched, box = (tuple(prefix), None) if region is None else buffers.narrowed(prefix, region, views)
        if box is None:
            token, region = original_get(token, *buffer, prefix, *args, **kwargs)
        else:
            token, _ = original_get(token, *buffer, touched, *args, **kwargs)
        fill = None
        if shared_memory.out_of_bounds_reads != "raise":
            fill = utils.get_uninitialized_value(region.dtype, shared_memory.uninitialized_memory)
        try:
            return token, view_algebra.read_view(region, views, fill=fill)
        except view_algebra.ViewOutOfBounds as error:
            raise IndexError(_view_error(error, "read", where, views)) from None

    return get


def _store_through_views(buffers: _ViewedBuffers, original_store: Callable) -> Callable:
    """``store`` that writes through the views into the region they were taken of, then hands the
    interpreter the box of it they touch."""

    @buffers.interpreter.fail_on_exception
    def store(token, device_id, local_core_id, memory_space, buffer_id, transforms, val, *args, **kwargs):
        buffer = (device_id, local_core_id, memory_space, buffer_id)
        prefix, views = _views_with_ints(transforms)
        if not views:
            return original_store(token, *buffer, transforms, val, *args, **kwargs)
        region = buffers.read_region_unrecorded(buffer, prefix, "write")
        try:
            updated = view_algebra.write_view(region, views, np.asarray(val))
        except view_algebra.ViewOutOfBounds as error:
            raise ValueError(_view_error(error, "write", buffers.location(*buffer), views)) from None
        touched, box = buffers.narrowed(prefix, region, views)
        return original_store(
            token, *buffer, touched, updated if box is None else updated[box], *args, **kwargs
        )

    return store


def _swap_through_views(buffers: _ViewedBuffers, original_swap: Callable) -> Callable:
    """``swap`` that merges the mask and writes through the views as ``store`` does, and returns the
    previous values as the views see them."""

    @buffers.interpreter.fail_on_exception
    def swap(token, device_id, local_core_id, memory_space, buffer_id, transforms, val, mask, **kwargs):
        buffer = (device_id, local_core_id, memory_space, buffer_id)
        prefix, views = _views_with_ints(transforms)
        if not views:
            return original_swap(token, *buffer, transforms, val, mask, **kwargs)
        where = buffers.location(*buffer)
        region = buffers.read_region_unrecorded(buffer, prefix, "swap")
        try:
            new_value = np.asarray(val)
            if mask is not None:
                new_value = np.where(np.asarray(mask), new_value, view_algebra.read_view(region, views))
            updated = view_algebra.write_view(region, views, new_value)
        except view_algebra.ViewOutOfBounds as error:
            raise ValueError(_view_error(error, "swap", where, views)) from None
        touched, box = buffers.narrowed(prefix, region, views)
        token, previous = original_swap(
            token, *buffer, touched, updated if box is None else updated[box], None, **kwargs
        )
        if box is not None:
            whole = region.copy()
            whole[box] = previous
            previous = whole
        old_value = view_algebra.read_view(previous, views)
        if mask is not None:
            old_value = np.where(np.asarray(mask), old_value, np.asarray(val))
        return token, old_value

    return swap


def _view_patches() -> list[Patch]:
    """Hand the interpreter the indexers *before* the first reshape or bitcast (so its bounds, race and NaN
    machinery sees a plain region) and apply the views to that region in NumPy. DMAs call
    ``get.__wrapped__`` / ``store.__wrapped__``, so they are covered too."""
    buffers = _ViewedBuffers()
    interpreter = buffers.interpreter
    return [
        Patch(interpreter, "get", _get_through_views(buffers, interpreter.get.__wrapped__)),
        Patch(interpreter, "store", _store_through_views(buffers, interpreter.store.__wrapped__)),
        Patch(interpreter, "swap", _swap_through_views(buffers, interpreter.swap.__wrapped__)),
    ]


# ---------------------------------------------------------------------------------------------------------
# Gap tpu-masked-swap.

_SWAP_PROBE_SHAPE = (4, 2, 128)


def _masked_swap_probe() -> bool:
    """A valid mask on a ``(4, 2, 128)`` buffer, swapped through the unpatched method on a bare memory."""
    internals = _internals()
    key = ("vmem", 0, 0, 0)
    memory = types.SimpleNamespace(
        lock=threading.Lock(),
        detect_races=False,
        enable_logging=False,
        mem={key: internals.shared_memory.Buffer(np.zeros(_SWAP_PROBE_SHAPE, np.float32))},
    )
    mask = np.zeros(_SWAP_PROBE_SHAPE, bool)
    mask[1:3] = True
    previous, _, _ = internals.shared_memory.SharedMemory.swap_buffer_content(
        memory, key, (), np.ones(_SWAP_PROBE_SHAPE, np.float32), mask, (0, 0)
    )
    return previous is None


def _masked_swap_internals() -> None:
    memory = _internals().shared_memory.SharedMemory
    require_parameters(
        memory.swap_buffer_content,
        ["self", "key", "rnge", "value", "mask", None],
        "SharedMemory.swap_buffer_content",
    )
    require_parameters(
        memory.get_buffer_content, ["self", "key", "rnge", None], "SharedMemory.get_buffer_content"
    )
    require(
        "increment_clock" in parameter_names(memory.get_buffer_content),
        "get_buffer_content has no increment_clock",
    )


def _within(rnge: tuple, in_bounds_shape: tuple[int, ...]) -> tuple:
    """``rnge`` (slices and ints over the buffer) cut to the part that ``in_bounds_shape`` says exists."""
    clipped, kept = [], iter(in_bounds_shape)
    for part in rnge:
        if isinstance(part, slice):
            step = part.step or 1
            clipped.append(slice(part.start, part.start + next(kept) * step, step))
        else:
            clipped.append(part)
    return tuple(clipped)


def _masked_swap_patches() -> list[Patch]:
    """Check a masked swap's mask against the in-bounds extent of *every* axis, then hand the in-bounds part,
    already merged with the mask, to the original as an unmasked swap (so its clocks and logging stay).

    The read of the current values and the swap take the memory's lock separately: with several simulated
    cores writing the same elements at once the merge can use stale values, which is a race that
    ``detect_races`` reports."""
    memory_class = _internals().shared_memory.SharedMemory
    original = memory_class.swap_buffer_content

    @functools.wraps(original)
    def swap_buffer_content(self, key, rnge, value, mask, reader, *args, **kwargs):
        if mask is None:
            return original(self, key, rnge, value, mask, reader, *args, **kwargs)
        current, shape_and_dtype, _ = self.get_buffer_content(key, rnge, reader, increment_clock=False)
        if current is None:  # entirely out of bounds: an error only where the mask would write
            if mask.any():
                return None, shape_and_dtype, None
            _, _, clock = self.get_buffer_content(key, (), reader)
            return value.copy(), shape_and_dtype, clock
        in_bounds = tuple(slice(0, size) for size in current.shape)
        outside = np.ones(mask.shape, dtype=bool)
        outside[in_bounds] = False
        if (outside & mask).any():
            return None, shape_and_dtype, None
        inside_mask = mask[in_bounds]
        merged = np.where(inside_mask, value[in_bounds], current)
        before, shape_and_dtype, clock = original(
            self, key, _within(tuple(rnge), current.shape), merged, None, reader, *args, **kwargs
        )
        if before is None:
            return None, shape_and_dtype, clock
        previous = value.copy()
        previous[in_bounds] = np.where(inside_mask, before, value[in_bounds])
        return previous, shape_and_dtype, clock

    return [Patch(memory_class, "swap_buffer_content", swap_buffer_content)]


# ---------------------------------------------------------------------------------------------------------
# Gap tpu-race-history (a cost, not an error).

_PRUNE_FROM = 64
"""A buffer's history is pruned once it holds this many accesses, and again each time it doubles."""


def _clock_array(clock) -> np.ndarray:
    """A vector clock as an array: 0.10 stores arrays, later jax ``NpVectorClock`` objects."""
    return clock if isinstance(clock, np.ndarray) else clock.clock


def _clock_position() -> int:
    """Where a history entry holds its clock: (device, core, clock, ...) on 0.10, (thread, clock, ...) later."""
    parameters = parameter_names(_internals().races.RaceDetectionState.check_read)
    return parameters.index("clock") - 1


def _history_probe() -> bool:
    """Whether the unpatched detector keeps accesses that happened before every later one: one thread's
    reads of a buffer, each after the last, all stay in its history."""
    internals = _internals()
    state = internals.races.RaceDetectionState(**({"num_cores": 1} if "num_cores" in _state_fields() else {}))
    thread = {"thread": (0, 0)} if _clock_position() == 1 else {"device_id": 0, "local_core_id": 0}
    for step in range(1, 9):
        clock = np.array([step, 0], np.int32)
        if _clock_position() == 1:
            clock = _np_vector_clock(clock)
        state.check_read(**thread, clock=clock, buffer_key=("vmem", 0, 0, 0), rnge=(slice(0, 8),))
    return len(state.reads[("vmem", 0, 0, 0)]) == 8


def _state_fields() -> set[str]:
    return {field.name for field in dataclasses.fields(_internals().races.RaceDetectionState)}


def _np_vector_clock(values: np.ndarray):
    clock = _vector_clock_module().NpVectorClock(len(values))
    clock.clock[:] = values
    return clock


def _history_internals() -> None:
    internals = _internals()
    state = internals.races.RaceDetectionState
    require_attributes(state, "check_read", "check_write")
    require({"reads", "writes", "lock"} <= _state_fields(), "RaceDetectionState has no reads/writes/lock")
    for name in ("check_read", "check_write"):
        names = parameter_names(getattr(state, name))
        require(
            names
            in (
                ["self", "device_id", "local_core_id", "clock", "buffer_key", "rnge", "source_info"],
                ["self", "thread", "clock", "buffer_key", "rnge", "source_info"],
            ),
            f"RaceDetectionState.{name} takes ({', '.join(names)})",
        )
    interpreter = internals.interpreter
    require_attributes(interpreter, "DMA", "DmaState", "_shared_memory")
    require_attributes(interpreter.DmaState, "COMPLETED")
    dma_fields = {field.name for field in dataclasses.fields(interpreter.DMA)}
    require({"clock", "state"} <= dma_fields, "interpret_pallas_call.DMA has no clock/state")
    require_attributes(internals.shared_memory.SharedMemory, "num_cores")
    memory_fields = {field.name for field in dataclasses.fields(internals.shared_memory.SharedMemory)}
    require({"clocks", "lock"} <= memory_fields, "SharedMemory has no clocks/lock")


class _LiveClocks:
    """The vector clocks live in the current simulated memory: each core's and each uncompleted DMA's
    (every future access's clock is at least one of them; see ``_history_patches``)."""

    def __init__(self):
        self._interpreter = _internals().interpreter
        self._completed = self._interpreter.DmaState.COMPLETED
        # DMAs created since the last prune that may still access memory, with the id of the simulated
        # memory they were created in: a DMA of an earlier call that ended in an exception never completes,
        # and must not count as live in later calls (it would stop all pruning). Matching by id is safe: the
        # DMAs of the current memory always match (a live object's id is unique); a stale match only prunes
        # less.
        self._started: list[tuple[weakref.ref, int]] = []

    def dma_created(self, dma) -> None:
        self._started.append((weakref.ref(dma), id(self._interpreter._shared_memory)))

    def now(self) -> np.ndarray | None:
        """The live clocks, stacked; None where none can be pruned against (no memory, several cores)."""
        shared_memory = self._interpreter._shared_memory
        if shared_memory is None or shared_memory.num_cores != 1:
            return None
        with shared_memory.lock:
            clocks = shared_memory.clocks
            cores = list(clocks.values()) if isinstance(clocks, dict) else list(clocks)
            live = [_clock_array(clock).copy() for clock in cores]
        current = id(shared_memory)
        pending = [
            (dma, memory)
            for dma, memory in ((ref(), memory) for ref, memory in self._started)
            if dma is not None and dma.state != self._completed and memory == current
        ]
        self._started[:] = [(weakref.ref(dma), memory) for dma, memory in pending]
        live += [_clock_array(dma.clock).copy() for dma, _ in pending]
        if not live or len({clock.shape for clock in live}) != 1:
            return None
        return np.stack(live)


def _not_below_every_live_clock(entries: list, live: np.ndarray, position: int) -> list:
    """The history ``entries`` (clock at ``position``) that a later access may still race with."""
    if not entries:
        return entries
    clocks = np.stack([_clock_array(entry[position]) for entry in entries])[:, None, :]
    below_every_live = ((clocks <= live).all(-1) & (clocks != live).any(-1)).all(-1)
    return [entry for entry, prune in zip(entries, below_every_live, strict=True) if not prune]


def _prune(state, buffer_key, live_clocks: _LiveClocks, position: int) -> None:
    """Prune ``buffer_key``'s history in race detection ``state`` once it has reached its next size."""
    sizes = state.__dict__.setdefault("_interpret_compat_prune_at", {})
    count = len(state.reads[buffer_key]) + len(state.writes[buffer_key])
    if count < sizes.get(buffer_key, _PRUNE_FROM):
        return
    live = live_clocks.now()
    if live is None:
        sizes[buffer_key] = 2 * count
        return
    with state.lock:  # new lists: a check running concurrently keeps iterating over the old ones
        state.reads[buffer_key] = _not_below_every_live_clock(state.reads[buffer_key], live, position)
        state.writes[buffer_key] = _not_below_every_live_clock(state.writes[buffer_key], live, position)
        remaining = len(state.reads[buffer_key]) + len(state.writes[buffer_key])
    sizes[buffer_key] = max(_PRUNE_FROM, 2 * remaining)


def _pruning(check: Callable, live_clocks: _LiveClocks, position: int) -> Callable:
    """``RaceDetectionState.check_read`` or ``check_write``, pruning the history of the buffer it checked."""
    key_position = parameter_names(check).index("buffer_key") - 1  # after self

    @functools.wraps(check)
    def checked(self, *args, **kwargs):
        result = check(self, *args, **kwargs)
        buffer_key = kwargs["buffer_key"] if "buffer_key" in kwargs else args[key_position]
        _prune(self, buffer_key, live_clocks, position)
        return result

    return checked


def _history_patches() -> list[Patch]:
    """Drop from a buffer's race history the accesses that happened before every access still to come.

    Why this cannot hide a race: the detector reports a past access (clock ``e``) against a new one (clock
    ``x``) only when neither clock is below the other. Every future access's clock is at least, coordinate
    by coordinate, one of the clocks live now: a core's accesses use copies of its clock, which only grows
    (increments, and maxima at semaphore waits and barriers); a DMA's accesses use its own clock, copied
    from its core's at ``dma_start`` and then only incremented, so a DMA started later starts at or above
    its core's clock now and one already started (not yet completed) is itself live. So if ``e`` is below
    (<= everywhere, < somewhere) every live clock — each core's and each uncompleted DMA's — then ``e`` is
    below every future ``x`` and that access can never be reported again; dropping it changes no verdict.
    The live clocks are read in the interpreter's single thread: with more than one core (threads) a DMA
    could copy its clock between our reads, so histories are pruned only when the memory has one core.
    A buffer's history is pruned when it reaches ``_PRUNE_FROM`` accesses and then each time it doubles
    (amortised O(1) per access)."""
    internals = _internals()
    state_class = internals.races.RaceDetectionState
    dma_class = internals.interpreter.DMA
    live_clocks = _LiveClocks()
    position = _clock_position()
    original_init = dma_class.__init__

    @functools.wraps(original_init)
    def dma_init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        live_clocks.dma_created(self)

    return [
        Patch(dma_class, "__init__", dma_init),
        Patch(state_class, "check_read", _pruning(state_class.check_read, live_clocks, position)),
        Patch(state_class, "check_write", _pruning(state_class.check_write, live_clocks, position)),
    ]


# ---------------------------------------------------------------------------------------------------------
# Gap tpu-callback-arguments (a cost, not an error).


# How many of the TPU interpreter's callbacks (its loads, stores, DMAs, semaphore operations) have returned
# in this process: the sign that a long kernel call is still running, not stuck in a wait (``device.watchdog``).
_returned_callbacks = 0


def returned_callbacks() -> int:
    """The count of the TPU interpreter's callbacks that have returned so far (0 where this layer is off)."""
    return _returned_callbacks


@dataclasses.dataclass(frozen=True)
class _InterpreterCallback:
    """A callback the TPU interpreter makes: its arguments may reach it as NumPy arrays; each one that
    returns is counted (``returned_callbacks``).

    Equal when the wrapped functions are equal, as jax's own callback parameters are (jaxpr caching)."""

    function: Callable

    def __call__(self, *args, **kwargs):
        global _returned_callbacks
        result = self.function(*args, **kwargs)
        _returned_callbacks += 1  # a racy increment at worst misses a count; any change shows progress
        return result


class _MarkingCallbackModule(types.ModuleType):
    """Stands in for ``jax._src.callback`` inside the interpreter module: marks each ``io_callback``."""

    def __init__(self, module: types.ModuleType):
        super().__init__(module.__name__, module.__doc__)
        self._module = module

    def __getattr__(self, name: str):
        return getattr(self._module, name)

    def io_callback(self, function, *args, **kwargs):
        return self._module.io_callback(_InterpreterCallback(function), *args, **kwargs)


def _callback_module():
    from jax._src import callback

    return callback


def _callback_arguments_probe() -> bool:
    """Whether ``io_callback``'s implementation hands a callback something other than NumPy arrays."""
    callback = _callback_module()
    received = []

    def record(value):
        received.append(value)
        return ()

    flat = callback._FlatCallback(record, jax.tree_util.tree_structure(((0,), {})))
    callback.io_callback_impl(np.int32(1), result_avals=(), callback=flat, sharding=None, ordered=False)
    return not isinstance(received[0], np.ndarray)


def _callback_arguments_internals() -> None:
    callback = _callback_module()
    require_attributes(callback, "io_callback", "io_callback_impl", "io_callback_lowering", "_FlatCallback")
    require(
        parameter_names(callback.io_callback_impl)
        == ["args", "result_avals", "callback", "sharding", "ordered"],
        f"io_callback_impl takes ({', '.join(parameter_names(callback.io_callback_impl))})",
    )
    callback_fields = [field.name for field in dataclasses.fields(callback._FlatCallback)]
    require("callback_func" in callback_fields, f"_FlatCallback has fields {callback_fields}")
    nested = [
        const
        for const in callback.io_callback_lowering.__code__.co_consts
        if isinstance(const, types.CodeType)
    ]
    require(
        any("io_callback_impl" in code.co_names for code in nested),
        "io_callback_lowering's callback does not call io_callback_impl by its module name",
    )
    require(
        getattr(_internals().interpreter, "callback", None) is callback,
        "interpret_pallas_call does not call io_callback through jax._src.callback",
    )


def _callback_arguments_patches() -> list[Patch]:
    """Give the interpreter's callbacks NumPy copies of their arguments; every other callback is untouched.

    The interpreter's callbacks compute with NumPy and read scalars with ``int()``, so a jax array and a
    NumPy array of the same value are the same to them. The arguments arrive as read-only NumPy views of
    buffers XLA reuses in its next call: each is copied (``np.array``), so whatever the interpreter keeps
    (a stored block, an allocated buffer) owns its memory, as a device-put array did."""
    callback_module = _callback_module()
    original = callback_module.io_callback_impl

    @functools.wraps(original)
    def io_callback_impl(*args, result_avals, callback, sharding, ordered):
        if not isinstance(callback.callback_func, _InterpreterCallback):
            return original(
                *args, result_avals=result_avals, callback=callback, sharding=sharding, ordered=ordered
            )
        cpu_device, *_ = jax.local_devices(backend="cpu")
        with jax.default_device(cpu_device):
            try:
                return jax.tree_util.tree_map(np.asarray, callback(*(np.array(arg) for arg in args)))
            except BaseException:
                callback_module.logger.exception("jax.io_callback failed")
                raise

    return [
        Patch(callback_module, "io_callback_impl", io_callback_impl),
        Patch(_internals().interpreter, "callback", _MarkingCallbackModule(callback_module)),
    ]


# ---------------------------------------------------------------------------------------------------------
# Gap tpu-clock-order (a cost, not an error).


def _vector_clock_module():
    from jax._src.pallas.mosaic.interpret import vector_clock

    return vector_clock


def _ordered(x: np.ndarray, y: np.ndarray) -> bool:
    """Whether clock ``x`` is below ``y`` or ``y`` below ``x`` (below: <= everywhere, < somewhere).

    Two different clocks are ordered iff one is <= the other everywhere: "< somewhere" then follows from
    their being different; equal clocks are not ordered."""
    xs, ys = x.tolist(), y.tolist()
    if xs == ys:
        return False
    return all(a <= b for a, b in zip(xs, ys, strict=True)) or all(
        b <= a for a, b in zip(xs, ys, strict=True)
    )


def _clock_order_probe() -> bool:
    """Whether jax orders clocks with NumPy reductions (``.all()``/``.any()`` in its ``lt``)."""
    vector_clock = _vector_clock_module()
    lt = vector_clock.NpVectorClock.lt if hasattr(vector_clock, "NpVectorClock") else vector_clock.lt
    return {"all", "any"} <= set(lt.__code__.co_names)


def _clock_order_internals() -> None:
    vector_clock = _vector_clock_module()
    if hasattr(vector_clock, "NpVectorClock"):
        require_parameters(vector_clock.NpVectorClock.ordered, ["self", "other"], "NpVectorClock.ordered")
        clock = vector_clock.NpVectorClock(2)
        require(isinstance(getattr(clock, "clock", None), np.ndarray), "NpVectorClock keeps no .clock array")
    else:
        require_attributes(vector_clock, "ordered", "make_vector_clock")
        require_parameters(vector_clock.ordered, ["x", "y"], "vector_clock.ordered")
        require(
            isinstance(vector_clock.make_vector_clock(2), np.ndarray), "vector clocks are not NumPy arrays"
        )
    require(
        getattr(_internals().races, "vc", None) is vector_clock,
        "race_detection_state does not reach the vector clocks as module vc",
    )


def _clock_order_patches() -> list[Patch]:
    vector_clock = _vector_clock_module()
    if hasattr(vector_clock, "NpVectorClock"):

        def ordered(self, other) -> bool:
            return _ordered(self.clock, other.clock)

        return [Patch(vector_clock.NpVectorClock, "ordered", ordered)]
    return [Patch(vector_clock, "ordered", _ordered)]


# ---------------------------------------------------------------------------------------------------------
# Gap tpu-deadlock (a missing check).

DEADLOCK_MESSAGE = "DEADLOCK:"
"""How the deadlock check's error starts (the harness finds it in the error a kernel call raises)."""

_WAITING = "_interpret_compat_waiting"
"""The Semaphore attribute holding (value, global core id, has_tasks, logging_info) while its ``wait`` runs."""


class _FakeSharedMemory:
    """Just enough of ``SharedMemory`` for one semaphore on one core; ``check_failed`` ends a looping wait."""

    num_cores = 1
    detect_races = False
    dma_execution_mode = "on_wait"

    def __init__(self):
        self.turns = 0

    def check_failed(self):
        self.turns += 1
        if self.turns > 1:
            raise _StillWaiting

    def get_global_core_id(self, device_id, local_core_id):
        return 0

    def global_core_id_to_thread(self, global_core_id):
        return (0, 0)


class _StillWaiting(Exception):
    """The probe's wait went round its loop again: nothing stopped it."""


def _semaphore_class():
    return _internals().shared_memory.Semaphore


def _deadlock_probe() -> bool:
    """Whether a wait nothing can signal (count 0, no task, one core) goes round its loop instead of raising."""
    semaphore = _semaphore_class()(_FakeSharedMemory(), 0)
    try:
        semaphore.wait(1, 0)
    except _StillWaiting:
        return True
    except RuntimeError as error:
        return DEADLOCK_MESSAGE not in str(error) and "deadlock" not in str(error).lower()
    return False


def _deadlock_internals() -> None:
    semaphore_class = _semaphore_class()
    require_parameters(
        semaphore_class.__init__, ["self", "shared_memory", "semaphore_id"], "Semaphore.__init__"
    )
    require_parameters(semaphore_class.wait, ["self", "value", "global_core_id"], "Semaphore.wait")
    require(
        {"has_tasks", "logging_info"} <= set(parameter_names(semaphore_class.wait)),
        f"Semaphore.wait takes ({', '.join(parameter_names(semaphore_class.wait))})",
    )
    semaphore = semaphore_class(_FakeSharedMemory(), 0)
    for name in ("cv", "count_by_core", "tasks", "id", "shared_memory"):
        require(hasattr(semaphore, name), f"Semaphore has no {name}")
    require(isinstance(semaphore.cv, threading.Condition), "Semaphore.cv is not a threading.Condition")
    require(
        "cv" in semaphore_class.wait.__code__.co_names and "tasks" in semaphore_class.wait.__code__.co_names,
        "Semaphore.wait no longer sleeps on self.cv while its tasks are empty",
    )


class _DeadlockCheckingCondition(threading.Condition):
    """A semaphore's condition variable that refuses to sleep when nothing can ever wake its waiter.

    ``Semaphore.wait`` sleeps on it only when its count is short and no DMA in flight will signal it; with
    one core (one thread: nothing else runs while the kernel waits) that state can never change."""

    def __init__(self, semaphore):
        super().__init__()
        self._semaphore = weakref.ref(semaphore)

    def wait(self, timeout=None):
        semaphore = self._semaphore()
        waiting = None if semaphore is None else semaphore.__dict__.get(_WAITING)
        if waiting is not None and semaphore.shared_memory.num_cores == 1:
            value, core, has_tasks, logging_info = waiting
            count = int(semaphore.count_by_core[core])
            if count < value and not semaphore.tasks[core]:
                what = "a DMA wait" if has_tasks else "a semaphore wait"
                needs = f"{value} (bytes)" if has_tasks else f"{value}"
                raise RuntimeError(
                    f"{DEADLOCK_MESSAGE} {what} at {_kernel_line(logging_info)} needs {needs}, its semaphore's "
                    f"count is {count} and no DMA in flight will signal it: the kernel would wait forever"
                )
        return super().wait(timeout)


def _kernel_line(logging_info) -> str:
    """``file.py:line (function)`` of the kernel's wait: the file's name only, so that the message is the
    same wherever the kernel is installed (a replay compares it with the recorded one)."""
    from jax._src import source_info_util

    source_info = getattr(logging_info, "source_info", None)
    frame = None if source_info is None else source_info_util.user_frame(source_info.traceback)
    if frame is None:
        return "an unknown kernel line"
    return f"{os.path.basename(frame.file_name)}:{frame.start_line} ({frame.function_name})"


def _deadlock_patches() -> list[Patch]:
    semaphore_class = _semaphore_class()
    original_init, original_wait = semaphore_class.__init__, semaphore_class.wait

    @functools.wraps(original_init)
    def init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        self.cv = _DeadlockCheckingCondition(self)

    @functools.wraps(original_wait)
    def wait(self, value, global_core_id, *args, has_tasks=False, logging_info=None, **kwargs):
        self.__dict__[_WAITING] = (int(value), int(global_core_id), has_tasks, logging_info)
        try:
            return original_wait(
                self, value, global_core_id, *args, has_tasks=has_tasks, logging_info=logging_info, **kwargs
            )
        finally:
            self.__dict__.pop(_WAITING, None)

    return [Patch(semaphore_class, "__init__", init), Patch(semaphore_class, "wait", wait)]


# ---------------------------------------------------------------------------------------------------------
# Gap tpu-empty-copy-at-end (a false out-of-bounds read).


def _empty_copy_probe() -> bool:
    """Whether the unpatched clip takes an empty slice at a dimension's end for out of bounds."""
    return _internals().utils.clip_range_to_shape((slice(4, 4, 1),), (4,)) is None


def _empty_copy_internals() -> None:
    internals = _internals()
    require_parameters(internals.utils.clip_range_to_shape, ["rnge", "shape"], "clip_range_to_shape")
    require(
        getattr(internals.shared_memory, "interpret_utils", None) is internals.utils,
        "shared_memory does not reach clip_range_to_shape through module interpret_utils",
    )


def _empty_copy_patches() -> list[Patch]:
    utils = _internals().utils
    original = utils.clip_range_to_shape

    def clip_range_to_shape(rnge, shape):
        """jax's clip, with an empty slice that starts at its dimension's end taken as in bounds."""
        rnge = tuple(
            slice(0, 0, r.step) if isinstance(r, slice) and r.start == size and r.stop <= r.start else r
            for r, size in zip(rnge, shape, strict=True)
        )
        return original(rnge, shape)

    return [Patch(utils, "clip_range_to_shape", clip_range_to_shape)]


# ---------------------------------------------------------------------------------------------------------
# Gap tpu-wait-for-nothing (a wait for no elements on a semaphore never signalled).


class _RaceDetectingSharedMemory(_FakeSharedMemory):
    detect_races = True
    enable_logging = False


def _wait_for_nothing_probe() -> bool:
    """Whether a wait for 0 on a semaphore nothing has signalled fails with race detection on."""
    semaphore = _semaphore_class()(_RaceDetectingSharedMemory(), 0)
    try:
        semaphore.wait(0, 0)
    except AssertionError:
        return True
    return False


def _wait_for_nothing_internals() -> None:
    semaphore_class = _semaphore_class()
    require_parameters(semaphore_class.wait, ["self", "value", "global_core_id"], "Semaphore.wait")
    semaphore = semaphore_class(_RaceDetectingSharedMemory(), 0)
    require(
        getattr(semaphore, "clocks", None) == [None],
        "a race-detecting Semaphore no longer starts with one clock per core, None until signalled",
    )


def _wait_for_nothing_patches() -> list[Patch]:
    semaphore_class = _semaphore_class()
    original_wait = semaphore_class.wait

    @functools.wraps(original_wait)
    def wait(self, value, global_core_id, *args, **kwargs):
        if int(value) == 0 and self.detect_races and self.clocks[int(global_core_id)] is None:
            return None
        return original_wait(self, value, global_core_id, *args, **kwargs)

    return [Patch(semaphore_class, "wait", wait)]


# ---------------------------------------------------------------------------------------------------------
# Gap tpu-empty-access-race (an access of no elements taken for a race).


def _empty_access_probe() -> bool:
    """Whether the unpatched detector has an empty slice overlap a slice that holds its start."""
    return bool(_internals().races._slices_overlap(slice(0, 0, 1), slice(0, 8, 1)))


def _empty_access_internals() -> None:
    races = _internals().races
    require_parameters(races._slices_overlap, ["slice_or_idx1", "slice_or_idx2"], "_slices_overlap")
    code = races._ranges_overlap.__code__
    names = set(code.co_names).union(*(c.co_names for c in code.co_consts if isinstance(c, types.CodeType)))
    require(
        "_slices_overlap" in names,
        "_ranges_overlap no longer compares ranges slice by slice through _slices_overlap",
    )


def _is_empty_range(slice_or_index) -> bool:
    """A slice of known bounds with no elements (an index, or a whole axis, is never empty here)."""
    return (
        isinstance(slice_or_index, slice)
        and slice_or_index.start is not None
        and slice_or_index.stop is not None
        and int(slice_or_index.stop) <= int(slice_or_index.start)
    )


def _empty_access_patches() -> list[Patch]:
    races = _internals().races
    original = races._slices_overlap

    def slices_overlap(slice_or_idx1, slice_or_idx2):
        """jax's overlap test, with an empty slice overlapping nothing."""
        if _is_empty_range(slice_or_idx1) or _is_empty_range(slice_or_idx2):
            return False
        return original(slice_or_idx1, slice_or_idx2)

    return [Patch(races, "_slices_overlap", slices_overlap)]


# ---------------------------------------------------------------------------------------------------------
# Gap tpu-exit-state (a missing check).

WOULD_HALT_MESSAGE = "WOULD HALT A TPU:"
"""How the exit check's error starts (the harness finds it in the error a kernel call raises)."""

_LISTED_AT_EXIT = 3
"""How many kinds of unfinished work (DMAs from one line on one semaphore, a semaphore's count) the exit
check's error names (then how many more)."""


@contextlib.contextmanager
def _probe_shared_memory():
    """The interpreter's shared memory for one device of one core, fresh, while the block runs; the
    interpreter's own state (a call's, or none) is put back after it."""
    from jax.experimental.pallas import tpu as pltpu

    interpreter = _internals().interpreter
    names = ("_shared_memory", "races", "dma_id_counter")
    saved = {name: getattr(interpreter, name) for name in names}
    interpreter._shared_memory = None
    try:
        interpreter._initialize_shared_memory(np.int32(0), 0, 1, 1, interpret_params=pltpu.InterpretParams())
        yield interpreter._get_shared_memory()
    finally:
        for name, value in saved.items():
            setattr(interpreter, name, value)


def _exit_check_raises(leave: Callable) -> bool:
    """Whether the interpreter's exit check (``_validate``) raises once ``leave(shared_memory, semaphore)``
    has left one semaphore of a fresh shared memory as a kernel could end with it (its print hushed)."""
    interpreter = _internals().interpreter
    with _probe_shared_memory() as shared_memory:
        semaphore_id = shared_memory.allocate_semaphores(0, 1)
        leave(shared_memory, semaphore_id)
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                interpreter._validate(np.int32(0), 0)
        except Exception:  # noqa: BLE001 - any error at exit is the check jax lacks
            return True
    return False


def _leave_a_copy_unwaited(shared_memory, semaphore_id: int) -> None:
    shared_memory.append_semaphore_task(semaphore_id, 0, lambda: None)


def _leave_a_count(shared_memory, semaphore_id: int) -> None:
    shared_memory.sem[semaphore_id].signal(4, 0, clock=None)


def _exit_state_probe() -> bool:
    """Whether the unpatched interpreter lets a kernel end with a DMA never waited (a task still queued on
    its semaphore: in ``on_wait`` mode a DMA runs at its wait) or with a semaphore count left, without
    raising (jax prints the count, and only the count)."""
    return not (_exit_check_raises(_leave_a_copy_unwaited) and _exit_check_raises(_leave_a_count))


def _exit_state_internals() -> None:
    interpreter = _internals().interpreter
    require_attributes(
        interpreter,
        "_validate",
        "fail_on_exception",
        "_initialize_shared_memory",
        "_get_shared_memory",
        "_shared_memory",
        "races",
        "dma_id_counter",
        "dma_start",
        "DMA",
    )
    require(hasattr(interpreter._validate, "__wrapped__"), "_validate is not a fail_on_exception wrapper")
    require_parameters(interpreter._validate.__wrapped__, ["token", "device_id"], "_validate")
    dma_start = inspect.unwrap(interpreter.dma_start)
    require(
        {"append_semaphore_task", "execute_read_and_write"} <= set(dma_start.__code__.co_names),
        "dma_start no longer queues a started DMA's execute_read_and_write on its semaphore",
    )
    dma_fields = {field.name for field in dataclasses.fields(interpreter.DMA)}
    require(
        {"source_info", "dst_transforms"} <= dma_fields,
        f"a DMA no longer keeps the source_info of its start and its dst_transforms (fields {sorted(dma_fields)})",
    )
    require_attributes(_internals().indexing.NDIndexer, "get_indexer_shape")
    from jax._src import source_info_util

    require_attributes(source_info_util, "raw_frame_to_frame", "is_user_filename")
    with _probe_shared_memory() as shared_memory:
        for name in ("sem", "fixed_id_sem", "lock", "num_devices"):
            require(hasattr(shared_memory, name), f"SharedMemory has no {name}")
        require_attributes(
            shared_memory, "get_global_core_ids", "allocate_semaphores", "append_semaphore_task"
        )
        semaphore = shared_memory.sem[shared_memory.allocate_semaphores(0, 1)]
        for name in ("tasks", "count_by_core", "cv", "id", "signal"):
            require(hasattr(semaphore, name), f"Semaphore has no {name}")


def _started_at(source_info) -> str:
    """Where a DMA was started: the kernel's innermost frame and, in the same file, its caller
    (``kernel.py:65 (MultiPageAsyncCopyDescriptor.start), from line 409 (prefetch_first_kv_blk)``); file
    names only, so that the message is the same wherever the kernel is installed."""
    from jax._src import source_info_util

    traceback = getattr(source_info, "traceback", None)
    if traceback is None:
        return "an unknown kernel line"
    code, lasti = traceback.raw_frames()
    frames = [
        source_info_util.raw_frame_to_frame(code[i], lasti[i])
        for i in range(len(code))
        if _is_kernel_file(code[i].co_filename)
    ]
    if not frames:
        return "an unknown kernel line"
    innermost, *outer = frames
    where = f"{os.path.basename(innermost.file_name)}:{innermost.start_line} ({_short_name(innermost)})"
    if outer and outer[0].file_name == innermost.file_name:
        where += f", from line {outer[0].start_line} ({_short_name(outer[0])})"
    return where


def _short_name(frame) -> str:
    """A frame's function as the kernel's source names it: its qualified name past the last enclosing
    function (``prefetch_first_kv_blk``, not ``ragged_paged_attention_kernel.<locals>.prefetch_first_kv_blk``)."""
    return frame.function_name.rsplit(".<locals>.", 1)[-1]


def _is_kernel_file(file_name: str) -> bool:
    """A kernel's source (the user's code, or a kernel jax ships under ``pallas/ops``), not jax's internals
    or Python's."""
    from jax._src import source_info_util

    return source_info_util.is_user_filename(file_name) or f"{os.sep}pallas{os.sep}ops{os.sep}" in file_name


def _unfinished_at_exit(shared_memory, device_id: int) -> list[str]:
    """What a kernel left unfinished on ``device_id``'s cores, alike ones counted together: DMAs started
    and never waited (their tasks still queued on the semaphore they signal), and each semaphore whose
    count is not back at 0."""
    cores = shared_memory.get_global_core_ids(device_id)
    with shared_memory.lock:
        semaphores = [*shared_memory.sem.values(), *shared_memory.fixed_id_sem.values()]
    unwaited: collections.Counter = collections.Counter()  # (where started, semaphore) -> DMAs
    counts = []
    for semaphore in semaphores:
        with semaphore.cv:
            for core in cores:
                on = f"semaphore {semaphore.id}" + (f", core {core}" if len(cores) > 1 else "")
                for task in semaphore.tasks[core]:
                    dma = getattr(task, "__self__", None)
                    if dma is not None and _copies_no_elements(dma):
                        continue
                    unwaited[(None if dma is None else _started_at(dma.source_info), on)] += 1
                if count := int(semaphore.count_by_core[core]):
                    counts.append(f"{on} at count {count}, not 0")
    return [f"{_tasks(number, where)} ({on})" for (where, on), number in unwaited.items()] + counts


def _copies_no_elements(dma) -> bool:
    """Whether a DMA copies no elements (an empty slice of its destination). Its wait needs 0 bytes, which
    the semaphore has at once, so the interpreter never runs it, waited for or not: it is left out."""
    indexer = _internals().indexing.NDIndexer
    return any(
        isinstance(transform, indexer) and 0 in tuple(transform.get_indexer_shape())
        for transform in dma.dst_transforms
    )


def _tasks(number: int, started_at: str | None) -> str:
    """``number`` unfinished tasks of a semaphore in words: DMAs started at a line, else tasks."""
    if started_at is None:
        return f"{number} queued task{'s' * (number > 1)} that never ran"
    return f"{'a DMA' if number == 1 else f'{number} DMAs'} started at {started_at} and never waited"


def _exit_state_patches() -> list[Patch]:
    interpreter = _internals().interpreter
    original = interpreter._validate

    def check_exit_state(token, device_id):
        """jax's exit check, raising where a TPU would halt (``fail_on_exception`` then ends the call as any
        failed callback does, its shared memory cleared). With one device only: another device's clean-up
        barrier would wait forever for this one (jax's own reason to print instead)."""
        shared_memory = interpreter._get_shared_memory()
        if shared_memory.num_devices == 1:
            unfinished = _unfinished_at_exit(shared_memory, int(device_id))
            if unfinished:
                more = len(unfinished) - _LISTED_AT_EXIT
                listed = "; ".join(unfinished[:_LISTED_AT_EXIT]) + (f"; and {more} more" if more > 0 else "")
                raise RuntimeError(
                    f"{WOULD_HALT_MESSAGE} it ends with {listed}; a TPU needs every DMA a kernel starts "
                    "waited and every semaphore back at 0 when it ends"
                )
        return original(token, device_id)

    return [Patch(interpreter, "_validate", interpreter.fail_on_exception(check_exit_state))]


GAPS = patching.gap_table(
    "tpu",
    # (name, symptom, probe, check_internals, patches), in the order install() applies them: a later
    # gap's patch may wrap an earlier one's
    ("tpu-ref-views", "ref.reshape/ref.bitcast: 'ReshapeTransform' object has no attribute 'indices'",
     _views_probe, _views_internals, _view_patches),
    ("tpu-masked-swap", "a valid mask on a ref whose later axes are shorter than axis 0: 'Out-of-bounds masked swap'",
     _masked_swap_probe, _masked_swap_internals, _masked_swap_patches),
    ("tpu-race-history", "race detection keeps every access, so each access is checked against all earlier ones (slow)",
     _history_probe, _history_internals, _history_patches),
    ("tpu-callback-arguments", "each interpreter callback puts its arguments on the CPU device as jax arrays first (slow)",
     _callback_arguments_probe, _callback_arguments_internals, _callback_arguments_patches),
    ("tpu-clock-order", "race detection orders two vector clocks with four NumPy reductions per earlier access (slow)",
     _clock_order_probe, _clock_order_internals, _clock_order_patches),
    ("tpu-deadlock", "a wait nothing can signal (one core, no DMA in flight) loops forever: only a watchdog ends it",
     _deadlock_probe, _deadlock_internals, _deadlock_patches),
    ("tpu-empty-copy-at-end", "a DMA of no elements from the end of its source is reported as an out-of-bounds read",
     _empty_copy_probe, _empty_copy_internals, _empty_copy_patches),
    ("tpu-wait-for-nothing", "with race detection, a wait for a copy of no elements on a semaphore never signalled fails an assertion",
     _wait_for_nothing_probe, _wait_for_nothing_internals, _wait_for_nothing_patches),
    ("tpu-empty-access-race", "with race detection, an access of no elements is reported as racing with one around its start",
     _empty_access_probe, _empty_access_internals, _empty_access_patches),
    ("tpu-exit-state", "a kernel may end with a DMA never waited or a semaphore count left: jax prints a count at most",
     _exit_state_probe, _exit_state_internals, _exit_state_patches),
)  # fmt: skip
(
    REF_VIEWS,
    MASKED_SWAP,
    RACE_HISTORY,
    CALLBACK_ARGUMENTS,
    CLOCK_ORDER,
    DEADLOCK,
    EMPTY_COPY_AT_END,
    WAIT_FOR_NOTHING,
    EMPTY_ACCESS_RACE,
    EXIT_STATE,
) = GAPS
