"""Broken targets: the bundled kernel wrapped so that it crashes, hangs or breaks the output's contract
(the hanging one returns the oracle's output where it does not hang).

Each keeps upstream's signature; ``tests/test_broken_targets.py`` runs the properties against each and
checks that the run fails with the right one-line reason and exit code and leaves a replayable repro.
"""

import numpy as np

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
