"""Writes NaN into the last live query row (rows before cu_q_lens[num_seqs] must be finite)."""

import jax.numpy as jnp
from rpa_harness.kernel import dynamic_validate_inputs  # noqa: F401  (part of the target interface)
from rpa_harness.kernel import ragged_paged_attention as correct_attention

from tests.broken import SMALL_SPACE

RPA_HARNESS_CAPABILITIES = SMALL_SPACE


def ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options):
    out = correct_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options)
    last_live_row = int(cu_q_lens[int(num_seqs[0])]) - 1
    if last_live_row < 0:
        return out
    return out.at[last_live_row].set(jnp.nan)
