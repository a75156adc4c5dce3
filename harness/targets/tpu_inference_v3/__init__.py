"""tpu-inference's ragged paged attention v3 as a harness target: ``--rpa-target=rpa_harness.targets.tpu_inference_v3``.

v3 (PyPI ``tpu-inference``, ``tpu_inference/kernels/ragged_paged_attention/v3/kernel.py``) is the kernel
that serves vLLM on TPU. Its API differs from upstream jax's: the new tokens' keys and values are inputs
that the kernel writes into a packed cache, which it returns with the attention. This module adapts an
upstream-style call (a cache that already holds every key) to v3's, so that the harness's properties run
unchanged, and exposes the rest of v3's contract for ``tests/test_v3_target.py``:

- ``ragged_paged_attention`` / ``dynamic_validate_inputs``: upstream's signatures; the attention output.
- ``call_v3``: the same call returning v3's updated cache too; ``check_updated_cache`` judges it bit for bit.
- ``v3_inputs``: the upstream-style case in v3's layout (what is passed, and what the cache must become).

Its profile is whole here: the adapter (this module), its validators' messages (``messages``) and rule
table (``rules``), and its known issues with their predicates (``known_issues``). ``rpa_harness.tpu_inference_v3``
is accepted as a shorter target name.

Install v3 without its dependencies (its ``__init__`` imports vllm, and it pins a jax it does not need):

    pip install --no-deps tpu-inference==0.32.0
"""

import dataclasses
import importlib.util
import os
import sys
import types
from importlib.metadata import version as _version

import jax
import jax.numpy as jnp
import numpy as np
from rpa_harness import generations, reference
from rpa_harness.backends import INTERPRET, Backend, Deadlock
from rpa_harness.checks import PropertyFailure, RaisedOnValidInput, numeric_failure
from rpa_harness.spec.interface import MASK_ADDED, MASK_REPLACES
from rpa_harness.targets import layouts

INSTALL_COMMAND = "pip install --no-deps tpu-inference==0.32.0"
_KERNEL_MODULE = "tpu_inference.kernels.ragged_paged_attention.v3.kernel"
# Upstream's default mask value; v3's default (finfo(out_dtype).min, replacing the logit) masks as fully.
UPSTREAM_DEFAULT_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
DEFAULT_VMEM_LIMIT_BYTES = 64 * 2**20
DEFAULT_QUERIES_PER_BLOCK = 8
DEFAULT_KV_PAGES_PER_BLOCK = 2


def load_kernel_module(name: str) -> types.ModuleType:
    """Imports a module of tpu-inference's v3 kernels (``name``) without running ``tpu_inference/__init__.py``
    (it imports vllm).

    The package entries are stubs whose ``__path__`` is the installed folder, so the kernel's absolute
    imports of its siblings (``...v3.util``) resolve to the installed files.
    """
    if "tpu_inference" not in sys.modules:
        spec = importlib.util.find_spec("tpu_inference")  # finds the package without running it
        if spec is None or not spec.submodule_search_locations:
            raise ImportError(
                f"tpu-inference is not installed; install its RPA v3 kernel with `{INSTALL_COMMAND}` "
                "(--no-deps: the kernel needs only jax, and the package's own dependencies include vllm)"
            )
        package, path = "", list(spec.submodule_search_locations)[0]
        for part in ("tpu_inference", "kernels", "ragged_paged_attention", "v3"):
            package, path = (f"{package}.{part}", os.path.join(path, part)) if package else (part, path)
            stub = types.ModuleType(package)
            stub.__path__ = [path]
            sys.modules.setdefault(package, stub)
    return importlib.import_module(name)


v3 = load_kernel_module(_KERNEL_MODULE)

# What the strategies draw for v3 (fields of rpa_harness.strategies.valid.Capabilities). Outside of it: q_len == 0 (v3
# forbids it and hangs on it: tests/test_v3_target.py) and page sizes v3 rejects for a KV dtype.
RPA_HARNESS_CAPABILITIES = dict(
    head_dims=(64, 128, 256),
    page_size_multiple_of_kv_packing=True,
    empty_sequences=False,
    # v3 replaces a masked logit with mask_value (default finfo(out_dtype).min); upstream adds it.
    mask_value_meaning=MASK_REPLACES,
    # v3's quantised query: q / q_scale clipped to the KV dtype's range, cast to it; logits times q_scale.
    q_scale=True,
    # v3 folds k_scale into the score scale and applies v_scale after P @ V, without upstream's rounding
    # of the scaled cache to q's dtype (docs/tpu-inference-v3-findings/README.md).
    kv_scales_round_to_q_dtype=False,
    # The generic interpreter runs v3's data-dependent copy sizes (pl.ds with a traced length) through the
    # compat layer's gap generic-dynamic-size-copies (masked copies of a static window).
    backends=("interpret", "fast-interpret", "tpu"),
    # v3 reads the chip (util.get_tpu_version, pltpu.get_tpu_info) for its default block sizes and VMEM
    # limit, its position integers (int16 for packed queries from v6 on) and its output memory space (v7).
    # v4 has no default block sizes in v3 (NotImplementedError).
    tpu_generations=("v5e", "v5p", "v6e", "7x"),
    # v3's options beyond upstream's, as the specification's extensions: use_causal_mask, out_dtype (the
    # accumulators' dtype; the output stays q's), skip_kv_mask, chunk_prefill_size, update_kv_cache.
    non_causal=True,
    out_dtype=True,
    skip_kv_mask=True,
    chunk_prefill_size=True,
    update_kv_cache=True,
    buckets=("tiny", "small", "long"),
    # At long contexts v3's default decode block is 16,384 keys for a bfloat16 cache (32,768 for fp8),
    # copied page by page, each copy unrolled. With 16-key pages (1,024 copies) one call with 65,536 keys
    # did not return within 300 s on the fast interpreter (v6e); with 256-key pages (64 copies) a call with
    # 70,001 keys on v3's own defaults took 46-54 s on v5e, v5p and v6e (benchmarks/generation_branches.py).
    min_page_size_for_long_default_blocks=256,
)
# v3 keeps its softmax max, denominator and P @ V accumulator in the output dtype (bfloat16 for bfloat16
# queries: l_ref/m_ref/acc_ref are allocated with out_dtype, and P @ V is cast to it before accumulating).
# Its kernel computes logits and P in float32 and does not round P to V's dtype (its reference does).
RPA_HARNESS_PRECISION = ("accumulators-in-output-dtype",)


@dataclasses.dataclass(frozen=True)
class KernelInputs:
    """One upstream-style call in the terms of one of tpu-inference's v3 kernels, and the cache the kernel
    must return: what ``check_updated_cache`` reads (``V3Inputs``, the hd64 target's ``Hd64Inputs``)."""

    args: tuple  # queries, keys, values, kv_cache, kv_lens, page_indices, cu_q_lens, distribution (NumPy)
    kwargs: dict  # keyword options for the kernel
    expected_cache: np.ndarray  # the packed cache with every live key and value in place
    new_slots: np.ndarray  # bool [pages, page_size]: the slots v3 writes (positions [kv_len - q_len, kv_len))
    slot_owner: np.ndarray  # int [pages, page_size]: sequence whose page holds the slot, -1 for none
    slot_position: np.ndarray  # int [pages, page_size]: the key position of the slot in its sequence


@dataclasses.dataclass(frozen=True)
class V3Inputs(KernelInputs):
    """One upstream-style call in v3's terms, and the cache v3 must return."""

    # (bq, bkv, bq_chunk, bkv_chunk) of v3's decode and mixed kernels: the ones passed, or where the
    # target leaves them to v3 (None in kwargs), the ones v3 chooses for the chip.
    decode_block_sizes: tuple[int, int, int, int]
    mixed_block_sizes: tuple[int, int, int, int]


def decode_prefix(q_lens: np.ndarray) -> int:
    """How many leading sequences are decodes (q_len == 1): v3's decode kernel runs those."""
    count = 0
    for q_len in q_lens:
        if q_len != 1:
            break
        count += 1
    return count


def block_sizes(tokens_per_block: int, chunk_unit: int) -> tuple[int, int]:
    """A block and its compute chunk: half the block when that is a whole number of units."""
    units = tokens_per_block // chunk_unit
    return tokens_per_block, (units // 2 if units > 0 and units % 2 == 0 else units) * chunk_unit


def given_block_options(
    num_queries_per_block: int | None, num_kv_pages_per_block: int | None, pages_per_seq: int
) -> tuple[int, int] | None:
    """``(query rows, KV pages)`` per block to pass to a v3 kernel, or None where it chooses its own: on a
    TPU generation (real or emulated) with neither given. Off one, the target's defaults fill what is not
    given (8 rows, 2 pages): the kernels' tuned tables need a chip."""
    if num_queries_per_block is None and num_kv_pages_per_block is None and generations.on_a_tpu_generation():
        return None
    return (
        DEFAULT_QUERIES_PER_BLOCK if num_queries_per_block is None else num_queries_per_block,
        min(DEFAULT_KV_PAGES_PER_BLOCK, pages_per_seq)
        if num_kv_pages_per_block is None
        else num_kv_pages_per_block,
    )


def chunked_prefills(q_lens: np.ndarray, decodes: int, chunk_prefill_size: int | None) -> int:
    """How many sequences after the leading decodes have q_len == ``chunk_prefill_size``: v3's prefill
    kernel, compiled for that q_len, runs those."""
    count = 0
    if chunk_prefill_size is not None:
        for q_len in q_lens[decodes:]:
            if q_len != chunk_prefill_size:
                break
            count += 1
    return count


def kernel_arguments(
    q, tokens, cache, kv_lens, page_indices, cu_q_lens, num_seqs, *, chunk_prefill_size=None
) -> tuple:
    """The positional arguments both v3 kernels take: q, the new tokens' keys and values, the packed cache
    (their slots poisoned), the metadata as given with the page table flat, and the distribution (the
    leading decodes run by the decode kernel, then the chunked prefills of ``chunk_prefill_size`` rows)."""
    decodes = decode_prefix(tokens.q_lens)
    prefills_end = decodes + chunked_prefills(tokens.q_lens, decodes, chunk_prefill_size)
    num_live = int(np.asarray(num_seqs).reshape(-1)[0])
    return (
        q,
        tokens.keys,
        tokens.values,
        cache,
        np.asarray(kv_lens),
        np.asarray(page_indices).reshape(-1),
        np.asarray(cu_q_lens),
        np.array([decodes, prefills_end, num_live], np.int32),
    )


def shared_kv_inputs(tokens, kv_pages):
    """For ``update_kv_cache=False`` (a KV-shared layer): the cache to pass is the whole cache, new tokens
    included, and the new tokens' keys and values are NaN, so that a kernel that reads them instead of the
    cache returns NaN; it must return the cache unchanged."""
    unused = dataclasses.replace(
        tokens,
        keys=np.full_like(tokens.keys, np.nan),
        values=np.full_like(tokens.values, np.nan),
        new_slots=np.zeros_like(tokens.new_slots),
    )
    return unused, kv_pages


def v3_default_block_sizes(
    q, kv_cache, num_kv_heads: int, max_num_seqs: int, pages_per_seq: int, case
) -> tuple[int, int, int, int]:
    """(bq, bkv, bq_chunk, bkv_chunk) that v3 chooses for its ``case`` kernel (``RpaCase.DECODE`` or
    ``MIXED``) on the chip it sees (its ``get_default_block_sizes``, called with the arguments v3 passes)."""
    sizes = v3.get_default_block_sizes(
        q.dtype,
        kv_cache.dtype,
        q.shape[1],
        num_kv_heads,
        q.shape[2],
        kv_cache.shape[1],
        q.shape[0],
        max_num_seqs,
        pages_per_seq,
        case=case,
    )
    return sizes["bq_sz"], sizes["bkv_sz"], sizes["bq_csz"], sizes["bkv_csz"]


def _vmem_limit(vmem_limit_bytes: int | None) -> int | None:
    """v3 takes its default VMEM limit from the chip (``pltpu.get_tpu_info()``): off a TPU generation,
    which has none, the target passes ``DEFAULT_VMEM_LIMIT_BYTES``."""
    if vmem_limit_bytes is None and not generations.on_a_tpu_generation():
        return DEFAULT_VMEM_LIMIT_BYTES
    return vmem_limit_bytes


def replacing_mask_value(mask_value: float | None, mask_value_meaning: str) -> float | None:
    """The ``mask_value`` to pass to a v3 kernel, which replaces a masked logit with it (None: its default,
    which masks fully). With upstream's meaning (added) only its defaults have a v3 counterpart."""
    if mask_value_meaning == MASK_REPLACES:
        return mask_value
    if mask_value in (None, UPSTREAM_DEFAULT_MASK_VALUE):
        return None
    raise ValueError(
        f"mask_value={mask_value!r} with mask_value_meaning={mask_value_meaning!r}: v3 replaces a masked "
        f"logit with mask_value, so an added mask has no v3 counterpart; pass "
        f"mask_value_meaning={MASK_REPLACES!r} (or the default mask_value)"
    )


def v3_inputs(
    q,
    kv_pages,
    kv_lens,
    page_indices,
    cu_q_lens,
    num_seqs,
    *,
    sm_scale: float = 1.0,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    mask_value: float | None = UPSTREAM_DEFAULT_MASK_VALUE,
    k_scale: float | None = None,
    v_scale: float | None = None,
    num_kv_pages_per_block: int | None = None,
    num_queries_per_block: int | None = None,
    vmem_limit_bytes: int | None = None,
    q_scale: float | None = None,
    mask_value_meaning: str = MASK_ADDED,
    use_causal_mask: bool = True,
    out_dtype: str | None = None,
    skip_kv_mask: bool = False,
    chunk_prefill_size: int | None = None,
    update_kv_cache: bool = True,
) -> V3Inputs:
    """Maps an upstream-style call to v3's.

    ``mask_value`` is v3's when ``mask_value_meaning`` is ``replaces``; with upstream's meaning (added)
    only its defaults, which mask fully under both meanings, have a v3 counterpart (v3's default).

    The new tokens of sequence ``i`` are its last ``q_len`` keys (positions ``[kv_len - q_len, kv_len)``),
    taken from the case's pages into ``keys``/``values`` rows ``cu_q_lens[i]..``; their cache slots are set
    to NaN in the cache v3 receives, so a kernel that reads them from the cache instead of from the new
    tokens returns NaN, and the cache it must return is the case's cache, packed. Padding rows of the new
    keys/values are NaN where q's padding row is NaN (poisoned cases), zero otherwise. With
    ``update_kv_cache=False`` the cache holds every key and the new tokens are NaN (``shared_kv_inputs``).
    v3's prefill kernel (``chunk_prefill_size``) gets the block sizes its decode and mixed kernels get.
    """
    v3_mask_value = replacing_mask_value(mask_value, mask_value_meaning)
    q, kv_pages = np.asarray(q), np.asarray(kv_pages)
    # v3 receives the metadata as given (its validators judge dtypes and shapes); the split reads only the
    # entries that exist: invalid metadata is v3's validators' business.
    tokens = layouts.split_new_tokens(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs)
    page_size, pages_per_seq = kv_pages.shape[1], np.asarray(page_indices).shape[1]
    if update_kv_cache:
        packed_cache = layouts.pack_cache(tokens.poisoned_cache(kv_pages))
    else:
        tokens, cache = shared_kv_inputs(tokens, kv_pages)
        packed_cache = layouts.pack_cache(cache)
    given = given_block_options(num_queries_per_block, num_kv_pages_per_block, pages_per_seq)
    passed: tuple[int, int, int, int] | None = None  # None: v3's own for the chip, known once it validated
    if given is not None:
        bq, bkv_pages = given
        bq, bq_chunk = block_sizes(bq, 1)
        bkv, bkv_chunk = block_sizes(bkv_pages * page_size, page_size)
        passed = (bq, bkv, bq_chunk, bkv_chunk)
    kwargs = dict(
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        mask_value=v3_mask_value,
        q_scale=q_scale,
        k_scale=k_scale,
        v_scale=v_scale,
        d_block_sizes=passed,
        p_block_sizes=passed,
        m_block_sizes=passed,
        vmem_limit_bytes=_vmem_limit(vmem_limit_bytes),
        use_causal_mask=use_causal_mask,
        skip_kv_mask=skip_kv_mask,
        out_dtype=None if out_dtype is None else jnp.dtype(out_dtype),
        chunk_prefill_size=chunk_prefill_size,
        update_kv_cache=update_kv_cache,
    )
    args = kernel_arguments(
        q,
        tokens,
        packed_cache,
        kv_lens,
        page_indices,
        cu_q_lens,
        num_seqs,
        chunk_prefill_size=chunk_prefill_size,
    )
    if passed is None:
        # v3 validates its inputs before it chooses its block sizes: an invalid input raises its message,
        # not an assertion of the sizing helpers. (Its prefill kernel's defaults are its mixed kernel's:
        # get_default_block_sizes tells only the decode case apart.)
        v3.static_validate_inputs(*args, **validator_options(kwargs))
        decode_sizes, mixed_sizes = (
            v3_default_block_sizes(q, packed_cache, tokens.keys.shape[1], len(kv_lens), pages_per_seq, case)
            for case in (v3.RpaCase.DECODE, v3.RpaCase.MIXED)
        )
    else:
        decode_sizes = mixed_sizes = passed
    expected_cache = layouts.pack_cache(kv_pages)
    return V3Inputs(
        args,
        kwargs,
        expected_cache,
        tokens.new_slots,
        tokens.slot_owner,
        tokens.slot_position,
        decode_sizes,
        mixed_sizes,
    )


def validator_options(kwargs: dict) -> dict:
    """The keyword options v3's validators and reference take: the kernel's, less ``update_kv_cache``."""
    return {name: value for name, value in kwargs.items() if name != "update_kv_cache"}


_JITTED: dict = {}


def jitted(kernel, kwargs: dict):
    """``kernel`` (a v3 kernel function) under jit, one per option set: v3's kernels donate their inputs to
    their outputs (jit keeps the caller's arrays), and each static configuration compiles once. Keyed by
    each value's type and repr, so that options that compare equal but render differently (``-0.0`` and
    ``0.0``, ``1`` and ``1.0``) keep their own compilation, and the kernel's messages, which render them,
    stay theirs."""
    key = (kernel, *sorted((name, type(value).__name__, repr(value)) for name, value in kwargs.items()))
    if key not in _JITTED:
        _JITTED[key] = jax.jit(lambda *arrays: kernel(*arrays, **kwargs))
    return _JITTED[key]


def device_arrays(args) -> list:
    """A v3 kernel's positional arguments as jax arrays, put on the device without a per-shape compile
    (``targets.as_jax``); an absent optional one (the hd64 kernel without sinks) stays None."""
    return [None if a is None else jax.device_put(a) for a in args]


def call_v3(inputs: V3Inputs):
    """Runs v3 (on whatever backend the caller's context selects): ``(attention, updated packed cache)``."""
    return jitted(v3.ragged_paged_attention, inputs.kwargs)(*device_arrays(inputs.args))


def ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options):
    """Upstream's call on v3: the attention (v3 raises its static validators' errors while tracing)."""
    out, _ = call_v3(v3_inputs(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options))
    return out


def dynamic_validate_inputs(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options):
    """v3's own ``dynamic_validate_inputs`` (its rules, its messages) on the mapped inputs."""
    inputs = v3_inputs(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options)
    v3.dynamic_validate_inputs(*map(jax.device_put, inputs.args), **validator_options(inputs.kwargs))


def unwritten_by_sliding_window(inputs: V3Inputs) -> np.ndarray:
    """bool [pages, page_size]: the new-token slots v3 0.32.0 does not write with a sliding window (finding
    ``docs/tpu-inference-v3-findings/sliding-window-skips-cache-writes``).

    v3 writes a KV block's new tokens to the cache only while its last query block runs, and with a sliding
    window that query block starts its KV loop at block ``max(first_query_position - window, 0) // bkv``:
    the new tokens in the KV blocks before it are never written. This recomputes that set from v3's loop
    bounds, so that a campaign can tell this known finding from any other cache mismatch.
    """
    window = inputs.kwargs["sliding_window"]
    unwritten = np.zeros_like(inputs.new_slots)
    if window is None or not inputs.kwargs["update_kv_cache"]:
        return unwritten
    _, _, _, _, kv_lens, page_indices, cu_q_lens, distribution = inputs.args
    page_size = inputs.new_slots.shape[1]
    pages_per_seq = len(page_indices) // len(kv_lens)
    decodes, _, num_seqs = (int(x) for x in distribution)
    for i in range(num_seqs):
        bq, bkv = (inputs.decode_block_sizes if i < decodes else inputs.mixed_block_sizes)[:2]
        q_len, kv_len = int(cu_q_lens[i + 1] - cu_q_lens[i]), int(kv_lens[i])
        q_block = min(bq, q_len) if i < decodes else bq  # the decode kernel's query block is one row
        last_block_start = kv_len - q_len + (-(-q_len // q_block) - 1) * q_block
        first_written = max(last_block_start - window, 0) // bkv * bkv
        for position in range(kv_len - q_len, min(first_written, kv_len)):
            page = page_indices[i * pages_per_seq + position // page_size]
            unwritten[page, position % page_size] = True
    return unwritten


class CacheMismatch(PropertyFailure):
    """v3's updated cache is not the expected one; ``str()`` says which slots and whose. ``slots`` is the
    bool [pages, page_size] map of the slots that differ, ``stale`` whether each holds its input value."""

    kind = "returned cache differs from the expected one"

    def __init__(self, message: str, slots: np.ndarray | None = None, stale: np.ndarray | None = None):
        super().__init__(message)
        self.slots, self.stale = slots, stale


def check_updated_cache(inputs: KernelInputs, updated_cache) -> None:
    """The returned cache equals the expected one bit for bit: every new token written to its slot, and
    no other page, slot, padded head or padded dim changed (NaN payloads included)."""
    actual, expected = np.asarray(updated_cache), inputs.expected_cache
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        raise CacheMismatch(
            f"v3 returned a cache of {actual.shape} {actual.dtype}, expected {expected.shape} {expected.dtype}"
        )
    bits = f"u{expected.dtype.itemsize}"
    differs = (actual.view(bits) != expected.view(bits)).reshape(*expected.shape[:2], -1)
    if not differs.any():
        return
    stale_bits = np.asarray(inputs.args[3]).view(bits).reshape(differs.shape)
    is_stale = (actual.view(bits).reshape(differs.shape) == stale_bits).all(axis=-1)
    slots = np.argwhere(differs.any(axis=-1))
    lines = []
    for page, slot in slots[:5]:
        owner, position = inputs.slot_owner[page, slot], inputs.slot_position[page, slot]
        whose = f"sequence {owner}, key position {position}" if owner >= 0 else "a page no live sequence uses"
        role = "a new token's slot" if inputs.new_slots[page, slot] else "a slot v3 must leave unchanged"
        flat = np.flatnonzero(differs[page, slot])
        a = actual[page, slot].reshape(-1)[flat[0]]
        e = expected[page, slot].reshape(-1)[flat[0]]
        lines.append(
            f"  page {page}, slot {slot} ({role}; {whose}): {len(flat)} elements differ, first at packed "
            f"element {flat[0]}: got {a!r}, expected {e!r}"
        )
    written = int((differs.any(axis=-1) & inputs.new_slots).sum())
    raise CacheMismatch(
        f"v3's updated cache differs from the expected cache in {len(slots)} slots ({written} of "
        f"{int(inputs.new_slots.sum())} new-token slots, {len(slots) - written} slots it must leave unchanged):\n"
        + "\n".join(lines),
        slots=differs.any(axis=-1),
        stale=is_stale,
    )


# ---- v3's own property: both outputs of one call, judged ----

# The checking TPU interpreter with the compat layer, as the harness's ``interpret`` backend: out-of-bounds
# reads raise, scratch is NaN, races raise, a call that outlives the watchdog is a hang. (The generic
# properties also run v3 on the generic interpreter, through the compat layer's dynamic-size copies.)
CHECKING = Backend(INTERPRET)

SLIDING_WINDOW_FINDING = "sliding-window-skips-cache-writes"
# The kinds of v3's own repros (``rpa_harness.property_names``): both outputs judged; a call that hangs.
ATTENTION_AND_CACHE, HANG = "v3-attention-and-cache", "v3-hang"


@dataclasses.dataclass
class Verdict:
    """Both outputs of one v3 call, judged."""

    comparison: reference.Comparison  # of the attention with the float64 oracle
    cache_error: CacheMismatch | None  # None: the updated cache is the expected one, bit for bit
    known_finding: str | None  # the documented finding that explains the cache error exactly, if any


def judge(
    arrays: dict, options: dict, backend: Backend = CHECKING, *, precision=RPA_HARNESS_PRECISION
) -> Verdict:
    """Runs v3 once on an upstream-style case and judges both outputs: the attention against the float64
    oracle, the updated cache bit for bit. A cache error is attributed to a documented finding only when
    the differing slots are exactly the ones the finding predicts and each still holds its input value."""
    inputs = v3_inputs(**arrays, **options)
    out, cache = backend.run(call_v3, inputs)
    comparison = reference.compare(
        out,
        reference.oracle(**arrays, **options),
        label=f"tpu-inference v3 on {backend.label}",
        precision=precision,
    )
    try:
        check_updated_cache(inputs, cache)
    except CacheMismatch as error:
        predicted = unwritten_by_sliding_window(inputs)
        known = (
            error.slots is not None  # None: the cache's shape or dtype differs
            and error.stale is not None
            and predicted.any()
            and np.array_equal(error.slots, predicted)
            and error.stale[predicted].all()
        )
        return Verdict(comparison, error, SLIDING_WINDOW_FINDING if known else None)
    return Verdict(comparison, None, None)


def checks_both_outputs(judge_outputs):
    """The property ``judge_outputs(arrays, options, backend, precision=...)`` (a ``Verdict``) decides, as a
    check ``check(target, backend, arrays, options)`` (what ``rpa_harness.checks.recheck`` runs for this
    target's own kinds): it raises while either output is wrong, and a deadlock the TPU interpreter finds
    is the call raising on valid inputs (a hang)."""

    def check(target, backend, arrays: dict, options: dict) -> None:
        try:
            verdict = judge_outputs(arrays, options, backend, precision=target.precision)
        except Deadlock as deadlock:
            raise RaisedOnValidInput(
                f"{target.name} on {backend.label} never returns: {deadlock}",
                Deadlock.__name__,
                str(deadlock),
            ) from None
        if verdict.cache_error is not None:
            finding = (
                f"\n  (exactly the slots of docs/tpu-inference-v3-findings/{verdict.known_finding})"
                if verdict.known_finding
                else ""
            )
            attention = "" if verdict.comparison.ok else f"\n{verdict.comparison}"
            raise verdict.cache_error.__class__(f"{verdict.cache_error}{finding}{attention}") from None
        if not verdict.comparison.ok:
            raise numeric_failure(verdict.comparison, arrays)

    return check


# The rest of the profile: v3's validators' rule table, and its known issues (docs/tpu-inference-v3-findings/:
# their cases are not drawn, and tests/properties/test_known_issues.py replays each repro while it still
# fails). Imported last: both read the adapter above.
from rpa_harness.targets.tpu_inference_v3 import known_issues as _known_issues  # noqa: E402
from rpa_harness.targets.tpu_inference_v3.rules import RULES as RPA_HARNESS_RULES  # noqa: E402, F401

RPA_HARNESS_CATALOGUE = _known_issues.RPA_HARNESS_CATALOGUE
check_both_outputs = checks_both_outputs(judge)
RPA_HARNESS_PROPERTIES = dict.fromkeys((ATTENTION_AND_CACHE, HANG), check_both_outputs)
RPA_HARNESS_KNOWN_ISSUES = tuple(issue.name for issue in RPA_HARNESS_CATALOGUE)
RPA_HARNESS_VERSION = f"tpu-inference {_version('tpu-inference')}"


def RPA_HARNESS_REPORT(*args, **kwargs):  # noqa: N802  (a profile attribute, named as the others)
    """v3's own report (``report.render``): imported when a report is asked for, not with the target."""
    from rpa_harness.targets.tpu_inference_v3 import report

    return report.render(report.V3, *args, **kwargs)
