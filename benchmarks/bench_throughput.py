"""Examples per minute of the differential properties on one backend, and where a minute goes.

    PYTHONPATH=. python benchmarks/bench_throughput.py [--backend tpu|fast-interpret|interpret]
        [--targets rpa_harness.kernel,rpa_harness.targets.tpu_inference_v3]
        [--properties pooled,pooled-groups,any-config]
        [--examples 150] [--seconds 120] [--cache cold,warm] [--cache-dir DIR]

Runs in this process (on a chip, the one process that holds it), per target and property, the draws the
shipped property makes (``pooled``: ``valid_cases(pooled=True)``, one case an example, as on the
interpreters; ``pooled-groups``: ``valid_case_groups(pooled=True)``, several cases on one pooled
configuration, as on a chip; ``any-config``: ``valid_case_groups``; the target's capabilities,
known issues excluded, its precision contract on the backend), and times each stage of an example:

- ``draw``: Hypothesis and the strategies;
- ``arrays``: the case's host arrays (``Case.arrays``);
- ``call``: the target's call on the backend, its adapter, the transfer to the device, any compilation
  (also counted apart: ``compile s``) and the kernel;
- ``oracle``: the float64 oracle on the host; ``compare``: the tolerance model's comparison.

Each row ends at ``--examples`` examples or ``--seconds`` of wall time, whichever comes first. With
``--cache cold,warm`` each row runs twice, first with an empty persistent compilation cache (a folder of
its own under ``--cache-dir``), then in a fresh process reading what the first filled; ``off`` runs without
one. The table has examples/min, cases/min (a whole-space example holds several cases), compilations per
example, and the seconds per example of each stage.
"""

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DEFAULT_TARGETS = "rpa_harness.kernel,rpa_harness.targets.tpu_inference_v3"
STAGES = ("draw", "arrays", "call", "oracle", "compare")
CASES_PER_CONFIG = 6  # tests/properties/test_differential.py's


def measure(
    target_name: str, backend_name: str, prop: str, examples: int, seconds: float, cache, failures_dir
) -> dict:
    """One row, in this process; each failing case's JSON, the judge's words and the output it judged go
    into ``failures_dir`` (when given), to be studied where the oracle and the interpreters are."""
    from hypothesis import HealthCheck, given, settings
    from rpa_harness import backends, reference
    from rpa_harness.backends import Backend
    from rpa_harness.strategies.valid import valid_case_groups, valid_cases
    from rpa_harness.targets import load

    backends.count_compilations()
    if cache is not None:
        backends.enable_compilation_cache(cache)
    target, backend = load(target_name), Backend(backend_name)
    capabilities, issues = target.capabilities_on(backend), target.known_issues_on(backend)
    precision = target.precision_on(backend)
    if prop == "pooled":
        strategy = valid_cases(capabilities, pooled=True, excluding=issues).map(lambda case: [case])
    else:
        pooled = prop == "pooled-groups"
        strategy = valid_case_groups(
            capabilities, max_cases=CASES_PER_CONFIG, pooled=pooled, excluding=issues
        )
    totals = dict.fromkeys(STAGES, 0.0)
    counts = {"examples": 0, "cases": 0, "failures": 0, "largest_ratio": 0.0}
    before = backends.compilation_stats()
    start = time.perf_counter()
    mark = [start]

    @settings(
        max_examples=examples, derandomize=True, database=None, deadline=None,
        suppress_health_check=list(HealthCheck),
    )  # fmt: skip
    @given(cases=strategy)
    def run(cases):
        if time.perf_counter() - start > seconds:
            return
        now = time.perf_counter()
        totals["draw"] += now - mark[0]
        for case in cases:
            t0 = time.perf_counter()
            arrays, options = case.arrays(), case.options()
            t1 = time.perf_counter()
            try:
                out = backend.run(target.attention, arrays, options)
            except Exception as error:  # a failure the properties report: counted, kept, not timed further
                counts["failures"] += 1
                totals["call"] += time.perf_counter() - t1
                keep_failure(failures_dir, target_name, case, f"{type(error).__name__}: {error}", None)
                continue
            out = out[0] if isinstance(out, tuple) else out
            t2 = time.perf_counter()
            expected = reference.oracle(**arrays, **options)
            t3 = time.perf_counter()
            comparison = reference.compare(out, expected, precision=precision)
            t4 = time.perf_counter()
            if not comparison.ok:
                counts["failures"] += 1
                keep_failure(failures_dir, target_name, case, str(comparison), out)
            counts["largest_ratio"] = max(counts["largest_ratio"], float(comparison.max_ratio))
            for stage, spent in zip(STAGES[1:], (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
                totals[stage] += spent
            counts["cases"] += 1
        counts["examples"] += 1
        mark[0] = time.perf_counter()

    run()
    wall = time.perf_counter() - start
    after = backends.compilation_stats()
    n = max(counts["examples"], 1)
    return dict(
        target=target_name, backend=backend_name, property=prop, wall=wall, **counts,
        compilations=after["compilations"] - before["compilations"],
        compile_seconds=after["compile_seconds"] - before["compile_seconds"],
        cache_hits=after["cache_hits"] - before["cache_hits"],
        per_example={stage: totals[stage] / n for stage in STAGES},
    )  # fmt: skip


def keep_failure(folder, target_name: str, case, words: str, output) -> None:
    if folder is None:
        return
    import numpy as np

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    stem = f"{target_name}-{len(list(folder.glob('*.json')))}"
    (folder / f"{stem}.json").write_text(
        json.dumps({"target": target_name, "case": case.to_json(), "judge": words})
    )
    if output is not None:
        np.save(folder / f"{stem}.npy", np.asarray(output))


def row_in_subprocess(args, target: str, prop: str, cache) -> dict:
    command = [
        sys.executable, __file__, "--row", target, prop, "--backend", args.backend,
        "--examples", str(args.examples), "--seconds", str(args.seconds),
    ]  # fmt: skip
    if cache is not None:
        command += ["--cache-dir", str(cache)]
    if args.failures_dir:
        command += ["--failures-dir", args.failures_dir]
    done = subprocess.run(command, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        sys.stderr.write(done.stderr[-3000:])
        return dict(target=target, property=prop, error=f"exit {done.returncode}")
    return json.loads(lines[-1])


def print_row(row: dict, cache: str) -> None:
    if "error" in row:
        print(f"| {row['target']} | {row['property']} | {cache} | {row['error']} |")
        return
    minutes = row["wall"] / 60
    stages = " | ".join(f"{row['per_example'][stage]:.3f}" for stage in STAGES)
    print(
        f"| {row['target']} | {row['property']} | {cache} | {row['examples']} | {row['examples'] / minutes:,.0f} "
        f"| {row['cases'] / minutes:,.0f} | {row['compilations'] / max(row['examples'], 1):.2f} "
        f"| {row['compile_seconds'] / max(row['examples'], 1):.3f} | {stages} | {row['failures']} "
        f"| {row['largest_ratio']:.3g} |"
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backend", default="fast-interpret", choices=("tpu", "fast-interpret", "interpret"))
    parser.add_argument(
        "--targets", default=DEFAULT_TARGETS, help=f"comma-separated (default {DEFAULT_TARGETS})"
    )
    parser.add_argument(
        "--properties", default="pooled,any-config", help="pooled, pooled-groups, any-config, comma-separated"
    )
    parser.add_argument("--examples", type=int, default=150, help="examples per row at most (default 150)")
    parser.add_argument(
        "--seconds", type=float, default=120.0, help="wall seconds per row at most (default 120)"
    )
    parser.add_argument("--cache", default="cold,warm", help="cold, warm, off, or a comma-separated sequence")
    parser.add_argument(
        "--cache-dir", help="the compilation caches' parent folder (default: a temporary one)"
    )
    parser.add_argument("--failures-dir", help="keep each failing case (JSON) and its output (.npy) here")
    parser.add_argument("--row", nargs=2, metavar=("TARGET", "PROPERTY"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.row:
        print(
            json.dumps(
                measure(
                    args.row[0],
                    args.backend,
                    args.row[1],
                    args.examples,
                    args.seconds,
                    args.cache_dir,
                    args.failures_dir,
                )
            )
        )
        return 0
    parent = Path(args.cache_dir or tempfile.mkdtemp(prefix="rpa-bench-cache-"))
    print(f"backend {args.backend}; at most {args.examples} examples or {args.seconds:.0f} s per row")
    print(
        "| target | property | cache | examples | examples/min | cases/min | compilations/example "
        "| compile s/example | "
        + " | ".join(f"{stage} s" for stage in STAGES)
        + " | failures | largest error/bound |"
    )
    print("|" + " --- |" * (12 + len(STAGES) - 1))
    for target in args.targets.split(","):
        for prop in args.properties.split(","):
            folder = parent / f"{target}-{prop}"
            for cache in args.cache.split(","):
                if cache == "cold":
                    shutil.rmtree(folder, ignore_errors=True)
                print_row(row_in_subprocess(args, target, prop, None if cache == "off" else folder), cache)
                sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
