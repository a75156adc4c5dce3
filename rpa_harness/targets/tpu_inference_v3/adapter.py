"""tpu-inference's RPA v3 behind upstream's API: the call mapped to v3's, and v3 run on it.

v3's API differs from upstream jax's: the new tokens' keys and values are inputs that the kernel writes
into a packed cache, which it returns with the attention. ``v3_inputs`` maps an upstream-style call (a
cache that already holds every key) to v3's, with the cache v3 must return; ``call_v3`` runs v3 on it;
``ragged_paged_attention`` and ``dynamic_validate_inputs`` have upstream's signatures.
"""

import dataclasses
import functools
import inspect
import types

import jax
import jax.numpy as jnp
import numpy as np

from rpa_harness.spec.interface import options_taken
from rpa_harness.targets import layouts
from rpa_harness.targets.tpu_inference.arguments import (
    KernelInputs,
    block_sizes,
    given_block_options,
    replacing_mask_value,
    score_options,
    v3_arguments,
    vmem_limit,
)
from rpa_harness.targets.tpu_inference.kernels import V3_KERNEL_MODULE, jitted, load_kernel_module, run_jitted
from rpa_harness.targets.tpu_inference.releases import V3Api, installed_version


@functools.cache
def kernel() -> types.ModuleType:
    """v3's kernel module, imported on first use, so that the adapter and v3's catalogue import without
    tpu-inference (a fork's target names v3's findings); raises ImportError saying how to install it."""
    return load_kernel_module(V3_KERNEL_MODULE)


@dataclasses.dataclass(frozen=True)
class V3Inputs(KernelInputs):
    """One upstream-style call in v3's terms, and the cache v3 must return."""

    # (bq, bkv, bq_chunk, bkv_chunk) of v3's decode and mixed kernels: the ones passed, or where the
    # target leaves them to v3 (None in kwargs), the ones v3 chooses for the chip.
    decode_block_sizes: tuple[int, int, int, int]
    mixed_block_sizes: tuple[int, int, int, int]


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
