"""Strategies for valid cases: structure first (bucket, heads, dtypes, options), then the ragged layout.

Shapes come from a few static buckets so that examples reuse compiled kernels; the ragged layout
(``q_lens``/``kv_lens``), the page table and the data seed vary as data. Every choice is drawn so that
shrinking moves toward the simplest case: one sequence, fewest heads, smallest head_dim and page size,
no options, float32, the smallest bucket. Edge-case biasing (lengths on page and KV-block boundaries) sits
behind a branch the shrinker can turn off.
"""

import dataclasses
import math
from typing import Any

import numpy as np
from hypothesis import event, reject
from hypothesis import strategies as st
from rpa_harness.spec.interface import (
    DEFAULT_MASK_VALUE,
    MASK_ADDED,
    MASK_VALUE_MEANINGS,
    OUT_DTYPES,
    values_per_word,
)
from rpa_harness.strategies.case import DTYPES, Case


@dataclasses.dataclass(frozen=True)
class Bucket:
    """Static capacity: query rows, sequence slots and keys per sequence."""

    max_num_batched_tokens: int
    max_num_seqs: int
    max_kv_len: int


@dataclasses.dataclass(frozen=True)
class ProductionBucket:
    """Serving-scale shapes, drawn per example from the choices below within three budgets.

    The choices follow the keys of upstream's tuned block-size tables (jax's
    ``ragged_paged_attention/tuned_block_sizes.py``: max_num_batched_tokens 512-4096, page sizes 16-256,
    max_model_len = page_size * pages_per_seq; the tuned tables of other TPU kernels: 8-128 q heads, head_dim
    128/256, model lengths to 8k) widened to what serving uses (8,192 tokens, 512 slots, 128k keys per sequence). The
    budgets keep one example affordable on one CPU core: the oracle's result (seven float64 arrays of
    ``T * q_heads * head_dim``), the KV cache (which Case.arrays fills whole), and the attention work of the layout (query rows times
    keys times q heads, which is what the oracle and an interpreted kernel spend their time on).
    """

    token_budgets: tuple[int, ...] = (512, 1024, 2048, 4096, 8192)  # max_num_batched_tokens
    seq_slots: tuple[int, ...] = (256, 512)  # max_num_seqs
    max_model_lens: tuple[int, ...] = (4096, 32768, 131072)  # page_size * pages_per_seq
    page_sizes: tuple[int, ...] = (16, 32, 64, 128, 256)
    q_heads: tuple[int, int] = (8, 64)  # num_q_heads drawn in this range (from num_kv_heads * gqa_ratio)
    head_dims: tuple[int, ...] = (128, 256)
    max_output_elements: int = 1 << 25  # T * num_q_heads * head_dim: 256 MiB per float64 result array
    kv_cache_bytes: int = 128 * 2**20  # total_num_pages * page bytes; at least two pages per slot
    max_work: int = 1 << 24  # sum over sequences of q_len * kv_len * num_q_heads


@dataclasses.dataclass(frozen=True)
class LongBucket:
    """Long contexts for few query rows: decodes and short prefill chunks against up to 131,072 keys.

    Narrow integer arithmetic (int16 or uint16 positions, packed index math) breaks where a length or a
    position passes 2^15 or 2^16, so each sequence's kv_len is drawn short or within a few keys of one of
    ``boundaries`` or of the model length, with its query rows' positions below, across or above it
    (``long_layouts``). The budgets keep one example within seconds on the fast interpreter and the oracle's
    memory small: the KV cache (which Case.arrays fills whole) must hold one sequence of the model length,
    and the attention work (query rows times keys times q heads) is capped.
    """

    token_budgets: tuple[int, ...] = (16, 64, 256)  # max_num_batched_tokens
    seq_slots: tuple[int, ...] = (2, 4)  # max_num_seqs
    max_model_len: int = 131072  # page_size * pages_per_seq
    page_sizes: tuple[int, ...] = (16, 32, 64, 128, 256)
    max_q_heads: int = 8
    head_dims: tuple[int, ...] = (64, 128, 256)
    kv_cache_bytes: int = 256 * 2**20
    max_work: int = 1 << 26  # sum over sequences of q_len * kv_len * num_q_heads
    boundaries: tuple[int, ...] = (1 << 15, 1 << 16)


@dataclasses.dataclass(frozen=True)
class LongCorner:
    """A corner of the long bucket, where narrow integer arithmetic breaks: queries packed into 32-bit words
    (narrower than float32) or not, the longest context just up to or just past one of the bucket's
    boundaries (every query position below it, or the last one at or past it), block sizes left to the
    kernel or given. ``long_corners`` lists a target's; each ci run draws every one of them."""

    packed_queries: bool
    boundary: int
    past: bool
    kernel_block_sizes: bool

    @property
    def label(self) -> str:
        queries = "packed" if self.packed_queries else "float32"
        side = "just past" if self.past else "up to"
        blocks = "the kernel's" if self.kernel_block_sizes else "given"
        return (
            f"{queries} queries, context {side} 2^{self.boundary.bit_length() - 1} keys, {blocks} block sizes"
        )

    def leaves_blocks_to_the_kernel(self, capabilities: "Capabilities") -> bool:
        """Whether its cases leave the block sizes to the kernel: a kernel that needs them given (off a TPU
        generation, ``Capabilities.needs_block_sizes``) gets given ones."""
        return self.kernel_block_sizes and not capabilities.needs_block_sizes

    @property
    def name(self) -> str:
        """The corner in a file name: ``packed-past-2to15-own-blocks``."""
        queries = "packed" if self.packed_queries else "float32"
        side = "past" if self.past else "upto"
        blocks = "own" if self.kernel_block_sizes else "given"
        return f"{queries}-{side}-2to{self.boundary.bit_length() - 1}-{blocks}-blocks"


def is_packed(dtype_name: str) -> bool:
    """Whether values of this dtype are packed several to a 32-bit word (narrower than float32)."""
    return DTYPES[dtype_name].itemsize < 4


def long_corners(capabilities: "Capabilities", bucket: LongBucket = LongBucket()) -> tuple[LongCorner, ...]:
    """The long bucket's corners for a target: each kind of q dtype it takes (float32, packed) x each
    boundary x each side of it, with block sizes alternating between the kernel's own and given ones, so
    that each kind of q dtype meets both (the kernel's own where it chooses them on the backend: a kernel
    that needs block sizes off a TPU generation gets given ones there)."""
    kinds = [packed for packed in (False, True) if any(is_packed(d) == packed for d in capabilities.q_dtypes)]
    corners: list[LongCorner] = []
    for packed in kinds:
        for boundary in bucket.boundaries:
            for past in (False, True):
                corners.append(LongCorner(packed, boundary, past, kernel_block_sizes=len(corners) % 2 == 1))
    return tuple(corners)


LONG_BUCKET = LongBucket()
PRODUCTION_BUCKET = ProductionBucket()
BUCKETS: dict[str, Bucket | LongBucket | ProductionBucket] = {
    "tiny": Bucket(max_num_batched_tokens=8, max_num_seqs=2, max_kv_len=32),
    "small": Bucket(max_num_batched_tokens=32, max_num_seqs=4, max_kv_len=96),
    "medium": Bucket(max_num_batched_tokens=128, max_num_seqs=8, max_kv_len=512),
    "long": LONG_BUCKET,
    "production": PRODUCTION_BUCKET,
}
# Drawn when no selection is made (--rpa-buckets / RPA_BUCKETS), with PROFILE_BUCKETS of the profile.
DEFAULT_BUCKETS = ("tiny", "small")
# Large buckets a profile adds to DEFAULT_BUCKETS when no selection is made: a handful of long examples
# under ci, every large bucket under nightly.
PROFILE_BUCKETS = {"ci": ("long",), "nightly": ("long", "production")}
# Buckets whose examples cost seconds to minutes each on CPU: only the large-shape properties draw them (a
# handful of examples per run, tests/properties/test_production.py); every other property draws the selected
# small buckets, or DEFAULT_BUCKETS when the selection holds only large ones.
LARGE_BUCKETS = ("long", "production")
# Page sizes the small buckets draw (the production bucket has its own).
SMALL_PAGE_SIZES = (1, 2, 4, 8, 16, 32, 64)


class BucketError(ValueError):
    """An unknown bucket name, or a selection the target cannot draw; the message says which and why."""


def parse_buckets(text: str) -> tuple[str, ...]:
    """Bucket names from ``NAME[,NAME...]`` (empty: no selection); unknown names are one error."""
    names = tuple(dict.fromkeys(name.strip() for name in text.split(",") if name.strip()))
    unknown = [name for name in names if name not in BUCKETS]
    if unknown:
        raise BucketError(f"unknown bucket(s) {', '.join(unknown)}; known: {', '.join(BUCKETS)}")
    return names


def select_buckets(capabilities: "Capabilities", text: str, *, profile: str | None = None) -> "Capabilities":
    """``capabilities`` drawing from the buckets named in ``text`` that the target declares.

    No names: DEFAULT_BUCKETS and the profile's PROFILE_BUCKETS, within the declaration. Names
    of which the target declares none raise BucketError (a usage error, nothing would be drawn); declared
    ones among several are kept.
    """
    names = parse_buckets(text)
    if not names:
        defaults = DEFAULT_BUCKETS + (PROFILE_BUCKETS.get(profile, ()) if profile is not None else ())
        chosen = tuple(name for name in defaults if name in capabilities.buckets)
        return dataclasses.replace(capabilities, bucket_selection=chosen or None)
    chosen = tuple(name for name in names if name in capabilities.buckets)
    if not chosen:
        raise BucketError(
            f"{','.join(names)}: the target declares buckets {','.join(capabilities.buckets)} "
            "(Capabilities.buckets) and none of these; choose among the declared ones"
        )
    for name in chosen:
        bucket = BUCKETS[name]
        if isinstance(bucket, ProductionBucket):
            check_production_space(capabilities, bucket)
        if isinstance(bucket, LongBucket):
            check_long_space(capabilities, bucket)
    return dataclasses.replace(capabilities, bucket_selection=chosen)


def drawn_buckets(capabilities: "Capabilities", *, large: bool = False) -> tuple[str, ...]:
    """The selected buckets of one scale: large ones (possibly none) or small ones (never none)."""
    selection = capabilities.bucket_selection or tuple(
        name for name in DEFAULT_BUCKETS if name in capabilities.buckets
    )
    if large:
        return tuple(name for name in selection if name in LARGE_BUCKETS)
    small = tuple(name for name in selection if name not in LARGE_BUCKETS)
    declared = tuple(name for name in capabilities.buckets if name not in LARGE_BUCKETS)
    defaults = tuple(name for name in DEFAULT_BUCKETS if name in declared)
    return small or defaults or declared


# The options a target may take at run time (Capabilities.runtime_options): the ones that only weigh numbers.
RUNTIME_OPTIONS = ("sm_scale", "sliding_window", "soft_cap", "mask_value", "k_scale", "v_scale")


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What a target supports; strategies draw only inside it. Defaults: the whole specified space."""

    head_dims: tuple[int, ...] = (64, 128, 256)
    page_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    q_dtypes: tuple[str, ...] = ("float32", "bfloat16")
    kv_dtypes: tuple[str, ...] = ("float32", "bfloat16", "float8_e4m3fn", "float8_e5m2")
    num_kv_heads: tuple[int, ...] = (1, 2, 4, 8)
    gqa_ratios: tuple[int, ...] = (1, 2, 3, 4, 8)
    # Whether num_kv_heads must be even for 8-bit KV (upstream: combined heads must tile the packing).
    even_kv_heads_for_fp8: bool = False
    # Whether both block sizes must be given (upstream's default lookup needs a TPU).
    needs_block_sizes: bool = False
    # The smallest page size at which the long bucket may leave block sizes to the kernel (None); 0: any.
    # For a kernel whose default KV block at long contexts is a fixed number of keys, copied page by page
    # (each copy unrolled), small pages make one call take the interpreters minutes; below this page size
    # the long bucket draws tuned block sizes (the small buckets still draw None).
    min_page_size_for_long_default_blocks: int = 0
    # Whether k_scale and v_scale must be given together when q's dtype differs from the KV dtype
    # (upstream casts only the scaled side to q's dtype, then fails `assert k.dtype == v.dtype`).
    paired_kv_scales_for_mixed_dtypes: bool = False
    # Whether page_size must be a multiple of the KV dtype's values per 32-bit word (a cache that packs
    # them: bfloat16 2, fp8 4); page sizes a KV dtype cannot use are not drawn with it.
    page_size_multiple_of_kv_packing: bool = False
    # Whether a live sequence may have q_len == 0 (a target may require 0 < q_len <= kv_len).
    empty_sequences: bool = True
    # What the target's mask_value means (rpa_harness.spec.interface.MASK_VALUE_MEANINGS): upstream adds it to
    # a masked logit, a target may replace the logit with it. Cases carry the meaning (mask_value_meaning)
    # so that the judges compute it.
    mask_value_meaning: str = MASK_ADDED
    # Whether the target takes q_scale (an extension option: a quantised query).
    q_scale: bool = False
    # Whether the target takes attention_sink (an extension option: one logit per q head that joins the
    # softmax denominator with no value).
    attention_sink: bool = False
    # Whether the target takes each of these extension options (rpa_harness.spec.interface.Options says what
    # each means): non-causal attention (use_causal_mask=False), an accumulator dtype (out_dtype), the KV
    # mask skipped (skip_kv_mask, drawn with non-causal attention and whole-KV-block kv_lens), a chunked
    # prefill kernel (chunk_prefill_size, drawn as the q_len of the first sequence after the decodes) and
    # a cache that is read, not written (update_kv_cache=False).
    non_causal: bool = False
    out_dtype: bool = False
    skip_kv_mask: bool = False
    chunk_prefill_size: bool = False
    update_kv_cache: bool = False
    # Whether a K/V scale has upstream's meaning: the scaled cache is rounded to q's dtype. If not
    # (a kernel may fold k_scale into the score scale and apply v_scale after P @ V, unrounded), no
    # scale is drawn where that rounding is lossy, i.e. where the KV dtype is wider than q's.
    kv_scales_round_to_q_dtype: bool = True
    # The buckets the target can run (names of BUCKETS); ``bucket_selection`` is what is drawn (set by
    # ``select_buckets`` from --rpa-buckets; None: DEFAULT_BUCKETS within ``buckets``).
    buckets: tuple[str, ...] = ("tiny", "small")
    bucket_selection: tuple[str, ...] | None = None
    # The backends (rpa_harness.backends names) the target is declared to run on; elsewhere its numeric
    # properties are skipped as "cannot run" (declared). Any other error on valid input is a failure.
    backends: tuple[str, ...] = ("interpret", "fast-interpret", "tpu")
    # Opt-ins beyond the specified behaviour: the specification's stricter ValueErrors (the rules upstream
    # asserts or accepts), and lowering to Mosaic on CPU.
    strict_validation: bool = False
    lowers_for_tpu: bool = False
    # Options whose values the target takes at run time (calls differing only in them share a compilation;
    # whether each is None may still be static). Not a narrowing: the cases of a whole-space group
    # (valid_case_groups) vary these values, which costs a compilation per value where they are static.
    runtime_options: tuple[str, ...] = ()
    # The TPU generations whose code paths the kernel has (it asks which chip it is on while traced): the
    # interpreters emulate them (rpa_harness.generations; names as jax's tpu_info.ChipVersion values,
    # checked where the target is loaded). Empty: the kernel does not ask, a CPU device is enough.
    tpu_generations: tuple[str, ...] = ()

    def __post_init__(self):
        """Capabilities only narrow the specified space: each choice is a non-empty subset of the default
        (buckets: of BUCKETS). Checked here, once, so that a typo is one clear error instead of a strategy
        that draws nothing or a dtype no case can build."""
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, tuple) or field.name == "tpu_generations":  # jax knows the names
                continue
            allowed = {
                "buckets": tuple(BUCKETS),
                "bucket_selection": tuple(BUCKETS),
                "runtime_options": RUNTIME_OPTIONS,
            }.get(field.name, field.default)
            unknown = [v for v in value if v not in allowed]
            if unknown or (not value and field.name != "runtime_options"):
                problem = (
                    f"{unknown} not in the specified space" if unknown else "empty, so nothing can be drawn"
                )
                raise ValueError(
                    f"Capabilities({field.name}={value!r}): {problem}; choose a non-empty subset of {allowed}."
                )
        if self.bucket_selection and not set(self.bucket_selection) <= set(self.buckets):
            raise ValueError(
                f"Capabilities(bucket_selection={self.bucket_selection!r}) draws buckets the target does not "
                f"declare (buckets={self.buckets!r}); select among the declared ones."
            )
        if self.mask_value_meaning not in MASK_VALUE_MEANINGS:
            raise ValueError(
                f"Capabilities(mask_value_meaning={self.mask_value_meaning!r}): choose one of {MASK_VALUE_MEANINGS}."
            )
        fp8 = [d for d in self.kv_dtypes if d.startswith("float8")]
        if self.even_kv_heads_for_fp8 and fp8 and not any(h % 2 == 0 for h in self.num_kv_heads):
            raise ValueError(
                f"Capabilities(num_kv_heads={self.num_kv_heads!r}, even_kv_heads_for_fp8=True, kv_dtypes "
                f"{fp8}): no even num_kv_heads for the 8-bit KV dtypes; add one or drop those dtypes."
            )


WHOLE_SPACE = Capabilities()  # the default of every strategy: the whole specified space

SM_SCALES = (1.0, 0.125, 0.05)
SLIDING_WINDOWS = (1, 5, 16, 1 << 20)  # one key, small, medium, longer than every kv_len
SOFT_CAPS = (30.0, 5.0, 1.0)
MASK_VALUES = (None, -1e4, -2.0)  # besides the default, drawn first
KV_SCALES = (0.5, 2.0, 0.0625)
# q / q_scale is clipped to the KV dtype's range: 0.01 clips |q| > 4.48 for fp8 e4m3fn (max 448), 1e-4 clips
# most of q for e4m3fn and |q| > 5.7 for e5m2 (max 57344); 0.3 is inexact in every dtype.
Q_SCALES = (0.5, 2.0, 0.3, 0.01, 1e-4)
# Attention sink logits, drawn per q head: from no weight at all (-inf, -1e30, a large finite negative)
# through the range of the rows' logits to dominating every row (100 leaves the keys weights below
# float32's normal range, 1e4 leaves them none).
SINK_LOGITS = (0.0, float("-inf"), -1e30, -1e4, -3.0, 1.0, 5.0, 30.0, 100.0, 1e4)
QUERY_BLOCKS = (8, 1, 3, 16, 32)
CHUNK_PREFILL_SIZES = (8, 2, 16)  # replaced by a layout's prefill q_len where it has one
VMEM_LIMITS = (32 * 2**20, 64 * 2**20)
# What options() draws each option's value from when it is set (None, the default mask, is a value too).
_RUNTIME_OPTION_VALUES = dict(
    sm_scale=SM_SCALES,
    sliding_window=SLIDING_WINDOWS,
    soft_cap=SOFT_CAPS,
    mask_value=(DEFAULT_MASK_VALUE, *MASK_VALUES),
    k_scale=KV_SCALES,
    v_scale=KV_SCALES,
)


def optional(values) -> st.SearchStrategy:
    """None (the simplest), or one of ``values``."""
    return st.one_of(st.none(), st.sampled_from(values))


def make_config(
    bucket: str, page_size: int, num_kv_heads: int, gqa_ratio: int, head_dim: int, q_dtype: str, kv_dtype: str
) -> dict:
    """The static Case fields for a small bucket and head layout (a large bucket's are drawn per example:
    ``production_configs``, ``long_configs``)."""
    capacity = BUCKETS[bucket]
    assert isinstance(capacity, Bucket), f"{bucket!r} is a large bucket: its configs are drawn"
    pages_per_seq = math.ceil(capacity.max_kv_len / page_size) + 1  # one page more than the longest needs
    return dict(
        max_num_batched_tokens=capacity.max_num_batched_tokens,
        max_num_seqs=capacity.max_num_seqs,
        pages_per_seq=pages_per_seq,
        total_num_pages=capacity.max_num_seqs * pages_per_seq + 3,  # spare pages never referenced
        page_size=page_size,
        num_q_heads=num_kv_heads * gqa_ratio,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        q_dtype=q_dtype,
        kv_dtype=kv_dtype,
    )


def _kv_dtypes_for(capabilities: Capabilities, page_size: int) -> tuple[str, ...]:
    if capabilities.page_size_multiple_of_kv_packing:
        return tuple(d for d in capabilities.kv_dtypes if page_size % values_per_word(d) == 0)
    return capabilities.kv_dtypes


def _page_sizes_for(capabilities: Capabilities, kv_dtype: str) -> tuple[int, ...]:
    return tuple(p for p in capabilities.page_sizes if kv_dtype in _kv_dtypes_for(capabilities, p))


def _kv_heads_for(capabilities: Capabilities, kv_dtype: str) -> tuple[int, ...]:
    if capabilities.even_kv_heads_for_fp8 and kv_dtype.startswith("float8"):
        return tuple(h for h in capabilities.num_kv_heads if h % 2 == 0)
    return capabilities.num_kv_heads


def _small_page_sizes(capabilities: Capabilities) -> tuple[int, ...]:
    return tuple(p for p in capabilities.page_sizes if p in SMALL_PAGE_SIZES) or capabilities.page_sizes


@st.composite
def static_configs(draw, capabilities: Capabilities = WHOLE_SPACE, *, buckets=None) -> dict:
    """Static shapes and dtypes: the part that decides which compiled kernel runs.

    ``buckets`` default to the selected small ones (``drawn_buckets``); a large bucket named here is drawn
    with ``production_configs`` or ``long_configs``."""
    return draw(bucketed_configs(capabilities, buckets=buckets))[1]


@st.composite
def bucketed_configs(draw, capabilities: Capabilities = WHOLE_SPACE, *, buckets=None) -> tuple[str, dict]:
    """(bucket name, static config): see ``static_configs``."""
    bucket = draw(st.sampled_from(buckets or drawn_buckets(capabilities)))
    capacity = BUCKETS[bucket]
    if isinstance(capacity, ProductionBucket):
        return bucket, draw(production_configs(capabilities, capacity))
    if isinstance(capacity, LongBucket):
        return bucket, draw(long_configs(capabilities, capacity))
    page_size = draw(
        st.sampled_from([p for p in _small_page_sizes(capabilities) if _kv_dtypes_for(capabilities, p)])
    )
    kv_dtype = draw(st.sampled_from(_kv_dtypes_for(capabilities, page_size)))
    num_kv_heads = draw(st.sampled_from(_kv_heads_for(capabilities, kv_dtype)))
    ratio = draw(st.sampled_from(capabilities.gqa_ratios))
    head_dim = draw(st.sampled_from(capabilities.head_dims))
    q_dtype = draw(st.sampled_from(capabilities.q_dtypes))
    return bucket, make_config(bucket, page_size, num_kv_heads, ratio, head_dim, q_dtype, kv_dtype)


def page_bytes(page_size: int, num_kv_heads: int, head_dim: int, kv_dtype: str) -> int:
    """Bytes of one page of the combined K/V cache."""
    return page_size * 2 * num_kv_heads * head_dim * DTYPES[kv_dtype].itemsize


def production_heads(capabilities: Capabilities, bucket: ProductionBucket, kv_dtype: str):
    """(num_kv_heads, gqa_ratio) pairs the target supports with num_q_heads in the bucket's range, fewest
    q heads first."""
    low, high = bucket.q_heads
    pairs = [(h, r) for h in _kv_heads_for(capabilities, kv_dtype) for r in capabilities.gqa_ratios]
    return sorted(((h, r) for h, r in pairs if low <= h * r <= high), key=lambda p: (p[0] * p[1], p))


def check_production_space(capabilities: Capabilities, bucket: ProductionBucket) -> None:
    """Raises BucketError if the target supports no production head layout, head_dim or page size."""
    missing = []
    if not any(production_heads(capabilities, bucket, d) for d in capabilities.kv_dtypes):
        missing.append(f"num_q_heads in {bucket.q_heads[0]}..{bucket.q_heads[1]}")
    if not set(capabilities.head_dims) & set(bucket.head_dims):
        missing.append(f"head_dim in {bucket.head_dims}")
    if not set(capabilities.page_sizes) & set(bucket.page_sizes):
        missing.append(f"page_size in {bucket.page_sizes}")
    if missing:
        raise BucketError(
            f"the production bucket needs {', '.join(missing)}, which the target's Capabilities exclude; "
            "select another bucket"
        )


@st.composite
def production_configs(draw, capabilities: Capabilities, bucket: ProductionBucket) -> dict:
    """A serving-scale static config within the bucket's budgets (see ``ProductionBucket``).

    Drawn so that shrinking moves to the smallest: float32, fewest q heads, head_dim 128, page size 16,
    256 slots, the shortest model length and token budget. Page sizes and slot counts whose cache would
    not hold two pages per slot within ``kv_cache_bytes`` are left out, and token budgets whose result
    would exceed ``max_output_elements``.
    """
    check_production_space(capabilities, bucket)
    kv_dtype = draw(
        st.sampled_from([d for d in capabilities.kv_dtypes if production_heads(capabilities, bucket, d)])
    )
    q_dtype = draw(st.sampled_from(capabilities.q_dtypes))
    num_kv_heads, ratio = draw(st.sampled_from(production_heads(capabilities, bucket, kv_dtype)))
    head_dim = draw(st.sampled_from([d for d in capabilities.head_dims if d in bucket.head_dims]))

    def fits(page_size, slots):
        return 2 * slots * page_bytes(page_size, num_kv_heads, head_dim, kv_dtype) <= bucket.kv_cache_bytes

    smallest_slots = min(bucket.seq_slots)
    page_sizes = [p for p in _page_sizes_for(capabilities, kv_dtype) if p in bucket.page_sizes]
    page_size = draw(st.sampled_from([p for p in page_sizes if fits(p, smallest_slots)] or page_sizes[:1]))
    max_num_seqs = draw(
        st.sampled_from([n for n in bucket.seq_slots if fits(page_size, n)] or [smallest_slots])
    )
    max_model_len = draw(st.sampled_from(bucket.max_model_lens))
    num_q_heads = num_kv_heads * ratio
    tokens = [t for t in bucket.token_budgets if t * num_q_heads * head_dim <= bucket.max_output_elements]
    max_num_batched_tokens = draw(st.sampled_from(tokens or [min(bucket.token_budgets)]))
    pages_per_seq = max(1, max_model_len // page_size)
    cache_pages = bucket.kv_cache_bytes // page_bytes(page_size, num_kv_heads, head_dim, kv_dtype)
    return dict(
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        pages_per_seq=pages_per_seq,
        total_num_pages=max(1, min(max_num_seqs * pages_per_seq, cache_pages)),
        page_size=page_size,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        q_dtype=q_dtype,
        kv_dtype=kv_dtype,
    )


def long_layouts_of(
    capabilities: Capabilities, bucket: LongBucket, kv_dtype: str
) -> list[tuple[int, int, int]]:
    """(num_kv_heads, gqa_ratio, head_dim) the target supports whose cache holds one sequence of the model
    length within the bucket's bytes, fewest q heads and smallest head_dim first."""
    key_bytes = page_bytes(1, 1, 1, kv_dtype)
    found = [
        (h, r, d)
        for h in _kv_heads_for(capabilities, kv_dtype)
        for r in capabilities.gqa_ratios
        for d in capabilities.head_dims
        if d in bucket.head_dims
        and h * r <= bucket.max_q_heads
        and key_bytes * h * d * bucket.max_model_len <= bucket.kv_cache_bytes
    ]
    return sorted(found, key=lambda layout: (layout[0] * layout[1], layout[2], layout))


def check_long_space(capabilities: Capabilities, bucket: LongBucket) -> None:
    """Raises BucketError if the target supports no long head layout or page size."""
    missing = []
    if not any(long_layouts_of(capabilities, bucket, d) for d in capabilities.kv_dtypes):
        missing.append(
            f"a head layout with at most {bucket.max_q_heads} q heads and head_dim in {bucket.head_dims} "
            f"whose {bucket.max_model_len}-key sequence fits {bucket.kv_cache_bytes // 2**20} MiB"
        )
    if not any(
        set(_page_sizes_for(capabilities, d)) & set(bucket.page_sizes) for d in capabilities.kv_dtypes
    ):
        missing.append(f"page_size in {bucket.page_sizes}")
    if missing:
        raise BucketError(
            f"the long bucket needs {' and '.join(missing)}, which the target's Capabilities exclude; "
            "select another bucket"
        )


@st.composite
def long_configs(
    draw, capabilities: Capabilities, bucket: LongBucket, corner: LongCorner | None = None
) -> dict:
    """A long-context static config within the bucket's budgets (see ``LongBucket``), shrinking toward
    float32, fewest q heads, the smallest head_dim, page size, slot count and token budget. In a ``corner``:
    its kind of q dtype, and page sizes at which the kernel may choose its block sizes if it is to."""
    check_long_space(capabilities, bucket)
    own_blocks = corner is not None and corner.leaves_blocks_to_the_kernel(capabilities)
    smallest_page = capabilities.min_page_size_for_long_default_blocks if own_blocks else 0

    def page_sizes(kv_dtype):
        return [
            p
            for p in _page_sizes_for(capabilities, kv_dtype)
            if p in bucket.page_sizes and p >= smallest_page
        ]

    kv_dtypes = [
        d for d in capabilities.kv_dtypes if long_layouts_of(capabilities, bucket, d) and page_sizes(d)
    ]
    kv_dtype = draw(st.sampled_from(kv_dtypes))
    q_dtypes = [d for d in capabilities.q_dtypes if corner is None or is_packed(d) == corner.packed_queries]
    q_dtype = draw(st.sampled_from(q_dtypes))
    num_kv_heads, ratio, head_dim = draw(st.sampled_from(long_layouts_of(capabilities, bucket, kv_dtype)))
    page_size = draw(st.sampled_from(page_sizes(kv_dtype)))
    max_num_seqs = draw(st.sampled_from(bucket.seq_slots))
    pages_per_seq = bucket.max_model_len // page_size
    cache_pages = bucket.kv_cache_bytes // page_bytes(page_size, num_kv_heads, head_dim, kv_dtype)
    return dict(
        max_num_batched_tokens=draw(st.sampled_from(bucket.token_budgets)),
        max_num_seqs=max_num_seqs,
        pages_per_seq=pages_per_seq,
        total_num_pages=min(max_num_seqs * pages_per_seq, cache_pages),
        page_size=page_size,
        num_q_heads=num_kv_heads * ratio,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        q_dtype=q_dtype,
        kv_dtype=kv_dtype,
    )


@st.composite
def long_layouts(
    draw, config: dict, bucket: LongBucket, corner: LongCorner | None = None
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Decodes and short prefill chunks, each against a short context or one a few keys from 2^15, 2^16
    or the model length (``bucket.boundaries``): its query positions ``[kv_len - q_len, kv_len)`` lie
    below the boundary, across it or past it. Sequences are fitted in order to the rows, pages and work
    left (a chunk gets fewer rows, a context fewer keys); shrinking makes every context short, then one
    decode. In a ``corner`` the first sequence's context is the longest: within two keys up to its
    boundary, or past it with its last query position at or past it (shrinking toward one key past); the
    others are short."""
    capacity = config["pages_per_seq"] * config["page_size"]
    rows_left, pages_left = config["max_num_batched_tokens"], config["total_num_pages"]
    work_left = bucket.max_work // config["num_q_heads"]  # sum of q_len * kv_len
    near = st.sampled_from((None, *(b for b in bucket.boundaries if b < capacity), capacity))
    q_lens: list[int] = []
    kv_lens: list[int] = []
    for _ in range(draw(st.integers(1, config["max_num_seqs"]))):
        longest = min(capacity, pages_left * config["page_size"])
        if rows_left == 0 or longest == 0 or work_left == 0:
            break
        q_len = draw(st.integers(2, rows_left)) if rows_left > 1 and draw(st.booleans()) else 1
        if corner is None:
            target = draw(near)
        else:  # the corner's context first, then short ones
            target = None if q_lens else corner.boundary
        if target is None:
            kv_len = draw(st.integers(0, min(capacity, 1024)))
        elif corner:
            q_len = max(1, min(q_len, work_left // target))
            kv_len = target + (draw(st.integers(1, q_len + 1)) if corner.past else -draw(st.integers(0, 2)))
        else:
            q_len = max(1, min(q_len, work_left // target))
            kv_len = target + draw(st.integers(-2, q_len + 1))
        q_len = max(1, min(q_len, longest, work_left // max(1, min(kv_len, longest))))
        kv_len = max(q_len, min(kv_len, longest, work_left // q_len))
        if q_len * kv_len > work_left:  # even q_len keys for its rows exceed the work left
            break
        q_lens.append(q_len)
        kv_lens.append(kv_len)
        rows_left -= q_len
        pages_left -= -(-kv_len // config["page_size"])
        work_left -= q_len * kv_len
    return tuple(q_lens), tuple(kv_lens)


# Block sizes as upstream tunes them: every (num_kv_pages_per_block, num_queries_per_block) value in jax's
# tuned table (TPU v5e and v6e) and its untuned default (128, 32), clipped as upstream clips them (to
# pages_per_seq and max_num_batched_tokens). A KV block is kept to at most TUNED_MAX_BLOCK_KEYS keys, the
# table's largest (16 pages of 256); the default of 128 pages applies to small pages.
TUNED_KV_PAGES_PER_BLOCK = (4, 8, 16, 128)
TUNED_QUERIES_PER_BLOCK = (32, 64, 128, 256)
TUNED_MAX_BLOCK_KEYS = 4096


def tuned_block_sizes(config: dict) -> st.SearchStrategy[dict]:
    """A (num_kv_pages_per_block, num_queries_per_block) pair from upstream's tuned values for a config."""
    kv_pages = sorted(
        {
            min(p, config["pages_per_seq"])
            for p in TUNED_KV_PAGES_PER_BLOCK
            if p * config["page_size"] <= TUNED_MAX_BLOCK_KEYS
        }
        or {1}
    )
    queries = sorted({min(q, config["max_num_batched_tokens"]) for q in TUNED_QUERIES_PER_BLOCK})
    return st.fixed_dictionaries(
        dict(num_kv_pages_per_block=st.sampled_from(kv_pages), num_queries_per_block=st.sampled_from(queries))
    )


@st.composite
def production_block_sizes(
    draw, config: dict, capabilities: Capabilities = WHOLE_SPACE, *, kernel_defaults: bool = True
) -> dict:
    """Block sizes for a production or long config: left to the kernel (None, what shrinking moves to)
    where the target picks its own and ``kernel_defaults`` allows it, else (or sometimes) upstream's tuned
    values."""
    if kernel_defaults and not capabilities.needs_block_sizes and draw(st.booleans()) is False:
        return dict(num_kv_pages_per_block=None, num_queries_per_block=None)
    return draw(tuned_block_sizes(config))


# A fixed pool of compiled configurations (static config + options) that together touch every feature.
# Properties that need volume draw from it, so that hundreds of ragged layouts reuse a few compiled
# kernels; the first entry is the simplest and is what shrinking moves toward.
POOL: tuple[tuple[dict[str, Any], dict[str, Any]], ...] = (
    (dict(bucket="tiny", page_size=16, num_kv_heads=1, gqa_ratio=1, head_dim=64, q_dtype="float32",
          kv_dtype="float32"), {}),
    (dict(bucket="small", page_size=8, num_kv_heads=2, gqa_ratio=4, head_dim=128, q_dtype="float32",
          kv_dtype="float32"), dict(sliding_window=5, num_queries_per_block=8, num_kv_pages_per_block=3)),
    (dict(bucket="small", page_size=4, num_kv_heads=4, gqa_ratio=2, head_dim=64, q_dtype="bfloat16",
          kv_dtype="bfloat16"), dict(soft_cap=30.0, sm_scale=0.125)),
    (dict(bucket="small", page_size=2, num_kv_heads=2, gqa_ratio=3, head_dim=128, q_dtype="bfloat16",
          kv_dtype="float8_e4m3fn"), dict(k_scale=0.5, v_scale=2.0, q_scale=0.01, num_queries_per_block=3)),
    (dict(bucket="small", page_size=32, num_kv_heads=2, gqa_ratio=1, head_dim=256, q_dtype="float32",
          kv_dtype="float8_e5m2"), dict(mask_value=-2.0, num_kv_pages_per_block=1, num_queries_per_block=16)),
    (dict(bucket="small", page_size=64, num_kv_heads=8, gqa_ratio=1, head_dim=128, q_dtype="float32",
          kv_dtype="float32"), dict(mask_value=None, sliding_window=16, soft_cap=5.0, vmem_limit_bytes=32 * 2**20)),
    (dict(bucket="tiny", page_size=1, num_kv_heads=1, gqa_ratio=8, head_dim=64, q_dtype="float32",
          kv_dtype="bfloat16"), dict(num_queries_per_block=1, sm_scale=0.05)),
    # A quantised query scaled up 10^4 into a bfloat16 cache: where a compiler's quotient rounds otherwise
    # than IEEE's, one element moves by a bfloat16 ulp of a value near 10^4 (the oracle's query doubt).
    (dict(bucket="tiny", page_size=16, num_kv_heads=2, gqa_ratio=3, head_dim=256, q_dtype="float32",
          kv_dtype="bfloat16"), dict(q_scale=1e-4)),
    # Attention sinks from no weight to dominating the row, cycled over the q heads (pool() fits them).
    (dict(bucket="small", page_size=8, num_kv_heads=2, gqa_ratio=4, head_dim=64, q_dtype="bfloat16",
          kv_dtype="bfloat16"), dict(attention_sink=(1.0, -1e30, 5.0, 100.0, float("-inf"), -3.0, 0.0, 30.0),
                                     sliding_window=16)),
)  # fmt: skip


def _nearest(value, allowed):
    return min(allowed, key=lambda a: (abs(a - value), a))


def required_block_sizes(config: dict) -> dict:
    """Block sizes for a target that needs both given (upstream's default lookup needs a TPU)."""
    return dict(num_kv_pages_per_block=min(2, config["pages_per_seq"]), num_queries_per_block=8)


def pool(capabilities: Capabilities = WHOLE_SPACE) -> list[tuple[dict, dict]]:
    """POOL moved inside a target's capabilities (nearest supported head_dim, page size, heads, dtypes); an
    entry that exists only for an option the target does not take is left out."""
    entries = []
    for layout, opts in POOL:
        layout = dict(layout)
        if layout["q_dtype"] not in capabilities.q_dtypes:
            layout["q_dtype"] = capabilities.q_dtypes[0]
        if layout["kv_dtype"] not in capabilities.kv_dtypes:
            layout["kv_dtype"] = capabilities.kv_dtypes[0]
        layout["head_dim"] = _nearest(layout["head_dim"], capabilities.head_dims)
        layout["page_size"] = _nearest(layout["page_size"], _page_sizes_for(capabilities, layout["kv_dtype"]))
        layout["num_kv_heads"] = _nearest(
            layout["num_kv_heads"], _kv_heads_for(capabilities, layout["kv_dtype"])
        )
        layout["gqa_ratio"] = _nearest(layout["gqa_ratio"], capabilities.gqa_ratios)
        if layout["bucket"] not in drawn_buckets(capabilities):
            layout["bucket"] = drawn_buckets(capabilities)[0]
        config = make_config(**layout)
        opts = dict(opts)
        if capabilities.mask_value_meaning != MASK_ADDED:
            opts["mask_value_meaning"] = capabilities.mask_value_meaning
        if not capabilities.q_scale:
            if set(opts) == {"q_scale"}:
                continue  # an entry that exists for its quantised query
            opts.pop("q_scale", None)
        if "attention_sink" in opts:
            if not capabilities.attention_sink:
                continue  # an entry that exists for its sinks
            opts["attention_sink"] = _sinks_for(opts["attention_sink"], config["num_q_heads"])
        if capabilities.needs_block_sizes:
            opts = {**required_block_sizes(config), **opts}
        if "num_kv_pages_per_block" in opts:
            opts["num_kv_pages_per_block"] = min(opts["num_kv_pages_per_block"], config["pages_per_seq"])
        if _kv_scales_paired(capabilities, config) and ("k_scale" in opts) != ("v_scale" in opts):
            opts.pop("k_scale", None)
            opts.pop("v_scale", None)
        if _kv_scales_unspecified(capabilities, config):
            opts.pop("k_scale", None)
            opts.pop("v_scale", None)
        entries.append((config, opts))
    return entries


def _sinks_for(logits: tuple[float, ...], num_q_heads: int) -> tuple[float, ...]:
    """One sink logit per q head, cycling through ``logits``."""
    return tuple(logits[h % len(logits)] for h in range(num_q_heads))


def _kv_scales_paired(capabilities: Capabilities, config: dict) -> bool:
    return capabilities.paired_kv_scales_for_mixed_dtypes and config["q_dtype"] != config["kv_dtype"]


def _kv_scales_unspecified(capabilities: Capabilities, config: dict) -> bool:
    """Where the target's scales mean something other than upstream's: a lossy rounding it skips."""
    wider = DTYPES[config["kv_dtype"]].itemsize > DTYPES[config["q_dtype"]].itemsize
    return not capabilities.kv_scales_round_to_q_dtype and wider


@st.composite
def options(draw, config: dict, capabilities: Capabilities = WHOLE_SPACE) -> dict:
    """Keyword options; each shrinks to its upstream default."""
    drawn = dict(
        sm_scale=draw(st.sampled_from(SM_SCALES)),
        sliding_window=draw(optional(SLIDING_WINDOWS)),
        soft_cap=draw(optional(SOFT_CAPS)),
        mask_value=draw(st.one_of(st.just(DEFAULT_MASK_VALUE), st.sampled_from(MASK_VALUES))),
        k_scale=draw(optional(KV_SCALES)),
        v_scale=draw(optional(KV_SCALES)),
        vmem_limit_bytes=draw(optional(VMEM_LIMITS)),
    )
    if capabilities.mask_value_meaning != MASK_ADDED:
        drawn["mask_value_meaning"] = capabilities.mask_value_meaning
    if capabilities.q_scale:
        drawn["q_scale"] = draw(optional(Q_SCALES))
    if capabilities.attention_sink and draw(st.booleans()):
        sink = st.sampled_from(SINK_LOGITS)
        drawn["attention_sink"] = tuple(draw(sink) for _ in range(config["num_q_heads"]))
    if capabilities.non_causal:
        drawn["use_causal_mask"] = draw(st.sampled_from((True, False)))
    if capabilities.out_dtype:
        drawn["out_dtype"] = draw(optional(OUT_DTYPES))
    if capabilities.update_kv_cache:
        drawn["update_kv_cache"] = draw(st.sampled_from((True, False)))
    if capabilities.chunk_prefill_size and draw(st.booleans()):
        drawn["chunk_prefill_size"] = draw(st.sampled_from(CHUNK_PREFILL_SIZES))  # fit_options_to_layout
    if _kv_scales_paired(capabilities, config) and (drawn["k_scale"] is None) != (drawn["v_scale"] is None):
        drawn["k_scale"] = drawn["v_scale"] = None
    if _kv_scales_unspecified(capabilities, config):
        drawn["k_scale"] = drawn["v_scale"] = None
    kv_blocks = st.integers(1, min(4, config["pages_per_seq"])) | st.just(config["pages_per_seq"])
    query_blocks = st.sampled_from(QUERY_BLOCKS)
    if capabilities.needs_block_sizes:
        drawn["num_kv_pages_per_block"] = draw(kv_blocks)
        drawn["num_queries_per_block"] = draw(query_blocks)
    else:
        drawn["num_kv_pages_per_block"] = draw(st.none() | kv_blocks)
        drawn["num_queries_per_block"] = draw(st.none() | query_blocks)
    if capabilities.skip_kv_mask and drawn.get("use_causal_mask") is False:
        drawn["skip_kv_mask"] = draw(st.booleans())  # kept only with a KV block: fit_options_to_layout
    return drawn


def whole_kv_blocks(q_lens, kv_lens, *, block_keys: int, capacity: int, page_size: int, total_pages: int):
    """The layout with every kv_len a whole number of ``block_keys`` (rounded up where the page table holds
    it, else down, never below one block) and each q_len within its kv_len; trailing sequences are dropped
    while the cache's ``total_pages`` cannot hold them."""
    fitted = []
    for q_len, kv_len in zip(q_lens, kv_lens, strict=True):
        up = -(-kv_len // block_keys) * block_keys
        kv_len = max(up if up <= capacity else kv_len // block_keys * block_keys, block_keys)
        fitted.append((min(q_len, kv_len), kv_len))
    while fitted and sum(-(-kv // page_size) for _, kv in fitted) > total_pages:
        fitted.pop()
    return tuple(q for q, _ in fitted), tuple(kv for _, kv in fitted)


def fit_options_to_layout(case: Case, chunk_from_layout: bool = False) -> Case:
    """``case`` made valid for the options whose meaning depends on its layout.

    ``skip_kv_mask`` promises whole KV blocks: it is dropped without an explicit KV block, else the
    kv_lens are rounded to whole blocks. With ``chunk_from_layout``, a drawn ``chunk_prefill_size`` becomes
    the q_len of the first sequence after the leading decodes, so that the chunked-prefill kernel has a
    sequence to run (a batch of decodes keeps the drawn size: that kernel then runs no sequence).
    """
    if case.skip_kv_mask:
        if case.num_kv_pages_per_block is None:
            case = dataclasses.replace(case, skip_kv_mask=False)
        else:
            q_lens, kv_lens = whole_kv_blocks(
                case.q_lens,
                case.kv_lens,
                block_keys=case.num_kv_pages_per_block * case.page_size,
                capacity=case.kv_capacity,
                page_size=case.page_size,
                total_pages=case.total_num_pages,
            )
            case = dataclasses.replace(case, q_lens=q_lens, kv_lens=kv_lens)
    if chunk_from_layout and case.chunk_prefill_size is not None:
        decodes = next((i for i, q_len in enumerate(case.q_lens) if q_len != 1), len(case.q_lens))
        if decodes < len(case.q_lens) and case.q_lens[decodes] > 0:
            case = dataclasses.replace(case, chunk_prefill_size=case.q_lens[decodes])
    return case


def kv_lengths(capacity: int, boundaries: tuple[int, ...], shortest: int = 0) -> st.SearchStrategy[int]:
    """A kv_len in [shortest, capacity]: uniform, or on/next to a page or KV-block boundary."""
    near_boundary = st.tuples(st.sampled_from(boundaries), st.sampled_from((0, -1, 1))).map(
        lambda b: min(max(b[0] + b[1], shortest), capacity)
    )
    return st.one_of(st.integers(shortest, capacity), near_boundary)


@st.composite
def sequence(draw, capacity: int, boundaries: tuple[int, ...], empty: bool = True) -> tuple[int, int]:
    """One sequence's (q_len, kv_len): decode, prefill, or a chunk of a longer prompt (empty if allowed)."""
    kv_len = draw(kv_lengths(capacity, boundaries, shortest=0 if empty else 1))
    kind = draw(st.sampled_from(("decode", "prefill", "chunk")))
    q_len = {
        "decode": min(kv_len, 1),
        "prefill": kv_len,
        "chunk": draw(st.integers(0 if empty else 1, kv_len)),
    }[kind]
    return q_len, kv_len


@st.composite
def layouts(
    draw, config: dict, kv_block_pages: int | None = None, *, empty_sequences: bool = True
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The ragged layout: up to max_num_seqs sequences whose query rows fit the token budget.

    Query lengths are clipped to the rows left, in order, so every draw is valid by construction; without
    ``empty_sequences`` the sequences that would get no row are dropped.
    """
    page_size, capacity = config["page_size"], config["pages_per_seq"] * config["page_size"]
    boundary_pages = {1, 2, config["pages_per_seq"] - 1, config["pages_per_seq"]}
    if kv_block_pages:
        boundary_pages |= {kv_block_pages, 2 * kv_block_pages}
    boundaries = tuple(sorted(p * page_size for p in boundary_pages if 0 < p * page_size <= capacity))
    seqs = draw(
        st.lists(sequence(capacity, boundaries, empty_sequences), min_size=1, max_size=config["max_num_seqs"])
    )
    if draw(st.integers(0, 15)) == 15:  # an empty batch (num_seqs = 0) is valid; 1 in 16, shrinks away
        seqs = []
    rows_left = config["max_num_batched_tokens"]
    q_lens, kv_lens = [], []
    for q_len, kv_len in seqs:
        if not empty_sequences and rows_left == 0:
            break
        q_len = min(q_len, rows_left)
        rows_left -= q_len
        q_lens.append(q_len)
        kv_lens.append(kv_len)
    return tuple(q_lens), tuple(kv_lens)


@st.composite
def production_layouts(
    draw, config: dict, bucket: ProductionBucket
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A serving batch: mostly decode, a few long prefills, fitted to the bucket's page and work budgets.

    Decode sequences (one query row) have contexts log-uniform up to the model length; up to four prefill
    chunks share the rows left, each a fresh prompt or the continuation of a cached one; decodes come first,
    as vLLM orders them. Three switches the shrinker can turn off put in the edge cases of scale: every
    sequence slot live (the last slot included), one sequence as long as the budgets allow (many KV blocks,
    hundreds of pages), and every page of the cache in use (the page table holds the last page index).
    Lengths come from a NumPy generator seeded by one draw, so a 512-sequence batch costs a few draws.
    """
    tokens, slots, page_size = config["max_num_batched_tokens"], config["max_num_seqs"], config["page_size"]
    capacity = config["pages_per_seq"] * page_size
    total_pages = config["total_num_pages"]
    max_work = max(1, bucket.max_work // config["num_q_heads"])  # sum of q_len * kv_len
    num_prefills = draw(st.integers(0, 4))
    every_slot = draw(st.booleans())
    long_sequence = draw(st.booleans())
    full_cache = draw(st.booleans())
    most = min(slots, tokens, total_pages)
    num_prefills = min(num_prefills, most)
    if every_slot and most == slots:
        num_decodes = slots - num_prefills
    else:
        num_decodes = draw(st.integers(0, most - num_prefills))
    if num_decodes + num_prefills == 0:
        num_decodes = 1
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))

    def log_uniform(high, size):
        return np.floor(np.exp(rng.uniform(0.0, np.log(high + 1), size))).astype(np.int64).clip(1, high)

    # Prefill rows: one each, and a share of the rows the decodes leave split among them.
    rows_left = tokens - num_decodes - num_prefills
    shares = rng.dirichlet(np.ones(num_prefills)) if num_prefills else np.zeros(0)
    prefill_q = 1 + np.floor(shares * rows_left * rng.uniform(0.25, 1.0)).astype(np.int64)
    prefill_q = np.minimum(prefill_q, capacity)
    prefixes = np.where(rng.random(num_prefills) < 0.5, 0, log_uniform(capacity, num_prefills))
    q_lens = np.concatenate([np.ones(num_decodes, np.int64), prefill_q])
    minimum = q_lens.copy()  # kv_len >= q_len
    wanted = np.concatenate([log_uniform(capacity, num_decodes), prefill_q + prefixes]).clip(
        minimum, capacity
    )
    while (
        num_prefills
        and max(q_lens[num_decodes:]) > 1
        and ((q_lens * minimum).sum() > max_work or np.ceil(minimum / page_size).sum() > total_pages)
    ):
        q_lens[num_decodes:] = np.maximum(1, q_lens[num_decodes:] // 2)  # prefills too big for the budgets
        minimum = q_lens.copy()
        wanted = np.maximum(wanted, minimum)

    def fitted(q, low_kv, high_kv, pages, work):
        """kv lengths moved from ``high_kv`` toward ``low_kv`` (one factor for all) until they fit."""

        def at(f):
            return low_kv + np.floor(f * (high_kv - low_kv)).astype(np.int64)

        def fits(kv):
            return np.ceil(kv / page_size).sum() <= pages and (q * kv).sum() <= work

        if fits(at(1.0)):
            return at(1.0)
        low, high = 0.0, 1.0
        for _ in range(40):
            middle = (low + high) / 2
            low, high = (middle, high) if fits(at(middle)) else (low, middle)
        return at(low)

    if long_sequence and num_decodes:
        # Everything else within half the budgets, then the first decode takes what remains.
        kv_lens = wanted.copy()
        kv_lens[1:] = fitted(q_lens[1:], minimum[1:], wanted[1:], (total_pages - 1) // 2, max_work // 2)
        pages_left = total_pages - int(np.ceil(kv_lens[1:] / page_size).sum())
        work_left = max_work - int((q_lens[1:] * kv_lens[1:]).sum())
        kv_lens[0] = max(1, min(capacity, pages_left * page_size, work_left))
    else:
        kv_lens = fitted(q_lens, minimum, wanted, total_pages, max_work)
    if full_cache:
        # Grow sequences to whole pages, then by whole pages, until every page of the cache is used.
        pages_left = total_pages - int(np.ceil(kv_lens / page_size).sum())
        work_left = max_work - int((q_lens * kv_lens).sum())
        for i in range(len(kv_lens)):
            if pages_left <= 0:
                break
            used = -(-int(kv_lens[i]) // page_size)
            add = min(config["pages_per_seq"] - used, pages_left)
            grown = min(capacity, (used + add) * page_size)
            affordable = int(kv_lens[i]) + max(0, work_left) // int(q_lens[i])
            grown = max(int(kv_lens[i]), min(grown, affordable))
            pages_left -= -(-grown // page_size) - used
            work_left -= (grown - int(kv_lens[i])) * int(q_lens[i])
            kv_lens[i] = grown
    return tuple(int(q) for q in q_lens), tuple(int(kv) for kv in kv_lens)


@st.composite
def valid_cases(
    draw,
    capabilities: Capabilities = WHOLE_SPACE,
    *,
    pooled: bool = False,
    large: bool | str = False,
    with_options: bool = True,
    values=("normal", "large", "ties", "tiny"),
    excluding=(),
    long_corner: LongCorner | None = None,
) -> Case:
    """A valid case: from the whole static space, or (``pooled``) from the few configurations of POOL.

    ``large``: from the selected large buckets (``drawn_buckets(capabilities, large=True)``; a bucket name:
    that one; an error if it is not selected) with their layouts (``production_layouts``, ``long_layouts``)
    and block sizes left to the kernel or tuned (``production_block_sizes``). ``long_corner``: a long case in
    that corner of the long bucket (``long_corners``). ``excluding``: known issues of the target (see
    ``outside_known_issues``) whose cases are not drawn.
    """
    if long_corner is not None and large != "long":
        raise ValueError(f"valid_cases(long_corner={long_corner!r}) draws long cases: pass large='long'")
    if large and pooled:
        raise ValueError("valid_cases(pooled=True, large=True): the pool holds small configurations only")
    large_buckets = drawn_buckets(capabilities, large=True) if large else ()
    if isinstance(large, str):
        large_buckets = tuple(name for name in large_buckets if name == large)
    if large and not large_buckets:
        wanted = large if isinstance(large, str) else f"no large bucket ({', '.join(LARGE_BUCKETS)})"
        raise BucketError(
            f"valid_cases(large={large!r}): {wanted} is not selected "
            f"(bucket_selection={capabilities.bucket_selection}); select it with --rpa-buckets"
        )
    if pooled:
        config, opts = draw(st.sampled_from(pool(capabilities)))
        bucket = None
    else:
        if long_corner is None:
            name, config = draw(bucketed_configs(capabilities, buckets=large_buckets or None))
        else:
            name, config = "long", draw(long_configs(capabilities, LONG_BUCKET, long_corner))
        bucket = BUCKETS[name]
        opts = draw(options(config, capabilities)) if with_options else {}
        if long_corner is not None and long_corner.leaves_blocks_to_the_kernel(capabilities):
            opts = {**opts, "num_kv_pages_per_block": None, "num_queries_per_block": None}
        elif long_corner is not None:
            opts = {**opts, **draw(tuned_block_sizes(config))}
        elif isinstance(bucket, ProductionBucket | LongBucket):
            defaults = (
                not isinstance(bucket, LongBucket)
                or config["page_size"] >= capabilities.min_page_size_for_long_default_blocks
            )
            opts = {**opts, **draw(production_block_sizes(config, capabilities, kernel_defaults=defaults))}
        elif not with_options and capabilities.needs_block_sizes:
            opts = required_block_sizes(config)
    if isinstance(bucket, ProductionBucket):
        q_lens, kv_lens = draw(production_layouts(config, bucket))
    elif isinstance(bucket, LongBucket):
        q_lens, kv_lens = draw(long_layouts(config, bucket, long_corner))
    else:
        q_lens, kv_lens = draw(
            layouts(config, opts.get("num_kv_pages_per_block"), empty_sequences=capabilities.empty_sequences)
        )
    case = Case(
        **config,
        **opts,
        q_lens=q_lens,
        kv_lens=kv_lens,
        seed=draw(st.integers(0, 2**32 - 1)),
        values=draw(st.sampled_from(values)),
        poison=draw(st.booleans()),
        garbage=draw(st.booleans()),
    )
    case = fit_options_to_layout(case, chunk_from_layout=not pooled)
    case = outside_known_issues(case, excluding)
    label_coverage(case)
    return case


def outside_known_issues(case: Case, known_issues) -> Case:
    """``case`` moved out of every known issue, or rejected when it cannot be.

    A known issue is an object with ``name``, ``matches(case)`` and ``avoid(case)`` (the nearest case
    outside it), e.g. ``rpa_harness.known_issues.KnownIssue``. Moving the drawn case, rather than filtering it,
    keeps rejections rare and lets shrinking work as usual. Moving a case out of one issue can move it into
    another (dropping a sequence changes the data a predicate reads), so the passes repeat until none
    applies.
    """
    for _ in range(len(known_issues) + 1):
        moved = case
        for issue in known_issues:
            before, moved = moved, issue.avoid(moved)
            if moved != before:
                event(f"known issue avoided: {issue.name}")
        if moved == case:
            break
        case = moved
    for issue in known_issues:
        if issue.matches(case):
            event(f"known issue rejected: {issue.name}")
            reject()
    return case


def coverage_labels(case: Case) -> list[str]:
    """What a case exercises, as labels for ``--hypothesis-show-statistics``."""
    q, kv = case.q_lens, case.kv_lens
    live = [(a, b) for a, b in zip(q, kv, strict=True) if a > 0]
    decode = [a == 1 for a, _ in live]
    labels = [
        "batch: empty"
        if not live
        else "batch: decode"
        if all(decode)
        else "batch: prefill"
        if not any(decode)
        else "batch: mixed"
    ]
    if any(b % case.page_size for b in kv):
        labels.append("partial last page")
    block_tokens = (case.num_kv_pages_per_block or 1) * case.page_size
    if any(b > block_tokens for b in kv):
        labels.append("multi-block sequence")
    if case.num_queries_per_block and any(a > case.num_queries_per_block for a in q):
        labels.append("sequence spans query blocks")
    if case.num_kv_pages_per_block is None and case.num_queries_per_block is None:
        labels.append("block sizes: the kernel's defaults")
    if case.sliding_window is not None and any(b > case.sliding_window for b in kv):
        labels.append("window active")
    if case.soft_cap is not None:
        labels.append("soft cap")
    if case.kv_dtype.startswith("float8"):
        labels.append("fp8 KV" + (" scaled" if case.k_scale or case.v_scale else ""))
    if case.q_scale is not None:
        labels.append("q_scale")
    if case.attention_sink is not None:
        labels.append("attention sink")
    if not case.use_causal_mask:
        labels.append("non-causal" + (", KV mask skipped" if case.skip_kv_mask else ""))
    if case.out_dtype is not None:
        labels.append(f"out_dtype {case.out_dtype} for {case.q_dtype} queries")
    if case.chunk_prefill_size is not None:
        decodes = next((i for i, q_len in enumerate(q) if q_len != 1), len(q))
        chunked = decodes < len(q) and q[decodes] == case.chunk_prefill_size
        labels.append("chunked prefill" + ("" if chunked else ": no sequence of its size"))
    if not case.update_kv_cache:
        labels.append("cache read, not written")
    if case.mask_value not in (None, DEFAULT_MASK_VALUE):
        labels.append(f"mask_value {case.mask_value_meaning}")
    labels.append(f"GQA ratio {case.num_q_heads // case.num_kv_heads}")
    if case.num_seqs < case.max_num_seqs:
        labels.append("padding slots")
    if case.num_tokens < case.max_num_batched_tokens:
        labels.append("padding rows")
    labels.append(f"values: {case.values}")
    production = PRODUCTION_BUCKET
    if case.max_num_seqs in production.seq_slots and case.max_num_batched_tokens in production.token_budgets:
        labels.append(
            f"production shape: T={case.max_num_batched_tokens} seqs={case.num_seqs}/{case.max_num_seqs} "
            f"rows={case.num_tokens} heads={case.num_q_heads}/{case.num_kv_heads} d={case.head_dim} "
            f"page={case.page_size} pages={sum(-(-kv // case.page_size) for kv in case.kv_lens)}/"
            f"{case.total_num_pages} max kv_len={max(case.kv_lens, default=0)} {case.q_dtype}/{case.kv_dtype}"
        )
    if (corner := long_corner_of(case)) is not None:
        labels.append(f"long corner: {corner.label}")
    for boundary in LONG_BUCKET.boundaries:
        if any(kv > boundary for kv in case.kv_lens):
            labels.append(f"context past 2^{boundary.bit_length() - 1} keys")
        if any(kv - q < boundary < kv for q, kv in zip(q, kv, strict=True)):
            labels.append(f"query positions across 2^{boundary.bit_length() - 1}")
    return labels


def long_corner_of(case: Case) -> LongCorner | None:
    """The long-bucket corner ``case`` lies in (its longest context within two keys up to a boundary, or
    past it by at most the token budget plus one), or None."""
    longest = max(case.kv_lens, default=0)
    for boundary in LONG_BUCKET.boundaries:
        if boundary - 2 <= longest <= boundary + case.max_num_batched_tokens + 1:
            own = case.num_kv_pages_per_block is None and case.num_queries_per_block is None
            return LongCorner(is_packed(case.q_dtype), boundary, longest > boundary, own)
    return None


def label_coverage(case: Case) -> None:
    for label in coverage_labels(case):
        event(label)


def valid_case_groups(
    capabilities: Capabilities = WHOLE_SPACE, *, max_cases: int = 4, excluding=()
) -> st.SearchStrategy[list[Case]]:
    """1 to ``max_cases`` valid cases from the whole static space that share one static configuration and
    static options, so one compiled kernel serves them all: each has its own ragged layout and data, and
    its own values of the options the target takes at run time (``capabilities.runtime_options``; which
    of them are None is shared).

    The whole-space properties draw these: there a new configuration's compilation costs 10-100x a call,
    so more cases per configuration test more in the same time without narrowing what is drawn (the first
    case is ``valid_cases``' own draw). The extra cases shrink away first.
    """
    if not isinstance(max_cases, int) or max_cases < 1:
        raise ValueError(f"max_cases={max_cases!r} must be an int of at least 1")
    return _case_groups(capabilities, max_cases, excluding)


@st.composite
def _case_groups(draw, capabilities: Capabilities, max_cases: int, excluding) -> list[Case]:
    first = draw(valid_cases(capabilities, excluding=excluding))
    config = dict(
        page_size=first.page_size,
        pages_per_seq=first.pages_per_seq,
        max_num_seqs=first.max_num_seqs,
        max_num_batched_tokens=first.max_num_batched_tokens,
    )
    # mask_value None is the default mask, a value like the others.
    runtime = [
        name
        for name in capabilities.runtime_options
        if getattr(first, name) is not None or name == "mask_value"
    ]
    sharing = st.builds(
        lambda layout, option_values, seed, values, poison, garbage: dataclasses.replace(
            first,
            q_lens=layout[0],
            kv_lens=layout[1],
            seed=seed,
            values=values,
            poison=poison,
            garbage=garbage,
            **option_values,
        ),
        layouts(config, first.num_kv_pages_per_block, empty_sequences=capabilities.empty_sequences),
        st.fixed_dictionaries({name: st.sampled_from(_RUNTIME_OPTION_VALUES[name]) for name in runtime}),
        st.integers(0, 2**32 - 1),
        st.sampled_from(("normal", "large", "ties", "tiny")),
        st.booleans(),
        st.booleans(),
    )
    cases = [first]
    for case in draw(st.lists(sharing, max_size=max_cases - 1)):
        case = outside_known_issues(fit_options_to_layout(case), excluding)
        label_coverage(case)
        cases.append(case)
    return cases
