"""``rpa-harness chip smoke`` and ``rpa-harness chip calibrate``: each target's property campaign
(``rpa-harness run`` on the dev profile) on the chip, the targets sharing one time budget.

- ``smoke``, the first thing to run on a fresh TPU VM: the chip and the versions, then a few examples
  (``RPA_MAX_EXAMPLES``, default 4) of every property against each target (default the bundled kernel and
  upstream's), one run a target, one worker that opens the chip (``-n 1``: a halt or a libtpu abort ends the
  worker, not the run, and the summary names the suspect);
- ``calibrate``: each target's dev profile (``RPA_MAX_EXAMPLES``, default 3), every target in one run,
  ``--workers`` feeding one chip owner, ending with its summary and a line per target: what the nightly's
  budget buys on this chip. One run pays jax's import, the chip's opening and the workers' start once.

The targets share ``--seconds``: each is given what is left divided by the targets still to run, so that a
quick one leaves its time to those after it. The smoke's run of a target cut off at its share ends without
its summary (exit 124, as ``timeout`` gives it) and with whatever it started. The calibration's run hands
the sharing to the run itself (``--rpa-seconds``, all but ``SUMMARY_RESERVE`` of ``--seconds``): a target
past its share has its remaining tests skipped, saying so, and the run goes on to the next and ends with
every target's summary; only a run still going at ``--seconds`` (a test that outlives its target's share
by more than the reserve) is cut off, exit 124. A shipped target this jax cannot load (its kernel needs
another jax, or is not installed) is named with the reason and skipped. A smoke target's output goes to
``--logs``/smoke-TARGET.log (and is printed), the calibration's to ``--logs``/calibrate-TARGETS.log (the
targets' short names joined by ``+``); the repros under ``--logs``/repros, a folder per target; a line per
run says how it ended, and for the calibration a line per target how its tests did.
"""

import os
import platform
import sys
import time
from pathlib import Path

from rpa_harness import device, generations, targets
from rpa_harness.chip import (
    ChipUsageError,
    add_backend_options,
    add_target_option,
    backend_of,
    child_environment,
    loaded_targets,
)
from rpa_harness.device import processes

CUT_OFF = 124  # a run past its time, as timeout(1) reports it
CHIP_RELEASE_SECONDS = 2.0  # the chip is released with the process that held it
KILL_GRACE_SECONDS = 10.0
# The part of the calibration's --seconds its targets' shares leave for the run's summary and for a test
# still running when its target's share ends (the run skips the tests after it, never stops one).
SUMMARY_RESERVE = 0.1
DEFAULTS = {  # step: (targets, workers, examples per property, seconds the targets share)
    "smoke": ((targets.DEFAULT_TARGET, targets.UPSTREAM_TARGET), 1, 4, 540.0),
    "calibrate": (tuple(shipped.name for shipped in targets.SHIPPED), 12, 3, 510.0),
}


def add_arguments(parser, step: str) -> None:
    names, workers, examples, seconds = DEFAULTS[step]
    parser.epilog = f"RPA_MAX_EXAMPLES: the examples of each property (default {examples})"
    add_target_option(parser, names)
    add_backend_options(parser)
    parser.add_argument(
        "--workers", type=int, default=workers,
        help=f"pytest-xdist workers of a run (default {workers}; 2 or more feed one chip owner)",
    )  # fmt: skip
    parser.add_argument(
        "--seconds", type=float, default=seconds,
        help=f"seconds the targets share (default {seconds:g}); each gets what is left over the targets to run",
    )  # fmt: skip
    parser.add_argument(
        "--logs", default="chip-logs", help="folder of the logs and repros (default chip-logs)"
    )


def harness(*args: str) -> list[str]:
    """An ``rpa-harness`` command run by this Python."""
    return processes.python("-m", "rpa_harness.cli", *args)


def chip_and_versions(backend: device.Backend) -> str:
    import hypothesis
    import jax
    import jaxlib
    import numpy

    if backend.name == device.TPU:
        tpus = device.tpus()
        where = f"TPU: {tpus.count} device(s), {tpus.kind}"
    else:
        where = f"{backend.name} emulating {backend.generation} on a CPU (a rehearsal)"
    return (
        f"{where}\npython {platform.python_version()}, jax {jax.__version__}, jaxlib {jaxlib.__version__}, "
        f"numpy {numpy.__version__}, hypothesis {hypothesis.__version__}"
    )


def run_logged(names: list[str], backend: device.Backend, args, seconds: float, repros: Path, log_path: Path,
               **environment: str) -> int:  # fmt: skip
    """``rpa-harness run`` on the dev profile for ``names``, its output in ``log_path``, ended at ``seconds``;
    its exit status (``CUT_OFF`` when it was ended), once the chip it held is free again."""
    command = harness(
        "run", "--profile", "dev", "--backend", backend.name, *(o for name in names for o in ("--target", name)),
        "-n", str(args.workers), "--repro-dir", str(repros),
        *(["--tpu-generation", backend.generation] if backend.generation != generations.NONE else []),
    )  # fmt: skip
    with open(log_path, "w") as log:
        done = processes.run(
            command, timeout=max(seconds, 1.0), env=child_environment(**environment), output=log,
            grace=KILL_GRACE_SECONDS,
        )  # fmt: skip
    if backend.name == device.TPU:
        time.sleep(CHIP_RELEASE_SECONDS)
    return CUT_OFF if done.returncode is None else done.returncode


def run_target(step: str, target: str, backend: device.Backend, args, seconds: float, logs: Path) -> int:
    """One target's campaign (the smoke's), its output in its log, ended at ``seconds``; its exit status
    (``CUT_OFF`` when it was ended)."""
    examples = os.environ.get("RPA_MAX_EXAMPLES", str(DEFAULTS[step][2]))
    log_path = logs / f"{step}-{target}.log"
    started = time.monotonic()
    code = run_logged(
        [target], backend, args, seconds, logs / "repros" / step / target, log_path, RPA_MAX_EXAMPLES=examples
    )
    if step == "smoke":  # a first look at a host: its summary tables where it is read
        print(log_path.read_text(), end="")
    print(f"=== {step}-{target}: exit {code} in {time.monotonic() - started:.0f} s", flush=True)
    return code


def calibrate(names: list[str], backend: device.Backend, args, logs: Path) -> int:
    """Every target's campaign in one run, each given its share of ``--seconds`` by the run itself
    (``--rpa-seconds``), its output in one log, ended at ``--seconds``; its exit status (``CUT_OFF`` when
    it was ended), after a line per target from the run's summary."""
    from rpa_harness.plugin import target_ids

    # A run of several targets keeps each one's repros in a folder of its own in the one given; a run of one
    # is given its own.
    repros = logs / "repros" / (names[0] if len(names) == 1 else "")
    examples = os.environ.get("RPA_MAX_EXAMPLES", str(DEFAULTS["calibrate"][2]))
    shared = f"{args.seconds * (1 - SUMMARY_RESERVE):g}"
    log_path = logs / f"calibrate-{'+'.join(target_ids(names).values())}.log"
    started = time.monotonic()
    code = run_logged(
        names, backend, args, args.seconds, repros, log_path, RPA_MAX_EXAMPLES=examples, RPA_SECONDS=shared
    )
    for line in log_path.read_text().splitlines():
        if line.startswith(("rpa-harness: target ", "rpa-harness: failing target")):
            print(line)
    print(
        f"=== calibrate ({len(names)} targets, {log_path.name}): exit {code} in {time.monotonic() - started:.0f} s"
    )
    return code


def main(args) -> int:
    if args.workers < 1:
        raise ChipUsageError(f"--workers={args.workers} must be at least 1")
    backend = backend_of(args)
    loaded, not_run = loaded_targets(args.target or DEFAULTS[args.step][0])
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    if args.step == "smoke":
        print(chip_and_versions(backend), flush=True)
    for reason in not_run.values():
        print(f"not run here: {reason}", flush=True)
    if args.step == "calibrate":
        code = calibrate([target.name for target in loaded], backend, args, logs) if loaded else 0
        sys.stdout.flush()
        return 1 if code else 0
    deadline = time.monotonic() + args.seconds
    status = 0
    for left, target in zip(range(len(loaded), 0, -1), loaded, strict=True):
        share = (deadline - time.monotonic()) / left
        code = run_target(args.step, target.name, backend, args, share, logs)
        status = status or (1 if code else 0)
    sys.stdout.flush()
    return status
