"""``rpa-harness chip agreement``: does the CPU host predict the chip? The compile verdicts and the
interpreters' outputs, against a TPU.

Two steps, on two machines, sharing one folder:

  # On the CPU host (libtpu installed: pip install "rpa-harness[compile]"):
  rpa-harness chip agreement --predict --folder agreement --count 50 --tpu-generation v5e [--target T]...
  # On a TPU of that generation (the folder carried there; jax[tpu] and the harness installed):
  rpa-harness chip agreement --folder agreement [--target T]...

``--predict`` draws ``--count`` valid configurations per target (every shipped target this jax loads, by
default; derandomized, from its small buckets, ``--large`` more from its long and production ones, around
the target's declared findings as the properties draw: a configuration spent on a known answer tells
nothing) in groups that share a compile signature (``draw_groups``). It compiles each group once for the
generation with libtpu on this host and runs each configuration that compiles and is small enough
(``interpreted``: no long context) on the checking interpreter (whose exit check predicts a halt: ``halts
the chip``) and on the fast interpreter emulating that generation (the chip's float32 products emulated),
the groups shared among ``--workers`` processes, and ends with the seconds per target and phase. It writes
``predictions.json`` (case, options, verdict) and ``outputs.npz`` (the interpreter's outputs) into the
folder. The check runs on the chip: each configuration is compiled for it (same verdict: compiles, or
refused the same way), and each interpreted case is run there and compared with the interpreter's output
and the float64 oracle. It prints a table per target and dtype pair: verdicts
agreeing, halts predicted and seen, the largest and median |chip - interpreter| as a fraction of the judge's
bound, the largest in units of the output's last place (1: a result the two computed a hair apart, rounded
either way of an output boundary) and the largest fraction of the bound where they are more than one unit
apart, and the largest error/bound of each; it exits 1 when a verdict differs. ``--backend fast-interpret``
rehearses the check on the CPU host (the interpreter that predicted stands in for the chip).
"""

import concurrent.futures
import contextlib
import dataclasses
import functools
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from rpa_harness import device, generations
from rpa_harness.chip import ChipUsageError, add_target_option

# A configuration is run on the interpreters only where both finish it in seconds: at most LARGEST_RUN output
# elements and MOST_INTERPRETED_KEYS keys read over its sequences. Their cost grows with the key blocks a call
# steps through: a long context's (32,768 keys and more) took 5-19 minutes there on a 2-core host
# (docs/measurements.md). A larger one is compiled, its verdict compared, and run on the chip alone.
LARGEST_RUN = 1 << 18
MOST_INTERPRETED_KEYS = 1 << 14
# Configurations drawn per compile signature (``valid_case_groups``): one libtpu compilation (3-15 s on a
# 2-core host) serves them all, each with its own ragged layout, page table, values and run-time options.
CASES_PER_SIGNATURE = 4
# Prediction worker processes by default: the host's cores, at most this many (each holds jax, libtpu and
# the interpreters' state: 2.6 GB resident at most in one process predicting every shipped target).
MOST_WORKERS = 8
# Where a prediction's time goes, per target (the seconds printed at the end).
PHASES = ("draw", "compile", "checking interpreter", "fast interpreter")


def verdict_of(error) -> str:
    """A verdict that two machines can compare: "compiles", or the failure's class and first words."""
    if error is None:
        return "compiles"
    first = str(error).splitlines()[0]
    return f"{type(error).__name__}: {first[:160]}"


def interpreted(case) -> bool:
    """Whether the predictions run ``case`` on the interpreters (else it is compiled only)."""
    return (
        case.max_num_batched_tokens * case.num_q_heads * case.head_dim <= LARGEST_RUN
        and sum(case.kv_lens) <= MOST_INTERPRETED_KEYS
    )


def draw_groups(target, backend, count: int, large: int = 0) -> list[list]:
    """``count`` valid configurations of ``target`` from its small buckets, in groups that share a compile
    signature (up to CASES_PER_SIGNATURE of one static configuration: ``valid_case_groups``), then ``large``
    from its large buckets (long contexts, serving batches), a group each, where it declares any.
    Derandomized; what ran before in the process can still change it (docs/measurements.md), so the chip
    checks the predictions' file, never a draw of its own."""
    from hypothesis import strategies as st

    from rpa_harness.strategies.shapes import select_buckets
    from rpa_harness.strategies.valid import valid_case_groups, valid_cases

    capabilities, excluding = target.capabilities_on(backend), target.known_issues_on(backend)
    selection = select_buckets(capabilities, ",".join(capabilities.buckets))
    groups = examples_of(
        valid_case_groups(
            capabilities, max_cases=CASES_PER_SIGNATURE, selection=selection, excluding=excluding
        ),
        count,
    )
    if large and {"long", "production"} & set(selection or ()):
        singles = valid_cases(capabilities, large=True, selection=selection, excluding=excluding)
        groups += examples_of(st.lists(singles, min_size=1, max_size=1), large)
    return groups


def examples_of(strategy, count: int) -> list[list]:
    """Groups of configurations ``strategy`` draws, ``count`` configurations in all (the last group cut),
    each without a VMEM limit (the compiler's default, as the chip's). Hypothesis's examples are the
    groups: it draws ``count`` of them, and those past ``count`` configurations are dropped."""
    from hypothesis import given

    from rpa_harness.drawn import same_examples

    groups: list[list] = []

    @same_examples(count)
    @given(group=strategy)
    def collect(group):
        groups.append([dataclasses.replace(case, vmem_limit_bytes=None) for case in group])

    collect()
    kept, drawn = [], 0
    for group in groups:
        if drawn < count:
            kept.append(group[: count - drawn])
            drawn += len(kept[-1])
    return kept


def predict(args, names: list[str]) -> int:
    """Each target's groups drawn here (``draw_groups``), in the targets' order, and predicted by
    ``args.workers`` worker processes, a group a task (``predict_group``; 1: in this process); the entries
    written in the draw's order, and the seconds per target and phase printed at the end."""
    from rpa_harness import checks, targets

    folder = Path(args.folder)
    folder.mkdir(parents=True, exist_ok=True)
    compiler = device.Backend(device.TPU_COMPILER, True, args.tpu_generation)
    seconds: dict[str, dict[str, float]] = {}
    tasks: list[tuple[str, Any]] = []  # (target, its group's predictions: a future or a Deferred)
    started = time.perf_counter()
    with prediction_workers(args.workers) as executor:
        for name in names:
            try:
                target = targets.load(name)
            except targets.TargetError as cannot:
                print(f"{name}: not loaded ({cannot})", file=sys.stderr)
                continue
            spent = seconds[name] = dict.fromkeys(PHASES, 0.0)
            # The first configuration drawn tells whether the target can be compiled from shapes: one
            # whose call reads values while traced cannot, and drawing the rest would be for nothing.
            with timed(spent, "draw"):
                first = draw_groups(target, compiler, 1)[0][0]
            try:
                with timed(spent, "compile"):
                    first_verdict = compile_verdict(target, compiler, first)
            except checks.CannotRun as reason:
                print(f"{name}: not compiled here ({reason}); nothing predicted", file=sys.stderr)
                continue
            with timed(spent, "draw"):
                groups = draw_groups(target, compiler, args.count, args.large)
            drawn = 0
            for group in groups:
                texts = [case.to_json() for case in group]
                known = first_verdict if texts[0] == first.to_json() else None
                task = executor.submit(predict_group, name, args.tpu_generation, drawn, texts, known)
                tasks.append((name, task))
                drawn += len(group)
        predictions: list[dict[str, Any]] = []
        outputs: dict[str, Any] = {}
        for name, task in tasks:
            try:
                result = task.result()
            except concurrent.futures.BrokenExecutor as ended:
                print(f"a prediction worker ended during {name}'s predictions ({ended})", file=sys.stderr)
                return 1
            for phase, spent_there in result["seconds"].items():
                seconds[name][phase] += spent_there
            if "not_compiled" in result:
                print(result["not_compiled"], file=sys.stderr)
            for entry in result["entries"]:
                print(
                    f"{entry['key']}: {entry['verdict']}{' (run)' if entry.get('interpreted') else ''}",
                    flush=True,
                )
            predictions.extend(result["entries"])
            outputs.update(result["outputs"])
    (folder / "predictions.json").write_text(
        json.dumps({"generation": args.tpu_generation, "entries": predictions}, indent=1)
    )
    np.savez(folder / "outputs.npz", **outputs)
    print(f"{len(predictions)} configurations predicted into {folder}")
    print_seconds(seconds, time.perf_counter() - started, args.workers)
    return 0


@contextlib.contextmanager
def prediction_workers(count: int):
    """An executor of ``count`` worker processes (``device.processes.worker_pool``), or, for 1, one that
    makes each task in this process when its result is asked for: after every draw, as with workers, so
    that this process has done the same before each draw whatever the count."""
    if count == 1:
        yield InThisProcess()
        return
    with device.processes.worker_pool(count) as pool:
        yield pool


class InThisProcess:
    """``submit`` as an executor's; the task is made in this process when its ``result`` is asked for."""

    def submit(self, function, *args) -> "Deferred":
        return Deferred(functools.partial(function, *args))


@dataclasses.dataclass
class Deferred:
    """A task made when its result is asked for (``InThisProcess``)."""

    task: Any

    def result(self):
        return self.task()


def compile_verdict(target, compiler, case) -> str:
    """``verdict_of`` compiling ``case`` for the compiler's generation; raises ``checks.CannotRun`` where
    it cannot be compiled here."""
    from rpa_harness import checks
    from rpa_harness.repro import stand_ins

    try:
        checks.check_compiles(target, compiler, stand_ins(case.array_shapes()), case.options())
    except checks.PropertyFailure as failure:
        return verdict_of(failure)
    return verdict_of(None)


def predict_group(name: str, generation: str, first_index: int, texts: list[str], known: str | None) -> dict:
    """One group's predictions (a worker's task): its signature compiled for ``generation`` (unless its
    verdict is ``known``), and each configuration that compiles and is ``interpreted`` run on the checking
    interpreter (a halt predicted) and else on the fast interpreter, whose output is kept. Its entries are
    keyed ``NAME#INDEX`` from ``first_index``, and the seconds it spent per phase come with them."""
    from rpa_harness import checks, targets
    from rpa_harness.strategies.case import Case

    target = targets.load(name)
    spent = dict.fromkeys(PHASES, 0.0)
    result: dict[str, Any] = {"entries": [], "outputs": {}, "seconds": spent}
    cases = [Case.from_json(text) for text in texts]
    keys = [f"{name}#{first_index + place}" for place in range(len(cases))]
    if known is None:
        try:
            with timed(spent, "compile"):
                known = compile_verdict(
                    target, device.Backend(device.TPU_COMPILER, True, generation), cases[0]
                )
        except checks.CannotRun as reason:
            result["not_compiled"] = f"{keys[0]}-{keys[-1]}: not compiled here ({reason})"
            return result
    checking = device.Backend(device.INTERPRET, True, generation)
    interpreter = device.Backend(device.FAST_INTERPRET, True, generation)
    for key, case, text in zip(keys, cases, texts, strict=True):
        entry: dict[str, Any] = {"key": key, "target": name, "case": text, "verdict": known}
        if known == verdict_of(None) and interpreted(case):
            with timed(spent, "checking interpreter"):
                halts = halts_on_the_checking_interpreter(target, checking, case)
            if halts:
                entry["verdict"] = HALTS
            else:
                with timed(spent, "fast interpreter"):
                    out = checks.run_valid(target, interpreter, case.arrays(), case.options())
                result["outputs"][key] = np.asarray(out).astype(np.float32)
                entry["interpreted"] = True
        result["entries"].append(entry)
    return result


@contextlib.contextmanager
def timed(seconds: dict[str, float], phase: str):
    started = time.perf_counter()
    try:
        yield
    finally:
        seconds[phase] += time.perf_counter() - started


def print_seconds(seconds: dict[str, dict[str, float]], wall: float, workers: int) -> None:
    """Where the predictions' time went: seconds per target and phase, summed over the workers."""
    print(f"predicted in {wall:.0f} s with {workers} worker(s); seconds per target and phase:")
    print(f"| target | {' | '.join(PHASES)} |")
    print(f"|---|{'---|' * len(PHASES)}")
    for name, spent in seconds.items():
        print(f"| {name} | {' | '.join(f'{spent[phase]:.1f}' for phase in PHASES)} |")
    totals = [sum(spent[phase] for spent in seconds.values()) for phase in PHASES]
    print(f"| all | {' | '.join(f'{total:.1f}' for total in totals)} |")


HALTS = "halts the chip"


def halts_on_the_checking_interpreter(target, checking, case) -> bool:
    """Whether the checking interpreter says the call would halt a TPU (a DMA never waited, a semaphore
    count left at the kernel's exit); any other failure there is not this script's to judge."""
    from rpa_harness import checks

    try:
        checks.run_valid(target, checking, case.arrays(), case.options())
    except checks.WouldHaltATpu:
        return True
    except (checks.PropertyFailure, checks.CannotRun):
        return False
    return False


def verdict_class(verdict: str) -> str:
    """What two machines' verdicts must agree on: compiles (and runs), halts the chip, or refused."""
    return verdict if verdict in ("compiles", HALTS) else "refused"


def check_entry(entry: dict, chip, outputs) -> dict:
    """One configuration on the chip: its verdict (compiled for it and called once: a refusal raises on
    valid input) and, where the interpreter ran it, |chip - interpreter| / bound and each one's error/bound."""
    from rpa_harness import checks, reference, targets
    from rpa_harness.reference.tolerance import error_bound, half_ulp
    from rpa_harness.strategies.case import Case

    target = targets.load(entry["target"])
    case = Case.from_json(entry["case"])
    arrays, options = case.arrays(), case.options()
    try:
        actual, error = checks.run_valid(target, chip, arrays, options), None
    except (checks.PropertyFailure, checks.CannotRun) as failure:
        actual, error = None, failure
    result = {"key": entry["key"], "verdict": verdict_of(error)}
    if entry.get("interpreted") and actual is not None:
        expected = reference.oracle(**arrays, **options)
        precision = target.precision_on(chip)
        bound = error_bound(expected, precision=precision)
        live = checks.valid_rows(arrays)
        interpreted = outputs[entry["key"]].astype(np.float64)[live]
        apart = np.abs(actual.astype(np.float64)[live] - interpreted)
        gap = apart / bound[live]
        # In the output's own units: one unit is a result the two computed a hair apart rounded either way
        # of an output rounding boundary, which no emulation short of the chip's bits removes.
        larger = np.maximum(np.abs(actual.astype(np.float64)[live]), np.abs(interpreted))
        units = apart / (2 * half_ulp(larger, actual.dtype))
        result["diff"] = float(gap.max(initial=0.0))
        result["units"] = float(units.max(initial=0.0))
        result["beyond_one_unit"] = float(gap[units > 1].max(initial=0.0))
        result["chip"] = reference.compare(actual, expected, precision=precision).max_ratio
        result["interp"] = reference.compare(outputs[entry["key"]], expected, precision=precision).max_ratio
    return result


def check(args) -> int:
    """Runs the entries' calls through a chip owner (``rpa_harness.device.owner``), this process computing the
    oracles and comparisons; a call that halts the chip ends that owner and is that configuration's verdict
    ("halts the chip"), and a fresh owner goes on with the next one."""

    device.keep_off_the_chips()  # the owner opens the chip
    if args.backend == device.TPU and not device.tpus():
        raise ChipUsageError(
            "jax sees no TPU here, not a TPU host; run the check on the chip, or rehearse it here with "
            f"--backend {device.FAST_INTERPRET}"
        )
    chip_name = device.tpus().kind if args.backend == device.TPU else args.backend
    folder = Path(args.folder)
    recorded = json.loads((folder / "predictions.json").read_text())
    outputs = np.load(folder / "outputs.npz")
    chip = device.Backend(
        args.backend, True, "none" if args.backend == device.TPU else recorded["generation"]
    )
    entries = [entry for entry in recorded["entries"] if not args.target or entry["target"] in args.target]
    results: dict[str, dict] = {}
    supervisor = device.owner.Supervisor(dict(os.environ)).start()
    device.owner.route_calls_to(supervisor.where)
    try:
        for entry in entries:
            try:
                with device.owner.endings_raise():
                    result = check_entry(entry, chip, outputs)
            except device.owner.CallEndedTheOwner as ended:
                verdict = HALTS if ended.kind in ("halted", "crashed") else f"{ended.kind}: {ended}"
                result = {"key": entry["key"], "verdict": verdict}
                print(f"{entry['key']}: the call {ended.kind}; a fresh owner goes on", flush=True)
            results[entry["key"]] = result
            print(f"{result['key']}: {result['verdict']}", flush=True)
    finally:
        device.owner.route_calls_to(None)
        owners = supervisor.stop()
    print(f"chip owner: {owners['calls']} calls, busy {owners['busy_s']:.1f} s, {owners['owners']} owner(s)")
    rows: dict[tuple, dict] = defaultdict(
        lambda: {
            "n": 0,
            "agree": 0,
            "halts": [0, 0],
            "diffs": [],
            "chip": 0.0,
            "interp": 0.0,
            "units": 0.0,
            "beyond_one_unit": 0.0,
        }  # fmt: skip
    )
    differing = []
    for entry in entries:
        result = results[entry["key"]]
        case = json.loads(entry["case"])
        row = rows[(entry["target"], case["q_dtype"], case["kv_dtype"])]
        row["n"] += 1
        same = verdict_class(result["verdict"]) == verdict_class(entry["verdict"])
        row["agree"] += same
        row["halts"][0] += entry["verdict"] == HALTS
        row["halts"][1] += result["verdict"] == HALTS
        if not same:
            differing.append((entry["key"], entry["verdict"], result["verdict"]))
        if "diff" in result:
            row["diffs"].append(result["diff"])
        for measure in ("chip", "interp", "units", "beyond_one_unit"):
            row[measure] = max(row[measure], result.get(measure, 0.0))
    print(f"chip: {chip_name}; predictions for {recorded['generation']}")
    print(
        "| target | q / kv | configurations | verdicts agreeing | halts predicted / seen "
        "| abs(chip - interpreter) / bound: max, median | output units apart: max | / bound where over "
        "1 unit | max error/bound chip | interpreter |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for (name, q, kv), row in sorted(rows.items()):
        diffs = sorted(row["diffs"])
        spread = f"{diffs[-1]:.3g}, {diffs[len(diffs) // 2]:.3g}" if diffs else "-"
        print(
            f"| {name} | {q} / {kv} | {row['n']} | {row['agree']} | {row['halts'][0]} / {row['halts'][1]} "
            f"| {spread} | {row['units']:.3g} | {row['beyond_one_unit']:.3g} | {row['chip']:.3g} "
            f"| {row['interp']:.3g} |"
        )
    for key, predicted, seen in differing:
        print(f"DIFFERS {key}: predicted {predicted!r}, the chip: {seen!r}")
    return 1 if differing else 0


def add_arguments(parser, step: str) -> None:
    add_target_option(
        parser, ["every shipped target this jax loads"], "module whose configurations are drawn"
    )
    parser.add_argument(
        "--predict", action="store_true",
        help="on the CPU host: compile and interpret drawn configurations into --folder (without it: check "
        "them on the chip)",
    )  # fmt: skip
    parser.add_argument("--folder", required=True, help="the folder of predictions.json and outputs.npz")
    parser.add_argument(
        "--count", type=int, default=50, help="--predict: configurations per target (default 50)"
    )
    parser.add_argument(
        "--workers", type=int, default=None,
        help="--predict: worker processes compiling and interpreting the drawn groups (default: this host's "
        f"cores, at most {MOST_WORKERS}; 1: all in this process)",
    )  # fmt: skip
    parser.add_argument(
        "--large", type=int, default=0,
        help="--predict: configurations per target from its large buckets besides --count, compiled and "
        "too large to interpret (default 0: one long context's compilation can take minutes and GiB)",
    )  # fmt: skip
    parser.add_argument(
        "--tpu-generation", default="v5e", help="--predict: the chip's generation (default v5e)"
    )
    parser.add_argument(
        "--backend", default=device.TPU, choices=device.BACKENDS,
        help="the check: where to run (default tpu; an interpreter emulating the predicted generation "
        "rehearses it on a CPU host)",
    )  # fmt: skip


def main(args) -> int:
    if args.predict:
        if args.count < 1:
            raise ChipUsageError(f"--count={args.count} must be at least 1")
        if args.large < 0:
            raise ChipUsageError(f"--large={args.large} must be 0 or more")
        if args.workers is None:
            args.workers = min(len(os.sched_getaffinity(0)), MOST_WORKERS)
        if args.workers < 1:
            raise ChipUsageError(f"--workers={args.workers} must be at least 1")
        try:
            generations.check_name(args.tpu_generation)
        except generations.GenerationError as error:
            raise ChipUsageError(str(error)) from None
        if args.tpu_generation == generations.NONE:
            raise ChipUsageError(
                "--tpu-generation=none: --predict compiles for a TPU generation; name one, e.g. v5e"
            )
        from rpa_harness import targets

        return predict(args, args.target or [shipped.name for shipped in targets.SHIPPED])
    if not (Path(args.folder) / "predictions.json").is_file():
        raise ChipUsageError(
            f"--folder={args.folder}: no predictions.json there; write it on the CPU host with --predict"
        )
    return check(args)
