"""Raises a recognised limitation on every call off TPU (as a kernel whose tuned-parameter lookup needs one)."""

from rpa_harness.kernel import dynamic_validate_inputs  # noqa: F401  (part of the target interface)


def ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options):
    raise NotImplementedError("Unsupported tpu_version=-1.")
