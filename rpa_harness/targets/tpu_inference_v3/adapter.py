"""tpu-inference's RPA v3 behind upstream's API: the call mapped to v3's, and v3 run on it.

v3's API differs from upstream jax's: the new tokens' keys and values are inputs that the kernel writes
into a packed cache, which it returns with the attention. ``v3_inputs`` maps an upstream-style call (a
cache that already holds every key) to v3's, with the cache v3 must return; ``call_v3`` runs v3 on it;
``ragged_paged_attention`` and ``dynamic_validate_inputs`` have upstream's signatures.
"""

import dataclasses
import functools
import importlib.util
import inspect
import logging
import os
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np

from rpa_harness import generations
from rpa_harness.spec.interface import MASK_REPLACES, options_taken
from rpa_harness.targets import layouts
from rpa_harness.targets.tpu_inference_v3.releases import NOT_INSTALLED, V3Api, installed_version

PINNED_RELEASE = "0.32.0"  # the release CI tests and the findings' reports were made on
INSTALL_COMMAND = f"pip install --no-deps tpu-inference=={PINNED_RELEASE}"
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
    from rpa_harness.targets.tpu_inference_v3 import early_api  # it imports this module

    early_api.prepare_to_load()  # 0.11.1 to 0.13.x: a jax name they call, the tuned table's imports
    return importlib.import_module(name)


class OnceLogger:
    """What tpu-inference's kernel modules ask of its logger (vllm's): a ``logging.Logger`` with
    ``warning_once`` and ``info_once`` (the head_dim-64 kernel's tuned table)."""

    def __init__(self, name: str):
        self._logger = logging.getLogger(name)
        self._said: set = set()

    def _once(self, level, message, *args):
        if (message, args) not in self._said:
            self._said.add((message, args))
            self._logger.log(level, message, *args)

    def warning_once(self, message, *args):
        self._once(logging.WARNING, message, *args)

    def info_once(self, message, *args):
        self._once(logging.INFO, message, *args)

    def __getattr__(self, name):  # warning, info, ...: the logger's own
        return getattr(self._logger, name)


def stand_in_for_tpu_inference_logger() -> None:
    """Where vllm is not installed (``--no-deps``), ``tpu_inference.logger`` (vllm's logger, which some of
    tpu-inference's kernel modules import) as a module whose ``init_logger`` gives an ``OnceLogger``: one
    stand-in for every kernel module loaded in the process."""
    if importlib.util.find_spec("vllm") is None and "tpu_inference.logger" not in sys.modules:
        logger = types.ModuleType("tpu_inference.logger")
        logger.init_logger = OnceLogger  # type: ignore[attr-defined]
        sys.modules["tpu_inference.logger"] = logger


def tpu_device_name() -> str:
    """The chip as tpu-inference's tuned tables name it (``TPU v5e``, ``TPU v6e``, ``TPU v5``, ``TPU v7``),
    read from ``jax.devices()`` at each call so that TPU generation emulation answers; off a TPU the
    ``RuntimeError`` tpu-inference's ``get_device_name`` raises."""
    kind = jax.devices()[0].device_kind
    if "TPU" not in kind:
        raise RuntimeError("Expected TPU devices")
    suffix = ""
    for ending, letter in ((" lite", "e"), ("e", "e"), ("p", "p"), ("i", "i")):
        if kind.endswith(ending):
            kind, suffix = kind[: -len(ending)], letter
            break
    if kind.startswith("TPU7") or kind.startswith("TPU8"):
        kind = f"TPU v{kind[3]}"
    return kind + suffix


def stand_in_for_tpu_inference_utils() -> None:
    """The tuned tables (hd64's; v3's before 0.18.0) import ``tpu_inference.logger`` (vllm's logger) and
    ``tpu_inference.utils`` (torch, vllm) for one name each. Where vllm is not installed (``--no-deps``)
    both are stood in: ``init_logger`` (``stand_in_for_tpu_inference_logger``) and ``get_device_name``
    (``tpu_device_name``)."""
    if importlib.util.find_spec("vllm") is not None:
        return
    stand_in_for_tpu_inference_logger()
    if "tpu_inference.utils" not in sys.modules:
        utils = types.ModuleType("tpu_inference.utils")
        utils.get_device_name = tpu_device_name  # type: ignore[attr-defined]
        sys.modules["tpu_inference.utils"] = utils


def install_command() -> str:
    """How to install the release installed here (the pinned one where none is)."""
    version = installed_version()
    return INSTALL_COMMAND if version == NOT_INSTALLED else f"pip install --no-deps tpu-inference=={version}"


@functools.cache
def kernel() -> types.ModuleType:
    """v3's kernel module, imported on first use, so that the adapter and v3's catalogue import without
    tpu-inference (a fork's target names v3's findings); raises ImportError saying how to install it."""
    return load_kernel_module(_KERNEL_MODULE)


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

    @classmethod
    def of_tokens(cls, args: tuple, kwargs: dict, expected_cache: np.ndarray, tokens, *block_sizes):
        """The inputs whose new tokens' slots are ``tokens``' (``layouts.split_new_tokens``), followed by the
        subclass's block sizes."""
        return cls(
            args,
            kwargs,
            expected_cache,
            tokens.new_slots,
            tokens.slot_owner,
            tokens.slot_position,
            *block_sizes,
        )


def score_options(options) -> dict:
    """The options every v3-derived kernel takes under the specification's names: how a logit is scaled,
    capped and windowed and how a quantized query and cache are scaled. (The mask value each target maps
    to its kernel's meaning itself.)"""
    return dict(
        sm_scale=options.sm_scale,
        sliding_window=options.sliding_window,
        soft_cap=options.soft_cap,
        q_scale=options.q_scale,
        k_scale=options.k_scale,
        v_scale=options.v_scale,
    )


@dataclasses.dataclass(frozen=True)
class V3Inputs(KernelInputs):
    """One upstream-style call in v3's terms, and the cache v3 must return."""

    # (bq, bkv, bq_chunk, bkv_chunk) of v3's decode and mixed kernels: the ones passed, or where the
    # target leaves them to v3 (None in kwargs), the ones v3 chooses for the chip.
    decode_block_sizes: tuple[int, int, int, int]
    mixed_block_sizes: tuple[int, int, int, int]


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


def kernel_arguments(
    q, tokens, cache, kv_lens, page_indices, cu_q_lens, num_seqs, *, chunk_prefill_size=None
) -> tuple:
    """The positional arguments both v3 kernels take: q, the new tokens' keys and values, the packed cache
    (their slots poisoned), the metadata as given with the page table flat, and the distribution (the
    leading decodes run by the decode kernel, then the chunked prefills of ``chunk_prefill_size`` rows)."""
    return (
        q,
        tokens.keys,
        tokens.values,
        cache,
        np.asarray(kv_lens),
        np.asarray(page_indices).reshape(-1),
        np.asarray(cu_q_lens),
        layouts.distribution(tokens.q_lens, num_seqs, chunk_prefill_size=chunk_prefill_size),
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


def v3_arguments(
    q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, update_kv_cache: bool, chunk_prefill_size
) -> tuple[layouts.NewTokens, tuple]:
    """The positional arguments of a kernel with v3's API for an upstream-style case (``v3_inputs`` says
    how the new tokens and the cache are laid out), and the new tokens they hold."""
    q, kv_pages = np.asarray(q), np.asarray(kv_pages)
    # The kernel receives the metadata as given (its validators judge dtypes and shapes); the split reads
    # only the entries that exist: invalid metadata is the kernel's validators' business.
    tokens = layouts.split_new_tokens(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs)
    if update_kv_cache:
        packed_cache = layouts.pack_cache(tokens.poisoned_cache(kv_pages))
    else:
        tokens, cache = shared_kv_inputs(tokens, kv_pages)
        packed_cache = layouts.pack_cache(cache)
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
    return tokens, args


def v3_default_block_sizes(
    q, kv_cache, num_kv_heads: int, max_num_seqs: int, pages_per_seq: int, case, *, module=None
) -> tuple[int, int, int, int]:
    """(bq, bkv, bq_chunk, bkv_chunk) that v3 (or ``module``, a kernel with v3's API) chooses for its
    ``case`` kernel (``RpaCase.DECODE`` or ``MIXED``) on the chip it sees (its ``get_default_block_sizes``,
    called with the arguments v3 passes)."""
    sizes = (module or kernel()).get_default_block_sizes(
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


def vmem_limit(vmem_limit_bytes: int | None) -> int | None:
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
    module: types.ModuleType | None = None,
    **keywords,
) -> V3Inputs:
    """Maps an upstream-style call to v3's (or to ``module``'s, a kernel with v3's API: its validator and
    default block sizes).

    ``mask_value`` is v3's when ``mask_value_meaning`` is ``replaces``; with upstream's meaning (added)
    only its defaults, which mask fully under both meanings, have a v3 counterpart (v3's default).

    The new tokens of sequence ``i`` are its last ``q_len`` keys (positions ``[kv_len - q_len, kv_len)``),
    taken from the case's pages into ``keys``/``values`` rows ``cu_q_lens[i]..``; their cache slots are set
    to NaN in the cache v3 receives, so a kernel that reads them from the cache instead of from the new
    tokens returns NaN, and the cache it must return is the case's cache, packed. Padding rows of the new
    keys/values are NaN where q's padding row is NaN (poisoned cases), zero otherwise. With
    ``update_kv_cache=False`` the cache holds every key and the new tokens are NaN (``shared_kv_inputs``).
    v3's prefill kernel (``chunk_prefill_size``) gets the block sizes its decode and mixed kernels get.
    ``keywords``: the specification's options (``spec.interface.Options``), all but ``attention_sink``.
    """
    module = module or kernel()
    if not api_of(module).block_tuples:  # tpu-inference 0.11.1 to 0.13.x
        from rpa_harness.targets.tpu_inference_v3 import early_api  # it imports this module

        return early_api.early_v3_inputs(
            q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, module=module, **keywords
        )
    options = options_taken(keywords, by="v3_inputs", without=("attention_sink",))
    v3_mask_value = replacing_mask_value(options.mask_value, options.mask_value_meaning)
    q, kv_pages = np.asarray(q), np.asarray(kv_pages)
    tokens, args = v3_arguments(
        q,
        kv_pages,
        kv_lens,
        page_indices,
        cu_q_lens,
        num_seqs,
        update_kv_cache=options.update_kv_cache,
        chunk_prefill_size=options.chunk_prefill_size,
    )
    pages_per_seq = np.asarray(page_indices).shape[1]
    passed = passed_block_sizes(options, kv_pages.shape[1], pages_per_seq)
    kwargs = v3_options(options, v3_mask_value, passed, api_of(module))
    if passed is None:
        decode_sizes, mixed_sizes = chosen_block_sizes(module, args, kwargs, tokens, pages_per_seq)
    else:
        decode_sizes = mixed_sizes = passed
    return V3Inputs.of_tokens(args, kwargs, layouts.pack_cache(kv_pages), tokens, decode_sizes, mixed_sizes)


def passed_block_sizes(options, page_size: int, pages_per_seq: int) -> tuple[int, int, int, int] | None:
    """The (bq, bkv, bq_chunk, bkv_chunk) passed to each of v3's kernels: the case's blocks, each computed
    in halves when even; None where v3 chooses its own for the chip (``given_block_options``)."""
    given = given_block_options(options.num_queries_per_block, options.num_kv_pages_per_block, pages_per_seq)
    if given is None:
        return None
    bq, bkv_pages = given
    bq, bq_chunk = block_sizes(bq, 1)
    bkv, bkv_chunk = block_sizes(bkv_pages * page_size, page_size)
    return bq, bkv, bq_chunk, bkv_chunk


def v3_options(
    options, mask_value: float | None, passed: tuple[int, int, int, int] | None, api: V3Api
) -> dict:
    """v3's keyword options for the specification's ``options``: ``mask_value`` v3's
    (``replacing_mask_value``), ``passed`` the block sizes of all three of its kernels (decode, prefill,
    mixed)."""
    return dict(
        **score_options(options),
        mask_value=mask_value,
        d_block_sizes=passed,
        p_block_sizes=passed,
        m_block_sizes=passed,
        vmem_limit_bytes=vmem_limit(options.vmem_limit_bytes),
        use_causal_mask=options.use_causal_mask,
        skip_kv_mask=options.skip_kv_mask,
        out_dtype=None if options.out_dtype is None else jnp.dtype(options.out_dtype),
        chunk_prefill_size=options.chunk_prefill_size,
        **update_kv_cache_option(options.update_kv_cache, api),
    )


def chosen_block_sizes(module: types.ModuleType, args: tuple, kwargs: dict, tokens, pages_per_seq: int):
    """(decode, mixed) block sizes ``module`` chooses for the chip, once its static validator accepted
    the inputs: v3 validates before it sizes, so an invalid input raises its message, not an assertion of
    the sizing helpers. (Its prefill kernel's defaults are its mixed kernel's: get_default_block_sizes
    tells only the decode case apart.)"""
    module.static_validate_inputs(*args, **validator_options(kwargs))
    q, packed_cache, kv_lens = args[0], args[3], args[4]
    return tuple(
        v3_default_block_sizes(
            q, packed_cache, tokens.keys.shape[1], len(kv_lens), pages_per_seq, case, module=module
        )
        for case in (module.RpaCase.DECODE, module.RpaCase.MIXED)
    )


def api_of(module: types.ModuleType) -> V3Api:
    """What ``module``'s ``ragged_paged_attention`` takes (the release's API, ``releases``)."""
    return V3Api(tuple(inspect.signature(module.ragged_paged_attention).parameters))


def update_kv_cache_option(update_kv_cache: bool, api: V3Api) -> dict:
    """``update_kv_cache`` for a kernel that takes it (tpu-inference 0.22.1 on); one that does not always
    writes the new tokens, so only the default has a counterpart there."""
    if api.update_kv_cache:
        return dict(update_kv_cache=update_kv_cache)
    if not update_kv_cache:
        raise ValueError(
            f"update_kv_cache=False: the installed tpu-inference {installed_version()} has no such option "
            "(its kernel always writes the new tokens to the cache; the option exists from 0.22.1 on)"
        )
    return {}


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


def run_jitted(function, inputs):
    """``function`` (a kernel function of tpu-inference's) on mapped ``inputs`` (its positional ``args``,
    its keyword ``kwargs``) under ``jitted``, on whatever backend the caller's context selects: how every
    tpu-inference target runs its kernel."""
    return jitted(function, inputs.kwargs)(*device_arrays(inputs.args))


def compiled_call(arrays: dict, options: dict, module: types.ModuleType | None = None):
    """What the chip compiles for an upstream-style call (the compile property; the chip owner compiles it
    ahead of the call): the jitted kernel function with its keyword options, the one ``call_v3`` runs, and
    its positional arguments as mapped here (their shapes are what matter)."""
    module = module or kernel()
    inputs = v3_inputs(**arrays, module=module, **options)
    return jitted(module.ragged_paged_attention, inputs.kwargs), inputs.args


def call_v3(inputs: V3Inputs):
    """Runs v3 (on whatever backend the caller's context selects): ``(attention, updated packed cache)``."""
    return run_jitted(kernel().ragged_paged_attention, inputs)


def ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options):
    """Upstream's call on v3: the attention (v3 raises its static validators' errors while tracing)."""
    out, _ = call_v3(v3_inputs(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options))
    return out


def dynamic_validate_inputs(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options):
    """v3's own ``dynamic_validate_inputs`` (its rules, its messages) on the mapped inputs."""
    inputs = v3_inputs(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options)
    kernel().dynamic_validate_inputs(*map(jax.device_put, inputs.args), **validator_options(inputs.kwargs))
