"""The keyword options drawn for a case: run-time values, block sizes (tuned, production, required), and
the fit of options to a drawn layout."""

import dataclasses

from hypothesis import strategies as st

from rpa_harness.spec.interface import (
    DEFAULT_MASK_VALUE,
    MASK_ADDED,
    OPTION_DEFAULTS,
    OUT_DTYPES,
)
from rpa_harness.strategies.capabilities import WHOLE_SPACE, Capabilities
from rpa_harness.strategies.case import DTYPES, Case

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
RUNTIME_OPTION_VALUES = dict(
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


# Block sizes as upstream tunes them: every (num_kv_pages_per_block, num_queries_per_block) value in jax's
# tuned table (TPU v5e and v6e) and its untuned default (128, 32), clipped as upstream clips them (to
# pages_per_seq and max_num_batched_tokens). A KV block is kept to at most TUNED_MAX_BLOCK_KEYS keys, the
# table's largest (16 pages of 256); the default of 128 pages applies to small pages.
TUNED_KV_PAGES_PER_BLOCK = (4, 8, 16, 128)


TUNED_QUERIES_PER_BLOCK = (32, 64, 128, 256)


TUNED_MAX_BLOCK_KEYS = 4096


def kv_pages_cap(capabilities: Capabilities, config: dict) -> int:
    """The most pages a given KV block may hold for ``config``: its pages per sequence, or fewer where the
    target declares ``max_kv_pages_per_block``."""
    return min(config["pages_per_seq"], capabilities.max_kv_pages_per_block or config["pages_per_seq"])


def tuned_block_sizes(config: dict, capabilities: Capabilities = WHOLE_SPACE) -> st.SearchStrategy[dict]:
    """A (num_kv_pages_per_block, num_queries_per_block) pair from upstream's tuned values for a config
    (the KV block clipped to the target's ``max_kv_pages_per_block``)."""
    kv_pages = sorted(
        {
            min(p, kv_pages_cap(capabilities, config))
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
    return draw(tuned_block_sizes(config, capabilities))


def sinks_for(logits: tuple[float, ...], num_q_heads: int) -> tuple[float, ...]:
    """One sink logit per q head, cycling through ``logits``."""
    return tuple(logits[h % len(logits)] for h in range(num_q_heads))


# The most pages a KV block may copy one by one where the target's default block is a fixed number of keys
# and its page copies are unrolled (``Capabilities.min_page_size_for_long_default_blocks``): 97 one-key
# pages compile for about 290 s on the fast interpreter.
MAX_UNROLLED_PAGE_COPIES = 32


def many_page_copies(capabilities: Capabilities, config: dict) -> bool:
    """Whether the kernel's own KV block could be more small pages than ``MAX_UNROLLED_PAGE_COPIES``: then
    the block sizes are given, not left to it."""
    return (
        config["page_size"] < capabilities.min_page_size_for_long_default_blocks
        and config["pages_per_seq"] > MAX_UNROLLED_PAGE_COPIES
    )


def kv_scales_paired(capabilities: Capabilities, config: dict) -> bool:
    return capabilities.paired_kv_scales_for_mixed_dtypes and config["q_dtype"] != config["kv_dtype"]


def kv_scales_unspecified(capabilities: Capabilities, config: dict) -> bool:
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
    for name in capabilities.options_not_taken:
        drawn[name] = getattr(OPTION_DEFAULTS, name)
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
    if kv_scales_paired(capabilities, config) and (drawn["k_scale"] is None) != (drawn["v_scale"] is None):
        drawn["k_scale"] = drawn["v_scale"] = None
    if kv_scales_unspecified(capabilities, config):
        drawn["k_scale"] = drawn["v_scale"] = None
    cap = kv_pages_cap(capabilities, config)
    kv_blocks = st.integers(1, min(4, cap)) | st.just(cap)
    query_blocks = st.sampled_from(QUERY_BLOCKS)
    if capabilities.needs_block_sizes or many_page_copies(capabilities, config):
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
