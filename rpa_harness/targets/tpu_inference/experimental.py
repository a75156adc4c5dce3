"""What the adapters of tpu-inference's experimental kernels derived from v3 share (batched RPA, stacked
RPA; docs/experimental-kernels.md): v3's arguments with no chunked prefill, a ``BlockSizes`` per kernel
(decode, mixed) built from the case's blocks, and the keyword options they take under v3's names. Each
adapter adds its own cache layout and block classes; every tpu-inference kernel runs through
``kernels.run_jitted``.
"""

import jax.numpy as jnp

from rpa_harness.targets import layouts
from rpa_harness.targets.tpu_inference import arguments

# The specification's options they do not take; chunk_prefill_size and use_causal_mask=False are passed
# on, for their own refusal.
NOT_TAKEN = ("attention_sink", "skip_kv_mask")


def v3_arguments(
    q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, options
) -> tuple[layouts.NewTokens, tuple]:
    """v3's positional arguments for the case (``arguments.v3_arguments``) and the new tokens they hold: their
    distribution has no chunked prefills (they refuse ``chunk_prefill_size``)."""
    return arguments.v3_arguments(
        q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
        update_kv_cache=options.update_kv_cache, chunk_prefill_size=None,
    )  # fmt: skip


def mixed_blocks(given: tuple[int, int], page_size: int) -> tuple[int, int, int]:
    """(bq, bq_chunk, bkv) of the mixed kernel for ``given`` (query rows, KV pages) per block
    (``arguments.given_block_options``): the query block computed in halves when even (v3's adapter's rule), the
    KV block whole pages."""
    bq, bkv_pages = given
    bq, bq_chunk = arguments.block_sizes(bq, 1)
    return bq, bq_chunk, bkv_pages * page_size


def kernel_options(options, decode_block_sizes, mixed_block_sizes) -> dict:
    """Their keyword options for the specification's ``options`` (v3's meaning of ``mask_value``), with
    the decode and mixed kernels' ``BlockSizes`` (None: the kernel's own)."""
    return dict(
        **arguments.score_options(options),
        mask_value=arguments.replacing_mask_value(options.mask_value, options.mask_value_meaning),
        chunk_prefill_size=options.chunk_prefill_size,
        decode_block_sizes=decode_block_sizes,
        prefill_block_sizes=mixed_block_sizes,
        vmem_limit_bytes=arguments.vmem_limit(options.vmem_limit_bytes),
        out_dtype=None if options.out_dtype is None else jnp.dtype(options.out_dtype),
        use_causal_mask=options.use_causal_mask,
        update_kv_cache=options.update_kv_cache,
    )
