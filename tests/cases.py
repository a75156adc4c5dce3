"""Cases (and the condition for tpu-inference's) more than one test module uses: one definition each,
imported from here (never from a test module)."""

import math

import ml_dtypes
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from rpa_harness.strategies.case import Case


def skip_without_tpu_inference(*, module_level: bool = False) -> None:
    """Skips the test (or, ``module_level``, the calling test module) where tpu-inference's kernels are not
    installed; the reason names the command that installs them. v3's targets import without them (their
    catalogues are shared), so an import does not tell."""
    from rpa_harness.targets.tpu_inference_v3 import adapter

    try:
        adapter.kernel()
    except ImportError as error:
        pytest.skip(str(error), allow_module_level=module_level)


# The two Pallas interpreters, as force_tpu_interpret_mode takes them.
INTERPRETERS = {
    "tpu_interpreter": pltpu.InterpretParams(),
    "generic_interpreter": True,
}
# Garbage for page-table entries and metadata slots no sequence owns: negative, past the cache, both int32
# extremes, and small values that look plausible.
GARBAGE = (-1, -(2**31), 2**31 - 1, 10**6, 7, -3, 0, -5, 3)

BF16 = np.dtype(ml_dtypes.bfloat16)
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E5M2 = np.dtype(ml_dtypes.float8_e5m2)
F32 = np.dtype(np.float32)

# Three sequences: a chunk straddling query blocks (4 rows each), a decode and a prefill; partial last
# pages, several KV blocks (2 pages each), two KV heads with two query heads each, NaN in page tails and
# padding, garbage in the padding slot's metadata.
MIXED = Case(
    max_num_batched_tokens=16,
    max_num_seqs=4,
    pages_per_seq=6,
    total_num_pages=27,
    page_size=4,
    num_q_heads=4,
    num_kv_heads=2,
    head_dim=64,
    q_lens=(5, 1, 8),
    kv_lens=(13, 9, 8),
    sm_scale=0.125,
    num_kv_pages_per_block=2,
    num_queries_per_block=4,
    seed=7,
    garbage=True,
)

# Every run-time option set, two sequences, one KV head: one compilation of our kernel serves any values.
SMALL = Case(
    max_num_batched_tokens=8, max_num_seqs=2, pages_per_seq=5, total_num_pages=13, page_size=8,
    num_q_heads=2, num_kv_heads=1, head_dim=64, q_lens=(3, 1), kv_lens=(20, 9), seed=3,
    sm_scale=0.125, sliding_window=5, soft_cap=30.0, mask_value=-1e4, k_scale=0.5, v_scale=2.0,
)  # fmt: skip


def build_case(
    seed,
    q_lens,
    kv_lens,
    *,
    page_size=4,
    num_q_heads=4,
    num_kv_heads=2,
    head_dim=32,
    q_dtype=F32,
    kv_dtype=F32,
    spare_seqs=1,
    spare_rows=3,
    spare_pages=1,
    garbage=True,
):
    """The arrays of a ``Case`` sized to the layout plus spare sequence slots, query rows and pages: NaN in
    every slot no live key or row owns, and (with ``garbage``) arbitrary int32 in unused page-table entries
    and metadata slots past num_seqs."""
    case = Case(
        max_num_batched_tokens=sum(q_lens) + spare_rows,
        max_num_seqs=len(q_lens) + spare_seqs,
        pages_per_seq=max(1, math.ceil(max(kv_lens, default=1) / page_size)) + spare_pages,
        total_num_pages=sum(math.ceil(kv / page_size) for kv in kv_lens) + 2,
        page_size=page_size,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        q_dtype=np.dtype(q_dtype).name,
        kv_dtype=np.dtype(kv_dtype).name,
        q_lens=tuple(q_lens),
        kv_lens=tuple(kv_lens),
        seed=seed,
        garbage=garbage,
    )
    return case.arrays()
