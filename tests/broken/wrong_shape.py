"""Drops the last query row of the output (the specification: q's shape)."""

import jax

from rpa_harness.kernel import dynamic_validate_inputs  # noqa: F401  (part of the target interface)
from tests.broken import SMALL_SPACE, oracle_output

RPA_HARNESS_CAPABILITIES = SMALL_SPACE


def ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options):
    return jax.device_put(
        oracle_output(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options)[:-1]
    )
