"""Right on the interpreters, refused by the TPU compiler: after the bundled kernel, a Pallas kernel adds
zero times a running sum, an operation Pallas' TPU lowering does not implement (``cumsum``)."""

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from rpa_harness.kernel import dynamic_validate_inputs  # noqa: F401  (part of the target interface)
from rpa_harness.kernel import ragged_paged_attention as bundled
from tests.broken import SMALL_SPACE

RPA_HARNESS_CAPABILITIES = SMALL_SPACE


def _plus_zero_running_sum(x_ref, o_ref):
    ones = jnp.ones(x_ref.shape, jnp.float32)
    o_ref[...] = (x_ref[...].astype(jnp.float32) + 0 * jnp.cumsum(ones, axis=0)).astype(o_ref.dtype)


def ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options):
    out = bundled(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options)
    flat = out.reshape(out.shape[0], -1)
    summed = pl.pallas_call(_plus_zero_running_sum, out_shape=jax.ShapeDtypeStruct(flat.shape, flat.dtype))
    return summed(flat).reshape(out.shape)
