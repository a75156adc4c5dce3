"""``rpa-harness chip verdicts``: the verdict of every declared finding of the targets named on one chip, as
a table (the rows docs/measurements.md and each finding's doc take).

On a TPU (``--backend tpu``, the default) it says what each finding's repro does on this chip; on a CPU
host, ``--backend fast-interpret --tpu-generation v5e`` predicts what a v5e says: the known-issue property
(``--rpa-predict-chip``) replays the repro a v5e replays, under the v5e's emulation, compiled first for the
v5e where libtpu is installed (a refusal another finding predicts masks it, as on the chip), and a halt's
repro on the checking interpreter, whose exit check is what halts a chip. ``--compare CHIP_TABLE.md``
(repeatable) compares the rows with a chip's table of the same targets and findings by verdict (the words
before the trailing backend), printing each disagreement; a row the chip did not judge (recorded for another
generation, not run) is not compared.

Per target, the known-issue property (``rpa_harness.properties``' ``test_known_issues``) replays the
target's declared findings in one pytest process holding the chip, with the harness's own rules: the repro
recorded for the chip's generation or for none, a finding outside the chip's generations not applying, a
chip-only refusal masked by the finding that predicts it. A finding whose repro halts the chip or hangs is
replayed on the chip with ``rpa-harness replay`` in processes of its own (either would end the process that
holds the chip). One row per finding: its target, its generations (the chips whose code has it), and the
verdict:

- ``reproduces``: the repro fails with the finding's symptom (``halts the chip``, ``hangs`` for those);
- ``FIXED: does not reproduce``: it passes where the finding says it shows;
- ``does not apply to G`` / ``recorded for G', not replayed on G``: the chip cannot show it (its code);
- ``masked by NAME``, ``fails differently``, ``not run ...``: as the known-issue property says.

Exit 0 when no finding is FIXED or fails differently and every compared row agrees, 1 otherwise, 4 on a
usage error.
"""

import datetime
import platform
import re
import tempfile
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from rpa_harness import device, generations, lowering, runlog, targets
from rpa_harness import repro as repro_files
from rpa_harness.chip import (
    ChipUsageError,
    add_backend_options,
    add_target_option,
    backend_of,
    child_environment,
    loaded_targets,
)
from rpa_harness.device import processes
from rpa_harness.known_issues import PREDICT_CHIP_OPTION

KNOWN_ISSUE_PROPERTY = "test_known_issue_still_reproduces"
UNTOLD_OUTCOMES = ("FIXED", "fails differently", "fails where it cannot show")
SECONDS_PER_TARGET = 540
REPLAY_TIMEOUT_SECONDS = 120  # a replayed hang's call: past this it still hangs
# rpa-harness replay's exit statuses: the property holds now, it still fails the same way.
REPLAY_PASSES, REPLAY_FAILS = 0, 1
# A verdict's trailing backend, which a prediction and the chip name differently (``tpu-compiler-v5e``).
BACKEND_NAMES = "|".join(map(re.escape, (device.TPU_COMPILER, *device.BACKENDS)))
TRAILING_BACKEND = re.compile(rf" \((?:{BACKEND_NAMES})(?:-[\w.]+)?\)$")
# The verdicts of a row the chip did not judge: its repro was recorded for another generation, or not run.
NOT_JUDGED = ("recorded for ", "not run")


def add_arguments(parser, step: str) -> None:
    add_target_option(parser, ["every shipped target"], "module whose declared findings are replayed")
    add_backend_options(parser)
    parser.add_argument("--markdown", help="also write the table to this file")
    parser.add_argument(
        "--compare", action="append", default=[], metavar="CHIP_TABLE.md",
        help="a chip's verdicts table (repeat for several): each of its judged rows of this run's targets "
        "and findings must have the same verdict here (exit 1 where one differs)",
    )  # fmt: skip


def replay_the_property(target: targets.Target, backend: device.Backend, log: Path) -> dict[str, str]:
    """The known-issue property's outcome per finding of one target, from the run log of its pytest."""
    command = processes.python(
        "-m", "pytest", "--pyargs", "rpa_harness.properties", "-p", "no:cacheprovider", "-q",
        "--hypothesis-profile=dev", f"--rpa-target={target.name}", f"--rpa-backend={backend.name}",
        f"--rpa-repro-dir={log / 'repros'}", "-k", KNOWN_ISSUE_PROPERTY, "-p", "no:xdist",
        *([f"{generations.OPTION}={backend.generation}"] if backend.generation != generations.NONE else []),
        *([PREDICT_CHIP_OPTION] if backend.name != device.TPU and backend.generation != generations.NONE else []),
    )  # fmt: skip
    # Past its time the run is ended: the findings replayed before it still have their outcome.
    processes.run(
        command, timeout=SECONDS_PER_TARGET, env=child_environment(**{runlog.ENV: str(log)}),
        output=processes.DISCARD,
    )  # fmt: skip
    outcomes: dict[str, list[str]] = {}
    for event in runlog.read_events(log):
        if event.get("kind") == "known-issue-replay":
            outcomes.setdefault(event["issue"], []).append(f"{event['outcome']} ({event['backend']})")
    return {name: "; ".join(sorted(set(seen))) for name, seen in outcomes.items()}


def replay_apart(repro: Path, target: targets.Target) -> str:
    """A repro that halts the chip or hangs, replayed on the chip in processes of its own (a halt's alone,
    then after its predecessors), where the property does not replay it."""
    done = processes.run(
        processes.python("-m", "rpa_harness.cli", "replay", str(repro), "--target", target.name,
                         "--backend", device.TPU, "--timeout", str(REPLAY_TIMEOUT_SECONDS)),
        timeout=SECONDS_PER_TARGET, env=child_environment(),
    )  # fmt: skip
    ends = "halts the chip" if repro_files.read(repro).halt else "hangs"
    if done.returncode == REPLAY_FAILS:
        return f"reproduces: {ends}"
    if done.returncode == REPLAY_PASSES:
        return f"FIXED: does not reproduce (recorded: {ends}; on this chip it returned)"
    if done.timed_out:
        return f"not run: its replay did not end within {SECONDS_PER_TARGET} s"
    last = (done.stderr.strip().splitlines() or done.stdout.strip().splitlines() or ["no output"])[-1]
    return f"not run: its replay exited {done.returncode} ({last[:160]})"


def verdict(outcome: str) -> str:
    """The known-issue property's outcome in the table's words."""
    if outcome.startswith("reproduces"):
        return outcome
    if outcome.startswith("FIXED"):
        return outcome.replace("FIXED", "FIXED: does not reproduce", 1)
    return outcome or "no outcome: the property recorded none (it errored, or its run ended before it)"


def verdict_class(verdict: str) -> str:
    """A verdict without its trailing backend: ``reproduces (tpu)`` and ``reproduces (fast-interpret-v5e)``
    are both ``reproduces``."""
    return TRAILING_BACKEND.sub("", verdict.strip())


def table_rows(markdown: str) -> dict[tuple[str, str], str]:
    """A verdicts table's verdict per (target, finding), its header and unloaded targets left out."""
    rows = {}
    for line in markdown.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) >= 4 and cells[0] not in ("target", "---"):
            if cells[1] != "(not loaded)":
                rows[cells[0], cells[1]] = "|".join(cells[3:])
    return rows


def read_chip_tables(paths: list[str]) -> dict[tuple[str, str], tuple[str, str]]:
    """The chip's verdict and its table's path per (target, finding), from every table named; a table that
    cannot be read or holds no row is a usage error."""
    chip_rows = {}
    for path in paths:
        try:
            rows = table_rows(Path(path).read_text())
        except OSError as error:
            raise ChipUsageError(f"--compare {path}: {error.strerror or error}") from None
        if not rows:
            raise ChipUsageError(f"--compare {path}: no row of a verdicts table (| target | finding | ... |)")
        chip_rows.update({key: (verdict, path) for key, verdict in rows.items()})
    return chip_rows


def disagreements(rows: dict[tuple[str, str], str], chip_rows: dict) -> tuple[int, list[str]]:
    """How many rows both tables judge, and a line per row whose verdicts differ."""
    compared, differing = 0, []
    for key, (chip_verdict, path) in chip_rows.items():
        if key not in rows or chip_verdict.startswith(NOT_JUDGED):
            continue
        compared += 1
        if verdict_class(rows[key]) != verdict_class(chip_verdict):
            differing.append(f"{key[0]} {key[1]}: here {rows[key]}; the chip ({path}) {chip_verdict}")
    return compared, differing


def chip_line(backend: device.Backend, chip: str) -> str:
    """The table's first line: when, on what, with which versions, and the command that made it."""
    import jax

    if backend.name == device.TPU:
        where = f"{device.tpus().kind} ({chip})"
    else:
        where = f"{backend.name} emulating {backend.generation} on a {platform.machine()} CPU"
    try:
        inference = f", tpu-inference {version('tpu-inference')}"
    except PackageNotFoundError:
        inference = ""
    emulating = f" --tpu-generation {backend.generation}" if backend.generation != generations.NONE else ""
    return (
        f"{datetime.date.today().isoformat()}, {where}, jax {jax.__version__}, Python {platform.python_version()}"
        f"{inference}; `rpa-harness chip verdicts --backend {backend.name}{emulating}`"
    )


def main(args) -> int:
    backend = backend_of(args)
    chip_rows = read_chip_tables(args.compare)
    loaded, not_run = loaded_targets(args.target or [shipped.name for shipped in targets.SHIPPED])
    chip = ""
    if backend.name == device.TPU:
        chip = lowering.generation_of_device_kind(device.tpus().kind.split(", ")[0]) or ""
    rows = [
        "| target | finding | generations | verdict |",
        "|---|---|---|---|",
        *(f"| {name} | (not loaded) | | {reason} |" for name, reason in not_run.items()),
    ]
    untold, verdicts = 0, {}
    for target in loaded:
        if not target.known_issues:
            continue
        with tempfile.TemporaryDirectory(prefix="rpa-verdicts-") as log:
            outcomes = replay_the_property(target, backend, Path(log))
        for finding in target.known_issues:
            outcome = verdict(outcomes.get(finding.name, ""))
            if chip:  # the property does not replay a halt or a hang in the process that holds the chip
                path, _ = finding.repro_on_chip(chip)
                if path is not None and (repro_files.read(path).halt or repro_files.read(path).hang):
                    outcome = replay_apart(path, target)
            untold += any(word in outcome for word in UNTOLD_OUTCOMES)
            where = ", ".join(finding.generations) or "all"
            rows.append(f"| {target.name} | {finding.name} | {where} | {outcome} |")
            verdicts[target.name, finding.name] = outcome
            print(rows[-1], flush=True)
    table = "\n".join([chip_line(backend, chip), "", *rows])
    print(f"\n{table}")
    if args.markdown:
        Path(args.markdown).write_text(table + "\n")
    differing: list[str] = []
    if args.compare:
        compared, differing = disagreements(verdicts, chip_rows)
        print(f"\nagreement with {', '.join(args.compare)}: {compared - len(differing)} of {compared} rows")
        for line in differing:
            print(f"  differs: {line}")
    return 1 if untold or differing else 0
