"""``rpa-harness chip throughput``: examples and cases per minute of the shipped differential property once
warm, and where the time goes.

Each row runs the property itself, as a user's run does (``pytest --pyargs rpa_harness.properties``, the dev
profile resized by ``RPA_MAX_EXAMPLES`` so that it never ends first), until ``--seconds`` have passed since
its first example, then interrupts it as Ctrl-C would (its process session only:
``rpa_harness.device.processes``) and reads its run log:

- the wall time to the first example (starting pytest, the workers, the chip and its owner) and to warm
  (the last case whose process compiled, or the chip owner's last compilation);
- the steady window after that, and its examples (Hypothesis examples) and cases (a whole-space example, or
  a pooled one on a chip, holds several) per minute: a window under 120 s is marked short;
- where a chip owner made the calls (``--workers`` of 2 or more, unless ``--chip-owner off``): its calls,
  the static signatures it compiled (how many ahead of their calls, off the chip's path), the seconds spent
  compiling, its milliseconds per call running (transfers, dispatch, the chip) and the fraction of the row
  the chip's lock was held; without one, the workers' compile seconds;
- a steady case's host milliseconds: its arrays, its repro written before the call, the kernel's call
  (through the owner: with its queue), the float64 oracle and the comparison;
- the row's bound: start-up or compilation where either took half its wall time or more, else the chip
  (its owner running calls 80% of the steady window or more) or the host.

``--workers 1`` runs one process that makes its own calls (``--rpa-chip-owner=off``): the path without an
owner. ``pooled`` is ``test_kernel_matches_oracle`` (on a chip, groups of cases on pooled configurations);
``any-config`` is ``test_kernel_matches_oracle_any_config``. With ``--cache cold,warm`` each row runs twice,
first with an empty persistent compilation cache (a folder of its own under ``--cache-dir``), then reading
what the first filled; ``off`` runs without one. Failing examples leave their repros in ``--repro-dir``
(default: a temporary folder), named in the row. ``--backend fast-interpret`` measures the interpreters.
"""

import argparse
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from rpa_harness import device, targets
from rpa_harness.chip import ChipUsageError, add_target_option, backend_of, child_environment, loaded_targets
from rpa_harness.device import processes

DEFAULT_TARGETS = (targets.DEFAULT_TARGET, targets.V3_TARGET)
PROPERTIES = {
    "pooled": "test_kernel_matches_oracle and not any_config and not checked and not reference",
    "any-config": "test_kernel_matches_oracle_any_config and not checked",
}
NEVER_ENDS_FIRST = 1_000_000  # RPA_MAX_EXAMPLES: the time limit ends every row
INTERRUPT_GRACE_SECONDS = 60.0  # after Ctrl-C: the run writes its summary and stops its chip owner
POLL_SECONDS = 2.0
STEADY_SECONDS = 120.0  # a steady window shorter than this is marked "(short)"
COMPILED = 0.05  # a case whose process compiled for longer than this (seconds) ends the warm-up
# A case's host seconds, as the differential property records them: its arrays, its repro written before
# the call, the kernel's call (on a chip: with the owner's queue), the float64 oracle, the comparison.
CASE_SECONDS = ("arrays_s", "record_s", "call_s", "oracle_s", "judge_s")


def run_row(args, target: str, prop: str, workers: int, cache, repro_dir: Path) -> dict:
    """One row: the property until ``args.seconds`` have passed since its first example (at most
    ``args.max_seconds`` in all), then its run log read."""
    log = Path(tempfile.mkdtemp(prefix="rpa-bench-log-"))
    command = processes.python(
        "-m", "pytest", "--pyargs", "rpa_harness.properties", "-p", "no:cacheprovider", "-q",
        "-k", PROPERTIES[prop], f"--rpa-target={target}", f"--rpa-backend={args.backend}",
        "--hypothesis-profile=dev", f"--rpa-repro-dir={repro_dir}",
        f"--rpa-compilation-cache={cache if cache is not None else 'off'}",
        "-n", str(workers), f"--rpa-chip-owner={owner_setting(args.chip_owner, workers)}",
        *([f"--rpa-tpu-generation={args.tpu_generation}"] if args.tpu_generation else []),
    )  # fmt: skip
    environ = child_environment(RPA_RUN_LOG=str(log), RPA_MAX_EXAMPLES=str(NEVER_ENDS_FIRST))
    started = time.time()
    with tempfile.TemporaryFile("w+") as output:
        process = processes.start(command, env=environ, stdout=output, stderr=output)
        try:
            while process.poll() is None and not row_is_long_enough(log, started, args):
                time.sleep(POLL_SECONDS)
        finally:
            # The run's own controller first, as Ctrl-C: it ends its workers and owner, writes its summary.
            processes.end(process, first=signal.SIGINT, grace=INTERRUPT_GRACE_SECONDS)
        output.seek(0)
        last_line = output.read().strip().splitlines()[-1:]
    row = summarise(log, started, time.time())
    row.update(target=target, property=prop, workers=workers, exit=process.returncode)
    if not row["examples"]:
        row["error"] = f"no example ran (exit {process.returncode}): {last_line or ''}"
    shutil.rmtree(log, ignore_errors=True)
    return row


def row_is_long_enough(log: Path, started: float, args) -> bool:
    """Whether ``args.seconds`` have passed since the row's first example, or ``args.max_seconds`` in all."""
    from rpa_harness import runlog

    now = time.time()
    if now - started >= args.max_seconds:
        return True
    times = [entry["time"] for entry in runlog.read(log)]
    return bool(times) and now - min(times) >= args.seconds


def owner_setting(choice: str, workers: int) -> str:
    """``--rpa-chip-owner`` for a row: ``auto`` is an owner for 2 or more workers, on any backend."""
    if choice == "auto":
        return "on" if workers > 1 else "off"
    return choice


def summarise(log: Path, started: float, ended: float) -> dict:
    """The run log read as a row: its examples, cases and failures; the wall time before the first example;
    the steady window (after the run's last compilation, the workers' or the owner's) and its rates; where
    a case's host seconds went; and the chip owner's calls, signatures and seconds."""
    from rpa_harness import runlog

    entries = sorted(runlog.read(log), key=lambda entry: entry["time"])
    events = runlog.read_events(log)
    owners = [event for event in events if event["kind"] == "chip_owner"]
    owner = owners[-1] if owners else {}
    times = [entry["time"] for entry in entries]
    compiled_at = [entry["time"] for entry in entries if entry.get("compile_s", 0.0) > COMPILED]
    warm_from = max([*compiled_at[-1:], owner.get("last_compiled", 0.0), *times[:1]], default=ended)
    steady = [entry for entry in entries if entry["time"] > warm_from]
    window = times[-1] - warm_from if steady else 0.0
    worker_compile_s = sum(
        event.get("trace_seconds", 0.0) + event.get("lower_seconds", 0.0) + event.get("compile_seconds", 0.0)
        for event in events
        if event["kind"] == "compilations"
    )
    return {
        "examples": sum(1 for entry in entries if runlog.is_example(entry)),
        "cases": len(entries),
        "failures": sum(1 for entry in entries if entry.get("repro")),
        "before_first_s": times[0] - started if times else ended - started,
        "wall_s": ended - started,
        "warm_after_s": warm_from - started,
        "window_s": window,
        "steady": (
            (sum(1 for entry in steady if runlog.is_example(entry)) / window * 60, len(steady) / window * 60)
            if window
            else (0.0, 0.0)
        ),
        "per_case_ms": {
            name: 1e3 * sum(entry.get(name, 0.0) for entry in steady) / len(steady) if steady else 0.0
            for name in CASE_SECONDS
        },
        "compile_s": worker_compile_s,
        "owner": owner,
        "largest_ratio": max((entry.get("max_ratio", 0.0) for entry in entries), default=0.0),
    }


def bound(row: dict, workers: int) -> str:
    """What held the row back: start-up or compilation where they took most of its wall time, else in the
    steady window the chip (its owner busy most of the time) or the host (the workers)."""
    wall = row["wall_s"]
    shares = {
        "start-up": row["before_first_s"] / wall,
        "compile": (row["warm_after_s"] - row["before_first_s"]) / wall,
    }
    name, share = max(shares.items(), key=lambda item: item[1])
    if share >= 0.5 or not row["window_s"]:
        return f"{name} ({share:.0%} of the row)"
    owner = row["owner"]
    if owner and owner.get("calls"):
        # Where there is an owner a chip, their seconds together over the chips: a chip's on average.
        running = owner.get("seconds", {}).get("run_s", 0.0) / len(owner.get("per_chip", [None]))
        busy = running / max(owner.get("wall_s", wall) - row["warm_after_s"], 1e-9)
        if busy >= 0.8:
            return f"chip ({busy:.0%} busy)"
    return f"host ({workers} worker{'s' if workers > 1 else ''})"


def print_row(row: dict, cache: str, workers: int) -> None:
    lead = f"| {row['target']} | {row['property']} | {row['workers']} | {cache} |"
    if "error" in row:
        print(f"{lead} {row['error']} |")
        return
    examples_per_minute, cases_per_minute = row["steady"]
    steady = "" if row["window_s"] >= STEADY_SECONDS else " (short)"
    owner = row["owner"]
    if owner and owner.get("calls"):
        seconds, calls = owner.get("seconds", {}), owner["calls"]
        owner_cells = (
            f"{calls:,} | {owner.get('signatures', 0)} ({owner.get('compiled_ahead', 0)} ahead) | "
            f"{seconds.get('compile_ahead_s', 0.0) + seconds.get('compile_in_call_s', 0.0):.1f} | "
            f"{1e3 * seconds.get('run_s', 0.0) / calls:.1f} | {owner.get('busy_fraction', 0.0):.0%}"
        )
    else:
        owner_cells = f"- | - | {row['compile_s']:.1f} | - | -"
    per_case = " / ".join(f"{row['per_case_ms'][name]:.1f}" for name in CASE_SECONDS)
    print(
        f"{lead} {row['examples']:,} | {row['before_first_s']:.0f} | {row['warm_after_s']:.0f} | "
        f"{row['window_s']:.0f}{steady} | {examples_per_minute:,.0f} | {cases_per_minute:,.0f} | {owner_cells} | "
        f"{per_case} | {bound(row, workers)} | {row['failures']} | {row['largest_ratio']:.3g} |"
    )


def add_arguments(parser, step: str) -> None:
    add_target_option(parser, DEFAULT_TARGETS, "module whose property is run")
    parser.add_argument(
        "--backend", default=device.TPU, choices=device.BACKENDS,
        help="where the kernels run (default tpu; an interpreter measures the interpreters)",
    )  # fmt: skip
    parser.add_argument(
        "--tpu-generation",
        help="the interpreters' emulated generation(s), as --rpa-tpu-generation (default: the target's)",
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
    parser.add_argument(
        "--seconds", type=float, default=180.0,
        help="seconds a row runs after its first example (default 180: a steady window after the warm-up)",
    )  # fmt: skip
    parser.add_argument(
        "--max-seconds", type=float, default=600.0, help="wall seconds a row runs at most (default 600)"
    )
    parser.add_argument("--cache", default="cold,warm", help="cold, warm, off, or a comma-separated sequence")
    parser.add_argument(
        "--cache-dir", help="the compilation caches' parent folder (default: a temporary one)"
    )
    parser.add_argument(
        "--repro-dir", help="where failing examples leave repros (default: a temporary folder)"
    )


def main(args) -> int:
    unknown = sorted(set(args.properties.split(",")) - set(PROPERTIES))
    if unknown:
        raise ChipUsageError(f"--properties: {', '.join(unknown)} is not one of {', '.join(PROPERTIES)}")
    try:
        worker_counts = [int(count) for count in args.workers.split(",")]
    except ValueError:
        worker_counts = []
    if not worker_counts or min(worker_counts) < 1:
        raise ChipUsageError(f"--workers={args.workers}: give worker counts of 1 or more, comma-separated")
    if args.backend == device.TPU and args.tpu_generation:
        raise ChipUsageError(f"--tpu-generation={args.tpu_generation} with a TPU: the chip is what it is")
    backend_of(argparse.Namespace(backend=args.backend, tpu_generation="none"))
    loaded, not_run = loaded_targets(args.target or DEFAULT_TARGETS)
    for reason in not_run.values():
        print(f"not run here: {reason}")
    parent = Path(args.cache_dir or tempfile.mkdtemp(prefix="rpa-bench-cache-"))
    repro_dir = Path(args.repro_dir or tempfile.mkdtemp(prefix="rpa-bench-repros-"))
    print(f"backend {args.backend}; {args.seconds:.0f} s a row; repros in {repro_dir}")
    print(
        "| target | property | workers | cache | examples | s to the first | s to warm | steady s | "
        "examples/min steady | cases/min steady | owner's calls | signatures | compile s | ms a call "
        "running | chip busy | ms a case: arrays / repro / call / oracle / judge | bound | failures "
        "| largest error/bound |"
    )
    print("|" + " --- |" * 19)
    for target in (loaded_target.name for loaded_target in loaded):
        for prop in args.properties.split(","):
            for workers in worker_counts:
                folder = parent / f"{target}-{prop}"
                for cache in args.cache.split(","):
                    if cache == "cold":
                        shutil.rmtree(folder, ignore_errors=True)
                    row = run_row(args, target, prop, workers, None if cache == "off" else folder, repro_dir)
                    print_row(row, cache, workers)
                    sys.stdout.flush()
    return 0
