"""Halts the device, as a kernel that faults a TPU does: the first call on a case whose first sequence has 2
or more query tokens raises libtpu's runtime error, and so does every later call in the process, whatever
its case.

The harness must keep that first case as the halt's repro (not a later, innocent case Hypothesis would shrink
the cascade to) and end the process; replaying the repro in a fresh process halts again.
"""

import jax

from rpa_harness.kernel import dynamic_validate_inputs  # noqa: F401  (part of the target interface)
from tests.broken import SMALL_SPACE, first_sequence_has_two_tokens, oracle_output

RPA_HARNESS_CAPABILITIES = SMALL_SPACE
# What libtpu raises on every call once the chip has halted.
HALTED = "FAILED_PRECONDITION: The program continuator has halted unexpectedly."

_halted = False


def ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options):
    global _halted
    _halted = _halted or first_sequence_has_two_tokens(num_seqs, cu_q_lens)
    if _halted:
        raise jax.errors.JaxRuntimeError(HALTED)
    return jax.device_put(oracle_output(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options))
