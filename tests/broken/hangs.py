"""Never returns when the first sequence has 2 or more query tokens (as a DMA wait with nothing pending would)."""

import threading

from rpa_harness.kernel import dynamic_validate_inputs  # noqa: F401  (part of the target interface)
from rpa_harness.kernel import ragged_paged_attention as correct_attention

from tests.broken import SMALL_SPACE

RPA_HARNESS_CAPABILITIES = SMALL_SPACE


def ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options):
    if int(num_seqs[0]) > 0 and int(cu_q_lens[1]) - int(cu_q_lens[0]) >= 2:
        threading.Event().wait()  # nothing will ever set it
    return correct_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options)
