"""Throughput of the harness itself: valid differential examples per minute, and where the time goes.

    PYTHONPATH=. python benchmarks/bench_harness.py [--examples 300] [--checking-examples 150]
        [--any-config-examples 40] [--caches cold,warm] [--blas-threads one|default] [--suite]

Each measurement runs once per compilation-cache state (``--caches``): ``cold`` starts from an empty
persistent compilation cache (RPA_COMPILATION_CACHE), ``warm`` reuses the folder the cold pass filled,
``off`` runs without one. ``--blas-threads default`` starts the workers with the BLAS library's own thread
count instead of the one thread per worker the plugin gives xdist workers.

1. Examples per minute with two workers (``-n 2`` equivalent: two processes, each running one property
   with its own seed), per property: the pooled differential property on each interpreter and the
   whole-space ("any config") one on each; overall (compilations included) and steady state (the second
   half of each worker's examples), from the run log's timestamps. Wall time is noisy on a shared machine,
   so each line also gives the CPU seconds per example, the compilations per example and the cache use
   the workers report (hits, entries written, and requests not written: executables with host callbacks,
   i.e. every kernel on the TPU interpreter).
2. The cost split of one example, measured in-process over the pooled property: generation (Hypothesis
   and the strategies), array building, kernel, oracle, comparison; and the compilations per run.
3. With ``--suite``: the wall time of the whole CI suite (``ci/run_ci.sh``, ci profile, -n 2) per cache state.
   ``--examples 0 --checking-examples 0 --any-config-examples 0 --skip-split --suite`` times the suite only.

Before and after, the CPU time of a fixed pure-Python loop: the machine's speed while it measured.
"""

import argparse
import os
import resource
import shutil
import signal
import tempfile
import time
from pathlib import Path

from rpa_harness.device import processes

ROOT = Path(__file__).resolve().parent.parent
# name -> (pytest node, backend, examples per worker for RPA_MAX_EXAMPLES=1 worth of base count)
PROPERTIES = {
    "pooled fast": ("tests/properties/test_differential.py::test_kernel_matches_oracle", "fast-interpret"),
    "pooled checking": (
        "tests/properties/test_differential.py::test_kernel_matches_oracle_checked",
        "interpret",
    ),
    "any-config fast": (
        "tests/properties/test_differential.py::test_kernel_matches_oracle_any_config",
        "fast-interpret",
    ),
    "any-config checking": (
        "tests/properties/test_differential.py::test_kernel_matches_oracle_checked_any_config",
        "interpret",
    ),
}
# RPA_MAX_EXAMPLES (the profile's base count) that gives each property `examples` examples (tests/properties/budget.py).
BASE_FOR = {
    "pooled fast": lambda examples: max(1, examples // 5),
    "pooled checking": lambda examples: examples,
    "any-config fast": lambda examples: 2 * examples,
    "any-config checking": lambda examples: 4 * examples,
}
STAT_KEYS = ("compilations", "cache_hits", "cache_writes", "cache_not_written")


def children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def machine_speed() -> float:
    """CPU seconds of a fixed pure-Python loop (3e7 multiply-adds), printed before and after the
    measurements: on a shared virtual machine the CPU time of the same work moves with what the other
    tenants do, and two runs compare only at about the same speed."""
    start = time.process_time()
    total = 0
    for i in range(30_000_000):
        total += i * i
    return time.process_time() - start


def examples_per_minute(prop: str, examples: int, cache: str, blas_threads: str) -> dict:
    """Two concurrent workers on one property: examples/min overall and steady, CPU and compilations."""
    from rpa_harness import device, runlog

    node, backend = PROPERTIES[prop]
    with tempfile.TemporaryDirectory() as log_dir:
        env = dict(
            os.environ,
            RPA_RUN_LOG=log_dir,
            RPA_MAX_EXAMPLES=str(BASE_FOR[prop](examples)),
            RPA_COMPILATION_CACHE=cache,
            PYTHONPATH=str(ROOT),
        )
        if blas_threads == "one":  # as the plugin starts xdist workers
            env = device.one_blas_thread_per_worker(env)
        cpu_before, start = children_cpu_seconds(), time.time()
        workers = [
            processes.start(
                processes.python(
                    "-m",
                    "pytest",
                    node,
                    f"--rpa-backend={backend}",
                    "-q",
                    "-p",
                    "no:cacheprovider",
                    "--hypothesis-profile=dev",
                    f"--hypothesis-seed={seed}",
                ),
                cwd=ROOT,
                env=env,
                stdout=processes.DEVNULL,
                stderr=processes.DEVNULL,
            )  # fmt: skip
            for seed in (1, 2)
        ]
        try:
            codes = [worker.wait() for worker in workers]
        except BaseException:  # interrupted: the workers go with it
            for worker in workers:
                processes.end(worker, first=signal.SIGINT)
            raise
        wall, cpu = time.time() - start, children_cpu_seconds() - cpu_before
        records = runlog.read(log_dir)
        events = [e for e in runlog.read_events(log_dir) if e["kind"] == "compilations"]
    by_worker = {}
    for record in records:
        by_worker.setdefault(record["pid"], []).append(record["time"])
    steady = 0.0
    for times in by_worker.values():
        times.sort()
        half = times[len(times) // 2 :]
        if len(half) > 1:
            steady += (len(half) - 1) / (half[-1] - half[0]) * 60
    count = len(records)
    stats = {key: sum(e.get(key, 0) for e in events) for key in STAT_KEYS}
    return dict(
        examples=count,
        overall=count / wall * 60,
        steady=steady,
        wall=wall,
        cpu_per_example=cpu / max(count, 1),
        failed=[c for c in codes if c not in (0,)],
        **stats,
    )


def cost_split(backend_name: str, examples: int, cache: str) -> dict:
    """Seconds per example in each stage, in this process, over the pooled valid cases."""
    import jax  # noqa: F401  (configured before the first compilation below)
    from hypothesis import given, settings

    from rpa_harness import device, reference
    from rpa_harness.device import Backend
    from rpa_harness.strategies.valid import valid_cases
    from rpa_harness.targets import load

    device.count_compilations()
    folder = device.compilation_cache_setting(cache)
    if folder is not None:
        device.enable_compilation_cache(folder)
    before = device.compilation_stats()
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

    start, cpu_start = time.perf_counter(), time.process_time()
    run()
    total, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    after = device.compilation_stats()
    split = {stage: seconds / count for stage, seconds in stages.items()}
    split["generation"] = (total - sum(stages.values())) / count
    split["total"] = total / count
    split["cpu"] = cpu / count
    split["examples"] = count
    for key in (*STAT_KEYS, "compile_seconds", "lower_seconds", "trace_seconds"):
        split[key] = after[key] - before[key]
    return split


def cost_split_in_subprocess(backend_name: str, examples: int, cache: str) -> dict:
    """``cost_split`` in a fresh process (jax decides once per process whether it uses the cache)."""
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); from benchmarks.bench_harness import cost_split; "
        "print('SPLIT', json.dumps(cost_split(sys.argv[2], int(sys.argv[3]), sys.argv[4])))"
    )
    out = processes.run(
        processes.python("-c", code, str(ROOT), backend_name, str(examples), cache),
        cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )  # fmt: skip
    if out.returncode != 0:
        raise SystemExit(
            f"bench_harness: the cost split's child exited {out.returncode}:\n{out.stderr[-3000:]}"
        )
    import json

    line = next(line for line in out.stdout.splitlines() if line.startswith("SPLIT "))
    return json.loads(line[len("SPLIT ") :])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=300,
                        help="fast interpreter, pooled: examples per worker x 5 (the pooled property runs "
                        "5x the base count), and the cost split's examples")  # fmt: skip
    parser.add_argument("--checking-examples", type=int, default=150,
                        help="TPU interpreter, pooled: examples per worker (and in the cost split)")  # fmt: skip
    parser.add_argument("--any-config-examples", type=int, default=40,
                        help="whole-space properties: examples per worker on the fast interpreter (a "
                        "quarter of it on the checking one); 0 skips them")  # fmt: skip
    parser.add_argument("--caches", default="cold,warm",
                        help="compilation-cache states, comma-separated: cold (empty folder), warm (the "
                        "folder the cold pass filled), off")  # fmt: skip
    parser.add_argument("--skip-split", action="store_true", help="skip the in-process cost split")
    parser.add_argument("--blas-threads", choices=("one", "default"), default="one",
                        help="one BLAS thread per worker (what the plugin gives xdist workers) or the library's default")  # fmt: skip
    parser.add_argument("--suite", action="store_true", help="also time the whole CI suite")
    args = parser.parse_args()
    states = [s.strip() for s in args.caches.split(",") if s.strip()]
    unknown = [s for s in states if s not in ("cold", "warm", "off")]
    if unknown or not states:
        parser.exit(4, f"bench_harness: --caches={args.caches!r}: use cold, warm and/or off\n")
    if "warm" in states and "cold" not in states[: states.index("warm")]:
        parser.exit(
            4, f"bench_harness: --caches={args.caches!r}: warm reuses what cold filled; put cold first\n"
        )
    cache_root = Path(tempfile.mkdtemp(prefix="rpa-bench-cache-"))
    folder = cache_root / "cache"
    sizes = {
        "pooled fast": args.examples * 5,
        "pooled checking": args.checking_examples,
        "any-config fast": args.any_config_examples,
        "any-config checking": args.any_config_examples // 4,
    }
    print(f"machine speed before: {machine_speed():.2f} s for the fixed loop")
    try:
        for state in states:
            if state == "cold":
                shutil.rmtree(folder, ignore_errors=True)
            cache = "off" if state == "off" else str(folder)
            print(f"=== compilation cache: {state}")
            print("examples/min with 2 workers (overall includes compilation; cpu = CPU s per example)")
            for prop, examples in sizes.items():
                if examples <= 0:
                    continue
                r = examples_per_minute(prop, examples, cache, args.blas_threads)
                per = max(r["examples"], 1)
                print(
                    f"  {prop:<20} {r['examples']:>5} ex  overall {r['overall']:7.0f}/min  steady "
                    f"{r['steady']:7.0f}/min  wall {r['wall']:6.1f} s  cpu {r['cpu_per_example']:.3f} s/ex  "
                    f"compilations {r['compilations']} ({r['compilations'] / per:.2f}/ex)"
                    + (
                        f"  cache hits {r['cache_hits']} written {r['cache_writes']} not written "
                        f"{r['cache_not_written']}"
                        if state != "off"
                        else ""
                    )
                    + (f"  EXIT {r['failed']}" if r["failed"] else "")
                )
            if args.skip_split:
                continue
            print("cost split per example, one process (seconds)")
            for backend, examples in (
                ("fast-interpret", args.examples),
                ("interpret", args.checking_examples),
            ):
                split = cost_split_in_subprocess(backend, examples, cache)
                stages = "  ".join(
                    f"{k} {split[k]:.4f}" for k in ("generation", "arrays", "kernel", "oracle", "compare")
                )
                print(
                    f"  {backend:<15} {stages}  total {split['total']:.4f}  cpu {split['cpu']:.4f}  "
                    f"({split['examples']} examples, {split['compilations']} compilations: "
                    f"{split['trace_seconds']:.1f} s tracing, {split['lower_seconds']:.1f} s lowering, "
                    f"{split['compile_seconds']:.1f} s compiling"
                    + (
                        f"; cache hits {split['cache_hits']}, written {split['cache_writes']}, not written "
                        f"{split['cache_not_written']})"
                        if state != "off"
                        else ")"
                    )
                )
        if args.suite:
            for state in states:
                if state == "cold":
                    shutil.rmtree(folder, ignore_errors=True)
                # The README's command as it stands: without the PYTHONPATH this benchmark runs with.
                env = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}
                env["RPA_COMPILATION_CACHE"] = "off" if state == "off" else str(folder)
                start, cpu_before = time.time(), children_cpu_seconds()
                code = processes.run(
                    ["bash", "ci/run_ci.sh", "-q"],
                    cwd=ROOT,
                    env=env,
                    output=processes.INHERIT,
                    first=signal.SIGINT,
                ).returncode
                print(
                    f"ci suite (ci/run_ci.sh, -n 2), cache {state}: {time.time() - start:.0f} s wall, "
                    f"{children_cpu_seconds() - cpu_before:.0f} s CPU, exit {code}"
                )
        print(f"machine speed after: {machine_speed():.2f} s for the fixed loop")
    finally:
        shutil.rmtree(cache_root, ignore_errors=True)


if __name__ == "__main__":
    main()
