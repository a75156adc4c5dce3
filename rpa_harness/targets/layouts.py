"""Paged-KV layout converters: upstream jax's interface to the layouts other RPA kernels take.

The harness calls every target as upstream's ``ragged_paged_attention(q, kv_pages, kv_lens, page_indices,
cu_q_lens, num_seqs, **options)``: one cache ``[pages, page_size, 2 * kv_heads, head_dim]`` with K and V
interleaved on axis 2 (K at ``0::2``, V at ``1::2``), a 2-D page table ``[max_num_seqs, pages_per_seq]``,
and only the first ``num_seqs`` sequences live. Kernels with another paged-KV API differ in a few recurring
ways, each converted here both ways, so that their adapter is a signature mapping:

- separate K and V caches: ``split_kv`` / ``combine_kv``;
- a flat page list instead of a table (per-sequence page offsets, or page-aligned cumulative kv lengths):
  ``flat_page_list`` / ``page_table_from_flat``;
- tpu-inference v3's cache packed into 32-bit words: ``values_per_word``, ``pack_cache`` / ``unpack_cache``;
  its head_dim-64 kernel's, each head's K and V side by side in one 128-lane row: ``pack_cache_side_by_side``;
- the new tokens' keys and values as separate inputs that the kernel writes into the cache:
  ``split_new_tokens`` (and ``NewTokens.poisoned_cache``).

For example, a kernel taking separate caches and a padded flat page list:

    def ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options):
        k_pages, v_pages = layouts.split_kv(kv_pages)
        flat = layouts.flat_page_list(
            page_indices, kv_lens, num_seqs, page_size=kv_pages.shape[1], pad_to=np.size(page_indices)
        )
        return my_kernel(q, k_pages, v_pages, flat.pages, flat.page_offsets, cu_q_lens, num_seqs, **options)

Everything is NumPy on the host: inputs are whatever ``np.asarray`` takes (the harness passes concrete
jax arrays), outputs are new NumPy arrays that never alias the inputs. A malformed argument raises
``LayoutError`` (a ``ValueError``) naming the function, the argument, its value and what to pass instead,
before any work. ``flat_page_list`` requires valid live metadata (it cannot list pages of a negative or
over-long sequence) unless told to ``clip`` it, for an adapter whose kernel raises its own validators'
errors; ``split_new_tokens`` tolerates invalid metadata, as v3's target must.
"""

import dataclasses
import numbers

import numpy as np

from rpa_harness.spec.interface import values_per_word

__all__ = [  # what an adapter imports (docs/targets.md)
    "LANES",
    "UPSTREAM_CACHE",
    "LayoutError",
    "split_kv",
    "combine_kv",
    "FlatPages",
    "flat_page_list",
    "page_table_from_flat",
    "pack_cache",
    "pack_cache_side_by_side",
    "unpack_cache",
    "NewTokens",
    "split_new_tokens",
    "distribution",
    "pad_lanes",
    "unpad_lanes",
    "values_per_word",
]

INT32 = np.iinfo(np.int32)
LANES = 128  # v3 pads head_dim to a whole number of TPU lanes
UPSTREAM_CACHE = "[pages, page_size, 2 * kv_heads, head_dim]"  # K at 0::2 and V at 1::2 of axis 2


class LayoutError(ValueError):
    """A converter's argument is malformed. A ``ValueError``, so that it reads as bad input; its own class,
    so that an adapter can tell its own misuse from the ``ValueError`` a kernel's validators raise."""


def _align(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _array(function: str, name: str, value, ndim: int, layout: str) -> np.ndarray:
    array = np.asarray(value)
    if array.ndim != ndim:
        raise LayoutError(
            f"{function}: {name} has shape {array.shape} ({array.ndim}-D); pass a {ndim}-D array {layout}"
        )
    return array


def _integer_array(function: str, name: str, value, ndim: int, layout: str) -> np.ndarray:
    """An integer array of ``ndim`` dimensions, as int64 (no range check)."""
    array = _array(function, name, value, ndim, layout)
    if array.dtype.kind not in "iu":
        raise LayoutError(
            f"{function}: {name} has dtype {array.dtype}; page indices and lengths are integers: pass an "
            f"int32 array ({layout})"
        )
    return array.astype(np.int64)


def _index_array(function: str, name: str, value, ndim: int, layout: str) -> np.ndarray:
    """An integer array of ``ndim`` dimensions, as int32 (what kernels take for indices and lengths)."""
    array = _integer_array(function, name, value, ndim, layout)
    if array.size and (array.min() < INT32.min or array.max() > INT32.max):
        raise LayoutError(
            f"{function}: {name} holds {int(array.min())}..{int(array.max())}, outside int32; pass int32 values"
        )
    return array.astype(np.int32)


def _is_integer(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _count(function: str, name: str, value, *, minimum: int) -> int:
    if not _is_integer(value) or value < minimum:
        raise LayoutError(f"{function}: {name}={value!r}; pass an integer >= {minimum}")
    return int(value)


def _int32(function: str, name: str, value) -> int:
    if not _is_integer(value) or not INT32.min <= value <= INT32.max:
        raise LayoutError(f"{function}: {name}={value!r}; pass an integer that fits in int32")
    return int(value)


def _num_seqs(function: str, num_seqs, max_num_seqs: int, *, clip: bool = False) -> int:
    """Upstream's ``num_seqs`` (int32 ``[1]``) or a plain integer, within ``[0, max_num_seqs]`` (or clipped
    to it)."""
    array = np.asarray(num_seqs)
    if array.size != 1 or array.dtype.kind not in "iu":
        raise LayoutError(
            f"{function}: num_seqs={num_seqs!r} (shape {array.shape}, dtype {array.dtype}); pass one integer, "
            "e.g. upstream's int32 array of shape [1]"
        )
    n = int(array.reshape(-1)[0])
    if clip:
        return min(max(n, 0), max_num_seqs)
    if not 0 <= n <= max_num_seqs:
        raise LayoutError(
            f"{function}: num_seqs={n} is outside [0, max_num_seqs={max_num_seqs}] (the page table's rows); "
            "pass the number of live sequences"
        )
    return n


def _cumulative(counts: np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])


# ---- K and V: one interleaved cache, or two ----


def split_kv(kv_pages) -> tuple[np.ndarray, np.ndarray]:
    """Upstream's interleaved cache as ``(k_pages, v_pages)``, each ``[pages, page_size, kv_heads, head_dim]``
    and contiguous (as a kernel taking two caches expects them)."""
    kv_pages = _array("split_kv", "kv_pages", kv_pages, 4, UPSTREAM_CACHE)
    if kv_pages.shape[2] % 2:
        raise LayoutError(
            f"split_kv: kv_pages has shape {kv_pages.shape}: {kv_pages.shape[2]} heads on axis 2, an odd "
            "number; upstream's cache interleaves K and V there (2 * kv_heads): pass that layout"
        )
    return kv_pages[:, :, 0::2].copy(), kv_pages[:, :, 1::2].copy()


def combine_kv(k_pages, v_pages) -> np.ndarray:
    """Two caches ``[pages, page_size, kv_heads, head_dim]`` as upstream's interleaved one: the inverse of
    ``split_kv``."""
    layout = "[pages, page_size, kv_heads, head_dim]"
    k_pages = _array("combine_kv", "k_pages", k_pages, 4, layout)
    v_pages = _array("combine_kv", "v_pages", v_pages, 4, layout)
    if k_pages.shape != v_pages.shape or k_pages.dtype != v_pages.dtype:
        raise LayoutError(
            f"combine_kv: k_pages is {k_pages.shape} {k_pages.dtype} and v_pages {v_pages.shape} "
            f"{v_pages.dtype}; pass K and V caches of the same shape and dtype"
        )
    pages, page_size, kv_heads, head_dim = k_pages.shape
    kv_pages = np.empty((pages, page_size, 2 * kv_heads, head_dim), k_pages.dtype)
    kv_pages[:, :, 0::2] = k_pages
    kv_pages[:, :, 1::2] = v_pages
    return kv_pages


# ---- Page tables: 2-D, or one flat list ----


@dataclasses.dataclass(frozen=True)
class FlatPages:
    """The live sequences' pages as one list, with both common encodings of where each sequence starts.

    Sequence ``i`` owns ``pages[page_offsets[i]:page_offsets[i + 1]]``, its table's first
    ``ceil(kv_len / page_size)`` entries in order; sequences past ``num_seqs`` own none. ``cu_kv_lens`` is
    the same boundary in tokens, ``page_offsets * page_size`` (each kv_len rounded up to whole pages), for
    kernels that locate a sequence's pages by its cumulative length. Entries past ``page_offsets[-1]`` are
    ``pad_to``'s padding.
    """

    pages: np.ndarray  # int32 [pad_to, or the live sequences' page count]
    page_offsets: np.ndarray  # int32 [max_num_seqs + 1]
    cu_kv_lens: np.ndarray  # int32 [max_num_seqs + 1]


def flat_page_list(
    page_indices,
    kv_lens,
    num_seqs,
    *,
    page_size: int,
    pad_to: int | None = None,
    pad_page: int = 0,
    clip: bool = False,
) -> FlatPages:
    """Upstream's 2-D page table as a flat page list (``FlatPages``).

    ``pad_to``: the list's length, for kernels whose page list has a static size (e.g. ``pad_to =
    page_indices.size``, which every valid call fits); the padding entries hold ``pad_page``, by default
    0, a page every cache has, so that a kernel reading past the list (a prefetch of the next block) reads
    a real page rather than out of bounds. Without ``pad_to`` the list is exactly as long as needed.

    ``clip``: list what the table holds for invalid metadata instead of raising: ``num_seqs`` clipped to
    ``[0, max_num_seqs]``, each live kv_len to ``[0, pages_per_seq * page_size]``. For an adapter whose
    kernel validates the metadata itself: pass it the real ``num_seqs`` and ``kv_lens`` beside the list.
    """
    function = "flat_page_list"
    table = _index_array(function, "page_indices", page_indices, 2, "[max_num_seqs, pages_per_seq]")
    max_num_seqs, pages_per_seq = table.shape
    kv_lens = _index_array(function, "kv_lens", kv_lens, 1, "[max_num_seqs]")
    if kv_lens.shape != (max_num_seqs,):
        raise LayoutError(
            f"{function}: kv_lens has shape {kv_lens.shape} but page_indices has {max_num_seqs} rows "
            f"(shape {table.shape}); pass one kv_len per page-table row"
        )
    n = _num_seqs(function, num_seqs, max_num_seqs, clip=clip)
    page_size = _count(function, "page_size", page_size, minimum=1)
    pad_page = _int32(function, "pad_page", pad_page)
    capacity = pages_per_seq * page_size
    live = np.clip(kv_lens[:n], 0, capacity) if clip else kv_lens[:n]
    outside = np.flatnonzero((live < 0) | (live > capacity))
    if outside.size:
        seq = int(outside[0])
        raise LayoutError(
            f"{function}: kv_lens[{seq}]={int(live[seq])} of a live sequence is outside [0, {capacity}] "
            f"(pages_per_seq={pages_per_seq} x page_size={page_size}); pass valid metadata (validate the "
            "call before converting it)"
        )
    counts = np.zeros(max_num_seqs, np.int64)
    counts[:n] = -(-live.astype(np.int64) // page_size)
    offsets = _cumulative(counts)
    total = int(offsets[-1])
    if total * page_size > INT32.max:
        raise LayoutError(
            f"{function}: the live sequences hold {total} pages of {page_size} slots, more slots than int32 "
            "counts; pass fewer or shorter sequences"
        )
    if pad_to is not None:
        pad_to = _count(function, "pad_to", pad_to, minimum=0)
        if pad_to < total:
            raise LayoutError(
                f"{function}: pad_to={pad_to} is shorter than the {total} pages the live sequences use; "
                f"pass pad_to >= {total} (page_indices.size={table.size} fits every valid call)"
            )
    pages = np.full(total if pad_to is None else pad_to, pad_page, np.int32)
    for i in range(n):
        pages[offsets[i] : offsets[i + 1]] = table[i, : counts[i]]
    return FlatPages(pages, offsets.astype(np.int32), (offsets * page_size).astype(np.int32))


def page_table_from_flat(pages, page_offsets, *, pages_per_seq: int, pad_page: int = 0) -> np.ndarray:
    """A flat page list back to a 2-D table int32 ``[max_num_seqs, pages_per_seq]``: the inverse of
    ``flat_page_list`` on each sequence's pages; the entries past them hold ``pad_page``.

    ``page_offsets`` is ``FlatPages.page_offsets`` (``max_num_seqs + 1`` entries from 0); for the
    ``cu_kv_lens`` encoding, pass ``cu_kv_lens // page_size``.
    """
    function = "page_table_from_flat"
    pages = _index_array(function, "pages", pages, 1, "[number of pages]")
    offsets = _index_array(function, "page_offsets", page_offsets, 1, "[max_num_seqs + 1]")
    pages_per_seq = _count(function, "pages_per_seq", pages_per_seq, minimum=0)
    pad_page = _int32(function, "pad_page", pad_page)
    if offsets.size == 0 or offsets[0] != 0:
        raise LayoutError(
            f"{function}: page_offsets={offsets.tolist()} must start at 0 (one entry per sequence and one "
            "more); pass FlatPages.page_offsets"
        )
    counts = np.diff(offsets)
    if (counts < 0).any() or (counts > pages_per_seq).any() or offsets[-1] > len(pages):
        raise LayoutError(
            f"{function}: page_offsets={offsets.tolist()} must not decrease, step by at most "
            f"pages_per_seq={pages_per_seq} and end within the {len(pages)} pages; pass FlatPages.page_offsets "
            "(or cu_kv_lens // page_size)"
        )
    table = np.full((len(counts), pages_per_seq), pad_page, np.int32)
    for i, count in enumerate(counts):
        table[i, :count] = pages[offsets[i] : offsets[i + 1]]
    return table


# ---- tpu-inference v3's packed cache ----


def pack_cache(kv_pages) -> np.ndarray:
    """Upstream's cache in v3's layout ``[pages, page_size, align(2 * kv_heads, packing) // packing, packing,
    align(head_dim, 128)]`` (``packing = values_per_word``), zero in the padded heads and dims, as v3 writes
    them.

    Any count of combined heads is packed, an odd one too: v3's validators must see a cache whose K and V
    head counts differ (``split_new_tokens``).
    """
    kv_pages = _array("pack_cache", "kv_pages", kv_pages, 4, UPSTREAM_CACHE)
    packing = values_per_word(kv_pages.dtype)
    pages, page_size, heads_x2, head_dim = kv_pages.shape
    padded = np.zeros((pages, page_size, _align(heads_x2, packing), _align(head_dim, LANES)), kv_pages.dtype)
    padded[:, :, :heads_x2, :head_dim] = kv_pages
    return padded.reshape(pages, page_size, padded.shape[2] // packing, packing, padded.shape[3])


def pack_cache_side_by_side(kv_pages) -> np.ndarray:
    """Upstream's cache in the layout of tpu-inference v3's head_dim-64 kernel: ``[pages, page_size,
    align(kv_heads, packing) // packing, packing, 2 * head_dim]``, each head's K in ``[..., :head_dim]`` and
    its V in ``[..., head_dim:]``, zero in the padded heads.

    An odd count of combined heads is packed too (K one head more than V, V's missing head zero): the
    kernel's validators must see K and V head counts that differ (``split_new_tokens``).
    """
    kv_pages = _array("pack_cache_side_by_side", "kv_pages", kv_pages, 4, UPSTREAM_CACHE)
    packing = values_per_word(kv_pages.dtype)
    pages, page_size, heads_x2, head_dim = kv_pages.shape
    heads = -(-heads_x2 // 2)
    rows = np.zeros((pages, page_size, _align(heads, packing), 2 * head_dim), kv_pages.dtype)
    rows[:, :, :heads, :head_dim] = kv_pages[:, :, 0::2]
    rows[:, :, : heads_x2 // 2, head_dim:] = kv_pages[:, :, 1::2]
    return rows.reshape(pages, page_size, rows.shape[2] // packing, packing, rows.shape[3])


def unpack_cache(packed, *, num_kv_heads: int, head_dim: int) -> np.ndarray:
    """v3's packed cache back to upstream's ``[pages, page_size, 2 * num_kv_heads, head_dim]``: the inverse of
    ``pack_cache`` (the padding is dropped, whatever it holds). The packed shape does not say how much of
    it is padding, hence the two sizes."""
    function = "unpack_cache"
    layout = "[pages, page_size, heads_in_words, packing, padded_head_dim]"
    packed = _array(function, "packed", packed, 5, layout)
    num_kv_heads = _count(function, "num_kv_heads", num_kv_heads, minimum=1)
    head_dim = _count(function, "head_dim", head_dim, minimum=1)
    packing = values_per_word(packed.dtype)
    pages, page_size = packed.shape[:2]
    expected = (
        pages,
        page_size,
        _align(2 * num_kv_heads, packing) // packing,
        packing,
        _align(head_dim, LANES),
    )
    if packed.shape != expected:
        raise LayoutError(
            f"{function}: packed has shape {packed.shape}, but {num_kv_heads} kv heads of head_dim {head_dim} "
            f"in {packed.dtype} ({packing} per word) pack to {expected}; pass the num_kv_heads and head_dim "
            "the cache was packed with"
        )
    combined = packed.reshape(pages, page_size, expected[2] * packing, expected[4])
    return combined[:, :, : 2 * num_kv_heads, :head_dim].copy()


# ---- New tokens as inputs (tpu-inference v3) ----


@dataclasses.dataclass(frozen=True)
class NewTokens:
    """A call's new tokens as a kernel that writes them into the cache takes them, and where they go.

    The new tokens of live sequence ``i`` are its last ``q_len`` keys (positions ``[kv_len - q_len,
    kv_len)``): row ``cu_q_lens[i] + j`` of ``keys``/``values`` holds position ``kv_len - q_len + j``. Rows
    no live sequence fills are NaN where q's row is all NaN (a poisoned case's padding), zero elsewhere.
    """

    keys: np.ndarray  # [max_num_batched_tokens, kv_heads, head_dim], the cache's dtype
    values: np.ndarray  # [max_num_batched_tokens, kv_heads, head_dim]
    new_slots: np.ndarray  # bool [pages, page_size]: the slots the kernel writes the new tokens to
    slot_owner: np.ndarray  # int64 [pages, page_size]: the live sequence whose page holds the slot, -1 none
    slot_position: np.ndarray  # int64 [pages, page_size]: the slot's key position in its owner, -1 none
    q_lens: np.ndarray  # int64 [sequences read]: the q_len of each live sequence the split read

    def poisoned_cache(self, kv_pages) -> np.ndarray:
        """``kv_pages`` with the new tokens' slots set to NaN: the cache to pass, so that a kernel reading a
        new token from the cache rather than from ``keys``/``values`` returns NaN."""
        kv_pages = _array("poisoned_cache", "kv_pages", kv_pages, 4, UPSTREAM_CACHE)
        if kv_pages.shape[:2] != self.new_slots.shape:
            raise LayoutError(
                f"poisoned_cache: kv_pages has shape {kv_pages.shape}, but these new tokens were split from a "
                f"cache of {self.new_slots.shape[0]} pages of {self.new_slots.shape[1]} slots; pass that cache"
            )
        poisoned = kv_pages.copy()
        poisoned[self.new_slots] = np.nan
        return poisoned


def _holds_nan(dtype: np.dtype) -> bool:
    with np.errstate(invalid="ignore"):
        try:
            return bool(np.isnan(np.array(np.nan, dtype).astype(np.float32)))
        except (TypeError, ValueError):
            return False


def split_new_tokens(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs) -> NewTokens:
    """Upstream's call (a cache holding every key) as new-token inputs (``NewTokens``): what tpu-inference
    v3's target passes.

    Invalid metadata is tolerated, not judged: a kernel's validators must see it as the caller passed it
    (v3 rejects it with its own messages), so only the entries that exist are read (the first
    ``min(num_seqs, len(kv_lens), len(cu_q_lens) - 1, page-table rows)`` sequences), in any integer or
    float dtype (read as integers), and a row outside q, a position outside the page table or a page
    outside the cache is skipped. Where invalid metadata makes sequences overlap, the later sequence's
    row, owner and position win. An odd number of combined heads (v3's "k and v shapes differ") gives K one
    head more than V, as ``0::2`` and ``1::2`` split it.
    """
    function = "split_new_tokens"
    q = _array(function, "q", q, 3, "[max_num_batched_tokens, num_q_heads, head_dim]")
    kv_pages = _array(function, "kv_pages", kv_pages, 4, UPSTREAM_CACHE)
    if not _holds_nan(kv_pages.dtype):
        raise LayoutError(
            f"{function}: kv_pages has dtype {kv_pages.dtype}, which has no NaN to poison the new tokens' "
            "slots with; pass a floating-point cache"
        )
    metadata = {}
    for name, value, ndim, layout in (
        ("kv_lens", kv_lens, 1, "[max_num_seqs]"),
        ("page_indices", page_indices, 2, "[max_num_seqs, pages_per_seq]"),
        ("cu_q_lens", cu_q_lens, 1, "[max_num_seqs + 1]"),
    ):
        array = _array(function, name, value, ndim, layout)
        if array.dtype.kind not in "iuf":
            raise LayoutError(f"{function}: {name} has dtype {array.dtype}; pass an int32 array {layout}")
        with np.errstate(invalid="ignore"):  # a float NaN or infinity reads as some integer, as v3's cast
            metadata[name] = array.astype(np.int64)
    kv_lens, page_table, cu_q_lens = metadata["kv_lens"], metadata["page_indices"], metadata["cu_q_lens"]
    num_seqs = np.asarray(num_seqs)
    if num_seqs.size == 0:
        raise LayoutError(f"{function}: num_seqs is empty (shape {num_seqs.shape}); pass an int32 array [1]")
    n = int(num_seqs.reshape(-1)[0])

    num_pages, page_size, heads_x2, head_dim = kv_pages.shape
    num_rows, pages_per_seq = q.shape[0], page_table.shape[1]
    new_kv = np.zeros((num_rows, heads_x2, head_dim), kv_pages.dtype)
    # A poisoned case's padding rows stay poisoned in the new tokens, so that a kernel reading them shows.
    new_kv[np.isnan(q.astype(np.float32)).all(axis=(1, 2))] = np.nan
    new_slots = np.zeros((num_pages, page_size), bool)
    slot_owner = np.full((num_pages, page_size), -1, np.int64)
    slot_position = np.full((num_pages, page_size), -1, np.int64)
    read = min(max(n, 0), len(kv_lens), len(cu_q_lens) - 1, page_table.shape[0])
    for i in range(read):
        start, kv_len = int(cu_q_lens[i]), int(kv_lens[i])
        q_len = int(cu_q_lens[i + 1]) - start

        owned = np.arange(min(-(-kv_len // page_size), pages_per_seq))
        in_cache = (page_table[i, owned] >= 0) & (page_table[i, owned] < num_pages)
        owned = owned[in_cache]
        # A page listed twice takes its later entry's positions: the first occurrence in reverse order.
        _, first_from_end = np.unique(page_table[i, owned][::-1], return_index=True)
        owned = owned[len(owned) - 1 - first_from_end]
        slot_owner[page_table[i, owned]] = i
        slot_position[page_table[i, owned]] = owned[:, None] * page_size + np.arange(page_size)

        # Only the rows inside q: garbage cu_q_lens may point anywhere.
        j = np.arange(max(0, -start), max(0, min(q_len, num_rows - start)))
        position = kv_len - q_len + j
        in_table = (position >= 0) & (position < pages_per_seq * page_size)
        j, position = j[in_table], position[in_table]
        page, slot = page_table[i, position // page_size], position % page_size
        in_cache = (page >= 0) & (page < num_pages)
        j, page, slot = j[in_cache], page[in_cache], slot[in_cache]
        new_kv[start + j] = kv_pages[page, slot]
        new_slots[page, slot] = True
    return NewTokens(
        new_kv[:, 0::2].copy(),
        new_kv[:, 1::2].copy(),
        new_slots,
        slot_owner,
        slot_position,
        np.diff(cu_q_lens[: read + 1]),
    )


def distribution(q_lens, num_seqs, *, chunk_prefill_size: int | None = None) -> np.ndarray:
    """tpu-inference v3's ``distribution``, int32 ``[decodes_end, chunked_prefills_end, num_seqs]``: the
    leading sequences with ``q_len == 1`` (its decode kernel runs them), then those with ``q_len ==
    chunk_prefill_size`` (its prefill kernel), then the rest. ``q_lens`` are the live sequences' query
    lengths (``NewTokens.q_lens``); ``num_seqs`` is passed on as given, so that a kernel's validators see it."""
    # Any integers: a q_len is a difference of two int32 entries of cu_q_lens, which (on invalid input) may
    # not fit in int32 itself, and the kernel's validators, not this converter, must reject that input.
    q_lens = _integer_array("distribution", "q_lens", q_lens, 1, "[live sequences]")
    decodes = 0
    while decodes < len(q_lens) and q_lens[decodes] == 1:
        decodes += 1
    prefills_end = decodes
    while (
        chunk_prefill_size is not None
        and prefills_end < len(q_lens)
        and q_lens[prefills_end] == chunk_prefill_size
    ):
        prefills_end += 1
    return np.array([decodes, prefills_end, int(np.asarray(num_seqs).reshape(-1)[0])], np.int32)


def pad_lanes(array, multiple: int = LANES) -> np.ndarray:
    """``array`` with its last axis (head_dim) zero-padded to a multiple of ``multiple`` lanes."""
    array = np.asarray(array)
    if array.ndim == 0:
        raise LayoutError("pad_lanes: a scalar has no head_dim axis; pass an array [..., head_dim]")
    padding = _align(array.shape[-1], multiple) - array.shape[-1]
    return np.pad(array, [(0, 0)] * (array.ndim - 1) + [(0, padding)])


def unpad_lanes(array, head_dim: int) -> np.ndarray:
    """The first ``head_dim`` lanes of ``array``'s last axis: a lane-padded cache back in upstream's layout."""
    array = np.asarray(array)
    if array.ndim == 0 or array.shape[-1] < head_dim:
        raise LayoutError(
            f"unpad_lanes: an array of shape {array.shape} has fewer than head_dim={head_dim} lanes; pass the "
            "lane-padded array and the unpadded head_dim"
        )
    return array[..., :head_dim].copy()
