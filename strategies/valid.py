"""Strategies for valid cases: structure first (bucket, heads, dtypes, options), then the ragged layout.

Shapes come from a few static buckets so that examples reuse compiled kernels; the ragged layout
(``q_lens``/``kv_lens``), the page table and the data seed vary as data. Every choice is drawn so that
shrinking moves toward the simplest case: one sequence, fewest heads, smallest head_dim and page size,
no options, float32, the smallest bucket. Edge-case biasing (lengths on page and KV-block boundaries) sits
behind a branch the shrinker can turn off.
"""

import dataclasses
import math

from hypothesis import event, reject
from hypothesis import strategies as st

from rpa_harness.spec.interface import DEFAULT_MASK_VALUE, MASK_ADDED, MASK_VALUE_MEANINGS
from rpa_harness.strategies.case import DTYPES, Case


@dataclasses.dataclass(frozen=True)
class Bucket:
    """Static capacity: query rows, sequence slots and keys per sequence."""

    max_num_batched_tokens: int
    max_num_seqs: int
    max_kv_len: int


BUCKETS = {
    "tiny": Bucket(max_num_batched_tokens=8, max_num_seqs=2, max_kv_len=32),
    "small": Bucket(max_num_batched_tokens=32, max_num_seqs=4, max_kv_len=96),
    "medium": Bucket(max_num_batched_tokens=128, max_num_seqs=8, max_kv_len=512),
}


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What a target supports; strategies draw only inside it. Defaults: the whole specified space."""

    head_dims: tuple[int, ...] = (64, 128, 256)
    page_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    q_dtypes: tuple[str, ...] = ("float32", "bfloat16")
    kv_dtypes: tuple[str, ...] = ("float32", "bfloat16", "float8_e4m3fn", "float8_e5m2")
    num_kv_heads: tuple[int, ...] = (1, 2, 4, 8)
    gqa_ratios: tuple[int, ...] = (1, 2, 3, 4, 8)
    # Whether num_kv_heads must be even for 8-bit KV (upstream: combined heads must tile the packing).
    even_kv_heads_for_fp8: bool = False
    # Whether both block sizes must be given (upstream's default lookup needs a TPU).
    needs_block_sizes: bool = False
    # Whether k_scale and v_scale must be given together when q's dtype differs from the KV dtype
    # (upstream casts only the scaled side to q's dtype, then fails `assert k.dtype == v.dtype`).
    paired_kv_scales_for_mixed_dtypes: bool = False
    # Whether page_size must be a multiple of the KV dtype's values per 32-bit word (tpu-inference v3 packs
    # them: bfloat16 2, fp8 4); page sizes a KV dtype cannot use are not drawn with it.
    page_size_multiple_of_kv_packing: bool = False
    # Whether a live sequence may have q_len == 0 (tpu-inference v3 requires 0 < q_len <= kv_len).
    empty_sequences: bool = True
    # What the target's mask_value means (rpa_harness.spec.interface.MASK_VALUE_MEANINGS): upstream adds it to a masked
    # logit, tpu-inference v3 replaces the logit with it. Cases carry the meaning (mask_value_meaning) so
    # that the judges compute it.
    mask_value_meaning: str = MASK_ADDED
    # Whether the target takes q_scale (an extension option: tpu-inference v3's quantised query).
    q_scale: bool = False
    # Whether a K/V scale has upstream's meaning: the scaled cache is rounded to q's dtype. If not
    # (tpu-inference v3 folds k_scale into the score scale and applies v_scale after P @ V, unrounded), no
    # scale is drawn where that rounding is lossy, i.e. where the KV dtype is wider than q's.
    kv_scales_round_to_q_dtype: bool = True
    buckets: tuple[str, ...] = ("tiny", "small")
    # The backends (rpa_harness.backends names) the target is declared to run on; elsewhere its numeric
    # properties are skipped as "cannot run" (declared). Any other error on valid input is a failure.
    backends: tuple[str, ...] = ("interpret", "fast-interpret", "tpu")
    # The input rules and messages the target's validators are held to (rpa_harness.strategies.violations.TABLES):
    # upstream's, or tpu-inference v3's own (spec/tpu_inference_v3.py).
    validation_rules: str = "upstream"
    # Opt-ins beyond the specified behaviour: our stricter ValueErrors, and lowering to Mosaic on CPU.
    strict_validation: bool = False
    lowers_for_tpu: bool = False

    def __post_init__(self):
        """Capabilities only narrow the specified space: each choice is a non-empty subset of the default
        (buckets: of BUCKETS). Checked here, once, so that a typo is one clear error instead of a strategy
        that draws nothing or a dtype no case can build."""
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, tuple):
                continue
            allowed = tuple(BUCKETS) if field.name == "buckets" else field.default
            unknown = [v for v in value if v not in allowed]
            if unknown or not value:
                problem = (
                    f"{unknown} not in the specified space" if unknown else "empty, so nothing can be drawn"
                )
                raise ValueError(
                    f"Capabilities({field.name}={value!r}): {problem}; choose a non-empty subset of {allowed}."
                )
        if self.validation_rules not in ("upstream", "tpu-inference-v3"):
            raise ValueError(
                f"Capabilities(validation_rules={self.validation_rules!r}): choose 'upstream' or 'tpu-inference-v3'."
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


OUR_KERNEL = Capabilities(strict_validation=True, lowers_for_tpu=True)
# One K/V scale with mixed dtypes is an upstream bug, not a documented limitation: it is the known issue
# one-kv-scale-with-mixed-dtypes (harness/known_issues.py), not paired_kv_scales_for_mixed_dtypes.
UPSTREAM_KERNEL = Capabilities(
    head_dims=(128, 256),
    even_kv_heads_for_fp8=True,
    needs_block_sizes=True,
)

SM_SCALES = (1.0, 0.125, 0.05)
SLIDING_WINDOWS = (1, 5, 16, 1 << 20)  # one key, small, medium, longer than every kv_len
SOFT_CAPS = (30.0, 5.0, 1.0)
MASK_VALUES = (None, -1e4, -2.0)  # besides the default, drawn first
KV_SCALES = (0.5, 2.0, 0.0625)
# q / q_scale is clipped to the KV dtype's range: 0.01 clips |q| > 4.48 for fp8 e4m3fn (max 448), 1e-4 clips
# most of q for e4m3fn and |q| > 5.7 for e5m2 (max 57344); 0.3 is inexact in every dtype.
Q_SCALES = (0.5, 2.0, 0.3, 0.01, 1e-4)
QUERY_BLOCKS = (8, 1, 3, 16, 32)
VMEM_LIMITS = (32 * 2**20, 64 * 2**20)


def optional(values) -> st.SearchStrategy:
    """None (the simplest), or one of ``values``."""
    return st.one_of(st.none(), st.sampled_from(values))


def make_config(
    bucket: str, page_size: int, num_kv_heads: int, gqa_ratio: int, head_dim: int, q_dtype: str, kv_dtype: str
) -> dict:
    """The static Case fields for a bucket and head layout."""
    capacity = BUCKETS[bucket]
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


def _kv_packing(kv_dtype: str) -> int:
    return 4 if kv_dtype.startswith("float8") else 2 if kv_dtype == "bfloat16" else 1


def _kv_dtypes_for(capabilities: Capabilities, page_size: int) -> tuple[str, ...]:
    if capabilities.page_size_multiple_of_kv_packing:
        return tuple(d for d in capabilities.kv_dtypes if page_size % _kv_packing(d) == 0)
    return capabilities.kv_dtypes


def _page_sizes_for(capabilities: Capabilities, kv_dtype: str) -> tuple[int, ...]:
    return tuple(p for p in capabilities.page_sizes if kv_dtype in _kv_dtypes_for(capabilities, p))


def _kv_heads_for(capabilities: Capabilities, kv_dtype: str) -> tuple[int, ...]:
    if capabilities.even_kv_heads_for_fp8 and kv_dtype.startswith("float8"):
        return tuple(h for h in capabilities.num_kv_heads if h % 2 == 0)
    return capabilities.num_kv_heads


@st.composite
def static_configs(draw, capabilities: Capabilities = OUR_KERNEL, *, buckets=None) -> dict:
    """Static shapes and dtypes: the part that decides which compiled kernel runs."""
    bucket = draw(st.sampled_from(buckets or capabilities.buckets))
    page_size = draw(st.sampled_from(capabilities.page_sizes))
    kv_dtype = draw(st.sampled_from(_kv_dtypes_for(capabilities, page_size)))
    num_kv_heads = draw(st.sampled_from(_kv_heads_for(capabilities, kv_dtype)))
    ratio = draw(st.sampled_from(capabilities.gqa_ratios))
    head_dim = draw(st.sampled_from(capabilities.head_dims))
    q_dtype = draw(st.sampled_from(capabilities.q_dtypes))
    return make_config(bucket, page_size, num_kv_heads, ratio, head_dim, q_dtype, kv_dtype)


# A fixed pool of compiled configurations (static config + options) that together touch every feature.
# Properties that need volume draw from it, so that hundreds of ragged layouts reuse a few compiled
# kernels; the first entry is the simplest and is what shrinking moves toward.
POOL = (
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
)  # fmt: skip


def _nearest(value, allowed):
    return min(allowed, key=lambda a: (abs(a - value), a))


def required_block_sizes(config: dict) -> dict:
    """Block sizes for a target that needs both given (upstream's default lookup needs a TPU)."""
    return dict(num_kv_pages_per_block=min(2, config["pages_per_seq"]), num_queries_per_block=8)


def pool(capabilities: Capabilities = OUR_KERNEL) -> list[tuple[dict, dict]]:
    """POOL moved inside a target's capabilities (nearest supported head_dim, page size, heads, dtypes)."""
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
        if layout["bucket"] not in capabilities.buckets:
            layout["bucket"] = capabilities.buckets[0]
        config = make_config(**layout)
        opts = dict(opts)
        if capabilities.mask_value_meaning != MASK_ADDED:
            opts["mask_value_meaning"] = capabilities.mask_value_meaning
        if not capabilities.q_scale:
            opts.pop("q_scale", None)
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


def _kv_scales_paired(capabilities: Capabilities, config: dict) -> bool:
    return capabilities.paired_kv_scales_for_mixed_dtypes and config["q_dtype"] != config["kv_dtype"]


def _kv_scales_unspecified(capabilities: Capabilities, config: dict) -> bool:
    """Where the target's scales mean something other than upstream's: a lossy rounding it skips."""
    wider = DTYPES[config["kv_dtype"]].itemsize > DTYPES[config["q_dtype"]].itemsize
    return not capabilities.kv_scales_round_to_q_dtype and wider


@st.composite
def options(draw, config: dict, capabilities: Capabilities = OUR_KERNEL) -> dict:
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
    return drawn


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
def valid_cases(
    draw,
    capabilities: Capabilities = OUR_KERNEL,
    *,
    pooled: bool = False,
    with_options: bool = True,
    values=("normal", "large", "ties", "tiny"),
    excluding=(),
) -> Case:
    """A valid case: from the whole static space, or (``pooled``) from the few configurations of POOL.

    ``excluding``: known issues of the target (see ``outside_known_issues``) whose cases are not drawn.
    """
    if pooled:
        config, opts = draw(st.sampled_from(pool(capabilities)))
    else:
        config = draw(static_configs(capabilities))
        opts = draw(options(config, capabilities)) if with_options else {}
        if not with_options and capabilities.needs_block_sizes:
            opts = required_block_sizes(config)
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
    if case.sliding_window is not None and any(b > case.sliding_window for b in kv):
        labels.append("window active")
    if case.soft_cap is not None:
        labels.append("soft cap")
    if case.kv_dtype.startswith("float8"):
        labels.append("fp8 KV" + (" scaled" if case.k_scale or case.v_scale else ""))
    if case.q_scale is not None:
        labels.append("q_scale")
    if case.mask_value not in (None, DEFAULT_MASK_VALUE):
        labels.append(f"mask_value {case.mask_value_meaning}")
    labels.append(f"GQA ratio {case.num_q_heads // case.num_kv_heads}")
    if case.num_seqs < case.max_num_seqs:
        labels.append("padding slots")
    if case.num_tokens < case.max_num_batched_tokens:
        labels.append("padding rows")
    labels.append(f"values: {case.values}")
    return labels


def label_coverage(case: Case) -> None:
    for label in coverage_labels(case):
        event(label)
