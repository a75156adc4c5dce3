"""Shape buckets: the few static sizes examples are drawn from (so that they reuse compiled kernels), the
large ones with their long-context corners, and which of them a run draws."""

import dataclasses
from typing import TYPE_CHECKING

from rpa_harness.strategies.case import DTYPES

if TYPE_CHECKING:
    from rpa_harness.strategies.capabilities import Capabilities


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
    head_dims: tuple[int, ...] = (64, 128, 192, 256, 576)  # 192 and 576: latent attention (lkv + r)
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


def why_not_drawn(capabilities: "Capabilities", selection: tuple[str, ...] | None, bucket: str) -> str | None:
    """Why a run does not draw ``bucket``, in words that say what to do; None when it does."""
    if bucket not in capabilities.buckets:
        return (
            f"the target does not declare the {bucket} bucket (its Capabilities.buckets: "
            f"{', '.join(capabilities.buckets)}); declare it in RPA_HARNESS_CAPABILITIES, buckets=(..., "
            f"{bucket!r}), where the kernel runs such shapes (a module without a declaration gets tiny and small)"
        )
    if bucket not in drawn_buckets(capabilities, selection, large=bucket in LARGE_BUCKETS):
        return f"the {bucket} bucket is not selected (--rpa-buckets={bucket}, or a profile's default)"
    return None


def drawn_buckets(
    capabilities: "Capabilities", selection: tuple[str, ...] | None = None, *, large: bool = False
) -> tuple[str, ...]:
    """The buckets of one scale a run draws: large ones (possibly none) or small ones (never none).
    ``selection``: the run's (``select_buckets``); None: DEFAULT_BUCKETS within the declaration."""
    selection = selection or tuple(name for name in DEFAULT_BUCKETS if name in capabilities.buckets)
    if large:
        return tuple(name for name in selection if name in LARGE_BUCKETS)
    small = tuple(name for name in selection if name not in LARGE_BUCKETS)
    declared = tuple(name for name in capabilities.buckets if name not in LARGE_BUCKETS)
    defaults = tuple(name for name in DEFAULT_BUCKETS if name in declared)
    return small or defaults or declared
