"""Flips the lowest bit of one output element on every other call (two identical calls differ)."""

import itertools

import jax
import numpy as np

from rpa_harness.kernel import dynamic_validate_inputs  # noqa: F401  (part of the target interface)
from tests.broken import SMALL_SPACE, oracle_output

RPA_HARNESS_CAPABILITIES = SMALL_SPACE

_calls = itertools.count()


def ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options):
    out = oracle_output(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options)
    if next(_calls) % 2:
        bits = out.view(np.uint32 if out.dtype.itemsize == 4 else np.uint16)
        bits[0, 0, 0] ^= 1
    return jax.device_put(out)
