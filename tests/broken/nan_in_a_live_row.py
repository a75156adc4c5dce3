"""Writes NaN into the last live query row (rows before cu_q_lens[num_seqs] must be finite)."""

import jax
import numpy as np

from rpa_harness.kernel import dynamic_validate_inputs  # noqa: F401  (part of the target interface)
from tests.broken import SMALL_SPACE, oracle_output

RPA_HARNESS_CAPABILITIES = SMALL_SPACE


def ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options):
    out = oracle_output(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options)
    last_live_row = int(np.asarray(cu_q_lens)[int(np.asarray(num_seqs)[0])]) - 1
    if last_live_row >= 0:
        out[last_live_row] = np.nan
    return jax.device_put(out)
