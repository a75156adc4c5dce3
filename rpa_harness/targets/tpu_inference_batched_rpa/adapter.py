"""tpu-inference's batched RPA (experimental) behind upstream's API: v3's mapping, batched RPA's block sizes.

``experimental/batched_rpa/wrapper.py`` takes v3's arguments and, in its default layout
(``KVLayout.HEAD_ALONG_SUBLANE``), v3's packed cache; it returns the attention and the updated cache. It
differs from v3 in what tunes it: a ``configs.BlockSizes`` per kernel (decode, mixed) that adds how many
sequences one grid step batches and how many buffers its pipeline keeps, and no prefill kernel. The
arrays are mapped exactly as v3's adapter maps them (``v3_arguments``).
"""

import dataclasses
import functools
import types

import numpy as np

from rpa_harness.spec.interface import options_taken
from rpa_harness.targets import layouts
from rpa_harness.targets.tpu_inference import arguments, experimental, kernels

_WRAPPER = "tpu_inference.kernels.experimental.batched_rpa.wrapper"
_CONFIGS = "tpu_inference.kernels.experimental.batched_rpa.configs"
_SCHEDULE = "tpu_inference.kernels.experimental.batched_rpa.schedule"

# The kernel's own choices (tuned_params.calculate_block_sizes) batch eight decodes or two mixed sequences
# per grid step with three buffers, and grow the query and KV blocks until they fill the chip's VMEM
# (2,560 keys per decode block on v6e) whatever the problem size. The case gives the blocks; the target
# keeps the three buffers and batches two sequences in both kernels: the kernel unrolls its code once per
# batched sequence, and XLA:CPU compiles each copy (one call's compilation, measured: 38 s with eight
# decodes per step, 11.5 s with two, 8 s with one; docs/experimental-kernels.md).
DECODE_SEQUENCES_PER_STEP = 2
MIXED_SEQUENCES_PER_STEP = 2
BUFFERS = 3


@functools.cache
def kernel() -> types.ModuleType:
    """batched RPA's wrapper module, imported on first use (ImportError says how to install tpu-inference);
    its tuned parameters import vllm's logger, for which the v3 adapter's stand-in serves."""
    kernels.stand_in_for_tpu_inference_logger()
    return kernels.load_kernel_module(_WRAPPER)


def configs() -> types.ModuleType:
    """batched RPA's configuration module (``BlockSizes``, ``KVLayout``, ``RpaConfigs``)."""
    kernel()
    return kernels.load_kernel_module(_CONFIGS)


def schedule() -> types.ModuleType:
    """batched RPA's schedule module (``RpaSchedule``: the step arrays its schedule kernel fills)."""
    kernel()
    return kernels.load_kernel_module(_SCHEDULE)


@dataclasses.dataclass(frozen=True)
class BatchedInputs(arguments.KernelInputs):
    """One upstream-style call in batched RPA's terms, and the cache it must return."""

    # The decode and mixed kernels' BlockSizes (bq_sz, bq_c_sz, bkv_sz, batch_size, n_buffer); None where
    # the kernel tunes its own.
    decode_block_sizes: object | None
    mixed_block_sizes: object | None


def batched_block_sizes(num_queries_per_block, num_kv_pages_per_block, page_size: int, pages_per_seq: int):
    """(decode, mixed) ``BlockSizes`` for the case's blocks: a decode block of one query row (one token per
    decode), the mixed kernel's query block computed in halves when even (v3's adapter's rule), KV blocks of
    whole pages. (None, None) when the case gives neither block: the kernel tunes its own."""
    if num_queries_per_block is None and num_kv_pages_per_block is None:
        return None, None
    given = arguments.given_block_options(num_queries_per_block, num_kv_pages_per_block, pages_per_seq)
    assert given is not None  # a block is given
    bq, bq_chunk, bkv = experimental.mixed_blocks(given, page_size)
    block = configs().BlockSizes
    return (
        block(bq_sz=1, bq_c_sz=1, bkv_sz=bkv, batch_size=DECODE_SEQUENCES_PER_STEP, n_buffer=BUFFERS),
        block(bq_sz=bq, bq_c_sz=bq_chunk, bkv_sz=bkv, batch_size=MIXED_SEQUENCES_PER_STEP, n_buffer=BUFFERS),
    )


def batched_inputs(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **keywords) -> BatchedInputs:
    """Maps an upstream-style call to batched RPA's (the arrays as ``v3.v3_inputs`` maps them; v3's
    meaning of ``mask_value``). ``keywords``: the specification's options but ``experimental.NOT_TAKEN``."""
    options = options_taken(keywords, by="batched_inputs", without=experimental.NOT_TAKEN)
    q, kv_pages = np.asarray(q), np.asarray(kv_pages)
    tokens, args = experimental.v3_arguments(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, options)
    decode, mixed = batched_block_sizes(
        options.num_queries_per_block,
        options.num_kv_pages_per_block,
        kv_pages.shape[1],
        np.asarray(page_indices).shape[1],
    )
    kwargs = dict(
        **experimental.kernel_options(options, decode, mixed),
        kv_layout=configs().KVLayout.HEAD_ALONG_SUBLANE,  # v3's packed cache, whatever the environment says
    )
    return BatchedInputs.of_tokens(args, kwargs, layouts.pack_cache(kv_pages), tokens, decode, mixed)


def call_batched(inputs: BatchedInputs):
    """Runs batched RPA (on whatever backend the caller's context selects): ``(attention, updated cache)``."""
    return kernels.run_jitted(kernel().ragged_paged_attention, inputs)


def ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options):
    """Upstream's call on batched RPA: the attention (it raises its static validator's errors while tracing)."""
    out, _ = call_batched(batched_inputs(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options))
    return out
