"""Raises on valid input whenever more than one sequence is live (a crash on multi-sequence batches)."""

import jax
import numpy as np

from rpa_harness.kernel import dynamic_validate_inputs  # noqa: F401  (part of the target interface)
from tests.broken import SMALL_SPACE, oracle_output

RPA_HARNESS_CAPABILITIES = SMALL_SPACE


def ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options):
    if int(np.asarray(num_seqs)[0]) > 1:
        raise RuntimeError("internal kernel error: unsupported batch")
    return jax.device_put(oracle_output(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options))
