"""tpu-inference's stacked RPA (experimental) behind upstream's API: v3's arguments, stacked RPA's cache
layout and block sizes.

``experimental/stacked_rpa/wrapper.py`` takes v3's arguments (the new tokens apart, a flat page table,
``distribution``) with its own cache, ``[pages, 2 * kv_heads, padded_head_dim, page_size]`` (``layout``),
and returns the attention and the updated cache. A ``BlockSizes`` per kernel (decode, mixed) adds how many
sequences one grid step stacks; it runs no prefill kernel (the range ``[distribution[0],
distribution[1])``), which v3's convention leaves empty (``chunk_prefill_size`` is refused).
"""

import dataclasses
import functools
import types

import jax
import numpy as np

from rpa_harness.spec.interface import options_taken
from rpa_harness.targets.tpu_inference import arguments, experimental, kernels
from rpa_harness.targets.tpu_inference_stacked_rpa import layout

_WRAPPER = "tpu_inference.kernels.experimental.stacked_rpa.wrapper"
_DECODE_BLOCKS = "tpu_inference.kernels.experimental.stacked_rpa.decode.block_sizes"
_PREFILL_BLOCKS = "tpu_inference.kernels.experimental.stacked_rpa.prefill.block_sizes"
# Where jax 0.12 stops it (docs/experimental-kernels.md): the kernel's own emit_pipeline use, no interpreter
# involved.
FIRST_JAX_IT_DOES_NOT_TRACE_ON = (0, 12)
TRACE_FAILURE = (
    "AssertionError at jax/_src/pallas/mosaic/pipeline.py:868 (`assert self.wait_in_slot is not None`), "
    "from its emit_pipeline call at stacked_rpa/decode/non_sliding_window/kernel.py:599"
)
# Sequences per grid step in both kernels (its own choice stacks up to eight decodes): the kernel unrolls
# its attention once per stacked sequence, and XLA:CPU compiles every copy.
SEQUENCES_PER_STEP = 2
BUFFERS = 2  # its pipelines require double buffering (BlockSizes.__post_init__)


def jax_version() -> tuple[int, ...]:
    """(major, minor) of the jax in use: the kernel traces on jax < 0.12 only."""
    return tuple(int(part) for part in jax.__version__.split(".")[:2])


@functools.cache
def kernel() -> types.ModuleType:
    """stacked RPA's wrapper module, imported on first use; ImportError says how to install tpu-inference,
    or, on a jax it does not trace on, which jax to use."""
    if jax_version() >= FIRST_JAX_IT_DOES_NOT_TRACE_ON:
        raise ImportError(
            f"tpu-inference's stacked RPA does not trace on jax {jax.__version__} (jax >= 0.12 fails with "
            f"{TRACE_FAILURE}); run this target on jax 0.11.2, the jax tpu-inference "
            "0.32.0 pins (Python >= 3.12: pip install jax==0.11.2 jaxlib==0.11.2), or 0.10.2 (Python 3.11)"
        )
    return kernels.load_kernel_module(_WRAPPER)


def block_size_types() -> tuple[type, type]:
    """(decode, mixed) ``BlockSizes`` classes: ``(bq_sz, bkv_sz, batch_size, n_buffer)`` and ``(bq_sz,
    bq_c_sz, bkv_sz, batch_size, n_buffer)``."""
    kernel()
    decode = kernels.load_kernel_module(_DECODE_BLOCKS).BlockSizes
    mixed = kernels.load_kernel_module(_PREFILL_BLOCKS).BlockSizes
    return decode, mixed


@dataclasses.dataclass(frozen=True)
class StackedInputs(arguments.KernelInputs):
    """One upstream-style call in stacked RPA's terms. ``expected_cache`` and ``given_cache`` are slots first
    (``layout.slots_first``), as the cache judge reads them; ``args[3]`` is the given cache in the kernel's
    layout."""

    given_cache: np.ndarray
    # The decode and mixed kernels' BlockSizes; None where the kernel chooses its own.
    decode_block_sizes: object | None
    mixed_block_sizes: object | None


def window_span(sliding_window: int, page_size: int, pages_per_seq: int) -> int:
    """The keys one decode KV block must hold with a sliding window: the window and the query, from the
    page boundary below the window's start (``decode.block_sizes.required_window_bkv_size``; the decode
    kernel refuses a smaller block)."""
    anchored = -(-(sliding_window + 1 + page_size - 1) // page_size) * page_size
    return min(pages_per_seq * page_size, anchored)


def stacked_block_sizes(
    num_queries_per_block, num_kv_pages_per_block, *, page_size: int, pages_per_seq: int, sliding_window
):
    """(decode, mixed) ``BlockSizes`` for the case's blocks: a decode block of one query row, the mixed
    query block computed in halves when even (v3's adapter's rule), KV blocks of whole pages (a decode
    block widened to the window's span, as the kernel requires; the mixed kernel sizes its own KV block
    from the window). (None, None) when the case gives neither block: the kernel chooses its own."""
    given = arguments.given_block_options(num_queries_per_block, num_kv_pages_per_block, pages_per_seq)
    if given is None:
        return None, None
    bq, bq_chunk, bkv = experimental.mixed_blocks(given, page_size)
    decode_bkv = (
        bkv if sliding_window is None else max(bkv, window_span(sliding_window, page_size, pages_per_seq))
    )
    decode, mixed = block_size_types()
    return (
        decode(bq_sz=1, bkv_sz=decode_bkv, batch_size=SEQUENCES_PER_STEP, n_buffer=BUFFERS),
        mixed(bq_sz=bq, bq_c_sz=bq_chunk, bkv_sz=bkv, batch_size=SEQUENCES_PER_STEP, n_buffer=BUFFERS),
    )


def stacked_inputs(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **keywords) -> StackedInputs:
    """Maps an upstream-style call to stacked RPA's: the new tokens split from the cache and their slots
    poisoned (``arguments.v3_arguments``), the cache stacked, v3's meaning of ``mask_value``. ``keywords``: the
    specification's options but ``experimental.NOT_TAKEN``."""
    options = options_taken(keywords, by="stacked_inputs", without=experimental.NOT_TAKEN)
    q, kv_pages = np.asarray(q), np.asarray(kv_pages)
    tokens, args = experimental.v3_arguments(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, options)
    if options.update_kv_cache:
        given = tokens.poisoned_cache(kv_pages)
    else:
        given = kv_pages  # v3_arguments' shared-KV case: every key in the cache, the new tokens NaN
    stacked = layout.stack_cache(given)
    args = (*args[:3], stacked, *args[4:])
    decode, mixed = stacked_block_sizes(
        options.num_queries_per_block,
        options.num_kv_pages_per_block,
        page_size=kv_pages.shape[1],
        pages_per_seq=np.asarray(page_indices).shape[1],
        sliding_window=options.sliding_window,
    )
    kwargs = experimental.kernel_options(options, decode, mixed)
    expected_cache = layout.slots_first(layout.stack_cache(kv_pages))
    return StackedInputs.of_tokens(
        args, kwargs, expected_cache, tokens, layout.slots_first(stacked), decode, mixed
    )


def call_stacked(inputs: StackedInputs):
    """Runs stacked RPA (on whatever backend the caller's context selects): ``(attention, updated cache)``,
    the cache in the kernel's layout."""
    return kernels.run_jitted(kernel().ragged_paged_attention, inputs)


def ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options):
    """Upstream's call on stacked RPA: the attention (it raises its static validator's errors while tracing)."""
    out, _ = call_stacked(stacked_inputs(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options))
    return out
