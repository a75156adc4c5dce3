"""Static configurations (bucket, heads, dtypes, page size) and the ragged layouts drawn inside them: small
buckets, the production bucket and the long bucket with its corners."""

import math

import numpy as np
from hypothesis import strategies as st

from rpa_harness.spec.interface import (
    values_per_word,
)
from rpa_harness.strategies.buckets import (
    BUCKETS,
    DEFAULT_BUCKETS,
    PROFILE_BUCKETS,
    SMALL_PAGE_SIZES,
    Bucket,
    BucketError,
    LongBucket,
    LongCorner,
    ProductionBucket,
    drawn_buckets,
    is_packed,
    parse_buckets,
)
from rpa_harness.strategies.capabilities import WHOLE_SPACE, Capabilities
from rpa_harness.strategies.case import DTYPES


def select_buckets(
    capabilities: Capabilities, text: str, *, profile: str | None = None
) -> tuple[str, ...] | None:
    """A run's selection: the buckets named in ``text`` that the target declares (what the strategies'
    ``selection`` takes).

    No names: DEFAULT_BUCKETS and the profile's PROFILE_BUCKETS, within the declaration (None when none of
    them is declared: the strategies' default). Names of which the target declares none raise BucketError
    (a usage error, nothing would be drawn); declared ones among several are kept.
    """
    names = parse_buckets(text)
    if not names:
        defaults = DEFAULT_BUCKETS + (PROFILE_BUCKETS.get(profile, ()) if profile is not None else ())
        chosen = tuple(name for name in defaults if name in capabilities.buckets)
        return chosen or None
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
    return chosen


def make_config(
    bucket: str, page_size: int, num_kv_heads: int, gqa_ratio: int, head_dim: int, q_dtype: str, kv_dtype: str
) -> dict:
    """The static Case fields for a small bucket and head layout (a large bucket's are drawn per example:
    ``production_configs``, ``long_configs``)."""
    capacity = BUCKETS[bucket]
    assert isinstance(capacity, Bucket), f"{bucket!r} is a large bucket: its configs are drawn"
    pages_per_seq = math.ceil(capacity.max_kv_len / page_size) + 1  # one page more than the longest needs
    total_num_pages = capacity.max_num_seqs * pages_per_seq + 3  # spare pages never referenced
    sizes = (capacity.max_num_batched_tokens, capacity.max_num_seqs, pages_per_seq, total_num_pages)
    return config_fields(sizes, page_size, (num_kv_heads, gqa_ratio, head_dim), q_dtype, kv_dtype)


def config_fields(
    sizes: tuple[int, int, int, int], page_size: int, heads: tuple[int, int, int], q_dtype: str, kv_dtype: str
) -> dict:
    """The static Case fields of a configuration, from its ``sizes`` (max_num_batched_tokens, max_num_seqs,
    pages_per_seq, total_num_pages), page size, ``heads`` (num_kv_heads, gqa_ratio, head_dim) and dtypes."""
    max_num_batched_tokens, max_num_seqs, pages_per_seq, total_num_pages = sizes
    num_kv_heads, gqa_ratio, head_dim = heads
    return dict(
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        pages_per_seq=pages_per_seq,
        total_num_pages=total_num_pages,
        page_size=page_size,
        num_q_heads=num_kv_heads * gqa_ratio,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        q_dtype=q_dtype,
        kv_dtype=kv_dtype,
    )


def kv_dtypes_for(capabilities: Capabilities, page_size: int) -> tuple[str, ...]:
    if capabilities.page_size_multiple_of_kv_packing:
        return tuple(d for d in capabilities.kv_dtypes if page_size % values_per_word(d) == 0)
    return capabilities.kv_dtypes


def page_sizes_for(capabilities: Capabilities, kv_dtype: str) -> tuple[int, ...]:
    return tuple(p for p in capabilities.page_sizes if kv_dtype in kv_dtypes_for(capabilities, p))


def kv_heads_for(capabilities: Capabilities, kv_dtype: str) -> tuple[int, ...]:
    if capabilities.even_kv_heads_for_fp8 and kv_dtype.startswith("float8"):
        return tuple(h for h in capabilities.num_kv_heads if h % 2 == 0)
    return capabilities.num_kv_heads


def small_page_sizes(capabilities: Capabilities) -> tuple[int, ...]:
    return tuple(p for p in capabilities.page_sizes if p in SMALL_PAGE_SIZES) or capabilities.page_sizes


@st.composite
def static_configs(draw, capabilities: Capabilities = WHOLE_SPACE, *, buckets=None, selection=None) -> dict:
    """Static shapes and dtypes: the part that decides which compiled kernel runs.

    ``buckets`` default to the small ones of the run's ``selection`` (``drawn_buckets``); a large bucket
    named here is drawn with ``production_configs`` or ``long_configs``."""
    return draw(bucketed_configs(capabilities, buckets=buckets, selection=selection))[1]


@st.composite
def bucketed_configs(
    draw, capabilities: Capabilities = WHOLE_SPACE, *, buckets=None, selection=None
) -> tuple[str, dict]:
    """(bucket name, static config): see ``static_configs``."""
    bucket = draw(st.sampled_from(buckets or drawn_buckets(capabilities, selection)))
    capacity = BUCKETS[bucket]
    if isinstance(capacity, ProductionBucket):
        return bucket, draw(production_configs(capabilities, capacity))
    if isinstance(capacity, LongBucket):
        return bucket, draw(long_configs(capabilities, capacity))
    page_size = draw(
        st.sampled_from([p for p in small_page_sizes(capabilities) if kv_dtypes_for(capabilities, p)])
    )
    kv_dtype = draw(st.sampled_from(kv_dtypes_for(capabilities, page_size)))
    num_kv_heads = draw(st.sampled_from(kv_heads_for(capabilities, kv_dtype)))
    ratio = draw(st.sampled_from(capabilities.gqa_ratios))
    head_dim = draw(st.sampled_from(capabilities.head_dims))
    q_dtype = draw(st.sampled_from(capabilities.q_dtypes_for(kv_dtype)))
    return bucket, make_config(bucket, page_size, num_kv_heads, ratio, head_dim, q_dtype, kv_dtype)


def page_bytes(page_size: int, num_kv_heads: int, head_dim: int, kv_dtype: str) -> int:
    """Bytes of one page of the combined K/V cache."""
    return page_size * 2 * num_kv_heads * head_dim * DTYPES[kv_dtype].itemsize


def production_heads(capabilities: Capabilities, bucket: ProductionBucket, kv_dtype: str):
    """(num_kv_heads, gqa_ratio) pairs the target supports with num_q_heads in the bucket's range, fewest
    q heads first."""
    low, high = bucket.q_heads
    pairs = [(h, r) for h in kv_heads_for(capabilities, kv_dtype) for r in capabilities.gqa_ratios]
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
    q_dtype = draw(st.sampled_from(capabilities.q_dtypes_for(kv_dtype)))
    num_kv_heads, ratio = draw(st.sampled_from(production_heads(capabilities, bucket, kv_dtype)))
    head_dim = draw(st.sampled_from([d for d in capabilities.head_dims if d in bucket.head_dims]))

    def fits(page_size, slots):
        return 2 * slots * page_bytes(page_size, num_kv_heads, head_dim, kv_dtype) <= bucket.kv_cache_bytes

    smallest_slots = min(bucket.seq_slots)
    page_sizes = [p for p in page_sizes_for(capabilities, kv_dtype) if p in bucket.page_sizes]
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
    total_num_pages = max(1, min(max_num_seqs * pages_per_seq, cache_pages))
    sizes = (max_num_batched_tokens, max_num_seqs, pages_per_seq, total_num_pages)
    return config_fields(sizes, page_size, (num_kv_heads, ratio, head_dim), q_dtype, kv_dtype)


def long_layouts_of(
    capabilities: Capabilities, bucket: LongBucket, kv_dtype: str
) -> list[tuple[int, int, int]]:
    """(num_kv_heads, gqa_ratio, head_dim) the target supports whose cache holds one sequence of the model
    length within the bucket's bytes, fewest q heads and smallest head_dim first."""
    key_bytes = page_bytes(1, 1, 1, kv_dtype)
    found = [
        (h, r, d)
        for h in kv_heads_for(capabilities, kv_dtype)
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
    if not any(set(page_sizes_for(capabilities, d)) & set(bucket.page_sizes) for d in capabilities.kv_dtypes):
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
            p for p in page_sizes_for(capabilities, kv_dtype) if p in bucket.page_sizes and p >= smallest_page
        ]

    def q_dtypes(kv_dtype):
        return [
            d
            for d in capabilities.q_dtypes_for(kv_dtype)
            if corner is None or is_packed(d) == corner.packed_queries
        ]

    kv_dtypes = [
        d
        for d in capabilities.kv_dtypes
        if long_layouts_of(capabilities, bucket, d) and page_sizes(d) and q_dtypes(d)
    ]
    kv_dtype = draw(st.sampled_from(kv_dtypes))
    q_dtype = draw(st.sampled_from(q_dtypes(kv_dtype)))
    num_kv_heads, ratio, head_dim = draw(st.sampled_from(long_layouts_of(capabilities, bucket, kv_dtype)))
    page_size = draw(st.sampled_from(page_sizes(kv_dtype)))
    max_num_seqs = draw(st.sampled_from(bucket.seq_slots))
    pages_per_seq = bucket.max_model_len // page_size
    cache_pages = bucket.kv_cache_bytes // page_bytes(page_size, num_kv_heads, head_dim, kv_dtype)
    max_num_batched_tokens = draw(st.sampled_from(bucket.token_budgets))
    total_num_pages = min(max_num_seqs * pages_per_seq, cache_pages)
    sizes = (max_num_batched_tokens, max_num_seqs, pages_per_seq, total_num_pages)
    return config_fields(sizes, page_size, (num_kv_heads, ratio, head_dim), q_dtype, kv_dtype)


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
    q_lens: list[int] = []
    kv_lens: list[int] = []
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
