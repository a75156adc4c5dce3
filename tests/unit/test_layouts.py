"""The layout converters (``rpa_harness.targets.layouts``): each conversion against its stated layout, each
inverse round trip bit for bit, the new-token split's tolerance of any metadata, and the argument errors.

Arrays are built with NumPy from drawn structure; caches hold random bits (NaN payloads included), so that
a converter that rounds, reorders or drops anything shows.
"""

import dataclasses
import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rpa_harness.strategies.case import DTYPES
from rpa_harness.strategies.valid import valid_cases
from rpa_harness.targets import layouts
from rpa_harness.targets.bundled import RPA_HARNESS_CAPABILITIES as OUR_KERNEL
from rpa_harness.targets.layouts import LayoutError

FEW = settings(max_examples=40, deadline=None)
# valid_cases builds a whole case per example: fewer of them, and no complaint about the draw's size.
CASES = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def random_bits(seed: int, shape: tuple, dtype: np.dtype) -> np.ndarray:
    """An array of ``dtype`` holding arbitrary bit patterns (NaNs and infinities included)."""
    size = math.prod(shape) * dtype.itemsize
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).view(dtype).reshape(shape)


def assert_same_bits(actual, expected, name: str) -> None:
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape, f"{name}: shape {actual.shape}, expected {expected.shape}"
    assert actual.dtype == expected.dtype, f"{name}: dtype {actual.dtype}, expected {expected.dtype}"
    bits = f"u{expected.dtype.itemsize}"
    differ = np.argwhere(actual.view(bits) != expected.view(bits))
    assert not differ.size, f"{name}: {len(differ)} elements differ, first at {tuple(differ[0])}"


@st.composite
def caches(draw, *, dtypes=tuple(DTYPES)) -> np.ndarray:
    """Upstream's interleaved cache; head counts and dims that v3's packing must pad come up often."""
    shape = (
        draw(st.integers(1, 3)),  # pages
        draw(st.integers(1, 4)),  # page_size
        2 * draw(st.integers(1, 5)),  # combined heads: odd kv_heads pad for 16- and 8-bit packing
        draw(st.sampled_from((1, 3, 64, 128, 130))),  # head_dim: 128 is v3's lane multiple
    )
    return random_bits(draw(st.integers(0, 2**32 - 1)), shape, DTYPES[draw(st.sampled_from(dtypes))])


# ---- K and V ----


@FEW
@given(kv_pages=caches())
def test_split_kv_takes_even_heads_as_k_odd_as_v_and_combine_kv_inverts_it(kv_pages):
    k_pages, v_pages = layouts.split_kv(kv_pages)
    pages, page_size, heads_x2, head_dim = kv_pages.shape
    assert k_pages.shape == v_pages.shape == (pages, page_size, heads_x2 // 2, head_dim)
    assert k_pages.flags.c_contiguous and v_pages.flags.c_contiguous
    for head in range(heads_x2 // 2):
        assert_same_bits(k_pages[:, :, head], kv_pages[:, :, 2 * head], f"K head {head}")
        assert_same_bits(v_pages[:, :, head], kv_pages[:, :, 2 * head + 1], f"V head {head}")
    combined = layouts.combine_kv(k_pages, v_pages)
    assert_same_bits(combined, kv_pages, "combine_kv(split_kv(kv_pages))")
    assert not np.shares_memory(combined, k_pages) and not np.shares_memory(k_pages, kv_pages)


# ---- Page tables ----


@st.composite
def page_tables(draw) -> dict:
    """A 2-D page table whose live rows list valid pages; every other entry, and the padding sequences'
    kv_lens, hold arbitrary int32 (the converters must not read them)."""
    max_num_seqs, pages_per_seq = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    page_size = draw(st.sampled_from((1, 2, 3, 16)))
    num_seqs = draw(st.integers(0, max_num_seqs))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    table = rng.integers(np.iinfo(np.int32).min, np.iinfo(np.int32).max, (max_num_seqs, pages_per_seq))
    kv_lens = rng.integers(np.iinfo(np.int32).min, np.iinfo(np.int32).max, max_num_seqs)
    for i in range(num_seqs):
        kv_lens[i] = draw(st.integers(0, pages_per_seq * page_size))
        table[i, : -(-kv_lens[i] // page_size)] = rng.integers(0, 64, -(-kv_lens[i] // page_size))
    return dict(
        page_indices=table.astype(np.int32),
        kv_lens=kv_lens.astype(np.int32),
        num_seqs=np.array([num_seqs], np.int32),
        page_size=page_size,
    )


@FEW
@given(call=page_tables(), extra=st.none() | st.integers(0, 5), pad_page=st.sampled_from((0, -1, 7)))
def test_flat_page_list_lists_each_live_sequences_pages_and_inverts(call, extra, pad_page):
    table, kv_lens, page_size = call["page_indices"], call["kv_lens"], call["page_size"]
    n = int(call["num_seqs"][0])
    used = [math.ceil(int(kv) / page_size) for kv in kv_lens[:n]]
    pad_to = None if extra is None else sum(used) + extra
    flat = layouts.flat_page_list(
        table, kv_lens, call["num_seqs"], page_size=page_size, pad_to=pad_to, pad_page=pad_page
    )
    assert flat.pages.dtype == flat.page_offsets.dtype == flat.cu_kv_lens.dtype == np.int32
    assert len(flat.pages) == (sum(used) if pad_to is None else pad_to)
    counts = used + [0] * (len(table) - n)  # padding sequences own no pages
    np.testing.assert_array_equal(np.diff(flat.page_offsets), counts)
    assert flat.page_offsets[0] == flat.cu_kv_lens[0] == 0
    for i in range(n):
        np.testing.assert_array_equal(
            flat.pages[flat.page_offsets[i] : flat.page_offsets[i + 1]], table[i, : used[i]]
        )
        aligned = int(flat.cu_kv_lens[i + 1] - flat.cu_kv_lens[i])
        assert aligned % page_size == 0 and kv_lens[i] <= aligned < kv_lens[i] + page_size, f"sequence {i}"
    np.testing.assert_array_equal(np.diff(flat.cu_kv_lens)[n:], 0)
    assert (flat.pages[sum(used) :] == pad_page).all()

    back = layouts.page_table_from_flat(
        flat.pages, flat.page_offsets, pages_per_seq=table.shape[1], pad_page=pad_page
    )
    assert back.shape == table.shape and back.dtype == np.int32
    for i in range(len(table)):
        count = used[i] if i < n else 0
        np.testing.assert_array_equal(back[i, :count], table[i, :count])
        assert (back[i, count:] == pad_page).all(), f"row {i} past its pages"
    from_cu_kv_lens = layouts.page_table_from_flat(
        flat.pages, flat.cu_kv_lens // page_size, pages_per_seq=table.shape[1], pad_page=pad_page
    )
    np.testing.assert_array_equal(from_cu_kv_lens, back)
    again = layouts.flat_page_list(back, kv_lens, n, page_size=page_size)
    np.testing.assert_array_equal(again.pages, flat.pages[: sum(used)])
    np.testing.assert_array_equal(again.page_offsets, flat.page_offsets)
    np.testing.assert_array_equal(again.cu_kv_lens, flat.cu_kv_lens)


@FEW
@given(call=page_tables(), num_seqs=st.integers(-3, 7), data=st.data())
def test_flat_page_list_clips_invalid_metadata_to_what_the_table_holds(call, num_seqs, data):
    """``clip=True`` gives the list of the clipped metadata: what a kernel's own validators then compare
    with the real values."""
    table, page_size = call["page_indices"], call["page_size"]
    capacity = table.shape[1] * page_size
    kv_lens = call["kv_lens"].copy()
    n = min(max(num_seqs, 0), len(table))
    for i in range(n):  # each live kv_len anywhere from negative to past the table
        kv_lens[i] = data.draw(st.integers(-5, capacity + 5), label=f"kv_lens[{i}]")
        table[i] = np.arange(table.shape[1])  # every entry a page, as the clipped lengths may read them all
    clipped = layouts.flat_page_list(
        table, kv_lens, np.array([num_seqs], np.int32), page_size=page_size, pad_to=table.size, clip=True
    )
    valid = layouts.flat_page_list(
        table, np.clip(kv_lens, 0, capacity) * (np.arange(len(table)) < n), n, page_size=page_size,
        pad_to=table.size,
    )  # fmt: skip
    for got, expected in zip(dataclasses.astuple(clipped), dataclasses.astuple(valid), strict=True):
        np.testing.assert_array_equal(got, expected)
    in_range = 0 <= num_seqs <= len(table) and ((kv_lens[:n] >= 0) & (kv_lens[:n] <= capacity)).all()
    if not in_range:  # without clip, the same call is refused
        with pytest.raises(LayoutError):
            layouts.flat_page_list(table, kv_lens, np.array([num_seqs], np.int32), page_size=page_size)


# ---- v3's packed cache ----


@pytest.mark.parametrize(
    ("dtype", "per_word"),
    [
        (np.float32, 1),
        ("float32", 1),
        (ml_dtypes.bfloat16, 2),
        ("bfloat16", 2),
        (np.float16, 2),
        ("float8_e4m3fn", 4),
        (np.dtype(ml_dtypes.float8_e5m2), 4),
        (np.int8, 4),
    ],
)
def test_values_per_word(dtype, per_word):
    assert layouts.values_per_word(dtype) == per_word


@FEW
@given(kv_pages=caches())
def test_pack_cache_places_each_value_in_its_word_pads_with_zeros_and_unpacks(kv_pages):
    pages, page_size, heads_x2, head_dim = kv_pages.shape
    packing = 4 // kv_pages.dtype.itemsize
    packed = layouts.pack_cache(kv_pages)
    words = -(-heads_x2 // packing)
    assert packed.shape == (pages, page_size, words, packing, -(-head_dim // 128) * 128)
    assert packed.dtype == kv_pages.dtype
    for head in range(heads_x2):
        assert_same_bits(
            packed[:, :, head // packing, head % packing, :head_dim], kv_pages[:, :, head], f"head {head}"
        )
    padding = np.ones(packed.shape, bool)
    padding.reshape(pages, page_size, words * packing, -1)[:, :, :heads_x2, :head_dim] = False
    assert not packed.view(f"u{packed.dtype.itemsize}")[padding].any(), "padding is not all zero bits"
    unpacked = layouts.unpack_cache(packed, num_kv_heads=heads_x2 // 2, head_dim=head_dim)
    assert_same_bits(unpacked, kv_pages, "unpack_cache(pack_cache(kv_pages))")
    assert not np.shares_memory(unpacked, packed) and not np.shares_memory(packed, kv_pages)


# ---- New tokens ----


@st.composite
def garbage_calls(draw) -> dict:
    """Metadata of any length, dtype and value, around a small cache: what only the tolerance survives."""
    num_pages, page_size = draw(st.integers(1, 4)), draw(st.integers(1, 3))
    heads_x2, head_dim, rows = draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.integers(0, 6))
    index_dtype = draw(st.sampled_from((np.int32, np.int16, np.float32)))

    def vector(length_range, values):
        return np.array(
            draw(st.lists(values, min_size=length_range[0], max_size=length_range[1])), index_dtype
        )

    seqs = draw(st.integers(0, 4))
    pages_per_seq = draw(st.integers(0, 3))
    table = vector((seqs * pages_per_seq,) * 2, st.integers(-2, num_pages + 1)).reshape(seqs, pages_per_seq)
    seed = draw(st.integers(0, 2**32 - 1))
    q = np.random.default_rng(seed).standard_normal((rows, 2, head_dim)).astype(np.float32)
    q[draw(st.lists(st.integers(0, max(rows - 1, 0)), max_size=rows))] = np.nan  # poisoned rows
    return dict(
        q=q,
        kv_pages=random_bits(seed, (num_pages, page_size, heads_x2, head_dim), DTYPES["bfloat16"]),
        kv_lens=vector((0, 5), st.integers(-4, 12)),
        page_indices=table,
        cu_q_lens=vector((0, 6), st.integers(-3, 9)),
        num_seqs=np.array([draw(st.integers(-2, 6))], np.int32),
    )


@settings(max_examples=60, deadline=None)
@given(arrays=garbage_calls())
def test_split_new_tokens_tolerates_invalid_metadata(arrays):
    """Whatever the metadata, the split returns (a kernel's validators must see the call as passed), every
    slot it marks new lies in a page the cache has and is owned, and the poisoned cache differs from the
    cache only there."""
    new = layouts.split_new_tokens(**arrays)
    kv_pages = arrays["kv_pages"]
    assert new.keys.shape == new.values.shape[:1] + new.keys.shape[1:]
    assert new.keys.shape[0] == arrays["q"].shape[0] and new.new_slots.shape == kv_pages.shape[:2]
    assert (new.slot_owner[new.new_slots] >= 0).all()
    poisoned = layouts.pack_cache(new.poisoned_cache(kv_pages)).reshape(*kv_pages.shape[:2], -1)
    unchanged = layouts.pack_cache(kv_pages).reshape(*kv_pages.shape[:2], -1)
    assert_same_bits(poisoned[~new.new_slots], unchanged[~new.new_slots], "slots that are not new")


@CASES
@given(case=valid_cases(OUR_KERNEL, with_options=False))
def test_split_new_tokens_moves_each_new_key_to_its_row_and_poisons_its_slot(case):
    arrays = case.arrays()
    kv_pages, table, page_size = arrays["kv_pages"], arrays["page_indices"], case.page_size
    new = layouts.split_new_tokens(**arrays)
    k_pages, v_pages = layouts.split_kv(kv_pages)
    expected_slots = np.zeros(kv_pages.shape[:2], bool)
    start = 0
    for i, (q_len, kv_len) in enumerate(zip(case.q_lens, case.kv_lens, strict=True)):
        for j in range(q_len):
            position = kv_len - q_len + j
            page, slot = table[i, position // page_size], position % page_size
            assert_same_bits(new.keys[start + j], k_pages[page, slot], f"key row {start + j}")
            assert_same_bits(new.values[start + j], v_pages[page, slot], f"value row {start + j}")
            assert new.slot_owner[page, slot] == i and new.slot_position[page, slot] == position
            expected_slots[page, slot] = True
        start += q_len
    np.testing.assert_array_equal(new.new_slots, expected_slots)
    padding_rows = new.keys[case.num_tokens :].astype(np.float32)
    assert (np.isnan(padding_rows) if case.poison else padding_rows == 0).all()
    poisoned = new.poisoned_cache(kv_pages)
    assert np.isnan(poisoned[expected_slots].astype(np.float32)).all()
    assert_same_bits(poisoned[~expected_slots], kv_pages[~expected_slots], "slots that are not new")
    assert not np.isnan(kv_pages[expected_slots].astype(np.float32)).any(), "the input cache was changed"


# ---- Argument errors: each names the function, the argument and its value ----

KV = np.zeros((2, 4, 4, 8), np.float32)
TABLE = np.zeros((2, 3), np.int32)
LENS = np.array([5, 3], np.int32)


def _flat(**changes):
    call = dict(page_indices=TABLE, kv_lens=LENS, num_seqs=np.array([2], np.int32), page_size=4) | changes
    return lambda: layouts.flat_page_list(**call)


def _call_arrays() -> dict:
    return dict(
        q=np.zeros((4, 2, 8), np.float32),
        kv_pages=KV,
        kv_lens=LENS,
        page_indices=TABLE,
        cu_q_lens=np.array([0, 1, 2], np.int32),
        num_seqs=np.array([2], np.int32),
    )


def _new_tokens(**changes):
    return lambda: layouts.split_new_tokens(**_call_arrays() | changes)


ARGUMENT_ERRORS = {
    "split_kv of a 3-D cache": (lambda: layouts.split_kv(KV[0]), r"split_kv: kv_pages has shape \(4, 4, 8\)"),
    "split_kv of an odd head count": (
        lambda: layouts.split_kv(KV[:, :, :3]),
        r"split_kv: .* 3 heads on axis 2",
    ),
    "combine_kv of different shapes": (
        lambda: layouts.combine_kv(KV, KV[:1]),
        r"combine_kv: k_pages is \(2, 4, 4, 8\) float32 and v_pages \(1, 4, 4, 8\)",
    ),
    "combine_kv of different dtypes": (
        lambda: layouts.combine_kv(KV, KV.astype(ml_dtypes.bfloat16)),
        r"combine_kv: .* float32 and v_pages .* bfloat16",
    ),
    "a float page table": (_flat(page_indices=TABLE.astype(np.float32)), r"page_indices has dtype float32"),
    "a 1-D page table": (_flat(page_indices=TABLE[0]), r"page_indices has shape \(3,\) \(1-D\)"),
    "page indices outside int32": (
        _flat(page_indices=TABLE.astype(np.int64) + 2**31),
        r"page_indices holds 2147483648\.\.2147483648, outside int32",
    ),
    "one kv_len too few": (_flat(kv_lens=LENS[:1]), r"kv_lens has shape \(1,\) but page_indices has 2 rows"),
    "num_seqs over the table's rows": (_flat(num_seqs=3), r"num_seqs=3 is outside \[0, max_num_seqs=2\]"),
    "a negative num_seqs": (_flat(num_seqs=np.array([-1], np.int32)), r"num_seqs=-1 is outside"),
    "num_seqs of two entries": (_flat(num_seqs=np.array([1, 1])), r"num_seqs=array\(\[1, 1\]\)"),
    "a float num_seqs": (_flat(num_seqs=1.0), r"num_seqs=1\.0 .* pass one integer"),
    "a zero page size": (_flat(page_size=0), r"page_size=0; pass an integer >= 1"),
    "a live kv_len over the capacity": (
        _flat(kv_lens=np.array([5, 13], np.int32)),
        r"kv_lens\[1\]=13 of a live sequence is outside \[0, 12\]",
    ),
    "a negative live kv_len": (_flat(kv_lens=np.array([-1, 3], np.int32)), r"kv_lens\[0\]=-1 of a live"),
    "pad_to too short": (_flat(pad_to=2), r"pad_to=2 is shorter than the 3 pages"),
    "a pad_page outside int32": (_flat(pad_page=2**31), r"pad_page=2147483648; pass an integer that fits"),
    "offsets not from 0": (
        lambda: layouts.page_table_from_flat(np.arange(3), np.array([1, 3]), pages_per_seq=3),
        r"page_table_from_flat: page_offsets=\[1, 3\] must start at 0",
    ),
    "decreasing offsets": (
        lambda: layouts.page_table_from_flat(np.arange(3), np.array([0, 2, 1]), pages_per_seq=3),
        r"page_offsets=\[0, 2, 1\] must not decrease",
    ),
    "offsets past the list": (
        lambda: layouts.page_table_from_flat(np.arange(3), np.array([0, 4]), pages_per_seq=4),
        r"end within the 3 pages",
    ),
    "a sequence longer than the table": (
        lambda: layouts.page_table_from_flat(np.arange(3), np.array([0, 3]), pages_per_seq=2),
        r"step by at most pages_per_seq=2",
    ),
    "pack_cache of a 5-D array": (lambda: layouts.pack_cache(KV[None]), r"pack_cache: kv_pages has shape"),
    "unpack_cache with the wrong head count": (
        lambda: layouts.unpack_cache(layouts.pack_cache(KV), num_kv_heads=3, head_dim=8),
        r"unpack_cache: packed has shape \(2, 4, 4, 1, 128\), but 3 kv heads .* pack to \(2, 4, 6, 1, 128\)",
    ),
    "unpack_cache with a zero head_dim": (
        lambda: layouts.unpack_cache(layouts.pack_cache(KV), num_kv_heads=2, head_dim=0),
        r"head_dim=0; pass an integer >= 1",
    ),
    "split_new_tokens of an integer cache": (
        _new_tokens(kv_pages=KV.astype(np.int8)),
        r"split_new_tokens: kv_pages has dtype int8, which has no NaN",
    ),
    "split_new_tokens of a flat page table": (
        _new_tokens(page_indices=TABLE.reshape(-1)),
        r"split_new_tokens: page_indices has shape \(6,\) \(1-D\)",
    ),
    "split_new_tokens of 2-D q": (_new_tokens(q=np.zeros((4, 8))), r"q has shape \(4, 8\) \(2-D\)"),
    "split_new_tokens of boolean kv_lens": (_new_tokens(kv_lens=LENS > 0), r"kv_lens has dtype bool"),
    "split_new_tokens of an empty num_seqs": (
        _new_tokens(num_seqs=np.array([], np.int32)),
        r"num_seqs is empty",
    ),
    "distribution of 2-D q_lens": (
        lambda: layouts.distribution(np.ones((2, 2), np.int64), 2),
        r"distribution: q_lens has shape \(2, 2\) \(2-D\)",
    ),
    "pad_lanes of a scalar": (
        lambda: layouts.pad_lanes(np.float32(1)),
        r"pad_lanes: a scalar has no head_dim",
    ),
    "unpad_lanes past the lanes": (
        lambda: layouts.unpad_lanes(np.zeros((2, 64)), 128),
        r"unpad_lanes: an array of shape \(2, 64\) has fewer than head_dim=128 lanes",
    ),
    "poisoned_cache of another cache": (
        lambda: layouts.split_new_tokens(**_call_arrays()).poisoned_cache(KV[:1]),
        r"poisoned_cache: kv_pages has shape \(1, 4, 4, 8\), but .* 2 pages of 4 slots",
    ),
}


@pytest.mark.parametrize("name", ARGUMENT_ERRORS)
def test_argument_errors(name):
    call, message = ARGUMENT_ERRORS[name]
    with pytest.raises(LayoutError, match=message) as raised:
        call()
    assert "pass " in str(raised.value), f"the message does not say what to pass: {raised.value}"


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: layouts.values_per_word(np.float64), r"float64 has 64 bits"),
        (lambda: layouts.values_per_word("bfloat15"), r"dtype='bfloat15' is not"),
        (lambda: layouts.pack_cache(KV.astype(np.float64)), r"float64 has 64 bits"),
    ],
    ids=["values_per_word of float64", "values_per_word of a non-dtype", "pack_cache of float64"],
)
def test_dtype_errors(call, message):
    with pytest.raises(ValueError, match=message) as raised:
        call()
    assert "pass " in str(raised.value), f"the message does not say what to pass: {raised.value}"


@pytest.mark.parametrize(
    "q_lens, chunk_prefill_size, expected",
    [
        ((1, 1, 5, 5, 3), 5, (2, 4, 5)),
        ((1, 1, 5, 5, 3), None, (2, 2, 5)),
        ((5, 1, 1), 5, (0, 1, 3)),  # a decode after a prefill is not a leading decode
        ((), None, (0, 0, 0)),
        # Garbage cu_q_lens (invalid input the kernel's validators must reject) give q_lens outside int32.
        ((1, 2**31 + 5, -(2**31) - 7), None, (1, 1, 3)),
    ],
)
def test_distribution_counts_leading_decodes_then_chunked_prefills(q_lens, chunk_prefill_size, expected):
    num_seqs = np.array([len(q_lens)], np.int32)
    got = layouts.distribution(np.array(q_lens, np.int64), num_seqs, chunk_prefill_size=chunk_prefill_size)
    assert got.dtype == np.int32 and tuple(got) == expected


@given(head_dim=st.integers(1, 300), lanes=st.sampled_from([128, 64]))
def test_pad_lanes_pads_with_zeros_to_whole_lanes_and_unpad_lanes_inverts(head_dim, lanes):
    array = np.arange(3 * head_dim, dtype=np.float32).reshape(3, head_dim) + 1
    padded = layouts.pad_lanes(array, lanes)
    assert padded.shape == (3, -(-head_dim // lanes) * lanes) and not padded[:, head_dim:].any()
    assert np.array_equal(layouts.unpad_lanes(padded, head_dim), array)


def test_layout_error_is_a_value_error():
    assert issubclass(LayoutError, ValueError)
