"""Flips the lowest bit of one output element on every other call (two identical calls differ)."""

import itertools

import jax.numpy as jnp
from rpa_harness.kernel import dynamic_validate_inputs  # noqa: F401  (part of the target interface)
from rpa_harness.kernel import ragged_paged_attention as correct_attention

from tests.broken import SMALL_SPACE

RPA_HARNESS_CAPABILITIES = SMALL_SPACE

_calls = itertools.count()


def ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options):
    out = correct_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options)
    if next(_calls) % 2:
        bits = out.view(jnp.uint32 if out.dtype.itemsize == 4 else jnp.uint16)
        out = bits.at[0, 0, 0].set(bits[0, 0, 0] ^ 1).view(out.dtype)
    return out
