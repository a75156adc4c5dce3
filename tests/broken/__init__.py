"""Broken targets: the bundled kernel wrapped so that it crashes, hangs or breaks the output's contract
(the hanging one returns the oracle's output where it does not hang).

Each keeps upstream's signature; ``tests/test_broken_targets.py`` runs the properties against each and
checks that the run fails with the right one-line reason and exit code and leaves a replayable repro.
"""

# One small shape (the pool's option variants still vary): each run compiles a few kernels, not dozens.
SMALL_SPACE = dict(
    head_dims=(64,),
    page_sizes=(8,),
    num_kv_heads=(1,),
    gqa_ratios=(2,),
    kv_dtypes=("float32",),
    buckets=("tiny",),
)
