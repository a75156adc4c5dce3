"""A correct attention that rounds P to V's dtype before P @ V, and declares it.

A NumPy online-softmax (``rpa_harness.reference.variants.contract_attention``), so it runs on any backend without
compiling. Used by test_precision.py: it passes under its declared contract and fails under float32.
"""

from rpa_harness.kernel import dynamic_validate_inputs  # noqa: F401  (part of the target interface)
from rpa_harness.reference.variants import contract_attention

RPA_HARNESS_PRECISION = ("probabilities-in-value-dtype",)


def ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options):
    return contract_attention(
        q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, precision=RPA_HARNESS_PRECISION, **options
    )
