"""Never returns when the first sequence has 2 or more query tokens (as a DMA wait with nothing pending would).

On every other case it returns the oracle's output: nothing compiles under the watchdog before the hang, so
a short timeout in the tests cannot be a slow compilation taken for a hang.
"""

import threading

import jax

from rpa_harness.kernel import dynamic_validate_inputs  # noqa: F401  (part of the target interface)
from tests.broken import SMALL_SPACE, first_sequence_has_two_tokens, oracle_output

RPA_HARNESS_CAPABILITIES = SMALL_SPACE


def ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options):
    if first_sequence_has_two_tokens(num_seqs, cu_q_lens):
        threading.Event().wait()  # nothing will ever set it
    return jax.device_put(oracle_output(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options))
