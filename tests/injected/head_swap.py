"""Our kernel with one injected bug: for every sequence after the first, q head 1 gets q head 0's output.

(The kind of result a wrong GQA head offset past the first sequence produces.) Used by test_cli.py.
"""

import jax.numpy as jnp

from rpa_harness.kernel import dynamic_validate_inputs  # noqa: F401  (part of the target interface)
from rpa_harness.kernel import ragged_paged_attention as correct_attention


def ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options):
    out = correct_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options)
    if out.shape[1] < 2:
        return out
    after_first = jnp.arange(out.shape[0]) >= cu_q_lens[1]
    return out.at[:, 1].set(jnp.where(after_first[:, None], out[:, 0], out[:, 1]))
