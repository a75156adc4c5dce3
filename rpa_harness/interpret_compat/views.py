"""Views on NumPy values: what a reshape / bitcast / indexer chain reads, and how a write goes back through it.

Pure NumPy. The transforms are jax's ``NDIndexer``, ``ReshapeTransform`` and ``BitcastTransform`` (their
classes are looked up on first use, so importing this module imports no private jax module).

Bitcast layout (verified): a ref bitcast that changes the element width packs along the *second-minor*
axis, as on TPU memory: bf16 ``[2n, m]`` -> uint32 ``[n, m]`` where word ``(i, j)`` holds row ``2i`` in
bits 0-15 and row ``2i + 1`` in bits 16-31 (fp8 -> uint32: rows ``4i .. 4i + 3`` in bytes 0..3). This is
what (a) upstream's ``strided_load_kv`` relies on (``b << 16`` yields the even, K rows), (b) jax's own
``jax._src.state.utils.bitcast`` ("only valid on TPU") and the value-level ``pltpu.bitcast`` lowering
compute, and (c) ``tests/unit/test_interpret_compat.py`` checks with explicit bit arithmetic. It is *not*
numpy's ``view`` on the last axis.
"""

from __future__ import annotations

import functools

import jax
import numpy as np


@functools.cache
def transform_classes() -> tuple[type, type, type]:
    """(NDIndexer, ReshapeTransform, BitcastTransform) of the running jax."""
    from jax._src.state import indexing, types

    return indexing.NDIndexer, types.ReshapeTransform, types.BitcastTransform


def is_view(transform) -> bool:
    """Whether ``transform`` is a reshape or a bitcast (a view), as opposed to an indexer."""
    _, reshape, bitcast = transform_classes()
    return isinstance(transform, (reshape, bitcast))


def is_indexer(transform) -> bool:
    return isinstance(transform, transform_classes()[0])


def is_reshape(transform) -> bool:
    return isinstance(transform, transform_classes()[1])


def is_bitcast(transform) -> bool:
    return isinstance(transform, transform_classes()[2])


def split_at_first_view(transforms) -> tuple[tuple, tuple]:
    """(leading indexers, rest starting at the first reshape/bitcast); rest is empty without views."""
    transforms = tuple(transforms or ())
    for position, transform in enumerate(transforms):
        if is_view(transform):
            return transforms[:position], transforms[position:]
    return transforms, ()


def _bit_width(dtype) -> int:
    bits = jax.dtypes.itemsize_bits(dtype)
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


def numpy_index(indexer) -> tuple[int | slice, ...]:
    """An ``NDIndexer`` with concrete integer entries as a NumPy basic index."""
    return tuple(
        index
        if isinstance(index, int)
        else slice(index.start, index.start + index.size * index.stride, index.stride)
        for index in indexer.indices
    )


def _index_extents(indexer) -> list[tuple[int, int] | None]:
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


def _is_out_of_bounds(indexer, shape: tuple[int, ...]) -> bool:
    return any(
        extent is not None and (extent[0] < 0 or extent[1] >= size)
        for extent, size in zip(_index_extents(indexer), shape, strict=True)
    )


def _index_padded(value: np.ndarray, indexer, fill) -> np.ndarray:
    """Index ``value``, reading ``fill`` wherever the indexer leaves its bounds."""
    padding: list[tuple[int, int]] = []
    shifted: list[int | slice] = []
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
    if is_reshape(transform):
        return value.reshape(transform.shape)
    if is_bitcast(transform):
        return tpu_bitcast(value, transform.dtype)
    return value[numpy_index(transform)]


class ViewOutOfBounds(Exception):
    """An indexer after a reshape/bitcast leaves the bounds of the view it indexes."""

    def __init__(self, indexer, view_shape: tuple[int, ...]):
        super().__init__(indexer, view_shape)
        self.indexer = indexer
        self.view_shape = view_shape


def read_view(region: np.ndarray, views: tuple, *, fill=None) -> np.ndarray:
    """Apply ``views`` to ``region``; out-of-bounds indexing raises, or reads ``fill`` when one is given."""
    value = region
    for transform in views:
        if is_indexer(transform) and _is_out_of_bounds(transform, value.shape):
            if fill is None:
                raise ViewOutOfBounds(transform, value.shape)
            value = _index_padded(value, transform, fill)
        else:
            value = _view_once(value, transform)
    return value


def write_view(region: np.ndarray, views: tuple, new_value: np.ndarray) -> np.ndarray:
    """A copy of ``region`` with ``new_value`` written through ``views``."""
    stages = [region]
    for transform in views:
        if is_indexer(transform) and _is_out_of_bounds(transform, stages[-1].shape):
            raise ViewOutOfBounds(transform, stages[-1].shape)
        stages.append(_view_once(stages[-1], transform))
    written = np.asarray(new_value, dtype=stages[-1].dtype).reshape(stages[-1].shape)
    for transform, before in zip(reversed(views), reversed(stages[:-1]), strict=True):
        if is_reshape(transform):
            written = written.reshape(before.shape)
        elif is_bitcast(transform):
            written = tpu_bitcast(written, before.dtype)
        else:
            updated = before.copy()
            updated[numpy_index(transform)] = written
            written = updated
    return written


def _view_key(transform) -> tuple:
    """A hashable description of ``transform`` (concrete sizes, as Python ints)."""
    if is_reshape(transform):
        return ("reshape", tuple(int(size) for size in transform.shape))
    if is_bitcast(transform):
        return ("bitcast", _bit_width(transform.dtype))
    return (
        "index",
        tuple(
            (int(part.start), int(part.stop), int(part.step)) if isinstance(part, slice) else int(part)
            for part in numpy_index(transform)
        ),
    )


def touched_box(region_shape: tuple[int, ...], region_dtype, views: tuple) -> tuple[slice, ...] | None:
    """The smallest box of ``region`` that holds every element an access through ``views`` touches (an
    empty box, ``slice(0, 0)`` on every axis, for an access of no elements), or None when that is the whole
    region (or the views leave its bounds, which the access itself reports)."""
    key = tuple(_view_key(transform) for transform in views)
    return _touched_box(tuple(region_shape), _bit_width(region_dtype), key)


@functools.lru_cache(maxsize=4096)
def _touched_box(region_shape: tuple[int, ...], region_bits: int, views: tuple) -> tuple[slice, ...] | None:
    # Each view element carries the ids (flat positions in the region) of the region elements it covers, in
    # a trailing axis: a wider bitcast element covers several narrower ones.
    ids = np.arange(int(np.prod(region_shape)), dtype=np.int64).reshape(*region_shape, 1)
    bits = region_bits
    for kind, argument in views:
        if kind == "reshape":
            ids = ids.reshape(*argument, ids.shape[-1])
        elif kind == "index":
            index = tuple(slice(*part) if isinstance(part, tuple) else part for part in argument)
            view_shape = ids.shape[:-1]
            if any(
                isinstance(part, int) and not 0 <= part < size
                for part, size in zip(index, view_shape, strict=False)
            ):
                return None
            ids = ids[index]
        else:
            source_bits, target_bits = bits, argument
            if source_bits < target_bits:
                packing = target_bits // source_bits
                *leading, rows, cols, covered = ids.shape
                if rows % packing:
                    return None
                grouped = ids.reshape(*leading, rows // packing, packing, cols, covered)
                ids = np.moveaxis(grouped, -3, -2).reshape(*leading, rows // packing, cols, packing * covered)
            elif source_bits > target_bits:
                ids = np.repeat(ids, source_bits // target_bits, axis=-3)
            bits = target_bits
    if ids.size == 0:
        return tuple(slice(0, 0) for _ in region_shape)
    positions = np.unravel_index(ids.ravel(), region_shape)
    box = tuple(slice(int(axis.min()), int(axis.max()) + 1) for axis in positions)
    if all(part.stop - part.start == size for part, size in zip(box, region_shape, strict=True)):
        return None
    return box
