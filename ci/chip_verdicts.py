"""The verdict of every declared finding of the shipped targets on one chip, as a table for docs/measurements.md.

    python3 ci/chip_verdicts.py [--target T]... [--backend tpu] [--markdown FILE]

On a TPU (``--backend tpu``, the default) it says what each finding's repro does on this chip; on a CPU host,
``--backend fast-interpret --tpu-generation v5e`` says what the interpreters emulating that chip predict (the
repros recorded for another generation then replay under theirs, as they do in CI).

Per target, the known-issue property (``tests/properties/test_known_issues.py``) replays the target's
declared findings in one pytest process holding the chip, with the harness's own rules: the repro recorded
for the chip's generation or for none, a finding outside the chip's generations not applying, a chip-only
refusal masked by the finding that predicts it. A finding whose repro halts the chip or hangs is replayed
on the chip with ``rpa-harness replay`` in processes of its own (either would end the process that holds
the chip). One row per
finding: its target, its generations (the chips whose code has it), and the verdict:

- ``reproduces``: the repro fails with the finding's symptom (``halts the chip``, ``hangs`` for those);
- ``FIXED: does not reproduce``: it passes where the finding says it shows;
- ``does not apply to G`` / ``recorded for G', not replayed on G``: the chip cannot show it (its code);
- ``masked by NAME``, ``fails differently``, ``not run ...``: as the known-issue property says.

Exit 0 when no finding is FIXED or fails differently, 1 otherwise, 4 on a usage error.
"""

import argparse
import datetime
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

from rpa_harness import device, generations, lowering, runlog, targets
from rpa_harness import repro as repro_files
from rpa_harness.cli import FAILS, PASSES

KNOWN_ISSUE_PROPERTY = "test_known_issue_still_reproduces"
UNTOLD_OUTCOMES = ("FIXED", "fails differently", "fails where it cannot show")
SECONDS_PER_TARGET = 540


def declared_findings(target_name: str):
    """The target's declared known issues, or the reason it cannot be loaded on this jax."""
    try:
        return targets.load(target_name).known_issues, ""
    except targets.TargetError as error:
        return (), str(error).splitlines()[0]


def replay_the_property(target_name: str, backend: str, tpu_generation: str, log: Path) -> dict[str, str]:
    """The known-issue property's outcome per finding of one target, from the run log of its pytest."""
    command = [
        sys.executable, "-m", "pytest", "--pyargs", "rpa_harness.properties", "-p", "no:cacheprovider", "-q",
        "--hypothesis-profile=dev", f"--rpa-target={target_name}", f"--rpa-backend={backend}",
        f"--rpa-repro-dir={log / 'repros'}", "-k", KNOWN_ISSUE_PROPERTY, "-p", "no:xdist",
    ]  # fmt: skip
    if tpu_generation:
        command.append(f"{generations.OPTION}={tpu_generation}")
    env = dict(os.environ, **{runlog.ENV: str(log)})
    try:
        subprocess.run(command, env=env, timeout=SECONDS_PER_TARGET, stdout=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        pass  # the findings replayed before it still have their outcome
    outcomes: dict[str, list[str]] = {}
    for event in runlog.read_events(log):
        if event.get("kind") == "known-issue-replay":
            outcomes.setdefault(event["issue"], []).append(f"{event['outcome']} ({event['backend']})")
    return {name: "; ".join(sorted(set(seen))) for name, seen in outcomes.items()}


def replay_apart(repro: Path, target_name: str) -> str:
    """A repro that halts the chip or hangs, replayed on the chip in processes of its own (a halt's alone,
    then after its predecessors), where the property does not replay it."""
    done = subprocess.run(
        [sys.executable, "-m", "rpa_harness.cli", "replay", str(repro), "--target", target_name,
         "--backend", device.TPU, "--timeout", "120"],
        capture_output=True,
        text=True,
        timeout=SECONDS_PER_TARGET,
    )  # fmt: skip
    ends = "halts the chip" if repro_files.read(repro).halt else "hangs"
    if done.returncode == FAILS:
        return f"reproduces: {ends}"
    if done.returncode == PASSES:
        return f"FIXED: does not reproduce (recorded: {ends}; on this chip it returned)"
    last = (done.stderr.strip().splitlines() or done.stdout.strip().splitlines() or ["no output"])[-1]
    return f"not run: its replay exited {done.returncode} ({last[:160]})"


def verdict(outcome: str) -> str:
    """The known-issue property's outcome in the table's words."""
    if outcome.startswith("reproduces"):
        return outcome
    if outcome.startswith("FIXED"):
        return outcome.replace("FIXED", "FIXED: does not reproduce", 1)
    return outcome or "no outcome: the property recorded none (it errored, or its run ended before it)"


def chip_line(backend: str, tpu_generation: str, chip: str) -> str:
    import jax

    if backend == device.TPU:
        where = f"{device.tpus().kind} ({chip})"
    else:
        where = f"{backend} emulating {tpu_generation or 'no generation'} on a {platform.machine()} CPU"
    try:
        from importlib.metadata import version

        inference = f", tpu-inference {version('tpu-inference')}"
    except Exception:
        inference = ""
    return (
        f"{datetime.date.today().isoformat()}, {where}, jax {jax.__version__}, Python {platform.python_version()}"
        f"{inference}; `python3 ci/chip_verdicts.py --backend {backend}"
        f"{f' --tpu-generation {tpu_generation}' if tpu_generation else ''}`"
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", action="append", help="a shipped target (repeatable; default: every one)")
    parser.add_argument("--backend", default=device.TPU, choices=device.BACKENDS)
    parser.add_argument("--tpu-generation", default="", help="the generation an interpreter emulates")
    parser.add_argument("--markdown", help="also write the table to this file")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit:
        return 4 if exit.code else 0
    shipped = [s.name for s in targets.SHIPPED]
    unknown = [name for name in args.target or () if name not in shipped]
    if unknown:
        print(f"chip_verdicts: not shipped targets: {', '.join(unknown)}; choose among {', '.join(shipped)}")
        return 4
    if args.backend == device.TPU and args.tpu_generation:
        print("chip_verdicts: --tpu-generation is for an interpreter; a chip is the generation it is")
        return 4
    device.keep_off_the_chips()  # the pytest and replay processes hold the chip, one at a time
    chip = ""
    if args.backend == device.TPU:
        if not device.tpus():
            print("chip_verdicts: no TPU is visible to jax here; on a CPU host pass --backend fast-interpret")
            return 4
        chip = lowering.generation_of_device_kind(device.tpus().kind.split(", ")[0]) or ""
    rows = [
        "| target | finding | generations | verdict |",
        "|---|---|---|---|",
    ]
    untold = 0
    for target_name in args.target or shipped:
        findings, cannot = declared_findings(target_name)
        if cannot:
            rows.append(f"| {target_name} | (not loaded) | | {cannot} |")
            continue
        if not findings:
            continue
        with tempfile.TemporaryDirectory(prefix="rpa-verdicts-") as log:
            outcomes = replay_the_property(target_name, args.backend, args.tpu_generation, Path(log))
        for finding in findings:
            outcome = verdict(outcomes.get(finding.name, ""))
            if chip:  # the property does not replay a halt or a hang in the process that holds the chip
                path, _ = finding.repro_on_chip(chip)
                if path is not None and (repro_files.read(path).halt or repro_files.read(path).hang):
                    outcome = replay_apart(path, target_name)
            untold += any(word in outcome for word in UNTOLD_OUTCOMES)
            where = ", ".join(finding.generations) or "all"
            rows.append(f"| {target_name} | {finding.name} | {where} | {outcome} |")
            print(rows[-1], flush=True)
    table = "\n".join([chip_line(args.backend, args.tpu_generation, chip), "", *rows])
    print(f"\n{table}")
    if args.markdown:
        Path(args.markdown).write_text(table + "\n")
    return 1 if untold else 0


if __name__ == "__main__":
    sys.exit(main())
