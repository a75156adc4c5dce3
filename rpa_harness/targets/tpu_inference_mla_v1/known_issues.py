"""Known issues of tpu-inference's MLA v1 (``docs/tpu-inference-mla-v1-findings/``) and their predicates.

Restated from ``mla/v1/kernel.py`` (0.32.0): ``mla_ragged_paged_attention`` pads the q heads to a whole
number of q's packing (bfloat16: 2) and compiles three paths into one kernel, each under ``pl.when`` and so
each traced whatever the distribution: decodes (``static_q_len=1``), chunked prefills (``static_q_len=
chunk_prefill_size``, only when it is given) and mixed sequences. A path's query block is ``min(
num_queries_per_block, static_q_len)`` tokens, and ``flash_attention`` asserts that its rows (tokens times
padded heads) are a multiple of ``num_queries_per_block``. Both block sizes default to None in its signature,
and it raises when either is None, on every TPU generation: it has no tuned table and never asks which chip
it is on.
"""

import dataclasses

from rpa_harness.failures import OverTheBound, RaisedOnValidInput
from rpa_harness.known_issues import NUMERIC_MISMATCH, KnownIssue, findings_dir
from rpa_harness.spec.interface import DEFAULT_MASK_VALUE, values_per_word
from rpa_harness.strategies.case import Case
from rpa_harness.targets.tpu_inference.findings import finite_replacing_mask_value, masked_keys_weigh

FINDINGS = findings_dir("tpu-inference-mla-v1-findings")
# The block sizes tpu-inference's own MLA tests give (tests/kernels/mla_v2_test.py: 8 KV pages, 8 queries per
# block), where a case leaves them to a kernel that has none of its own.
GIVEN_KV_PAGES_PER_BLOCK = 8
GIVEN_QUERIES_PER_BLOCK = 8


def padded_q_heads(case: Case) -> int:
    packing = values_per_word(case.q_dtype)
    return -(-case.num_q_heads // packing) * packing


def query_block_not_dividing_q_heads(case: Case) -> bool:
    """The decode path's block (one token of the padded q heads) has a number of rows that
    ``num_queries_per_block`` does not divide. (The chunked prefill path's, ``min(bq, chunk_prefill_size)``
    tokens, then never fails: a block that divides the heads divides it.)"""
    bq = case.num_queries_per_block
    return bq is not None and bq > 0 and padded_q_heads(case) % bq != 0


def with_query_block_dividing_q_heads(case: Case) -> Case:
    """The largest query block at most the case's that divides the padded q heads (then every path's)."""
    heads = padded_q_heads(case)
    largest = min(case.num_queries_per_block or heads, heads)
    bq = max(d for d in range(1, largest + 1) if heads % d == 0)
    return dataclasses.replace(case, num_queries_per_block=bq)


def block_sizes_left_to_the_kernel(case: Case) -> bool:
    """Either block size None, the signature's default, which the kernel refuses on every TPU generation (and
    off one): it has no block sizes of its own. The interpreters without a generation always give both (its
    ``needs_block_sizes``); a chip, or an emulated generation, may leave them to the kernel, and this issue
    moves those cases to given block sizes."""
    return case.num_kv_pages_per_block is None or case.num_queries_per_block is None


def with_given_block_sizes(case: Case) -> Case:
    """A missing block size as tpu-inference's MLA tests give it: 8 KV pages (at most the sequence's pages), 8
    queries (where that does not divide MLA v1's q heads, its query-block issue moves it on)."""
    return dataclasses.replace(
        case,
        num_kv_pages_per_block=min(GIVEN_KV_PAGES_PER_BLOCK, case.pages_per_seq)
        if case.num_kv_pages_per_block is None
        else case.num_kv_pages_per_block,
        num_queries_per_block=GIVEN_QUERIES_PER_BLOCK
        if case.num_queries_per_block is None
        else case.num_queries_per_block,
    )


def mask_value_none(case: Case) -> bool:
    return case.mask_value is None


def with_its_default_mask_value(case: Case) -> Case:
    """The kernel's own default, upstream's -0.7 * float32 max (replacing: masked keys get no weight)."""
    return dataclasses.replace(case, mask_value=DEFAULT_MASK_VALUE)


def finite_mask_value_weights_keys_past_kv_len(case: Case) -> bool:
    """A finite replacing mask_value whose weight exp(mask_value - row max) does not underflow, in a sequence
    whose last KV block has slots past kv_len (kv_len not a multiple of the block's keys)."""
    mask_value = finite_replacing_mask_value(case)
    if mask_value is None or not case.num_kv_pages_per_block or case.num_kv_pages_per_block <= 0:
        return False
    block = case.num_kv_pages_per_block * case.page_size
    past_kv_len = (seq for seq, kv_len in enumerate(case.kv_lens) if kv_len % block)
    return masked_keys_weigh(case, mask_value, past_kv_len)


RPA_HARNESS_CATALOGUE = (
    KnownIssue(
        "mla-v1-query-block-not-dividing-q-heads-fails-to-trace",
        "num_queries_per_block that does not divide the (padded) number of q heads: the kernel fails to "
        "trace with a bare AssertionError, decodes or not; its validators accept the block",
        FINDINGS
        / "mla-v1-query-block-not-dividing-q-heads-fails-to-trace"
        / "differential-checked_interpret.json",
        query_block_not_dividing_q_heads,
        with_query_block_dividing_q_heads,
        r"AssertionError \(raised at kernel\.py:\d+ in flash_attention\)",
        explanation=(
            "Every call traces the decode path (`process(static_q_len=1)` under `pl.when`), whose query "
            "block is one token of `align(num_q_heads, q_packing)` rows, and `flash_attention` asserts "
            "`q_pe.shape[0] % bq_sz == 0` with `bq_sz = num_queries_per_block`: any block larger than the "
            "padded head count, or not dividing it, fails at trace time even in a batch without decodes (and "
            "the chunked prefill path likewise with `min(bq_sz, chunk_prefill_size)` tokens). "
            "`static_validate_inputs` only checks that the block is positive, and "
            "`ref_mla_ragged_paged_attention` takes no block size, so a caller learns the rule from a bare "
            "assertion. With DeepSeek's 128 q heads (16 per chip at TP 8) any power of two up to the head "
            "count works; a block of 32 with 16 heads does not."
        ),
        fails_as=(RaisedOnValidInput,),
    ),
    KnownIssue(
        "mla-v1-mask-value-none-fails-to-trace",
        "mask_value=None (its reference's default, which the signature allows) fails to trace: the kernel "
        "passes None to jnp.where",
        FINDINGS / "mla-v1-mask-value-none-fails-to-trace" / "differential-checked_interpret.json",
        mask_value_none,
        with_its_default_mask_value,
        r"where requires ndarray or scalar arguments, got <class 'NoneType'>",
        explanation=(
            "`mla_ragged_paged_attention` declares `mask_value: float | None = DEFAULT_MASK_VALUE` and "
            "`ref_mla_ragged_paged_attention` resolves None to `DEFAULT_MASK_VALUE`, but the kernel passes the "
            "value on unresolved to `flash_attention`, whose `jnp.where(mask, mask_value, s)` raises a "
            "TypeError while it traces. v3 resolves None (to `finfo(out_dtype).min`); MLA v1 does not."
        ),
        fails_as=(RaisedOnValidInput,),
    ),
    KnownIssue(
        "mla-v1-finite-mask-value-weights-keys-past-kv-len",
        "a finite mask_value weights the empty slots past kv_len in a sequence's last KV block (with whatever "
        "the cache holds there), not only the masked keys in [0, kv_len)",
        FINDINGS
        / "mla-v1-finite-mask-value-weights-keys-past-kv-len"
        / "differential-checked_interpret.json",
        finite_mask_value_weights_keys_past_kv_len,
        with_its_default_mask_value,
        NUMERIC_MISMATCH,
        explanation=(
            "Each query block walks `cdiv(kv_len, bkv_sz)` whole KV blocks of `num_kv_pages_per_block` pages "
            "and replaces every masked logit with `mask_value`; the causal mask `q_span < k_span` also masks "
            "the slots from kv_len to the block's end, so each gets the weight `exp(mask_value - m)` with the "
            "latent vector the page holds there (a stale token, or anything). `ref_mla_ragged_paged_attention` "
            "attends over exactly `kv_len` keys. With the default mask value the weight underflows to 0 and "
            "nothing shows; with a finite one (-2.0 here) one decode of one key in a block of 16 slots is off "
            "by 1.4e5 bounds."
        ),
        fails_as=(OverTheBound,),
    ),
    KnownIssue(
        "mla-v1-default-block-sizes-raise",
        "num_kv_pages_per_block or num_queries_per_block left at its default (None) raises ValueError on "
        "every TPU generation: the kernel has no block sizes of its own",
        FINDINGS / "mla-v1-default-block-sizes-raise" / "differential_fast-interpret-v5e.json",
        block_sizes_left_to_the_kernel,
        with_given_block_sizes,
        r"ValueError: num_kv_pages_per_block and num_queries_per_block must be specified\.",
        explanation=(
            "`mla_ragged_paged_attention` declares `num_kv_pages_per_block: int | None = None` and "
            "`num_queries_per_block: int | None = None`, and its first statement raises a ValueError when "
            "either is None, under a TODO to support an autotuning table and a heuristic for them. It has "
            "neither, and never asks which chip it runs on, so a call with the signature's defaults raises "
            "on every TPU generation (seen on a TPU v5e). `ref_mla_ragged_paged_attention` takes no block "
            "sizes; a caller must choose both, with nothing in the kernel to say which fit a chip."
        ),
        fails_as=(RaisedOnValidInput,),
    ),
)
