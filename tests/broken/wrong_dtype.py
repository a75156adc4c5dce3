"""Returns float32 whatever q's dtype (the specification: q's dtype)."""

import jax.numpy as jnp
from rpa_harness.kernel import dynamic_validate_inputs  # noqa: F401  (part of the target interface)
from rpa_harness.kernel import ragged_paged_attention as correct_attention

from tests.broken import SMALL_SPACE

RPA_HARNESS_CAPABILITIES = dict(SMALL_SPACE, q_dtypes=("bfloat16",))


def ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options):
    out = correct_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options)
    return out.astype(jnp.float32)
