"""Throughput of the harness itself: valid differential examples per minute, and where the time goes.

    PYTHONPATH=. python benchmarks/bench_harness.py [--examples 300] [--checking-examples 150] [--suite]

1. Examples per minute with two workers (``-n 2`` equivalent: two processes, each running the pooled
   differential property with its own seed), per interpreter, from the run log's timestamps: overall
   (compilations included) and steady state (the second half of each worker's examples).
2. The cost split of one example, measured in-process over the same property: generation (Hypothesis and
   the strategies), array building, kernel, oracle, comparison; and the compilations per run.
3. With ``--suite``: the wall time of the whole CI suite (``ci/run_ci.sh``, ci profile, -n 2).
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROPERTY = {
    "fast-interpret": "tests/properties/test_differential.py::test_kernel_matches_oracle",
    "interpret": "tests/properties/test_differential.py::test_kernel_matches_oracle_checked",
}


def examples_per_minute(backend: str, examples: int) -> tuple[float, float, int]:
    """(overall, steady-state) examples/min over two concurrent workers, and the examples run."""
    from rpa_harness import runlog

    with tempfile.TemporaryDirectory() as log_dir:
        env = dict(os.environ, RPA_RUN_LOG=log_dir, RPA_MAX_EXAMPLES=str(examples), PYTHONPATH=str(ROOT))
        start = time.time()
        workers = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "pytest",
                    PROPERTY[backend],
                    f"--rpa-backend={backend}",
                    "-q",
                    "-p",
                    "no:cacheprovider",
                    "--hypothesis-profile=dev",
                    f"--hypothesis-seed={seed}",
                ],
                cwd=ROOT,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )  # fmt: skip
            for seed in (1, 2)
        ]
        for worker in workers:
            worker.wait()
        wall = time.time() - start
        records = runlog.read(log_dir)
    by_worker = {}
    for record in records:
        by_worker.setdefault(record["pid"], []).append(record["time"])
    steady = 0.0
    for times in by_worker.values():
        times.sort()
        half = times[len(times) // 2 :]
        if len(half) > 1:
            steady += (len(half) - 1) / (half[-1] - half[0]) * 60
    return len(records) / wall * 60, steady, len(records)


def cost_split(backend_name: str, examples: int) -> dict:
    """Seconds per example in each stage, in this process, over the pooled valid cases."""
    import jax
    from hypothesis import given, settings
    from jax._src import dispatch

    from rpa_harness import reference
    from rpa_harness.backends import Backend
    from rpa_harness.targets import load
    from rpa_harness.strategies.valid import valid_cases

    compilations = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, secs, **_: (
            compilations.append(secs) if event == dispatch.BACKEND_COMPILE_EVENT else None
        )
    )
    target, backend = load("rpa_harness.kernel"), Backend(backend_name)
    stages = {"arrays": 0.0, "kernel": 0.0, "oracle": 0.0, "compare": 0.0}
    count = 0

    @settings(max_examples=examples, derandomize=True, database=None, deadline=None)
    @given(case=valid_cases(pooled=True))
    def run(case):
        nonlocal count
        t0 = time.perf_counter()
        arrays, options = case.arrays(), case.options()
        t1 = time.perf_counter()
        out = backend.run(target.attention, arrays, options)
        t2 = time.perf_counter()
        expected = reference.oracle(**arrays, **options)
        t3 = time.perf_counter()
        assert reference.compare(out, expected).ok
        t4 = time.perf_counter()
        for stage, seconds in zip(stages, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
            stages[stage] += seconds
        count += 1

    start = time.perf_counter()
    run()
    total = time.perf_counter() - start
    split = {stage: seconds / count for stage, seconds in stages.items()}
    split["generation"] = (total - sum(stages.values())) / count
    split["total"] = total / count
    split["examples"] = count
    split["compilations"] = len(compilations)
    split["compile_seconds"] = sum(compilations)
    return split


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--examples",
        type=int,
        default=300,
        help="fast interpreter: RPA_MAX_EXAMPLES of each worker (the pooled property runs 5x that many)",
    )
    parser.add_argument(
        "--checking-examples",
        type=int,
        default=150,
        help="TPU interpreter: examples per worker (and in the cost split); enough to amortise compilation",
    )
    parser.add_argument("--suite", action="store_true", help="also time the whole CI suite")
    args = parser.parse_args()
    print("examples/min with 2 workers (pooled differential property; overall includes compilation)")
    for backend, examples in (("fast-interpret", args.examples), ("interpret", args.checking_examples)):
        overall, steady, count = examples_per_minute(backend, examples)
        print(
            f"  {backend:<15} {count:>5} examples  overall {overall:8.0f}/min  steady state {steady:8.0f}/min"
        )
    print("\ncost split per example, one process (seconds)")
    for backend, examples in (("fast-interpret", args.examples), ("interpret", args.checking_examples)):
        split = cost_split(backend, examples)
        stages = "  ".join(
            f"{k} {split[k]:.4f}" for k in ("generation", "arrays", "kernel", "oracle", "compare")
        )
        print(
            f"  {backend:<15} {stages}  total {split['total']:.4f}  ({split['examples']} examples, "
            f"{split['compilations']} compilations, {split['compile_seconds']:.1f} s compiling)"
        )
    if args.suite:
        start = time.time()
        code = subprocess.call(["bash", "ci/run_ci.sh", "-q"], cwd=ROOT)
        print(f"\nci suite (ci/run_ci.sh, -n 2): {time.time() - start:.0f} s wall, exit {code}")


if __name__ == "__main__":
    main()
