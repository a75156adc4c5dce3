"""Upstream's interface of ragged paged attention, stated once: the options, their defaults, the input rules.

Every other part reads it from here: the kernel and the references take their keyword signature from
``Options`` (``takes_options``), the case model inherits its option fields from it, and the invalid-input
table (``strategies/violations.py``) renders its expected messages with the message functions below, the
ones the validators raise. This module imports no kernel, so a kernel that fails to import cannot take
the judges down with it.

The rules are upstream's (``jax.experimental.pallas.ops.tpu.ragged_paged_attention``), checked in the same
order and worded the same, character for character, so that a caller cannot tell the two validators apart
on the inputs upstream rejects. Where upstream raises a bare ``AssertionError`` or accepts an input that
makes the kernel read out of bounds or loop forever, a ``ValueError`` names the argument, the value and the
rule (docs/semantics.md lists each difference). ``static_validate_inputs`` looks only at shapes, dtypes and
options (it runs at trace time); ``dynamic_validate_inputs`` also reads the metadata arrays (call it
eagerly, outside ``jax.jit``).
"""

import dataclasses
import functools
import inspect
from typing import Any

import numpy as np

DEFAULT_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)

# What mask_value means. Upstream ADDS it to a masked logit (the default masks fully: its sum is far below
# every live logit). A kernel may instead REPLACE a masked logit with it, with the default (None)
# finfo(output dtype).min: with a finite mask_value a masked key keeps the weight exp(mask_value - max),
# and its value enters P @ V. The two defaults mean the same (no weight); other values do not.
MASK_ADDED = "added"
MASK_REPLACES = "replaces"
MASK_VALUE_MEANINGS = (MASK_ADDED, MASK_REPLACES)

ARRAY_NAMES = ("q", "kv_pages", "kv_lens", "page_indices", "cu_q_lens", "num_seqs")

# Latent attention (DeepSeek's MLA in its absorbed form) in upstream's layout. Its key is the latent vector
# and the rotary part side by side, [kv_c ; k_pe] (head_dim = lkv + r), its value the latent vector alone,
# kv_c (lkv dims), its query split the same way, [ql_nope ; q_pe]. Stated here as one extra fact of the
# inputs, not an option: the value slot of each KV head holds the key's first ``value_head_dim`` dims and
# zeros after them, in every slot of the cache. Upstream's formula then is MLA's, unchanged: logits over
# head_dim dims (the two dot products of widths lkv and r summed), and an output whose dims past
# ``value_head_dim`` are exactly zero. A kernel that returns only the value's dims is judged on those, its
# adapter filling the rest with zeros. ``value_head_dim == head_dim`` is one latent vector used whole as key
# and value (DeepSeek-V4's sliding-window attention). A target declares the (head_dim, value_head_dim)
# pairs it takes (``Capabilities.value_head_dims``); cases carry ``value_head_dim`` (``Case``).
VALUE_IS_KEY_PREFIX = "the value is the key's first value_head_dim dims, zero after them"

# Field metadata: an option that only tunes how the kernel runs (block sizes, VMEM); the output is the same.
TUNING = {"tuning": True}
# Field metadata: semantics beyond upstream's interface that some targets have. Not in
# upstream's signature (``SIGNATURE``, ``takes_options``): only the judges (``takes_extended_options``) and
# targets that declare them (``rpa_harness.strategies.valid.Capabilities``) receive them, so upstream's kernel and ours
# never get a keyword they do not take.
EXTENSION = {"extension": True}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Options:
    """The keyword options of ``ragged_paged_attention``: each field's name, type and default are upstream's."""

    sm_scale: float = 1.0
    sliding_window: int | None = None
    soft_cap: float | None = None
    mask_value: float | None = DEFAULT_MASK_VALUE  # None means DEFAULT_MASK_VALUE
    k_scale: float | None = None
    v_scale: float | None = None
    num_kv_pages_per_block: int | None = dataclasses.field(default=None, metadata=TUNING)
    num_queries_per_block: int | None = dataclasses.field(default=None, metadata=TUNING)
    vmem_limit_bytes: int | None = dataclasses.field(default=None, metadata=TUNING)
    # A quantised query: q is divided by it, clipped to the KV dtype's finite range and cast to the KV dtype
    # (in q's dtype until the cast), and the logits are multiplied by it. None: q is used as it is.
    q_scale: float | None = dataclasses.field(default=None, metadata=EXTENSION)
    # MASK_ADDED (upstream's) or MASK_REPLACES; see MASK_VALUE_MEANINGS.
    mask_value_meaning: str = dataclasses.field(default=MASK_ADDED, metadata=EXTENSION)
    # Attention sinks: one float32 logit per q head (a tuple, so that options stay hashable and static).
    # Head h's sink joins the softmax denominator of every row of head h and contributes no value:
    # o = sum_k exp(s_k - m) v_k / (exp(sink_h - m) + sum_k exp(s_k - m)), m = max(sink_h, max_k s_k).
    # A sink of -inf is no sink; a large one takes the weight from every key. None: no sinks.
    attention_sink: tuple[float, ...] | None = dataclasses.field(default=None, metadata=EXTENSION)
    # Causal attention (True): query t of a sequence sees keys [0, kv_len - q_len + t]. False: every query
    # of a sequence sees all its keys, [0, kv_len) (an encoder, or a multimodal prefix); a sliding window
    # still hides the keys at or before position - sliding_window.
    use_causal_mask: bool = dataclasses.field(default=True, metadata=EXTENSION)
    # The dtype a kernel keeps its softmax statistics and accumulator in, and rounds the result to before
    # it is stored in q's dtype (the output's dtype whatever this is): "float32" or "bfloat16". A precision
    # choice: the exact result is the same, the bound follows the declared precision contract. None: q's.
    out_dtype: str | None = dataclasses.field(default=None, metadata=EXTENSION)
    # The rest only choose how a kernel runs (TUNING: the output is the same).
    # The caller's promise that no key past kv_len needs masking: attention is not causal and every live
    # kv_len is a whole number of the kernel's KV blocks (num_kv_pages_per_block pages).
    skip_kv_mask: bool = dataclasses.field(default=False, metadata={**EXTENSION, **TUNING})
    # The sequences after the leading decodes whose q_len equals it run in a kernel compiled for that
    # q_len (a chunked prefill); None: no such kernel.
    chunk_prefill_size: int | None = dataclasses.field(default=None, metadata={**EXTENSION, **TUNING})
    # Whether the kernel writes the new tokens' keys and values into the cache it returns (for an API
    # that takes them apart from the cache). False (a KV-shared layer): the cache already holds them, every key is
    # read from it, and the returned cache is the input, bit for bit.
    update_kv_cache: bool = dataclasses.field(default=True, metadata={**EXTENSION, **TUNING})

    def keywords(self) -> dict:
        """Upstream's options as keyword arguments (what upstream's signature takes)."""
        return {name: getattr(self, name) for name in OPTION_NAMES}

    def extension_keywords(self) -> dict:
        """The extension options that differ from their defaults (what a target that declares them gets)."""
        return {
            name: getattr(self, name)
            for name in EXTENSION_NAMES
            if getattr(self, name) != getattr(OPTION_DEFAULTS, name)
        }

    def semantics(self) -> "Options":
        """The options that decide the output: tuning options at their defaults, ``mask_value`` resolved.

        Two calls whose ``semantics()`` are equal must return the same values, so a reference that jits on
        these compiles once per meaning, not once per block size.
        """
        tuning: dict[str, Any] = {
            f.name: f.default for f in dataclasses.fields(Options) if f.metadata.get("tuning")
        }
        mask_value = self.mask_value
        if mask_value is None and self.mask_value_meaning == MASK_ADDED:
            mask_value = DEFAULT_MASK_VALUE
        return dataclasses.replace(self, mask_value=mask_value, **tuning)

    def mask_value_for(self, q_dtype) -> float:
        """The mask value a call uses: ``None`` resolved per meaning (a replacing mask's default is the
        lowest value of the accumulator dtype, so it is resolved here rather than in ``semantics()``)."""
        if self.mask_value is not None:
            return self.mask_value
        if self.mask_value_meaning == MASK_REPLACES:
            import ml_dtypes  # numpy's finfo does not know bfloat16

            return float(ml_dtypes.finfo(self.accumulator_dtype(q_dtype)).min)
        return DEFAULT_MASK_VALUE

    def accumulator_dtype(self, q_dtype):
        """The dtype the softmax statistics and the accumulator are kept in: ``out_dtype``, else q's."""
        if self.out_dtype is None:
            return q_dtype
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, self.out_dtype, None) or self.out_dtype)


OPTION_NAMES = tuple(f.name for f in dataclasses.fields(Options) if not f.metadata.get("extension"))
EXTENSION_NAMES = tuple(f.name for f in dataclasses.fields(Options) if f.metadata.get("extension"))
ALL_OPTION_NAMES = OPTION_NAMES + EXTENSION_NAMES
OPTION_DEFAULTS = Options()


def options_taken(options: dict, *, by: str, without: tuple[str, ...] = ()) -> Options:
    """``options`` as ``Options``, for a kernel that takes the specification's options but ``without``: a
    keyword the specification does not know, or one the kernel does not take, is the TypeError Python's
    own call of ``by`` would raise."""
    unexpected = [name for name in options if name not in ALL_OPTION_NAMES or name in without]
    if unexpected:
        raise TypeError(f"{by}() got an unexpected keyword argument {unexpected[0]!r}")
    return Options(**options)


def _signature(names) -> inspect.Signature:
    fields = {f.name: f for f in dataclasses.fields(Options)}
    return inspect.Signature(
        [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD) for name in ARRAY_NAMES]
        + [
            inspect.Parameter(
                n, inspect.Parameter.KEYWORD_ONLY, default=fields[n].default, annotation=fields[n].type
            )
            for n in names
        ]
    )


SIGNATURE = _signature(OPTION_NAMES)
EXTENDED_SIGNATURE = _signature(ALL_OPTION_NAMES)


def _options_taker(implementation, names, signature):
    @functools.wraps(implementation)
    def call(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options):
        unknown = sorted(set(options) - set(names))
        if unknown:
            raise TypeError(
                f"{implementation.__name__}() got unexpected keyword argument(s) {', '.join(unknown)}; "
                f"it takes {', '.join(names)}"
            )
        return implementation(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, Options(**options))

    call.__signature__ = signature
    return call


def takes_options(implementation):
    """Gives ``implementation(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, options)`` upstream's
    signature: the six arrays, then upstream's options as keywords with their defaults.

    ``jax.jit(..., static_argnames=OPTION_NAMES)`` applies on top. An unknown keyword, an extension option
    included, is a TypeError.
    """
    return _options_taker(implementation, OPTION_NAMES, SIGNATURE)


def takes_extended_options(implementation):
    """``takes_options`` for the judges: upstream's options and the extensions (``EXTENSION_NAMES``)."""
    return _options_taker(implementation, ALL_OPTION_NAMES, EXTENDED_SIGNATURE)


# The messages, one function per rule. ``f"{x=}"`` in upstream renders ``x=`` and ``repr(x)``; each function
# takes the values as the validator has them (a jax scalar renders as ``Array(7, dtype=int32)``: JaxInt).


class JaxInt:
    """An int32 as a validator renders an entry of a jax array: ``Array(7, dtype=int32)``."""

    def __init__(self, value: int):
        self.value = int(value)

    def __repr__(self) -> str:
        return f"Array({self.value}, dtype=int32)"

    __str__ = __repr__


def values_per_word(dtype) -> int:
    """Values of ``dtype`` in one 32-bit word (float32 1, bfloat16 2, 8-bit types 4): how TPU layouts pack
    them. Takes a dtype or its name, ml_dtypes' names (``"bfloat16"``, ``"float8_e4m3fn"``) included."""
    import ml_dtypes  # numpy's dtype() does not know them by name

    if isinstance(dtype, str) and isinstance(getattr(ml_dtypes, dtype, None), type):
        dtype = getattr(ml_dtypes, dtype)
    try:
        dtype = np.dtype(dtype)
    except TypeError:
        raise ValueError(
            f"values_per_word: dtype={dtype!r} is not a dtype; pass a numpy dtype or a name such as "
            "'float32', 'bfloat16' or 'float8_e4m3fn'"
        ) from None
    if dtype.itemsize not in (1, 2, 4):
        raise ValueError(
            f"values_per_word: {dtype} has {8 * dtype.itemsize} bits; a 32-bit word holds a whole number of "
            "8-, 16- or 32-bit values only: pass one of those dtypes"
        )
    return 4 // dtype.itemsize


def odd_combined_kv_heads_message(num_combined_kv_heads) -> str:
    return (
        f"kv_pages.shape[2]={num_combined_kv_heads} (num_combined_kv_heads) must be even: K and V "
        "heads are interleaved, so it holds 2 * num_kv_heads."
    )


def scale_not_float_message(name, value) -> str:
    return (
        f"{name}={value!r} must be a Python float or None, got {type(value).__name__}; "
        f"pass float({name}) instead."
    )


def num_seqs_shape_message(shape) -> str:
    return f"num_seqs.shape={shape!r} must be (1,)"


def head_dim_mismatch_message(head_dim, head_dim_k) -> str:
    return f"Q head_dim {head_dim} must be the same as that of K/V {head_dim_k}."


def kv_lens_shape_message(shape, max_num_seqs) -> str:
    return (
        f"Expected kv_lens.shape={shape!r} to be ({max_num_seqs},) where"
        " `max_num_seqs` is `page_indices.shape[0]`."
    )


def cu_q_lens_shape_message(shape, max_num_seqs) -> str:
    return (
        f"Expected cu_q_lens.shape={shape!r} to be ({max_num_seqs + 1},)  where"
        " `max_num_seqs` is `page_indices.shape[0]`."
    )


def index_dtype_message(kv_lens_dtype, page_indices_dtype, cu_q_lens_dtype) -> str:
    return (
        "The dtype of `kv_lens`, `page_indices`, and `cu_q_lens` must be"
        f" int32. Got kv_lens.dtype={kv_lens_dtype!r}, page_indices.dtype={page_indices_dtype!r},"
        f" cu_q_lens.dtype={cu_q_lens_dtype!r}."
    )


def heads_not_divisible_message(num_q_heads, num_kv_heads) -> str:
    return f"num_q_heads={num_q_heads!r} must be divisible by num_kv_heads={num_kv_heads!r}"


def not_positive_message(name, value) -> str:
    """sliding_window, num_queries_per_block and vmem_limit_bytes share upstream's wording."""
    return f"{name}={value!r} must be positive."


def soft_cap_zero_message(soft_cap) -> str:
    return f"soft_cap={soft_cap!r} must not be 0.0."


def kv_block_out_of_range_message(num_kv_pages_per_block, pages_per_seq) -> str:
    return f"num_kv_pages_per_block={num_kv_pages_per_block!r} must be in range (0, {pages_per_seq}]."


def negative_num_seqs_message(num_seqs) -> str:
    return f"num_seqs[0]={num_seqs!r} must be non-negative: it counts the sequences in the batch."


def num_seqs_over_max_message(num_seqs, max_num_seqs) -> str:
    return f"num_seqs[0]={num_seqs!r} must be less or equal to max_num_seqs={max_num_seqs!r}"


def too_few_pages_message(pages_per_seq, min_pages_per_seq, max_kv_len, page_size) -> str:
    return (
        f"pages_per_seq={pages_per_seq!r} must be greater or equal to"
        f" min_pages_per_seq={min_pages_per_seq!r} given max_kv_len={max_kv_len!r} and page_size={page_size!r}."
    )


def too_many_tokens_message(total, max_num_batched_tokens) -> str:
    return (
        f"Total q tokens {total} must be less or equal to max_num_batched_tokens={max_num_batched_tokens!r}."
    )


def negative_q_len_message(q_len, seq) -> str:
    return (
        f"q_len={q_len!r} must be non-negative at sequence {seq}: cu_q_lens must not decrease over the"
        " first num_seqs + 1 entries."
    )


def q_len_over_kv_len_message(q_len, kv_len, seq) -> str:
    return f"q_len={q_len!r} must be less or equal to kv_len={kv_len!r} at sequence {seq}."


def page_out_of_range_message(seq, page, value, total_num_pages, kv_len) -> str:
    return (
        f"page_indices[{seq}, {page}]={value} must be in [0, {total_num_pages}) "
        f"(total_num_pages): sequence {seq} reads page {page} of its kv_len={kv_len}."
    )


def mask_value_meaning_message(meaning) -> str:
    return f"mask_value_meaning={meaning!r} must be one of {MASK_VALUE_MEANINGS}."


def attention_sink_type_message(attention_sink) -> str:
    return (
        f"attention_sink={attention_sink!r} ({type(attention_sink).__name__}) must be None or a tuple of "
        "Python floats, one logit per q head; pass tuple(float(x) for x in sinks)."
    )


def attention_sink_length_message(length, num_q_heads) -> str:
    return (
        f"attention_sink has {length} logits but q has num_q_heads={num_q_heads}; pass one logit per q head."
    )


OUT_DTYPES = ("float32", "bfloat16")


def flag_not_bool_message(name, value) -> str:
    return f"{name}={value!r} ({type(value).__name__}) must be True or False."


def skip_kv_mask_causal_message() -> str:
    return (
        "skip_kv_mask=True with use_causal_mask=True: a causal mask must mask keys; skip the KV mask only "
        "for non-causal attention (use_causal_mask=False) whose kv_lens are whole KV blocks."
    )


def chunk_prefill_size_message(chunk_prefill_size) -> str:
    return (
        f"chunk_prefill_size={chunk_prefill_size!r} must be None or a positive int: a prefill chunk's q_len."
    )


def out_dtype_message(out_dtype) -> str:
    return f"out_dtype={out_dtype!r} must be None or one of {OUT_DTYPES}."


def check_extensions(options: Options, num_q_heads: int) -> None:
    """The extension options' own rules: a known mask meaning, a float (or None) q_scale, one float sink
    logit per q head (``num_q_heads``, q.shape[1]), bool flags (the KV mask skipped only without the
    causal one), a positive chunk size and a known accumulator dtype."""
    if options.mask_value_meaning not in MASK_VALUE_MEANINGS:
        raise ValueError(mask_value_meaning_message(options.mask_value_meaning))
    _check_scale("q_scale", options.q_scale)
    for name in ("use_causal_mask", "skip_kv_mask", "update_kv_cache"):
        if not isinstance(getattr(options, name), bool):
            raise ValueError(flag_not_bool_message(name, getattr(options, name)))
    if options.skip_kv_mask and options.use_causal_mask:
        raise ValueError(skip_kv_mask_causal_message())
    size = options.chunk_prefill_size
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size <= 0):
        raise ValueError(chunk_prefill_size_message(size))
    if options.out_dtype is not None and options.out_dtype not in OUT_DTYPES:
        raise ValueError(out_dtype_message(options.out_dtype))
    sink = options.attention_sink
    if sink is None:
        return
    if not isinstance(sink, tuple) or not all(isinstance(x, float) for x in sink):
        raise ValueError(attention_sink_type_message(sink))
    if len(sink) != num_q_heads:
        raise ValueError(attention_sink_length_message(len(sink), num_q_heads))


def _check_scale(name, value):
    if value is not None and not isinstance(value, float):
        raise ValueError(scale_not_float_message(name, value))


@takes_options
def static_validate_inputs(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, options):
    """Checks what is known at trace time; raises ValueError on the first violation."""
    _, num_q_heads, head_dim = q.shape
    _, _, num_combined_kv_heads, head_dim_k = kv_pages.shape
    if num_combined_kv_heads % 2 != 0:
        raise ValueError(odd_combined_kv_heads_message(num_combined_kv_heads))
    _check_scale("k_scale", options.k_scale)
    _check_scale("v_scale", options.v_scale)
    num_kv_heads = num_combined_kv_heads // 2
    max_num_seqs, pages_per_seq = page_indices.shape
    if num_seqs.shape != (1,):
        raise ValueError(num_seqs_shape_message(num_seqs.shape))
    if head_dim_k != head_dim:
        raise ValueError(head_dim_mismatch_message(head_dim, head_dim_k))
    if kv_lens.shape != (max_num_seqs,):
        raise ValueError(kv_lens_shape_message(kv_lens.shape, max_num_seqs))
    if cu_q_lens.shape != (max_num_seqs + 1,):
        raise ValueError(cu_q_lens_shape_message(cu_q_lens.shape, max_num_seqs))
    if any(a.dtype != np.int32 for a in (kv_lens, page_indices, cu_q_lens)):
        raise ValueError(index_dtype_message(kv_lens.dtype, page_indices.dtype, cu_q_lens.dtype))
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(heads_not_divisible_message(num_q_heads, num_kv_heads))
    sliding_window, soft_cap = options.sliding_window, options.soft_cap
    num_kv_pages_per_block = options.num_kv_pages_per_block
    num_queries_per_block = options.num_queries_per_block
    vmem_limit_bytes = options.vmem_limit_bytes
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(not_positive_message("sliding_window", sliding_window))
    if soft_cap is not None and soft_cap == 0.0:
        raise ValueError(soft_cap_zero_message(soft_cap))
    if num_kv_pages_per_block is not None and not 0 < num_kv_pages_per_block <= pages_per_seq:
        raise ValueError(kv_block_out_of_range_message(num_kv_pages_per_block, pages_per_seq))
    if num_queries_per_block is not None and num_queries_per_block <= 0:
        raise ValueError(not_positive_message("num_queries_per_block", num_queries_per_block))
    if vmem_limit_bytes is not None and vmem_limit_bytes <= 0:
        raise ValueError(not_positive_message("vmem_limit_bytes", vmem_limit_bytes))


@takes_options
def dynamic_validate_inputs(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, options):
    """Runs the static checks, then the ones that read the metadata values.

    Decisions are taken on NumPy copies (fast); messages are rendered from the caller's own arrays, as
    upstream renders them (a jax array shows as ``Array(7, dtype=int32)``).
    """
    static_validate_inputs(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options.keywords())
    max_num_batched_tokens = q.shape[0]
    total_num_pages, page_size = kv_pages.shape[:2]
    max_num_seqs, pages_per_seq = page_indices.shape
    kv_lens_np = np.asarray(kv_lens)
    cu_q_lens_np = np.asarray(cu_q_lens)
    page_indices_np = np.asarray(page_indices)
    n = int(np.asarray(num_seqs)[0])
    if n < 0:
        raise ValueError(negative_num_seqs_message(num_seqs[0]))
    if n > max_num_seqs:
        raise ValueError(num_seqs_over_max_message(num_seqs[0], max_num_seqs))
    if pages_per_seq * page_size < int(kv_lens_np.max()):
        import jax.numpy as jnp  # upstream renders these two as jax scalars, whatever the caller passed

        max_kv_len = jnp.max(kv_lens)
        min_pages_per_seq = (max_kv_len + (page_size - 1)) // page_size
        raise ValueError(too_few_pages_message(pages_per_seq, min_pages_per_seq, max_kv_len, page_size))
    if cu_q_lens_np[n] > max_num_batched_tokens:
        raise ValueError(too_many_tokens_message(cu_q_lens[num_seqs[0]], max_num_batched_tokens))
    q_lens_np = np.diff(cu_q_lens_np[: n + 1])
    for i in range(n):
        if q_lens_np[i] < 0:
            raise ValueError(negative_q_len_message(cu_q_lens[i + 1] - cu_q_lens[i], i))
        if q_lens_np[i] > kv_lens_np[i]:
            raise ValueError(q_len_over_kv_len_message(cu_q_lens[i + 1] - cu_q_lens[i], kv_lens[i], i))
        used = page_indices_np[i, : -(-int(kv_lens_np[i]) // page_size)]
        bad = np.flatnonzero((used < 0) | (used >= total_num_pages))
        if bad.size:
            j = int(bad[0])
            raise ValueError(
                page_out_of_range_message(i, j, int(used[j]), total_num_pages, int(kv_lens_np[i]))
            )
