"""``rpa-harness``: replay a repro without Hypothesis, or run the property campaign with a summary.

rpa-harness replay FILE [--target MODULE] [--backend NAME] [--tpu-generation NAME] [--interpreter-compat on|off]
                        [--timeout S] [--script OUT.py] [--predecessors auto|skip|first]
    exit 0: the property holds now; 1: it still fails the same way (a wrong output, the same exception as
    recorded, a hang that still hangs, a halt that still halts the device, alone or after the examples its
    process ran before it, a deadlock the TPU interpreter finds); 2: the file is missing or
    malformed; 3: it cannot run here (a
    recognised interpreter limitation, a backend that is absent or not declared, or an error other than
    the recorded one).
rpa-harness run [--profile ci] [--target MODULE]... [--backend auto] [-n 2] [--repro-dir DIR] [--junit FILE]
                [--buckets NAME,...] [--tpu-generation NAME,...] [-- PYTEST ARGS]
    runs pytest on the properties and ends with a table: property, examples, result, repros, coverage,
    and the declared known issues (cases avoided, whether each still reproduces). Several --target run in
    one pytest session (one start-up, one set of workers, one chip owner), each property once per target.
rpa-harness report FILE [--target MODULE] [--backend NAME] [--run-script]
    prints an upstream-ready bug report (Markdown) for a differential repro or any tpu-inference v3 repro;
    exit 2 for a bad file, 3 when the repro does not reproduce here (nothing to report).
rpa-harness chip STEP [--target MODULE]... [--backend tpu] [options]
    one step of a session on a TPU for any targets (rpa_harness.chip): smoke, calibrate, verdicts,
    agreement, throughput, speed, q-len-zero.
A usage error (an unknown option, or a bad value given on the command line) is one line and exit 4.
"""

import argparse
import collections
import os
import re
import shlex
import shutil
import signal
import sys
import tempfile
import textwrap
import threading
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

from rpa_harness import __version__, bench, chip, device, generations, progress, runlog
from rpa_harness import repro as repro_files
from rpa_harness.device import AUTO, BACKENDS, Backend
from rpa_harness.run_settings import CLI_TERMS_ENV, RunSettings, SettingError, for_repro, in_cli_terms
from rpa_harness.snippets import snippet
from rpa_harness.targets import DEFAULT_TARGET

PROPERTIES_PACKAGE = "rpa_harness.properties"  # the shipped properties (tests/properties/ in a checkout)
PASSES, FAILS, BAD_FILE, CANNOT_RUN, USAGE = 0, 1, 2, 3, 4
# replay --predecessors: how a halt repro's preceded_by runs. auto: the suspect alone in a fresh process, then,
# where it passes, its predecessors and it in another; skip: the suspect alone; first: its predecessors, then it.
ALONE_THEN_AFTER_PREDECESSORS, WITHOUT_PREDECESSORS, PREDECESSORS_FIRST = "auto", "skip", "first"
DESCRIPTION = (
    "Replay a repro without Hypothesis, run the property campaign with a summary, report a bug, time a "
    "kernel, or run a session's steps on a TPU."
)


class UsageError(Exception):
    """A command line rpa-harness cannot act on; main() prints it as one line and exits 4."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(f"{self.prog}: {message} (see {self.prog} --help)")


def _recorded(repro: repro_files.Repro) -> str:
    if repro.in_flight:
        return "in flight when its process ended (a crash: no verdict was recorded)"
    if repro.hang:
        return f"a hang (no return within {repro.hang['seconds']:g} s)"
    if repro.halt:
        return f"a halted device ({repro.halt['error']})"
    if repro.error:
        return f"{repro.error['type']}: {repro.error['message']}"
    return (repro.failure.splitlines() or ["a failing property"])[0]


def replay(args) -> int:
    """``rpa-harness replay FILE``: the repro's case run once on its backend (or the one asked), judged as
    its property judged it; exit 0 passes, 1 fails, 2 a bad file, 3 cannot run here, 4 a usage error."""
    path = Path(args.file)
    try:
        repro = repro_files.read(path)
        run_first = repro_files.predecessors(path, repro) if args.predecessors == PREDECESSORS_FIRST else []
    except repro_files.ReproError as error:
        print(f"rpa-harness replay: {error}", file=sys.stderr)
        return BAD_FILE
    if repro.preceded_by and args.predecessors == ALONE_THEN_AFTER_PREDECESSORS:
        return _replay_alone_then_after_predecessors(args, repro)
    settings = _replay_settings(args, path, repro, run_first)
    if isinstance(settings, int):
        return settings
    run, run_first_as = settings
    target, backend = run.target, run.backends[0]
    cannot = _cannot_replay_here(target, backend, repro)
    if cannot:
        print(f"rpa-harness replay: cannot run here: {cannot}", file=sys.stderr)
        return CANNOT_RUN
    program = _standalone_program(args, path, repro, target.name, backend)
    _print_replay_header(args, repro, target, backend)
    return _run_the_replay(args, repro, target, backend, program, run_first, run_first_as)


def _replay_settings(args, path: Path, repro: repro_files.Repro, run_first: list):
    """The repro's run settings and its predecessors', each overridden by the options given; or the exit
    status of a setting that cannot be used (a usage error, or a bad file)."""
    compat = None if args.interpreter_compat is None else args.interpreter_compat == "on"
    try:
        run, *run_first_as = [
            for_repro(
                example,
                target=args.target,
                backend=args.backend,
                tpu_generation=args.tpu_generation,
                interpreter_compat=compat,
            )
            for example in (repro, *run_first)
        ]
    except SettingError as error:
        print(
            f"rpa-harness replay: {in_cli_terms(str(error)) if error.given else f'{path}: {error}'}",
            file=sys.stderr,
        )
        return USAGE if error.given else BAD_FILE
    return run, run_first_as


def _cannot_replay_here(target, backend: Backend, repro: repro_files.Repro) -> str:
    """Why the repro cannot run on ``backend`` here, or nothing: a backend this host lacks, a target that
    declares it cannot run there, or a chip of another generation than the one the repro was recorded for."""
    from rpa_harness.checks import declared_unrunnable

    if backend.skip_reason:
        instead = "" if backend.name == device.TPU_COMPILER else "; pass --backend interpret"
        return f"{backend.skip_reason}{instead}"
    declared = declared_unrunnable(target, backend)
    if declared:
        return f"target {target.name} {declared}"
    chip = backend.generation_seen if backend.name == device.TPU else generations.NONE
    if repro.tpu_generation not in (generations.NONE, chip) and chip != generations.NONE:
        return (
            f"recorded for TPU {repro.tpu_generation}, and this chip is {chip}: a kernel's code differs per "
            f"generation, so a pass here would say nothing of {repro.tpu_generation}; replay it on an "
            "interpreter emulating it (--backend fast-interpret)"
        )
    return ""


def _standalone_program(
    args, path: Path, repro: repro_files.Repro, target_name: str, backend: Backend
) -> str:
    """The standalone reproduction (written to ``--script`` when asked), its arrays on disk where the repro
    rebuilt them from its case."""
    if repro.in_flight:  # the standalone program loads the arrays from a file: the rebuilt ones
        repro.arrays_file = path.with_suffix(".npz")
        repro_files.write_arrays(repro.arrays, repro.arrays_file)
    elif repro.arrays_from_case:  # likewise, outside the repro's folder (a findings folder stays small)
        repro.arrays_file = Path(tempfile.gettempdir()) / "rpa-harness-arrays" / path.with_suffix(".npz").name
        repro.arrays_file.parent.mkdir(exist_ok=True)
        repro_files.write_arrays(repro.arrays, repro.arrays_file)
    program = snippet(repro, path, target_name, backend)
    if args.script:
        Path(args.script).write_text(program)
    return program


def _print_replay_header(args, repro: repro_files.Repro, target, backend: Backend) -> None:
    print(
        f"property: {repro.property}\ntarget:   {target.name}\nbackend:  {backend.label} "
        f"(interpreter compat {'on' if backend.interpreter_compat else 'off'})\nrecorded: {_recorded(repro)}\n"
        f"precision: {', '.join(target.precision_on(backend))}"
    )
    if repro.case is not None:
        print(f"case:     {repro.case.describe()}")
    if repro.in_flight or repro.arrays_from_case:
        print(f"arrays:   rebuilt from the case (checksum matches) into {repro.arrays_file}")
    if args.script:
        print(f"script:   {args.script}")


def _run_the_replay(args, repro, target, backend: Backend, program: str, run_first, run_first_as) -> int:
    """Runs the predecessors, then the repro, under the watchdog and the halt handler; its verdict."""
    from rpa_harness.checks import CannotRun, PropertyFailure, RaisedOnValidInput, recheck
    from rpa_harness.targets import first_line_of_error

    timeout = args.timeout or (repro.hang or {}).get("seconds") or device.endings.CALL_TIMEOUT_SECONDS
    running = [repro]  # the example whose calls run now (the halt handler names it)
    on_hang, on_halt = _replay_handlers(repro, run_first, running)
    started = time.monotonic()
    try:
        # The watchdog's timeout and the hang and halt handlers of every kernel call this replay makes.
        with device.on_hang(on_hang), device.on_halt(on_halt), device.call_timeout(timeout):
            for example, settings in zip(run_first, run_first_as, strict=True):
                running[0] = example
                _run_first(example, settings)
            running[0] = repro
            recheck(target, backend, repro)
    except CannotRun as reason:
        print(f"\ncannot run here (interpreter limitation): {reason}")
        return CANNOT_RUN
    except RaisedOnValidInput as failure:
        return _raised_verdict(repro, failure, program)
    except PropertyFailure as failure:
        note = "" if not (repro.error or repro.hang) else f"\n  (recorded: {_recorded(repro)})"
        print(f"\nFAILS:\n{failure}{note}\n\nStandalone reproduction:\n{program}")
        return FAILS
    except Exception as error:  # the oracle or the harness itself: never a reproduced bug
        print(f"\ncannot run here: the replay itself crashed: {first_line_of_error(error)}")
        return CANNOT_RUN
    _print_passes(repro, run_first, timeout, time.monotonic() - started)
    return PASSES


def _replay_handlers(repro, run_first, running: list):
    """The hang and halt handlers of a replay: (message, exit status) for what ended it, naming the example
    whose calls ran then (``running[0]``)."""

    def on_hang(what, seconds):
        if repro.hang:
            return f"rpa-harness replay: still hangs after {seconds:g} s: {what} did not return", FAILS
        return (
            f"rpa-harness replay: cannot run here: {what} did not return within {seconds:g} s "
            f"(a hang; recorded: {_recorded(repro)})",
            CANNOT_RUN,
        )

    def on_halt(what, error):
        if running[0] is not repro:
            return (
                f"rpa-harness replay: FAILS: halts the device in an example its process ran before it "
                f"({_described(running[0])}), before it ran: {what} raised {error}",
                FAILS,
            )
        if run_first:
            return (
                "rpa-harness replay: FAILS: halts the device after its predecessor(s) ran in the same process: the "
                f"fault is left by an earlier call ({'; '.join(map(_described, run_first))}): look there for work "
                f"left running on the chip after a call returns (a DMA started and never waited for); {what} "
                f"raised {error}",
                FAILS,
            )
        if repro.halt:
            return f"rpa-harness replay: FAILS: still halts the device: {what} raised {error}", FAILS
        return (
            f"rpa-harness replay: cannot run here: {what} halted the device: {error} (recorded: {_recorded(repro)})",
            CANNOT_RUN,
        )

    return on_hang, on_halt


def _raised_verdict(repro, failure, program: str) -> int:
    """The verdict of a replay whose kernel raised on valid input: the recorded error again, a deadlock the
    TPU interpreter found (the kernel's), or something this replay cannot judge."""
    raised = f"{failure.error_type}: {failure.error_message}"
    if repro.error and _same_error(repro.error, failure.error_type, failure.error_message):
        print(f"\nFAILS the same way: {failure}\n\nStandalone reproduction:\n{program}")
        return FAILS
    if failure.error_type == device.Deadlock.__name__:  # the kernel's bug, never the interpreter's
        still = "still " if repro.hang else ""
        print(
            f"\nFAILS: {still}hangs: {failure.error_message} (the TPU interpreter found a wait nothing can "
            f"signal: on a TPU the call would not return)\n\nStandalone reproduction:\n{program}"
        )
        return FAILS
    what = "a different error than recorded" if repro.error else "an interpreter or backend crash"
    print(f"\ncannot run here: {what}: raised {raised}\n  recorded: {_recorded(repro)}")
    return CANNOT_RUN


def _print_passes(repro, run_first, timeout: float, took: float) -> None:
    if repro.hang:
        returned = (
            f"returned within {timeout:g} s"
            if took <= timeout
            else f"returned after {took:.0f} s, still stepping at each {timeout:g} s: slow, not stuck"
        )
        print(f"\npasses now (recorded: {_recorded(repro)}; {returned})")
    elif repro.halt:
        after = f", its {len(run_first)} predecessor(s) run first" if run_first else ""
        print(f"\npasses now (recorded: {_recorded(repro)}; the device did not halt in this process{after})")
    elif repro.in_flight:
        print(
            "\npasses now: whatever ended the recorded process did not recur in this one (its cause is in that "
            "process's stderr: memory, a signal, the interpreter)"
        )
    else:
        print("\npasses now")


def _described(example: repro_files.Repro) -> str:
    """An example in one line: its property and its case."""
    return f"{example.property}: {example.case.describe() if example.case is not None else 'no case'}"


def _run_first(example: repro_files.Repro, settings: RunSettings) -> None:
    """Runs an example a halt's process ran before the halt, for the state it leaves on the device; its
    own verdict is shown, never this replay's."""
    from rpa_harness.checks import recheck
    from rpa_harness.targets import first_line_of_error

    try:
        recheck(settings.target, settings.backends[0], example)
        outcome = "passes"
    except Exception as error:
        outcome = f"fails: {first_line_of_error(error)}"
    print(f"ran first: {_described(example)} ({outcome})", flush=True)


def _replay_alone_then_after_predecessors(args, repro: repro_files.Repro) -> int:
    """A halt repro that names the examples its process ran before it: the suspect alone in a fresh process
    and, where it passes, its predecessors and then it in another, since a call can leave a fault on the
    chip that only a later call meets. This process runs no kernel: one process at a time holds a chip."""
    alone = _replay_in_a_child(args, WITHOUT_PREDECESSORS)
    if alone != PASSES:
        return alone
    print(
        f"\nit passes alone; now its {len(repro.preceded_by)} predecessor(s), then it, in one fresh process:",
        flush=True,
    )
    return _replay_in_a_child(args, PREDECESSORS_FIRST)


def _replay_in_a_child(args, predecessors: str) -> int:
    """``rpa-harness replay`` of the same file with the same options and ``--predecessors``, in a fresh
    process; its exit status (a signal's as a shell gives it: a libtpu abort)."""
    command = [sys.executable, "-m", "rpa_harness.cli", "replay", args.file, f"--predecessors={predecessors}"]
    for option in ("target", "backend", "interpreter_compat", "timeout", "tpu_generation", "script"):
        if (value := getattr(args, option)) is not None:
            command.append(f"--{option.replace('_', '-')}={value}")
    sys.stdout.flush()
    code = device.processes.run(command, output=device.processes.INHERIT, first=signal.SIGINT).returncode
    assert code is not None  # no time limit
    return code if code >= 0 else 128 - code


def run(args) -> int:
    """pytest on the shipped properties, from the current folder (so the user's own modules import)."""
    with tempfile.TemporaryDirectory(prefix="rpa-run-") as scratch:
        junit = Path(args.junit) if args.junit else Path(scratch) / "junit.xml"
        env = dict(os.environ, RPA_RUN_LOG=scratch, **{CLI_TERMS_ENV: "1"})
        command = pytest_command(args, junit)
        code = _call_with_progress(command, env, scratch)
        examples = runlog.read(scratch)
        ended = code in ENDED_BY_A_CALL and any(e.get("repro") for e in examples)
        if (code in PYTEST_RAN and _ran_tests(junit)) or ended:  # otherwise pytest's message is the story
            events = runlog.read_events(scratch)
            halts = replayed_halts(examples)
            print(summary(junit, examples, runlog.read_session(scratch), events, halts))
            print(known_issues_summary(events))
            print("pytest command:", shlex.join(command))
            failing = failing_targets_line(runlog.read_session(scratch))
            if failing:
                print(failing)
            if code == 1 and only_unconfirmed_halts_failed(junit, examples, halts):
                print(
                    "rpa-harness: every failure of this run is an unconfirmed halt (it passed alone and after its "
                    "predecessors in fresh processes): no finding of the kernel; exit 0"
                )
                code = 0
    return code


# A halt repro replayed after the run, in fresh processes (``rpa-harness replay``: alone, then after the
# examples its process ran before it): the verdicts, by the replay's exit status.
HALT_CONFIRMED, HALT_UNCONFIRMED = (
    "halts again when replayed",
    "UNCONFIRMED: passes alone and after its predecessors",
)
HALT_REPLAY_SECONDS = 900


def replayed_halts(examples: list[dict]) -> dict[str, str]:
    """Each halt repro of the run, by path: its verdict from a replay in fresh processes once the run has
    released the chip. A halt that passes alone and after its predecessors is a fault that did not recur
    (one left by an earlier process, or a flake), not a finding of the kernel."""
    verdicts = {}
    for path in sorted({e["repro"] for e in examples if e.get("halt") and e.get("repro")}):
        print(
            f"rpa-harness: replaying the halt {path} in fresh processes (alone, then after its predecessors)"
        )
        command = [sys.executable, "-m", "rpa_harness.cli", "replay", path]
        code = device.processes.run(command, timeout=HALT_REPLAY_SECONDS).returncode
        if code is None:
            verdicts[path] = f"not told: its replay took over {HALT_REPLAY_SECONDS} s"
            continue
        verdicts[path] = {PASSES: HALT_UNCONFIRMED, FAILS: HALT_CONFIRMED}.get(
            code, f"not told: its replay exited {code} (`{shlex.join(command[2:])}`)"
        )
    return verdicts


def only_unconfirmed_halts_failed(junit: Path, examples: list[dict], halts: dict[str, str]) -> bool:
    """Whether the run's failed tests are all tests whose every repro is an unconfirmed halt."""
    failed = {test for test, (outcome, _) in _results(junit).items() if outcome == "FAILED"}
    repros = collections.defaultdict(set)
    for e in examples:
        if e.get("repro"):
            repros[e["test"]].add(e["repro"])
    return bool(failed) and all(
        repros[test] and all(halts.get(path) == HALT_UNCONFIRMED for path in repros[test]) for test in failed
    )


def pytest_command(args, junit: Path) -> list[str]:
    """The pytest command ``rpa-harness run`` makes (short tracebacks: a failure is read from its report).
    ``-n N`` of at least 1 runs N xdist workers, so that
    a native crash of a kernel call (a segfault in a compiler) ends one worker, which pytest reports and
    replaces, never the run; ``-n 0`` runs in this one process."""
    command = [
        sys.executable, "-m", "pytest", "--pyargs", PROPERTIES_PACKAGE, "-p", "no:cacheprovider",
        f"--hypothesis-profile={args.profile}", *(f"--rpa-target={target}" for target in targets_of(args)),
        f"--rpa-backend={args.backend}", f"--rpa-repro-dir={args.repro_dir}", f"--junitxml={junit}", "-q",
        "--tb=short",  # a failure's report is its message; the frames are the harness's (`-- --tb=long`)
    ]  # fmt: skip
    if args.buckets:
        command.append(f"--rpa-buckets={args.buckets}")
    if args.tpu_generation:
        command.append(f"{generations.OPTION}={args.tpu_generation}")
    if args.n and args.n >= 1:
        command += ["-n", str(args.n)]
    return command + args.pytest_args


def targets_of(args) -> list[str]:
    """The targets ``rpa-harness run`` was given (``--target``, repeated), each once, in order."""
    return list(dict.fromkeys(args.target or [DEFAULT_TARGET]))


def _call_with_progress(command: list[str], env: dict, log_dir: str) -> int:
    """Runs pytest, passing its output through, with the run log's progress: a live line on a terminal,
    plain lines every RPA_PROGRESS_SECONDS otherwise (CI logs)."""
    process = device.processes.start(command, env=env, stdin=None, stdout=device.processes.PIPE)
    state = progress.Progress(log_dir)
    interactive = sys.stdout.isatty()
    interval = float(os.environ.get(progress.INTERVAL_ENV, progress.DEFAULT_INTERVAL_SECONDS))
    lock = threading.Lock()
    status = {"line": "", "plain_at": time.time()}
    width = shutil.get_terminal_size().columns - 1

    def redraw():
        if interactive and status["line"]:
            sys.stdout.write("\r\033[K" + status["line"][:width])
            sys.stdout.flush()

    def watch():
        while process.poll() is None:
            time.sleep(1.0)
            with lock:
                now = time.time()
                state.update()
                if interactive:
                    status["line"] = progress.live_line(state, now)
                    redraw()
                elif now - status["plain_at"] >= interval:
                    print("\n".join(progress.plain_lines(state, now, since=status["plain_at"])), flush=True)
                    status["plain_at"] = now

    watcher = threading.Thread(target=watch, name="rpa-harness progress", daemon=True)
    watcher.start()
    assert process.stdout is not None  # stdout=PIPE
    previous = ""
    try:
        for line in process.stdout:
            if line == previous == "bringing up nodes...\n":  # xdist prints its status twice when piped
                continue
            previous = line
            with lock:
                if interactive:
                    sys.stdout.write("\r\033[K")
                sys.stdout.write(line)
                redraw()
    except BaseException:  # interrupted (Ctrl-C reaches this process only): pytest, told so, ends its workers
        device.processes.end(process, first=signal.SIGINT)
        raise
    process.wait()
    watcher.join()
    if interactive:
        sys.stdout.write("\r\033[K")
    sys.stdout.flush()
    return process.returncode


# pytest's exit codes after a session that ran: all passed, some failed, none collected (or our NOT GREEN).
# 2 (interrupted), 3 (internal error) and 4 (usage error) print pytest's own message and no table.
PYTEST_RAN = (0, 1, 5)
# Without xdist workers, a hang or a halted device ends the process (and pytest: no JUnit report) after the
# call's repro is written; the summary is then built from the run log.
ENDED_BY_A_CALL = (device.HANG_EXIT_CODE, device.HALT_EXIT_CODE)


def _ran_tests(junit: Path) -> bool:
    try:
        return any(True for _ in ElementTree.parse(junit).iter("testcase"))
    except (OSError, ElementTree.ParseError):
        return False


SUMMARY_WIDTH = 120  # columns the closing table fits in; longer details wrap under their property


def _wrapped(text: str, indent: str = "    ") -> list[str]:
    return textwrap.wrap(
        text,
        SUMMARY_WIDTH,
        initial_indent=indent,
        subsequent_indent=indent + "  ",
        break_on_hyphens=False,
        break_long_words=False,
    )


def _outcome(case: ElementTree.Element) -> tuple[str, str]:
    """A JUnit test case's result and its reason (a skip's or an expected failure's)."""
    for child in case:
        if child.tag in ("failure", "error"):
            return "FAILED", ""
        if child.tag == "skipped":
            reason = child.get("message", "")
            if child.get("type") == "pytest.xfail":
                return "xfailed", reason.removeprefix("xfail: ").removeprefix("reason: ")
            return "skipped", reason.removeprefix("Skipped: ")
    return "passed", ""


def _repro_line(example: dict, halts: dict[str, str]) -> str:
    if example.get("hang"):
        return f"hang after {example['hang']:g} s: {example['repro']}"
    if example.get("halt"):
        verdict = f" ({halts[example['repro']]})" if example["repro"] in halts else ""
        return f"device halted ({example['halt']}): {example['repro']}{verdict}"
    return example["repro"]


def _results(junit: Path) -> dict[str, tuple[str, str]]:
    """Each property test of the JUnit report, by its path and name: its result and reason (``_outcome``)."""
    results = {}
    if junit.exists():
        for case in ElementTree.parse(junit).iter("testcase"):
            test = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
            results[test] = _outcome(case)
    return results


def summary(
    junit: Path,
    examples: list[dict],
    session: dict | None = None,
    events: list[dict] | None = None,
    halts: dict[str, str] | None = None,
) -> str:
    """The closing table, within ``SUMMARY_WIDTH`` columns: one row per property test in file order, each
    followed by its details (repros with a halt's replayed verdict, largest case, closeness to the bound, why
    it was skipped)."""
    results = _results(junit)
    counts = collections.Counter(e["test"] for e in examples if runlog.is_example(e))
    repros = collections.defaultdict(set)
    labels: collections.Counter[str] = collections.Counter()
    largest: dict[str, dict] = {}  # per property, its example of the largest size
    ratios = collections.defaultdict(list)
    for e in examples:
        if "max_ratio" in e and e["max_ratio"] is not None:
            ratios[e["test"]].append(e)
        if "size" in e and e["size"] >= largest.get(e["test"], {}).get("size", -1):
            largest[e["test"]] = e
        if e.get("repro"):
            repros[e["test"]].add(_repro_line(e, halts or {}))
        labels.update(e.get("labels", []))
    for e in events or ():
        if e.get("kind") == "crash":
            what = "suspect of a crash of the device" if e.get("device") else "in flight when its worker died"
            repros[e["test"]].add(f"{what}: {e['in_flight']}")
    for test in repros:  # a run a hang or halt ended without xdist: no JUnit report names the test
        if test not in results:
            results[test] = ("ENDED", "the run ended in this property's kernel call (repro above)")
    session = session or {}
    lines = ["", "rpa-harness summary"]
    for line in session.get("header", []):  # "  name: value" lines, continued further in
        indent = line[: len(line) - len(line.lstrip())]
        lines += textwrap.wrap(line, SUMMARY_WIDTH, subsequent_indent=indent + "    ", break_on_hyphens=False)
    if session.get("no_numeric"):
        lines.append(session["no_numeric"])
    several = len(session.get("targets", {})) > 1
    for each in session.get("cannot_run", []):
        which = f"target {each['target']}" if several else "target"
        lines += _wrapped(
            f"rpa-harness: {which} cannot run on {each['backend']}: {each['reason']}", indent=""
        )
    shown = {test: test.rpartition("/")[2] for test in results}  # the file's name is enough: all are ours
    width = min(max([len(name) for name in shown.values()] + [8]), SUMMARY_WIDTH - 19)
    lines.append(f"{'property':<{width}}  {'examples':>8}  result")
    for test in sorted(results, key=lambda t: t.partition("[")[::2]):
        outcome, reason = results[test]
        lines.append(f"{shown[test]:<{width}}  {counts.get(test, 0):>8}  {outcome}")
        lines += [f"    repro: {path}" for path in sorted(repros.get(test, ()))]  # never broken: copied
        details = []
        if reason:
            details.append(reason)
        if test in largest:
            details.append(f"largest case: {largest[test]['shape']}")
        if test in ratios:
            details.append(closeness_to_bound(ratios[test]))
        for detail in details:
            lines += _wrapped(detail)
    lines += _wrapped(
        f"coverage labels seen ({len(labels)}): " + ", ".join(f"{k} x{v}" for k, v in sorted(labels.items())),
        indent="",
    )
    if several:
        lines += targets_summary(session["targets"])
    return "\n".join(lines)


OUTCOMES = ("passed", "failed", "skipped", "xfailed")


def targets_summary(served: dict[str, dict]) -> list[str]:
    """A line per target of a run that served several: its tests' outcomes and, where one failed, the
    folder of its repros (``rpa-harness replay`` runs each against the target it names)."""
    lines = [f"targets ({len(served)}):"]
    for name, outcomes in served.items():
        counted = ", ".join(f"{outcomes[o]} {o}" for o in OUTCOMES if outcomes.get(o)) or "no test ran"
        failing = f"; FAILING, repros in {outcomes['repros']}" if outcomes.get("failed") else ""
        lines += _wrapped(f"{name}: {counted}{failing}")
    return lines


def failing_targets_line(session: dict) -> str | None:
    """The exit summary of a run of several targets with failures: which targets failed, and how many tests
    each; None where the run served one target or none failed."""
    served = session.get("targets", {})
    failing = {name: outcomes["failed"] for name, outcomes in served.items() if outcomes.get("failed")}
    if len(served) < 2 or not failing:
        return None
    named = ", ".join(f"{name} ({count} failed)" for name, count in failing.items())
    return f"rpa-harness: failing target(s): {named}; passing: {len(served) - len(failing)} of {len(served)}"


def closeness_to_bound(examples: list[dict]) -> str:
    """How close the property's comparisons came to the tolerance: the largest and median of each example's
    worst element's error/bound, and the dtype pair of the largest (a kernel's margin under its contract)."""
    values = sorted(e["max_ratio"] for e in examples)
    worst = max(examples, key=lambda e: e["max_ratio"])
    pair = f" (q {worst['q_dtype']}, kv {worst['kv_dtype']})" if "q_dtype" in worst else ""
    median = values[len(values) // 2]
    return f"error/bound: max {worst['max_ratio']:.3g}{pair}, median {median:.3g} of {len(values)} cases"


def known_issues_summary(events: list[dict]) -> str:
    """Rows for the declared known issues: drawn cases moved out of each, and whether its repro still fails."""
    replays = collections.defaultdict(list)
    avoided: collections.Counter[str] = collections.Counter()
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
    for n in names:
        row = f"{n:<{width}}  {avoided.get(n, 0):>7}  {', '.join(sorted(set(replays.get(n, ['not run']))))}"
        indent = " " * (width + 11)
        lines += textwrap.wrap(
            row, SUMMARY_WIDTH, subsequent_indent=indent, break_on_hyphens=False, break_long_words=False
        )
    return "\n".join(lines)


# A message-less exception's message as ``first_line_of_error`` gives it: where it was raised.
_BARE_SITE = re.compile(r"^(?P<type>\w+) \(raised at (?P<file>[^:]+):\d+ in (?P<function>[^)]+)\)$")


def _same_error(recorded: dict, error_type: str, message: str) -> bool:
    """Whether an exception is the one a repro recorded: its type and message; for an exception without a
    message (a bare assert) its file and function, not its line, which moves between releases and forks
    (upstream's kernel.py:476, RPA v2's :462); a repro that recorded such an exception without its site (an
    empty message) matches any of that type."""
    if error_type != recorded["type"]:
        return False
    if message == recorded["message"]:
        return True
    raised = _BARE_SITE.match(message)
    if raised is None:
        return False
    if recorded["message"] == "":
        return True
    then = _BARE_SITE.match(recorded["message"])
    return then is not None and (then["file"], then["function"]) == (raised["file"], raised["function"])


def report(args) -> int:
    from rpa_harness.bug_report import render
    from rpa_harness.report_sections import NothingToReport

    try:
        print(render(Path(args.file), target_name=args.target, backend_name=args.backend,
                     with_script_output=args.run_script), end="")  # fmt: skip
    except repro_files.ReproError as error:
        print(f"rpa-harness report: {error}", file=sys.stderr)
        return BAD_FILE
    except SettingError as error:
        print(
            f"rpa-harness report: {in_cli_terms(str(error)) if error.given else f'{args.file}: {error}'}",
            file=sys.stderr,
        )
        return USAGE if error.given else BAD_FILE
    except NothingToReport as error:
        print(f"rpa-harness report: {error}", file=sys.stderr)
        return CANNOT_RUN
    return PASSES


def _version() -> str:
    """The harness's release (CHANGELOG.md says what each changed), with the jax and Python it runs on."""
    import jax

    return f"rpa-harness {__version__} (jax {jax.__version__}, Python {sys.version.split()[0]})"


def parser() -> argparse.ArgumentParser:
    top = _Parser(prog="rpa-harness", description=DESCRIPTION)
    top.add_argument("--version", action="version", version=_version())
    commands = top.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_replay_parser(commands)
    _add_run_parser(commands)
    _add_report_parser(commands)
    bench.add_parser(commands)
    chip.add_parser(commands)
    return top


def _add_replay_parser(commands) -> None:
    replay_parser = commands.add_parser(
        "replay", help="replay a repro file without Hypothesis",
        description="Re-run one repro (NAME.json next to NAME.npz): exit 0 if the property holds now, 1 if it "
        "still fails the same way, 2 for a missing or malformed file, 3 if it cannot run here.",
    )  # fmt: skip
    replay_parser.add_argument("file", help="the repro's .json file (its arrays are the .npz next to it)")
    replay_parser.add_argument("--target", help="module to replay against (default: the one in the repro)")
    replay_parser.add_argument("--backend", choices=BACKENDS, help="default: the one in the repro")
    replay_parser.add_argument(
        "--interpreter-compat", choices=("on", "off"), help="default: as the repro was recorded"
    )
    replay_parser.add_argument(
        "--timeout", type=float, help="seconds before a call is taken for a hang (default: the recorded "
        "hang's timeout, else RPA_CALL_TIMEOUT)",
    )  # fmt: skip
    replay_parser.add_argument(
        "--tpu-generation",
        help="TPU generation to emulate (default: the one in the repro; none: a CPU device)",
    )
    replay_parser.add_argument("--script", help="also write the standalone reproduction to this file")
    replay_parser.add_argument(
        "--predecessors",
        choices=(ALONE_THEN_AFTER_PREDECESSORS, WITHOUT_PREDECESSORS, PREDECESSORS_FIRST),
        default=ALONE_THEN_AFTER_PREDECESSORS,
        help="for a halt repro that names the examples its process ran before it (preceded_by): auto "
        "(default) replays it alone in a fresh process and, where it passes, its predecessors then it in "
        "another; skip: it alone, in this process; first: its predecessors then it, in this process",
    )


def _add_run_parser(commands) -> None:
    run_parser = commands.add_parser(
        "run", help="run the property campaign (pytest) and print a summary",
        description="Run the shipped properties with pytest against one target, or several in one session, "
        "and end with a summary table (property, examples, result, repros, coverage, known issues) and the "
        "pytest command it ran.",
        epilog="exit codes (pytest's): 0 every property held; 1 a property failed (its repro is named); 2 "
        "interrupted; 3 internal error; 4 usage error (one line: what was wrong and what to pass); 5 no "
        "numeric property ran (NOT GREEN). Without xdist (-n 0) a hang ends the run with 70, a call too slow to "
        "judge (still stepping after four RPA_CALL_TIMEOUTs) with 71, a halted device with 72. On --backend tpu "
        "with -n 2 or more, chip owner processes, one a chip (RPA_CHIP_OWNERS), make the kernel calls the workers "
        "send them.",
    )  # fmt: skip
    run_parser.add_argument(
        "--profile", default="ci", choices=("dev", "ci", "nightly", "repro"),
        help="Hypothesis profile: dev (10 examples), ci (40, derandomized; default), nightly (400, with an "
        "example database), repro (replay the saved failures only)",
    )  # fmt: skip
    run_parser.add_argument(
        "--target", action="append", default=None,
        help="module under test: upstream's API or an adapter; repeat for several, each property then runs "
        "once per target in one session, its test ids and repro folder (DIR/MODULE) naming the target "
        f"(default {DEFAULT_TARGET}, the bundled kernel)",
    )  # fmt: skip
    run_parser.add_argument(
        "--backend", default=AUTO, choices=(*BACKENDS, AUTO),
        help="where the kernel runs; auto (default): a TPU if jax sees one, else both interpreters",
    )  # fmt: skip
    run_parser.add_argument(
        "-n",
        type=int,
        default=2,
        help="pytest-xdist workers (default 2; 0: one process, where a native crash ends the run; on --backend "
        "tpu, 2 or more feed the chip owners, one a chip (RPA_CHIP_OWNERS), 1 opens the chip itself)",
    )
    run_parser.add_argument(
        "--repro-dir", default=repro_files.DEFAULT_REPRO_DIR,
        help=f"where failing properties write their repros (default {repro_files.DEFAULT_REPRO_DIR})",
    )  # fmt: skip
    run_parser.add_argument("--junit", help="also keep pytest's JUnit XML report in this file")
    run_parser.add_argument(
        "--buckets", help="shape buckets to draw, comma-separated (--rpa-buckets; default: the profile's)"
    )
    run_parser.add_argument(
        "--tpu-generation",
        help="TPU generations to emulate, comma-separated (--rpa-tpu-generation; default: auto, the target's)",
    )
    run_parser.add_argument("pytest_args", nargs="*", help="passed to pytest after --")


def _add_report_parser(commands) -> None:
    report_parser = commands.add_parser(
        "report", help="print an upstream-ready bug report for a repro",
        description="Print a Markdown bug report for a differential repro or any tpu-inference v3 repro: the "
        "case, the wrong elements (for v3 also the returned cache, slot by slot) and a standalone script against "
        "the kernel's own reference. Exit 2 for a bad file, 3 when the repro does not reproduce here.",
    )  # fmt: skip
    report_parser.add_argument("file", help="the repro's .json file")
    report_parser.add_argument("--target", help="module to report on (default: the one in the repro)")
    report_parser.add_argument("--backend", choices=BACKENDS, help="default: the one in the repro")
    report_parser.add_argument("--run-script", action="store_true", help="run the script, show its output")


def main(argv=None) -> int:
    try:
        args = parser().parse_args(argv)
    except UsageError as error:
        print(error, file=sys.stderr)
        return USAGE
    os.environ.update(device.faster_cpu_compilation(os.environ))  # before the first computation
    if args.command in ("replay", "report", "chip"):
        import_from_the_current_folder()
    commands = {"replay": replay, "run": run, "report": report, "bench": bench.bench, "chip": chip.main}
    return commands[args.command](args)


def import_from_the_current_folder() -> None:
    """A repro names its target module as ``rpa-harness run`` imported it, from the folder it ran in (pytest
    puts that folder on the path); ``python -m`` does so too, a console script does not."""
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())


if __name__ == "__main__":
    sys.exit(main())
