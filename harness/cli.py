"""``rpa-harness``: replay a repro without Hypothesis, or run the property campaign with a summary.

rpa-harness replay FILE [--target MODULE] [--backend NAME]
    exit 0: the property holds now; 1: it still fails; 2: the file is missing or malformed.
rpa-harness run [--profile ci] [--target MODULE] [--backend auto] [-n 2] [--repro-dir DIR] [-- PYTEST ARGS]
    runs pytest on the properties and ends with a table: property, examples, result, repros, coverage,
    and the declared known issues (cases avoided, whether each still reproduces).
rpa-harness report FILE [--target MODULE] [--backend NAME] [--run-script]
    prints an upstream-ready bug report (Markdown) for a differential repro; exit 2 for a bad file.
"""

import argparse
import collections
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree
from pathlib import Path

from harness import repro as repro_files
from harness import runlog
from harness.backends import AUTO, BACKENDS, Backend
from harness.targets import DEFAULT_TARGET, TargetError, load

REPO_ROOT = Path(__file__).resolve().parent.parent
PROPERTY_TESTS = (
    "tests/test_differential.py",
    "tests/test_validation.py",
    "tests/test_padding.py",
    "tests/test_lowering.py",
    "tests/test_known_issues.py",
)


def snippet(repro: repro_files.Repro, json_path: Path, target: str, backend: str) -> str:
    """A standalone Python program that reproduces the failing call."""
    npz = json_path.with_suffix(".npz").resolve()
    dtypes = {name: str(value.dtype) for name, value in repro.arrays.items()}
    if backend == "tpu":
        context = "contextlib.nullcontext()"
    elif backend == "interpret":
        context = "pltpu.force_tpu_interpret_mode(pltpu.InterpretParams(detect_races=True))"
    else:
        context = "pltpu.force_tpu_interpret_mode(True)"
    if repro.expected_error is not None and repro.stage == "dynamic":
        call = "target.dynamic_validate_inputs(**arrays, **options)"
        expect = f"# expected: ValueError: {repro.expected_error}"
    else:
        call = "out = target.ragged_paged_attention(**arrays, **options)"
        expect = f"# expected: ValueError: {repro.expected_error}" if repro.expected_error else ""
    return "\n".join(
        line
        for line in [
            "import contextlib, importlib",
            "import jax.numpy as jnp, ml_dtypes, numpy as np",
            "from jax.experimental.pallas import tpu as pltpu",
            f"target = importlib.import_module({target!r})",
            f"stored = np.load({str(npz)!r})",
            f"dtypes = {dtypes!r}",
            "arrays = {k: jnp.asarray(stored[k].view(np.dtype(getattr(ml_dtypes, d, d))).reshape(stored[k].shape))",
            "          for k, d in dtypes.items()}",
            f"options = {repro.options!r}",
            f"with {context}:",
            f"    {call}",
            expect,
        ]
        if line
    )


def replay(args) -> int:
    path = Path(args.file)
    try:
        repro = repro_files.read(path)
    except repro_files.ReproError as error:
        print(f"rpa-harness replay: {error}", file=sys.stderr)
        return 2
    target_name = args.target or repro.target
    backend = Backend(args.backend or repro.backend)
    try:
        target = load(target_name)
    except TargetError as error:
        print(f"rpa-harness replay: {error}", file=sys.stderr)
        return 2
    if backend.skip_reason:
        print(f"rpa-harness replay: {backend.skip_reason}; pass --backend interpret", file=sys.stderr)
        return 2
    from harness.properties import recheck

    kind = repro.property.split("[", 1)[0]
    print(f"property: {repro.property}\ntarget:   {target_name}\nbackend:  {backend.name}")
    if repro.case is not None:
        print(f"case:     {repro.case.describe()}")
    try:
        recheck(kind, target, backend, repro)
    except AssertionError as failure:
        print(
            f"\nFAILS:\n{failure}\n\nStandalone reproduction:\n{snippet(repro, path, target_name, backend.name)}"
        )
        return 1
    print("\npasses now")
    return 0


def run(args) -> int:
    with tempfile.TemporaryDirectory(prefix="rpa-run-") as scratch:
        junit = Path(scratch) / "junit.xml"
        env = dict(os.environ, RPA_RUN_LOG=scratch)
        command = [
            sys.executable, "-m", "pytest", *PROPERTY_TESTS, f"--rootdir={REPO_ROOT}",
            f"--hypothesis-profile={args.profile}", f"--rpa-target={args.target}", f"--rpa-backend={args.backend}",
            f"--rpa-repro-dir={args.repro_dir}", f"--junitxml={junit}", "-q",
        ]  # fmt: skip
        if args.n and args.n > 1:
            command += ["-n", str(args.n)]
        command += args.pytest_args
        print("+", " ".join(command), flush=True)
        code = subprocess.call(command, cwd=REPO_ROOT, env=env)
        print(summary(junit, runlog.read(scratch)))
        print(known_issues_summary(runlog.read_events(scratch)))
    return code


def summary(junit: Path, examples: list[dict]) -> str:
    """The closing table: one row per property test."""
    results = {}
    if junit.exists():
        for case in ElementTree.parse(junit).iter("testcase"):
            test = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
            outcome = "passed"
            for child in case:
                if child.tag in ("failure", "error"):
                    outcome = "FAILED"
                elif child.tag == "skipped":
                    outcome = f"skipped: {child.get('message', '')[:70]}"
            results[test] = outcome
    counts = collections.Counter(e["test"] for e in examples)
    repros = collections.defaultdict(set)
    labels = collections.Counter()
    for e in examples:
        if e.get("repro"):
            repros[e["test"]].add(e["repro"])
        labels.update(e.get("labels", []))
    width = max([len(t) for t in results] + [8])
    lines = ["", "rpa-harness summary", f"{'property':<{width}}  {'examples':>8}  result"]
    for test, outcome in results.items():
        lines.append(f"{test:<{width}}  {counts.get(test, 0):>8}  {outcome}")
        lines.extend(f"{'':<{width}}  {'':>8}  repro: {path}" for path in sorted(repros.get(test, ())))
    lines.append(
        f"coverage labels seen ({len(labels)}): " + ", ".join(f"{k} x{v}" for k, v in sorted(labels.items()))
    )
    return "\n".join(lines)


def known_issues_summary(events: list[dict]) -> str:
    """Rows for the declared known issues: drawn cases moved out of each, and whether its repro still fails."""
    replays = collections.defaultdict(list)
    avoided = collections.Counter()
    for e in events:
        if e.get("kind") == "known-issue-replay":
            replays[e["issue"]].append(f"{e['backend']}: {e['outcome']}")
        elif e.get("kind") == "known-issue-avoided":
            avoided[e["issue"]] += 1
    names = list(replays) + [name for name in avoided if name not in replays]
    if not names:
        return "known issues: none declared (or none replayed)"
    width = max(len(name) for name in names)
    lines = [
        f"known issues declared ({len(names)}): drawn cases moved out of each, and the replay of its repro",
        f"{'issue':<{width}}  {'avoided':>7}  replay",
    ]
    lines += [
        f"{n:<{width}}  {avoided.get(n, 0):>7}  {', '.join(sorted(replays.get(n, ['not run'])))}"
        for n in names
    ]
    return "\n".join(lines)


def report(args) -> int:
    from harness.bug_report import render

    try:
        print(render(Path(args.file), target_name=args.target, backend_name=args.backend,
                     with_script_output=args.run_script), end="")  # fmt: skip
    except (repro_files.ReproError, TargetError) as error:
        print(f"rpa-harness report: {error}", file=sys.stderr)
        return 2
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="rpa-harness", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    replay_parser = commands.add_parser("replay", help="replay a repro file without Hypothesis")
    replay_parser.add_argument("file")
    replay_parser.add_argument("--target", help="module to replay against (default: the one in the repro)")
    replay_parser.add_argument("--backend", choices=BACKENDS, help="default: the one in the repro")
    run_parser = commands.add_parser("run", help="run the property campaign (pytest) and print a summary")
    run_parser.add_argument("--profile", default="ci", choices=("dev", "ci", "nightly", "repro"))
    run_parser.add_argument("--target", default=DEFAULT_TARGET)
    run_parser.add_argument("--backend", default=AUTO, choices=(*BACKENDS, AUTO))
    run_parser.add_argument("-n", type=int, default=2, help="pytest-xdist workers (default 2)")
    run_parser.add_argument("--repro-dir", default=repro_files.DEFAULT_REPRO_DIR)
    run_parser.add_argument("pytest_args", nargs="*", help="passed to pytest after --")
    report_parser = commands.add_parser("report", help="print an upstream-ready bug report for a repro")
    report_parser.add_argument("file")
    report_parser.add_argument("--target", help="module to report on (default: the one in the repro)")
    report_parser.add_argument("--backend", choices=BACKENDS, help="default: the one in the repro")
    report_parser.add_argument("--run-script", action="store_true", help="run the script, show its output")
    args = parser.parse_args(argv)
    return {"replay": replay, "run": run, "report": report}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
