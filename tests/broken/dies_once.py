"""Ends its process (``os.abort``, as a C++ check in a compiler or runtime would) the first time it is called
on a case whose first sequence has 2 or more query tokens; returns the oracle's output on every other call.

A crash that does not recur: the harness must name the example in flight, and replaying it must not report a
bug. The marker file RPA_DIES_ONCE_MARKER names says whether it has died already.
"""

import os

import jax

from rpa_harness.kernel import dynamic_validate_inputs  # noqa: F401  (part of the target interface)
from tests.broken import SMALL_SPACE, first_sequence_has_two_tokens, for_the_first_time, oracle_output

RPA_HARNESS_CAPABILITIES = SMALL_SPACE
MARKER_ENV = "RPA_DIES_ONCE_MARKER"


def ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options):
    if first_sequence_has_two_tokens(num_seqs, cu_q_lens) and for_the_first_time(MARKER_ENV, "died once"):
        os.abort()
    return jax.device_put(oracle_output(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options))
