"""v3 as tpu-inference 0.11.1 to 0.13.x ship it: their older API mapped from an upstream-style call (what
loading those kernels needs on the jax versions the harness supports is ``tpu_inference.kernels``'s).

The early kernels take the new tokens and the packed cache as 0.18.0 on does
(``tpu_inference.arguments.v3_arguments``), but upstream's two block options (``num_kv_pages_per_block``,
``num_queries_per_block``) instead of per-kernel block tuples, and none of ``use_causal_mask``, ``skip_kv_mask``, ``out_dtype`` or ``update_kv_cache``. Each
query block walks whole KV blocks of ``num_kv_pages_per_block`` pages (no compute chunks), so the target's
``(bq, bkv, bq_chunk, bkv_chunk)`` are ``(bq, bkv, bq, bkv)`` for every kernel. Where neither block option
is given the kernel asks its tuned table (``v3/tuned_block_sizes.py``), which reads the chip; the default
VMEM limit is a constant (100 MiB), not the chip's.

What a masked logit becomes differs between them, and is read from the kernel's source
(``kernel_mask_value_meaning``): 0.11.1 and 0.12.0 add ``mask_value`` to it (upstream's meaning), 0.13.x
replaces it with ``mask_value`` (while its own reference, ``ref_ragged_paged_attention``, still adds it).
"""

import ast
import dataclasses
import functools
import inspect
import types
from pathlib import Path

import numpy as np

from rpa_harness.spec.interface import MASK_ADDED, MASK_REPLACES, Options, options_taken
from rpa_harness.targets import layouts
from rpa_harness.targets.tpu_inference import arguments, releases
from rpa_harness.targets.tpu_inference_v3 import adapter

# The Pallas kernel's functions (``_ragged_paged_attention_kernel``, 0.32.0's ``..._loop``), where the mask is
# applied; the reference is another function.
KERNEL_BODY = "_ragged_paged_attention_kernel"
LACKING_OPTIONS_DEFAULTS = dict(
    use_causal_mask=True, skip_kv_mask=False, out_dtype=None, update_kv_cache=True
)


@functools.cache
def _mask_value_meaning_of(path: Path) -> str:
    tree = ast.parse(path.read_text())
    kernels = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith(KERNEL_BODY)]
    for node in (node for kernel in kernels for node in ast.walk(kernel)):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "where" and len(node.args) == 3:
            where = [isinstance(a, ast.Name) and a.id == "mask_value" for a in node.args]
            if where[1]:
                return MASK_ADDED  # s += jnp.where(mask, mask_value, 0.0)
            if where[2]:
                return MASK_REPLACES  # s = jnp.where(mask, s, mask_value)
    raise LookupError(f"{path}: {KERNEL_BODY}* applies mask_value in no jnp.where")


def kernel_mask_value_meaning(path: Path | None = None) -> str | None:
    """Whether the v3 kernel in ``path`` (default: the installed one) adds ``mask_value`` to a masked logit
    or replaces the logit with it, read from its source; None where tpu-inference is not installed."""
    path = path or releases.v3_file("kernel.py")
    return None if path is None else _mask_value_meaning_of(Path(path))


def early_mask_value(options: Options, kernel_meaning: str, kernel_default: float) -> float:
    """The ``mask_value`` to pass to an early kernel, which takes no None (its default is
    ``kernel_default``). A finite value means what it means only where the case's meaning is the kernel's;
    otherwise only the defaults, which mask fully under both meanings, have a counterpart."""
    if options.mask_value is None or options.mask_value == arguments.UPSTREAM_DEFAULT_MASK_VALUE:
        return kernel_default if options.mask_value is None else options.mask_value
    if options.mask_value_meaning == kernel_meaning:
        return options.mask_value
    raise ValueError(
        f"mask_value={options.mask_value!r} with mask_value_meaning={options.mask_value_meaning!r}: the "
        f"installed tpu-inference {releases.installed_version()} {kernel_meaning} it (a masked logit), so only the "
        f"default mask value has a counterpart; pass mask_value_meaning={kernel_meaning!r}"
    )


def check_options_taken(options: Options, api: releases.V3Api) -> None:
    """An option the early API lacks, other than at its default (the early kernels' only behaviour), is a
    ValueError naming the release."""
    for name, default in LACKING_OPTIONS_DEFAULTS.items():
        value = getattr(options, name)
        if not api.takes(name) and value != default:
            raise ValueError(
                f"{name}={value!r}: the installed tpu-inference {releases.installed_version()} has no such option "
                f"(its v3 kernel behaves as {name}={default!r})"
            )


def tuned_block_options(module: types.ModuleType, q, packed_cache, num_kv_heads: int, pages_per_seq: int, *,
                        sliding_window) -> tuple[int, int]:  # fmt: skip
    """``(num_queries_per_block, num_kv_pages_per_block)`` the early kernel's tuned table chooses on the chip
    seen now, called as the kernel calls it: head_dim aligned to 128 lanes, the token budget, and the window
    only where the table takes it (0.13.x)."""
    table = module.get_tuned_block_sizes
    window = (
        dict(sliding_window=sliding_window) if "sliding_window" in inspect.signature(table).parameters else {}
    )
    kv_pages, queries = table(
        q.dtype,
        packed_cache.dtype,
        q.shape[1],
        num_kv_heads,
        -(-q.shape[2] // 128) * 128,
        packed_cache.shape[1],
        q.shape[0],
        pages_per_seq,
        **window,
    )
    return queries, kv_pages


def early_v3_inputs(
    q,
    kv_pages,
    kv_lens,
    page_indices,
    cu_q_lens,
    num_seqs,
    *,
    module: types.ModuleType,
    **keywords,
) -> adapter.V3Inputs:
    """Maps an upstream-style call to an early v3's (``module``, 0.11.1 to 0.13.x), as ``adapter.v3_inputs``
    does for later releases: the same new tokens, poisoned slots, packed cache and distribution; upstream's
    block options (off a TPU generation the target's defaults fill what is not given; on one with neither
    given the kernel's tuned table chooses both, known here once the inputs validated); the mask value the
    kernel's meaning gives it (``early_mask_value``); the VMEM limit as given."""
    options = options_taken(keywords, by="v3_inputs", without=("attention_sink",))
    api = adapter.api_of(module)
    check_options_taken(options, api)
    mask_value = early_mask_value(
        options, _mask_value_meaning_of(Path(inspect.getfile(module))), module.DEFAULT_MASK_VALUE
    )
    q, kv_pages = np.asarray(q), np.asarray(kv_pages)
    tokens, args = arguments.v3_arguments(
        q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
        update_kv_cache=True, chunk_prefill_size=options.chunk_prefill_size,
    )  # fmt: skip
    page_size, pages_per_seq = kv_pages.shape[1], np.asarray(page_indices).shape[1]
    given = arguments.given_block_options(
        options.num_queries_per_block, options.num_kv_pages_per_block, pages_per_seq
    )
    kwargs = dict(
        **arguments.score_options(options),
        mask_value=mask_value,
        chunk_prefill_size=options.chunk_prefill_size,
        num_kv_pages_per_block=None if given is None else given[1],
        num_queries_per_block=None if given is None else given[0],
        vmem_limit_bytes=options.vmem_limit_bytes,
    )
    if given is None:
        # The kernel validates its inputs before it asks its table (whose assertions would otherwise speak).
        module.static_validate_inputs(*args, **kwargs)
        given = tuned_block_options(
            module, q, args[3], tokens.keys.shape[1], pages_per_seq, sliding_window=options.sliding_window
        )
    bq, bkv = given[0], given[1] * page_size
    return adapter.V3Inputs.of_tokens(
        args,
        kwargs,
        layouts.pack_cache(kv_pages),
        tokens,
        (bq, bkv, bq, bkv),
        (bq, bkv, bq, bkv),
    )


# What the standalone script of an early release's report runs before it imports the kernel (its loader,
# ``report.ReportedKernel.script_stubs``): the jax name 0.11.1 and 0.12.0 call, and the two names their tuned
# table imports from vllm's side of tpu-inference (unused: the script gives the block sizes).
EARLY_SCRIPT_STUBS = """\
    from jax._src import dtypes
    if not hasattr(dtypes, "bit_width"):  # jax 0.10.2 on names it itemsize_bits
        dtypes.bit_width = dtypes.itemsize_bits
    if importlib.util.find_spec("vllm") is None:  # tpu-inference installed with --no-deps
        for name, attribute in (("tpu_inference.logger", "init_logger"), ("tpu_inference.utils", "get_device_name")):
            stub = types.ModuleType(name)
            setattr(stub, attribute, lambda *args: None)
            sys.modules.setdefault(name, stub)
"""


def block_sizes_in_words(inputs: adapter.V3Inputs) -> str:
    """The report's line on an early kernel's block sizes (``report.ReportedKernel.block_sizes_in_words``)."""
    bq, bkv = inputs.mixed_block_sizes[:2]
    given = inputs.kwargs["num_kv_pages_per_block"] is not None
    return (
        f"- block sizes: `num_queries_per_block={bq}`, KV blocks of {bkv} keys "
        f"(`num_kv_pages_per_block={bkv // inputs.args[3].shape[1]}`), computed whole"
        + ("" if given else " (the kernel's tuned table's for the chip: neither option given)")
    )


def reported_kernel(v3_kernel):
    """v3's report (``report.V3``) for an early release: its tuning options (the ones its reference does
    not take), its block options in words, and its script's loader stubs."""
    return dataclasses.replace(
        v3_kernel,
        tuning_options=(
            "num_kv_pages_per_block",
            "num_queries_per_block",
            "vmem_limit_bytes",
            "chunk_prefill_size",
        ),
        block_sizes_in_words=block_sizes_in_words,
        script_stubs=EARLY_SCRIPT_STUBS,
        off_a_tpu=(
            "no particular TPU: observed on a CPU device, where the kernel reads no chip (its VMEM limit is a "
            "constant, and both block options are given), so the script makes the same call on any TPU"
        ),
    )
