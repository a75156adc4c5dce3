"""Halts the device once: the first call ever (across processes) on a case whose first sequence has 2 or more
query tokens raises libtpu's halt, as a fault left on the chip by another process would show in the next
one; every other call returns the oracle's output. The marker file RPA_HALTS_ONCE_MARKER names says whether it
has halted already.

A halt that does not recur: replayed alone and after its predecessors it passes, so the run reports it as
unconfirmed, not as the kernel's finding.
"""

import jax

from rpa_harness.kernel import dynamic_validate_inputs  # noqa: F401  (part of the target interface)
from tests.broken import SMALL_SPACE, first_sequence_has_two_tokens, for_the_first_time, oracle_output
from tests.broken.halts import HALTED

RPA_HARNESS_CAPABILITIES = SMALL_SPACE
MARKER_ENV = "RPA_HALTS_ONCE_MARKER"


def ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options):
    if first_sequence_has_two_tokens(num_seqs, cu_q_lens) and for_the_first_time(MARKER_ENV, "halted once"):
        raise jax.errors.JaxRuntimeError(HALTED)
    return jax.device_put(oracle_output(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options))
