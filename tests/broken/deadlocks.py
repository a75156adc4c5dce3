"""Waits for a DMA it never started when the first sequence has 2 or more query tokens (a Pallas kernel
runs before the attention): on a TPU the call never returns; the TPU interpreter's deadlock check raises."""

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from rpa_harness.kernel import dynamic_validate_inputs  # noqa: F401  (part of the target interface)
from rpa_harness.kernel import ragged_paged_attention as correct_attention
from tests.broken import SMALL_SPACE, first_sequence_has_two_tokens

RPA_HARNESS_CAPABILITIES = SMALL_SPACE


def _wait_for_a_copy_never_started(q_hbm, o_ref, buffer, semaphore):
    pltpu.make_async_copy(q_hbm, buffer, semaphore).wait()
    o_ref[...] = buffer[...]


def _stall(q):
    return pl.pallas_call(
        _wait_for_a_copy_never_started,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
        scratch_shapes=[pltpu.VMEM(q.shape, q.dtype), pltpu.SemaphoreType.DMA],
    )(q)


def ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options):
    if first_sequence_has_two_tokens(num_seqs, cu_q_lens):
        q = jax.jit(_stall)(jnp.asarray(q))
    return correct_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options)
