"""Time and peak memory of the float64 oracle and the comparison, per bucket, on one core.

    python benchmarks/bench_oracle.py [--examples N] [--buckets tiny,small,medium,production]

For each bucket, N cases are drawn as the properties draw them (derandomized, so runs are comparable), the
oracle judges each, and the comparison runs against the oracle's own output rounded to q's dtype (what a
correct kernel returns, near enough). Printed per bucket: mean and largest wall and CPU time of the oracle
and of the comparison, and the peak memory they allocate (tracemalloc; the case's input arrays are
listed apart). The production bucket adds its largest case: every budget at its limit (the result at
``max_output_elements``, the cache full, the attention work at ``max_work``). BLAS is pinned to one thread.
"""

import os

for _variable in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_variable, "1")

import argparse  # noqa: E402
import time  # noqa: E402
import tracemalloc  # noqa: E402

import numpy as np  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402

from rpa_harness.reference import compare, oracle  # noqa: E402
from rpa_harness.strategies.buckets import BUCKETS, LARGE_BUCKETS, ProductionBucket  # noqa: E402
from rpa_harness.strategies.case import DTYPES, Case  # noqa: E402
from rpa_harness.strategies.shapes import page_bytes, select_buckets  # noqa: E402
from rpa_harness.strategies.valid import valid_cases  # noqa: E402
from rpa_harness.targets.bundled import RPA_HARNESS_CAPABILITIES as OUR_KERNEL  # noqa: E402


def drawn_cases(bucket: str, examples: int) -> list[Case]:
    selection = select_buckets(OUR_KERNEL, bucket)
    large = bucket in LARGE_BUCKETS
    cases = []

    @settings(
        max_examples=examples, derandomize=True, database=None, deadline=None,
        suppress_health_check=list(HealthCheck),
    )  # fmt: skip
    @given(case=valid_cases(OUR_KERNEL, large=large, selection=selection))
    def collect(case):
        cases.append(case)

    collect()
    return cases[-examples:]


def largest_production_case(bucket: ProductionBucket) -> Case:
    """Every budget at its limit: T * q_heads * head_dim = max_output_elements, the cache full (one long
    prefill taking the work budget, every other slot a decode sharing the rest of the pages)."""
    num_q_heads, num_kv_heads, head_dim, page_size, kv_dtype = 64, 8, 256, 16, "bfloat16"
    tokens = bucket.max_output_elements // (num_q_heads * head_dim)
    slots = max(bucket.seq_slots)
    total_pages = bucket.kv_cache_bytes // page_bytes(page_size, num_kv_heads, head_dim, kv_dtype)
    prefill = int((bucket.max_work // num_q_heads) ** 0.5) // page_size * page_size
    decodes = slots - 1
    decode_pages = (total_pages - prefill // page_size) // decodes
    kv_lens = (prefill, *[decode_pages * page_size] * decodes)
    return Case(
        max_num_batched_tokens=tokens, max_num_seqs=slots, pages_per_seq=max(bucket.max_model_lens) // page_size,
        total_num_pages=total_pages, page_size=page_size, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, q_dtype="bfloat16", kv_dtype=kv_dtype, q_lens=(prefill, *[1] * decodes),
        kv_lens=kv_lens, poison=True,
    )  # fmt: skip


def measure(case: Case) -> dict:
    arrays, options = case.arrays(), case.options()
    inputs = sum(a.nbytes for a in arrays.values())
    tracemalloc.start()
    wall, cpu = time.perf_counter(), time.process_time()
    result = oracle(**arrays, **options)
    oracle_wall, oracle_cpu = time.perf_counter() - wall, time.process_time() - cpu
    actual = np.nan_to_num(result.out).astype(DTYPES[case.q_dtype])
    wall, cpu = time.perf_counter(), time.process_time()
    comparison = compare(actual, result)
    compare_wall, compare_cpu = time.perf_counter() - wall, time.process_time() - cpu
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert comparison.ok, str(comparison)
    work = sum(q * kv for q, kv in zip(case.q_lens, case.kv_lens, strict=True)) * case.num_q_heads
    return dict(
        oracle_wall=oracle_wall, oracle_cpu=oracle_cpu, compare_wall=compare_wall, compare_cpu=compare_cpu,
        peak=peak, inputs=inputs, work=work,
    )  # fmt: skip


def shape_of(case: Case) -> str:
    return (
        f"T={case.max_num_batched_tokens} seqs={case.num_seqs}/{case.max_num_seqs} heads={case.num_q_heads}/"
        f"{case.num_kv_heads} d={case.head_dim} page={case.page_size} pages={case.total_num_pages} "
        f"max kv_len={max(case.kv_lens, default=0)} rows={case.num_tokens}"
    )


def report(label: str, rows: list[dict]) -> None:
    def stat(key, scale=1.0):
        values = [r[key] / scale for r in rows]
        return f"{np.mean(values):7.2f} / {max(values):7.2f}"

    print(
        f"{label:<22} {len(rows):>3}  oracle wall {stat('oracle_wall')} s  cpu {stat('oracle_cpu')} s  "
        f"compare wall {stat('compare_wall')} s  cpu {stat('compare_cpu')} s  peak {stat('peak', 2**20)} MiB  inputs "
        f"{stat('inputs', 2**20)} MiB"
    )


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--examples", type=int, default=5, help="cases per bucket (default 5)")
    parser.add_argument("--buckets", default=",".join(BUCKETS), help="comma-separated bucket names")
    parser.add_argument("--verbose", action="store_true", help="one line per case")
    args = parser.parse_args()
    print("per bucket: examples, then mean / largest")
    for bucket in args.buckets.split(","):
        cases = drawn_cases(bucket, args.examples)
        if isinstance(BUCKETS[bucket], ProductionBucket):
            cases.append(largest_production_case(BUCKETS[bucket]))
        rows = []
        for case in cases:
            rows.append(measure(case))
            if args.verbose:
                r = rows[-1]
                print(
                    f"  {r['oracle_wall']:6.2f} s {r['peak'] / 2**20:7.0f} MiB work {r['work']:.2e}  {shape_of(case)}"
                )
        report(bucket, rows[: len(rows) - (1 if isinstance(BUCKETS[bucket], ProductionBucket) else 0)])
        if isinstance(BUCKETS[bucket], ProductionBucket):
            report(f"{bucket} (largest)", rows[-1:])
            print(f"  largest: {shape_of(cases[-1])}")


if __name__ == "__main__":
    main()
