"""The head_dim-64 kernel behind upstream's API: the call mapped to the kernel's (v3's adapter, with each KV
head's K and V side by side in one 128-lane row, sinks as a ninth array, upstream's block options)."""

import dataclasses
import functools
import inspect
import types

import numpy as np
from jax.experimental.pallas import tpu as pltpu

from rpa_harness.spec.interface import options_taken
from rpa_harness.targets import layouts
from rpa_harness.targets.tpu_inference import arguments, kernels, releases
from rpa_harness.targets.tpu_inference.kernels import tpu_device_name  # noqa: F401  (a public name)

_KERNEL_MODULE = "tpu_inference.kernels.ragged_paged_attention.v3.kernel_hd64"


@functools.cache
def kernel() -> types.ModuleType:
    """The head_dim-64 kernel's module, imported on first use (as v3's: ``tpu_inference_v3.adapter.kernel``)."""
    kernels.stand_in_for_tpu_inference_utils()
    return kernels.load_kernel_module(_KERNEL_MODULE)


HEAD_DIM = 64


def narrow_output_traces() -> bool:
    """Whether the installed kernel can normalise an output narrower than float32 on this jax: 0.32.0's
    calls ``pltpu.reciprocal``, which jax 0.10.2 lacks (there it fails to trace for bfloat16 queries, on
    every backend, and only float32 queries are drawn); 0.12.0 to 0.31.0 call ``pl.reciprocal``, which every
    supported jax has. Read from the installed kernel's source (``releases``)."""
    source = releases.v3_file("kernel_hd64.py")
    return hasattr(pltpu, "reciprocal") or source is None or "pltpu.reciprocal(" not in source.read_text()


NARROW_OUTPUT_TRACES = narrow_output_traces()


@dataclasses.dataclass(frozen=True)
class Hd64Inputs(arguments.KernelInputs):
    """One upstream-style call in the hd64 kernel's terms, and the cache it must return (``args`` end with
    the sinks)."""

    # (num_kv_pages_per_block, num_queries_per_block): passed, or those the tuned table chooses.
    block_sizes: tuple[int, int]


def sink_array(attention_sink) -> np.ndarray | None:
    """The specification's sinks (a tuple of floats, one per q head) as the kernel's f32[num_q_heads]."""
    return None if attention_sink is None else np.asarray(attention_sink, np.float32)


def hd64_inputs(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **keywords) -> Hd64Inputs:
    """Maps an upstream-style call to the hd64 kernel's, as ``tpu_inference_v3.v3_inputs`` does for v3
    (the new tokens, their poisoned slots, the distribution, the mask value), with the cache packed side by
    side and the block options passed as they are. Off a TPU generation, block options left None get v3's
    target defaults (8 query rows, 2 pages): the tuned table needs a chip. The specification's default
    replacing mask value (None) is the kernel's default (-0.7 * float32 max, replaced): both mask fully.
    ``keywords``: the specification's options (``spec.interface.Options``) but v3's use_causal_mask,
    out_dtype, skip_kv_mask and update_kv_cache, which this kernel does not take."""
    options = options_taken(
        keywords,
        by="hd64_inputs",
        without=("use_causal_mask", "out_dtype", "skip_kv_mask", "update_kv_cache"),
    )
    q, kv_pages = np.asarray(q), np.asarray(kv_pages)
    tokens = layouts.split_new_tokens(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs)
    pages_per_seq = np.asarray(page_indices).shape[1]
    given = arguments.given_block_options(
        options.num_queries_per_block, options.num_kv_pages_per_block, pages_per_seq
    )  # None: the tuned table's, below
    num_queries_per_block, num_kv_pages_per_block = given or (None, None)
    kwargs = dict(
        **arguments.score_options(options),
        num_kv_pages_per_block=num_kv_pages_per_block,
        num_queries_per_block=num_queries_per_block,
        vmem_limit_bytes=options.vmem_limit_bytes,
        chunk_prefill_size=options.chunk_prefill_size,
    )
    replacing = arguments.replacing_mask_value(options.mask_value, options.mask_value_meaning)
    if replacing is not None:  # None: the kernel's default (passed as None, it fails to trace: a finding)
        kwargs["mask_value"] = replacing
    cache = layouts.pack_cache_side_by_side(tokens.poisoned_cache(kv_pages))
    args = (
        *arguments.kernel_arguments(
            q,
            tokens,
            cache,
            kv_lens,
            page_indices,
            cu_q_lens,
            num_seqs,
            chunk_prefill_size=options.chunk_prefill_size,
        ),
        sink_array(options.attention_sink),
    )
    if given is None:
        # It validates its inputs before it looks its block sizes up: an invalid input raises its message.
        kernel().static_validate_inputs(*args, **kwargs)
        block_sizes = tuned_block_sizes(
            q, kv_pages.dtype, tokens.keys.shape[1], kv_pages.shape[1], pages_per_seq, options.sliding_window
        )
    else:
        block_sizes = (given[1], given[0])
    return Hd64Inputs.of_tokens(args, kwargs, layouts.pack_cache_side_by_side(kv_pages), tokens, block_sizes)


def tuned_block_sizes(
    q, kv_dtype, num_kv_heads: int, page_size: int, pages_per_seq: int, sliding_window
) -> tuple[int, int]:
    """(num_kv_pages_per_block, num_queries_per_block) the kernel's tuned table chooses on the chip it sees
    for ``q`` ([tokens, q heads, head_dim]), called with the arguments the kernel passes."""
    num_tokens, num_q_heads, head_dim = q.shape
    table = kernel().get_tuned_block_sizes
    # 0.12.0's table takes no window (its kernel passes none); later ones take it last.
    window = (sliding_window,) if "sliding_window" in inspect.signature(table).parameters else ()
    return table(
        q.dtype, kv_dtype, num_q_heads, num_kv_heads, head_dim, page_size, num_tokens, pages_per_seq, *window
    )  # fmt: skip


def call_hd64(inputs: Hd64Inputs):
    """Runs the kernel (on whatever backend the caller's context selects): ``(attention, updated cache)``."""
    return kernels.run_jitted(kernel().ragged_paged_attention_hd64, inputs)


def ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options):
    """Upstream's call on the hd64 kernel: the attention (it raises its static validators' errors while
    tracing)."""
    out, _ = call_hd64(hd64_inputs(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options))
    return out


def dynamic_validate_inputs(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options):
    """The kernel's own ``dynamic_validate_inputs`` (its rules, its messages) on the mapped inputs."""
    inputs = hd64_inputs(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options)
    kernel().dynamic_validate_inputs(*kernels.device_arrays(inputs.args), **inputs.kwargs)
