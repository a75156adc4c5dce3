"""Raises on valid input whenever more than one sequence is live (a crash on multi-sequence batches)."""

from rpa_harness.kernel import dynamic_validate_inputs  # noqa: F401  (part of the target interface)
from rpa_harness.kernel import ragged_paged_attention as correct_attention

from tests.broken import SMALL_SPACE

RPA_HARNESS_CAPABILITIES = SMALL_SPACE


def ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options):
    if int(num_seqs[0]) > 1:
        raise RuntimeError("internal kernel error: unsupported batch")
    return correct_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options)
