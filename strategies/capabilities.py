"""What a target declares it supports (``Capabilities``): the strategies draw only inside it. A declaration,
not a run's choice: which buckets a run draws is passed to the strategies apart (``selection``)."""

import dataclasses

from rpa_harness.spec.interface import (
    MASK_ADDED,
    MASK_VALUE_MEANINGS,
)
from rpa_harness.strategies.buckets import BUCKETS

__all__ = [  # what an adapter imports (docs/targets.md)
    "Capabilities",
    "RUNTIME_OPTIONS",
    "WHOLE_SPACE",
]

# The options a target may take at run time (Capabilities.runtime_options): the ones that only weigh numbers.
RUNTIME_OPTIONS = ("sm_scale", "sliding_window", "soft_cap", "mask_value", "k_scale", "v_scale")
# The options a target may declare it does not take (Capabilities.options_not_taken): each has a default
# that leaves the attention as if it did not exist.
OPTIONS_A_TARGET_MAY_NOT_TAKE = ("soft_cap", "mask_value", "k_scale", "v_scale")


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What a target supports; strategies draw only inside it. Defaults: the whole specified space."""

    head_dims: tuple[int, ...] = (64, 128, 256)
    # Latent attention (rpa_harness.spec.interface.VALUE_IS_KEY_PREFIX): (head_dim, value_head_dim) pairs,
    # key lkv + r dims and value lkv (value_head_dim == head_dim: the value is the whole key, one latent
    # vector used as both); every head_dim of the target is then one of them, and every case drawn for it
    # has its value as its key's prefix. Empty: ordinary attention, key and value of head_dim dims.
    value_head_dims: tuple[tuple[int, int], ...] = ()
    page_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    q_dtypes: tuple[str, ...] = ("float32", "bfloat16")
    kv_dtypes: tuple[str, ...] = ("float32", "bfloat16", "float8_e4m3fn", "float8_e5m2")
    # (q dtype, KV dtype) pairs not drawn though each dtype is: a pair the kernel, or the platform it runs
    # on, cannot run (every KV dtype keeps a q dtype).
    excluded_dtype_pairs: tuple[tuple[str, str], ...] = ()
    num_kv_heads: tuple[int, ...] = (1, 2, 4, 8)
    gqa_ratios: tuple[int, ...] = (1, 2, 3, 4, 8)
    # Whether num_kv_heads must be even for 8-bit KV (upstream: combined heads must tile the packing).
    even_kv_heads_for_fp8: bool = False
    # Whether both block sizes must be given (upstream's default lookup needs a TPU).
    needs_block_sizes: bool = False
    # Whether the interpreters may leave the block sizes to the kernel where it sees a TPU generation
    # (False: its own are sized to fill the chip's VMEM whatever the problem, which XLA:CPU takes minutes
    # to compile; only a real TPU then draws them).
    kernel_block_sizes_on_interpreters: bool = True
    # The most pages a given KV block holds (0: any): for a kernel whose compiled code grows with the pages
    # of a block (a copy unrolled per page and per batched sequence), which the interpreters take minutes to
    # compile past a few pages.
    max_kv_pages_per_block: int = 0
    # The smallest page size at which the long bucket may leave block sizes to the kernel (None); 0: any.
    # For a kernel whose default KV block at long contexts is a fixed number of keys, copied page by page
    # (each copy unrolled), small pages make one call take the interpreters minutes; below this page size
    # the long bucket draws tuned block sizes, and the small buckets draw given ones where a sequence has
    # more than 32 pages (``options.MAX_UNROLLED_PAGE_COPIES``).
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
    # Upstream's options the target does not take (its API has no such keyword), of soft_cap, mask_value,
    # k_scale and v_scale: drawn only at their defaults (no cap, the default mask, no scales).
    options_not_taken: tuple[str, ...] = ()
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
    # The buckets the target can run (names of BUCKETS); a run draws those of them it selects
    # (rpa_harness.strategies.shapes.select_buckets: --rpa-buckets, else the defaults).
    buckets: tuple[str, ...] = ("tiny", "small")
    # The backends (rpa_harness.device names) the target is declared to run on; elsewhere its numeric
    # properties are skipped as "cannot run" (declared). Any other error on valid input is a failure.
    backends: tuple[str, ...] = ("interpret", "fast-interpret", "tpu")
    # Of those, the ones a call is too slow on for a campaign: under --rpa-backend=auto its properties skip
    # there (declared slow); chosen explicitly (--rpa-backend, a repro's backend) they run.
    slow_backends: tuple[str, ...] = ()
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
        self._check_value_head_dims()
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, tuple) or field.name in (
                "tpu_generations",
                "value_head_dims",
                "excluded_dtype_pairs",
            ):
                continue
            allowed = {
                "buckets": tuple(BUCKETS),
                "runtime_options": RUNTIME_OPTIONS,
                "options_not_taken": OPTIONS_A_TARGET_MAY_NOT_TAKE,
                "head_dims": tuple(h for h, _ in self.value_head_dims) or field.default,
                "slow_backends": self.backends,
            }.get(field.name, field.default)
            unknown = [v for v in value if v not in allowed]
            may_be_empty = ("runtime_options", "options_not_taken", "slow_backends")
            if unknown or (not value and field.name not in may_be_empty):
                problem = (
                    f"{unknown} not in the specified space" if unknown else "empty, so nothing can be drawn"
                )
                raise ValueError(
                    f"Capabilities({field.name}={value!r}): {problem}; choose a non-empty subset of {allowed}."
                )
        if self.mask_value_meaning not in MASK_VALUE_MEANINGS:
            raise ValueError(
                f"Capabilities(mask_value_meaning={self.mask_value_meaning!r}): choose one of {MASK_VALUE_MEANINGS}."
            )
        self._check_excluded_dtype_pairs()
        if not isinstance(self.max_kv_pages_per_block, int) or self.max_kv_pages_per_block < 0:
            raise ValueError(
                f"Capabilities(max_kv_pages_per_block={self.max_kv_pages_per_block!r}): give a number of pages "
                "(0: any)."
            )
        fp8 = [d for d in self.kv_dtypes if d.startswith("float8")]
        if self.even_kv_heads_for_fp8 and fp8 and not any(h % 2 == 0 for h in self.num_kv_heads):
            raise ValueError(
                f"Capabilities(num_kv_heads={self.num_kv_heads!r}, even_kv_heads_for_fp8=True, kv_dtypes "
                f"{fp8}): no even num_kv_heads for the 8-bit KV dtypes; add one or drop those dtypes."
            )

    def q_dtypes_for(self, kv_dtype: str) -> tuple[str, ...]:
        """The q dtypes drawn with ``kv_dtype``."""
        return tuple(q for q in self.q_dtypes if (q, kv_dtype) not in self.excluded_dtype_pairs)

    def _check_excluded_dtype_pairs(self) -> None:
        for pair in self.excluded_dtype_pairs:
            if not (
                isinstance(pair, tuple)
                and len(pair) == 2
                and pair[0] in self.q_dtypes
                and pair[1] in self.kv_dtypes
            ):
                raise ValueError(
                    f"Capabilities(excluded_dtype_pairs={self.excluded_dtype_pairs!r}): {pair!r} is not a (q dtype, "
                    f"KV dtype) pair of the drawn dtypes {self.q_dtypes} and {self.kv_dtypes}."
                )
        stranded = [kv for kv in self.kv_dtypes if not self.q_dtypes_for(kv)]
        if stranded:
            raise ValueError(
                f"Capabilities(excluded_dtype_pairs={self.excluded_dtype_pairs!r}): no q dtype is left for the "
                f"KV dtypes {stranded}; drop them from kv_dtypes or exclude fewer pairs."
            )

    def _check_value_head_dims(self) -> None:
        for pair in self.value_head_dims:
            if not (
                isinstance(pair, tuple)
                and len(pair) == 2
                and all(isinstance(d, int) for d in pair)
                and 0 < pair[1] <= pair[0]
            ):
                raise ValueError(
                    f"Capabilities(value_head_dims={self.value_head_dims!r}): {pair!r} is not a (head_dim, "
                    "value_head_dim) pair of integers with 0 < value_head_dim <= head_dim, e.g. (576, 512)."
                )
        if len({h for h, _ in self.value_head_dims}) != len(self.value_head_dims):
            raise ValueError(
                f"Capabilities(value_head_dims={self.value_head_dims!r}): one value_head_dim per head_dim."
            )

    def value_head_dim_for(self, head_dim: int) -> int | None:
        """The value's width for keys of ``head_dim`` dims: a latent attention pair's, else None."""
        return dict(self.value_head_dims).get(head_dim)


WHOLE_SPACE = Capabilities()  # the default of every strategy: the whole specified space
