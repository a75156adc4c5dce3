"""Broken targets: kernels that crash, hang or break the output's contract.

Each keeps upstream's signature; ``tests/end_to_end/test_broken_targets.py`` runs the properties against each and
checks that the run fails with the right one-line reason and exit code and leaves a replayable repro. What
they break is the harness's subject, not attention: where they return an output it is the oracle's
(``oracle_output``), so nothing compiles and every shrink step costs a NumPy call, not a kernel build.
The deadlocking one is a Pallas kernel: the deadlock check it meets is the TPU interpreter's.
"""

import os
from pathlib import Path

import numpy as np

from rpa_harness import reference

# One small shape (the pool's option variants still vary): each run compiles a few kernels, not dozens.
SMALL_SPACE = dict(
    head_dims=(64,),
    page_sizes=(8,),
    num_kv_heads=(1,),
    gqa_ratios=(2,),
    kv_dtypes=("float32",),
    buckets=("tiny",),
)


def first_sequence_has_two_tokens(num_seqs, cu_q_lens) -> bool:
    """Where the hanging targets stop: a live first sequence of 2 or more query tokens (read with NumPy:
    indexing a jax array would compile)."""
    starts = np.asarray(cu_q_lens)
    return int(np.asarray(num_seqs)[0]) > 0 and int(starts[1] - starts[0]) >= 2


def oracle_output(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options) -> np.ndarray:
    """The specified output in q's dtype, as NumPy (what a correct kernel returns, to the oracle's last bit)."""
    expected = reference.oracle(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options)
    return np.nan_to_num(expected.out).astype(expected.out_dtype)


def for_the_first_time(marker_env: str, what: str) -> bool:
    """True once across processes: the marker file the environment variable ``marker_env`` names is written
    then (saying ``what`` happened), and its presence says so afterwards."""
    marker = Path(os.environ[marker_env])
    if marker.exists():
        return False
    marker.write_text(f"{what}\n")
    return True
