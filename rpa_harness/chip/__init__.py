"""``rpa-harness chip STEP``: the measurements a session on a TPU owes, for any targets, from the wheel alone.

A kernel developer who installs the harness on their TPU VM runs the same steps this repo's chip sessions
run (``ci/chip_session.sh`` is a thin caller of these), on their own target modules as on the shipped ones:

- ``smoke``: a few examples of every property on the chip, each target in one worker that opens it;
- ``calibrate``: each target's dev profile on the chip, every target in one run, workers feeding one chip
  owner, the targets sharing one time budget;
- ``verdicts``: each declared finding's verdict on this chip, as a table (``rpa_harness.chip.verdicts``);
- ``agreement``: whether a CPU host predicts the chip: ``--predict`` on the CPU host, then the check on the
  chip (``rpa_harness.chip.agreement``);
- ``throughput``: the differential property's steady rate on the chip and where its time goes;
- ``speed``: each target's time per serving batch through ``rpa-harness bench``'s call and bare, and at a
  sweep of block sizes;
- ``q-len-zero``: tpu-inference v3's ``q-len-zero-before-a-live-sequence-hangs``, step by step.

Every child process a step starts runs in a session of its own and is ended with what it started
(``rpa_harness.device.processes``). A usage error (an unknown step, a target that does not load) is one
line and exit 4.
"""

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from rpa_harness import device, generations, targets

USAGE = 4
# What a step's module provides: ``add_arguments(parser, step)`` and ``main(args) -> int``.
STEP_MODULES = {
    "smoke": "rpa_harness.chip.campaign",
    "calibrate": "rpa_harness.chip.campaign",
    "verdicts": "rpa_harness.chip.verdicts",
    "agreement": "rpa_harness.chip.agreement",
    "throughput": "rpa_harness.chip.throughput",
    "speed": "rpa_harness.chip.speed",
    "q-len-zero": "rpa_harness.chip.q_len_zero",
}
STEP_HELP = {
    "smoke": "a few examples of every property on the chip, each target in one worker",
    "calibrate": "each target's dev profile on the chip, all in one run, workers feeding one chip owner",
    "verdicts": "each declared finding's verdict on this chip, as a table",
    "agreement": "the CPU host's predictions (--predict) checked on the chip",
    "throughput": "the differential property's steady rate on the chip and where its time goes",
    "speed": "time per serving batch through bench's call and bare, and per block size",
    "q-len-zero": "tpu-inference v3's q-len-zero-before-a-live-sequence-hangs on the chip, step by step",
}


class ChipUsageError(ValueError):
    """A chip step's command line that cannot be honoured: main() prints it as one line and exits 4."""


def add_parser(commands) -> None:
    """``rpa-harness chip STEP``: one subcommand per step, each with the options its module adds."""
    chip = commands.add_parser(
        "chip", help="the measurements of a session on a TPU (smoke, calibrate, verdicts, ...)",
        description="Run one step of a session on a TPU for the targets named (the shipped ones or your "
        "own): smoke, calibrate, verdicts, agreement, throughput, speed, q-len-zero. "
        "On a CPU host, --backend fast-interpret (emulating a generation) rehearses a step.",
        epilog="exit codes: 0 done (for verdicts: no finding FIXED or failing differently, and every row a "
        "--compare table judges agrees; for agreement: every verdict agrees); 1 otherwise, or a step's run "
        "failed; 4 usage error (one line).",
    )  # fmt: skip
    steps = chip.add_subparsers(dest="step", required=True, metavar="STEP", parser_class=type(chip))
    for step, module in STEP_MODULES.items():
        steps_module = importlib.import_module(module)
        parser = steps.add_parser(
            step, help=STEP_HELP[step], description=steps_module.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )  # fmt: skip
        steps_module.add_arguments(parser, step)


def add_target_option(parser, default: Sequence[str], what: str = "module to run") -> None:
    parser.add_argument(
        "--target", action="append", default=None,
        help=f"{what} (repeat for several; default {' '.join(default)})",
    )  # fmt: skip


def add_backend_options(parser, default: str = device.TPU) -> None:
    parser.add_argument(
        "--backend", default=default, choices=device.BACKENDS,
        help=f"where the kernels run (default {default}; an interpreter emulating --tpu-generation rehearses "
        "the step on a CPU host)",
    )  # fmt: skip
    parser.add_argument(
        "--tpu-generation", default=generations.NONE,
        help="on an interpreter, the TPU generation it emulates (default none: a CPU device)",
    )  # fmt: skip


def backend_of(args, *, opens_the_chip: bool = False) -> device.Backend:
    """The step's backend. A step whose children make the kernel calls (``opens_the_chip`` False) keeps
    this process's jax off the chips, which one process opens at a time; on ``tpu`` a chip jax sees is
    asked for in a child either way."""
    try:
        backend = device.Backend(args.backend, generation=args.tpu_generation)
    except generations.GenerationError as error:
        raise ChipUsageError(str(error)) from None
    if not opens_the_chip:
        device.keep_off_the_chips()
    if backend.name == device.TPU and not device.tpus():
        raise ChipUsageError(
            "no TPU is visible to jax here; on a CPU host rehearse the step with --backend "
            f"{device.FAST_INTERPRET} --tpu-generation v5e"
        )
    return backend


def loaded_targets(names: Sequence[str]) -> tuple[list[targets.Target], dict[str, str]]:
    """The targets of ``names`` this jax loads, and why each shipped one it does not load is not run (its
    kernel needs another jax, or is not installed), by name. Any other target that does not load is a
    usage error."""
    shipped = {shipped.name for shipped in targets.SHIPPED} | set(targets.ALIASES)
    loaded, not_run = [], {}
    for name in names:
        try:
            loaded.append(targets.load(name))
        except targets.TargetError as error:
            if name not in shipped:
                raise ChipUsageError(str(error)) from None
            not_run[name] = str(error).splitlines()[0]
    return loaded, not_run


def child_environment(**variables: str) -> dict[str, str]:
    """This process's environment for a step's child, with the current folder first on its path: a target
    module of the user's that this process imported from there imports there too."""
    path = os.environ.get("PYTHONPATH")
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([os.getcwd(), *([path] if path else [])]),
        **variables,
    }


def main(args: argparse.Namespace) -> int:
    try:
        return importlib.import_module(STEP_MODULES[args.step]).main(args)
    except ChipUsageError as error:
        from rpa_harness.run_settings import in_cli_terms  # a target's error names pytest's options

        print(f"rpa-harness chip {args.step}: {in_cli_terms(str(error))}", file=sys.stderr)
        return USAGE
