"""Cases (and the condition for tpu-inference's) more than one test module uses: one definition each,
imported from here (never from a test module)."""

import math
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from jax.experimental.pallas import tpu as pltpu

from rpa_harness import targets
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


def sized_case(
    q_lens,
    kv_lens,
    *,
    page_size=4,
    spare_seqs=1,
    spare_rows=3,
    spare_pages=1,
    spare_cache_pages=2,
    **fields,
) -> Case:
    """A ``Case`` sized to its layout plus room: spare sequence slots, query rows, pages per sequence and
    cache pages no sequence owns (a case states what it holds, and its static shape follows)."""
    return Case(
        max_num_batched_tokens=sum(q_lens) + spare_rows,
        max_num_seqs=len(q_lens) + spare_seqs,
        pages_per_seq=max(1, math.ceil(max(kv_lens, default=1) / page_size)) + spare_pages,
        total_num_pages=sum(math.ceil(kv / page_size) for kv in kv_lens) + spare_cache_pages,
        page_size=page_size,
        q_lens=tuple(q_lens),
        kv_lens=tuple(kv_lens),
        **fields,
    )


# Three sequences: a chunk straddling query blocks (4 rows each), a decode and a prefill; partial last
# pages, several KV blocks (2 pages each), two KV heads with two query heads each, NaN in page tails and
# padding, garbage in the padding slot's metadata.
MIXED = sized_case(
    (5, 1, 8), (13, 9, 8), spare_rows=2, spare_pages=2, spare_cache_pages=18, num_q_heads=4, num_kv_heads=2,
    head_dim=64, sm_scale=0.125, num_kv_pages_per_block=2, num_queries_per_block=4, seed=7, garbage=True,
)  # fmt: skip

# Every run-time option set, two sequences, one KV head: one compilation of our kernel serves any values.
SMALL = Case(
    max_num_batched_tokens=8, max_num_seqs=2, pages_per_seq=5, total_num_pages=13, page_size=8,
    num_q_heads=2, num_kv_heads=1, head_dim=64, q_lens=(3, 1), kv_lens=(20, 9), seed=3,
    sm_scale=0.125, sliding_window=5, soft_cap=30.0, mask_value=-1e4, k_scale=0.5, v_scale=2.0,
)  # fmt: skip


# What a built case holds unless told otherwise: two KV heads with two query heads each, of 32 dims, and
# garbage in unused metadata.
BUILT_CASE = dict(num_q_heads=4, num_kv_heads=2, head_dim=32, garbage=True)


def build_case(seed, q_lens, kv_lens, *, q_dtype=F32, kv_dtype=F32, **fields):
    """The arrays of a ``sized_case`` of these NumPy dtypes, with BUILT_CASE's fields unless ``fields``
    (its room, heads, any other Case field) say otherwise: NaN in every slot no live key or row owns, and
    (with ``garbage``) arbitrary int32 in unused page-table entries and metadata slots past num_seqs."""
    dtypes = dict(q_dtype=np.dtype(q_dtype).name, kv_dtype=np.dtype(kv_dtype).name)
    return sized_case(q_lens, kv_lens, seed=seed, **dtypes, **{**BUILT_CASE, **fields}).arrays()


def drawn_cases(strategy, count: int) -> list[Case]:
    """``count`` cases from a strategy, the same on every run: a fixed sample for what is stated about a
    share of drawn cases (generated only, none shrunk)."""
    cases = []

    @settings(
        max_examples=count,
        derandomize=True,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
        deadline=None,
    )
    @given(strategy)
    def collect(case):
        cases.append(case)

    collect()
    return cases


def repro_recorded_for(folder: Path, name: str, generation: str) -> Path:
    """A repro pair ``folder/name.json`` of ``SMALL`` recorded for TPU ``generation``."""
    from rpa_harness import device, repro

    example = repro.Repro(
        "differential[fast-interpret]", "rpa_harness.kernel", device.FAST_INTERPRET, SMALL.arrays(),
        SMALL.options(), case=SMALL, tpu_generation=generation,
    )  # fmt: skip
    folder.mkdir(exist_ok=True)
    return repro.write(example, folder).rename(folder / f"{name}.json")


def issue_with(repro_path: Path, **fields):
    """A known issue of every case, whose repro is ``repro_path``, with ``fields`` (generations, ...)."""
    from rpa_harness.known_issues import KnownIssue

    return KnownIssue(
        "an-issue", "goes wrong", repro_path, lambda case: True, lambda case: case, "over the bound", **fields
    )


def loadable(names: list[str]) -> list[str]:
    """Those of ``names`` this jax loads (the kernel installed, the jax it needs), in their order."""
    found = []
    for name in names:
        try:
            targets.load(name)
        except targets.TargetError:
            continue
        found.append(name)
    return found
