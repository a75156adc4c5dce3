"""Examples and cases per minute of the shipped differential property, and how busy it keeps the chip.

    PYTHONPATH=. python benchmarks/bench_throughput.py [--backend tpu|fast-interpret|interpret]
        [--targets rpa_harness.kernel,rpa_harness.targets.tpu_inference_v3] [--properties pooled,any-config]
        [--workers 1,2] [--chip-owner auto|on|off] [--seconds 120] [--cache cold,warm] [--cache-dir DIR] [--repro-dir DIR]

Each row runs the property itself, as a user's run does (``pytest --pyargs rpa_harness.properties``, the dev
profile resized by ``RPA_MAX_EXAMPLES`` so that it never ends first), for ``--seconds`` of wall time, then
interrupts it as Ctrl-C would (its process session only) and reads its run log: examples (Hypothesis
examples) and cases (a whole-space example, or a pooled one on a chip, holds several) between the first
example and the last, per minute; the wall time before the first (starting workers, opening the chip);
and, where a chip owner made the calls (``--workers`` of 2 or more, unless ``--chip-owner off``), its
kernel calls and the fraction of the row's wall time the chip spent in them. ``--workers 1`` runs one
process that makes its own calls (``--rpa-chip-owner=off``): the path without an owner.

``pooled`` is ``test_kernel_matches_oracle`` (on a chip, groups of cases on pooled configurations);
``any-config`` is ``test_kernel_matches_oracle_any_config``. With ``--cache cold,warm`` each row runs twice,
first with an empty persistent compilation cache (a folder of its own under ``--cache-dir``), then reading
what the first filled; ``off`` runs without one. Failing examples leave their repros in ``--repro-dir``
(default: a temporary folder), named in the row.
"""

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DEFAULT_TARGETS = "rpa_harness.kernel,rpa_harness.targets.tpu_inference_v3"
PROPERTIES = {
    "pooled": "test_kernel_matches_oracle and not any_config and not checked and not reference",
    "any-config": "test_kernel_matches_oracle_any_config and not checked",
}
NEVER_ENDS_FIRST = 1_000_000  # RPA_MAX_EXAMPLES: the time limit ends every row
INTERRUPT_GRACE_SECONDS = 60.0  # after Ctrl-C: the run writes its summary and stops its chip owner


def run_row(args, target: str, prop: str, workers: int, cache, repro_dir: Path) -> dict:
    """One row: the property for ``args.seconds``, then its run log read."""
    log = Path(tempfile.mkdtemp(prefix="rpa-bench-log-"))
    command = [
        sys.executable, "-m", "pytest", "--pyargs", "rpa_harness.properties", "-p", "no:cacheprovider", "-q",
        "-k", PROPERTIES[prop], f"--rpa-target={target}", f"--rpa-backend={args.backend}",
        "--hypothesis-profile=dev", f"--rpa-repro-dir={repro_dir}",
        f"--rpa-compilation-cache={cache if cache is not None else 'off'}",
        "-n", str(workers), f"--rpa-chip-owner={owner_setting(args.chip_owner, workers)}",
    ]  # fmt: skip
    environ = {**os.environ, "RPA_RUN_LOG": str(log), "RPA_MAX_EXAMPLES": str(NEVER_ENDS_FIRST)}
    started = time.time()
    process = subprocess.Popen(
        command,
        env=environ,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=args.seconds)
    except subprocess.TimeoutExpired:
        os.kill(process.pid, signal.SIGINT)  # the run's own controller: it ends its workers and owner
        try:
            output, _ = process.communicate(timeout=INTERRUPT_GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)  # its session: nothing outside it
            output, _ = process.communicate()
    row = summarise(log, started, time.time())
    row.update(target=target, property=prop, workers=workers, exit=process.returncode)
    if not row["examples"]:
        row["error"] = f"no example ran (exit {process.returncode}): {output.strip().splitlines()[-1:] or ''}"
    shutil.rmtree(log, ignore_errors=True)
    return row


def owner_setting(choice: str, workers: int) -> str:
    """``--rpa-chip-owner`` for a row: ``auto`` is an owner for 2 or more workers, on any backend."""
    if choice == "auto":
        return "on" if workers > 1 else "off"
    return choice


def summarise(log: Path, started: float, ended: float) -> dict:
    """The run log's examples, cases and failures, their rate between the first example and the last, and
    the chip owner's calls and busy seconds."""
    from rpa_harness import runlog

    entries = runlog.read(log)
    times = sorted(entry["time"] for entry in entries)
    examples = sum(1 for entry in entries if runlog.is_example(entry))
    span = times[-1] - times[0] if len(times) > 1 else 0.0
    owners = [event for event in runlog.read_events(log) if event["kind"] == "chip_owner"]
    owner = owners[-1] if owners else {}
    return {
        "examples": examples,
        "cases": len(entries),
        "failures": sum(1 for entry in entries if entry.get("repro")),
        "per_minute": (examples / span * 60, len(entries) / span * 60) if span else (0.0, 0.0),
        "before_first_s": times[0] - started if times else ended - started,
        "wall_s": ended - started,
        "calls": owner.get("calls"),
        "busy": owner.get("busy_s", 0.0) / (ended - started) if owner else None,
        "largest_ratio": max((entry.get("max_ratio", 0.0) for entry in entries), default=0.0),
    }


def print_row(row: dict, cache: str) -> None:
    lead = f"| {row['target']} | {row['property']} | {row['workers']} | {cache} |"
    if "error" in row:
        print(f"{lead} {row['error']} |")
        return
    examples_per_minute, cases_per_minute = row["per_minute"]
    owner = "- | -" if row["calls"] is None else f"{row['calls']:,} | {row['busy']:.0%}"
    print(
        f"{lead} {row['examples']:,} | {examples_per_minute:,.0f} | {cases_per_minute:,.0f} | "
        f"{row['before_first_s']:.1f} | {owner} | {row['failures']} | {row['largest_ratio']:.3g} |"
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
        "--properties", default="pooled,any-config", help=f"{', '.join(PROPERTIES)}, comma-separated"
    )
    parser.add_argument(
        "--workers",
        default="1,2",
        help="xdist workers per row, comma-separated; 2 or more: with a chip owner",
    )
    parser.add_argument(
        "--chip-owner", default="auto", choices=("auto", "on", "off"),
        help="auto (default): workers of 2 or more feed a chip owner; off: each worker makes its own calls",
    )  # fmt: skip
    parser.add_argument("--seconds", type=float, default=120.0, help="wall seconds per row (default 120)")
    parser.add_argument("--cache", default="cold,warm", help="cold, warm, off, or a comma-separated sequence")
    parser.add_argument(
        "--cache-dir", help="the compilation caches' parent folder (default: a temporary one)"
    )
    parser.add_argument(
        "--repro-dir", help="where failing examples leave repros (default: a temporary folder)"
    )
    args = parser.parse_args()
    unknown = sorted(set(args.properties.split(",")) - set(PROPERTIES))
    if unknown:
        parser.error(f"--properties: {', '.join(unknown)} is not one of {', '.join(PROPERTIES)}")
    parent = Path(args.cache_dir or tempfile.mkdtemp(prefix="rpa-bench-cache-"))
    repro_dir = Path(args.repro_dir or tempfile.mkdtemp(prefix="rpa-bench-repros-"))
    print(f"backend {args.backend}; {args.seconds:.0f} s a row; repros in {repro_dir}")
    print(
        "| target | property | workers | cache | examples | examples/min | cases/min | s before the first "
        "| owner's calls | chip busy | failures | largest error/bound |"
    )
    print("|" + " --- |" * 12)
    for target in args.targets.split(","):
        for prop in args.properties.split(","):
            for workers in (int(count) for count in args.workers.split(",")):
                folder = parent / f"{target}-{prop}"
                for cache in args.cache.split(","):
                    if cache == "cold":
                        shutil.rmtree(folder, ignore_errors=True)
                    row = run_row(args, target, prop, workers, None if cache == "off" else folder, repro_dir)
                    print_row(row, cache)
                    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
