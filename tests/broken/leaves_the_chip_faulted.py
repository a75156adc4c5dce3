"""Leaves the device faulted, as a kernel that returns while work it started still runs (a DMA never waited
for): a call on a case whose first sequence has 2 or more query tokens returns the right output, and the
next call in the process, whatever its case, raises libtpu's halt, as does every later one.

The halt's repro is then an innocent case that passes alone; it must name the faulting case among the
examples its process ran before it (``preceded_by``), and replaying those, then it, in one process halts again.
"""

import jax

from rpa_harness.kernel import dynamic_validate_inputs  # noqa: F401  (part of the target interface)
from tests.broken import SMALL_SPACE, first_sequence_has_two_tokens, oracle_output
from tests.broken.halts import HALTED

RPA_HARNESS_CAPABILITIES = SMALL_SPACE

_faulted = False


def ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options):
    global _faulted
    if _faulted:
        raise jax.errors.JaxRuntimeError(HALTED)
    _faulted = first_sequence_has_two_tokens(num_seqs, cu_q_lens)
    return jax.device_put(oracle_output(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options))
