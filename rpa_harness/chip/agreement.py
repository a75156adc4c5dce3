"""``rpa-harness chip agreement``: does the CPU host predict the chip? The compile verdicts and the
interpreters' outputs, against a TPU.

Two steps, on two machines, sharing one folder:

  # On the CPU host (libtpu installed: pip install "rpa-harness[compile]"):
  rpa-harness chip agreement --predict --folder agreement --count 50 --tpu-generation v5e [--target T]...
  # On a TPU of that generation (the folder carried there; jax[tpu] and the harness installed):
  rpa-harness chip agreement --folder agreement [--target T]...

``--predict`` draws ``--count`` valid configurations per target (every shipped target this jax loads, by
default; derandomized, every declared bucket, around the target's declared findings as the properties draw:
a configuration spent on a known answer tells nothing), compiles each for the generation with libtpu on this
host, and, where it compiles and is small enough, runs it on the checking interpreter (whose exit check
predicts a halt: ``halts the chip``) and on the fast interpreter emulating that generation (the chip's
float32 products emulated). It writes ``predictions.json`` (case, options, verdict) and ``outputs.npz`` (the
interpreter's outputs) into the folder. The check runs on the chip: each configuration is compiled for it
(same verdict: compiles, or refused the same way), and each interpreted case is run there and compared with
the interpreter's output and the float64 oracle. It prints a table per target and dtype pair: verdicts
agreeing, halts predicted and seen, the largest and median |chip - interpreter| as a fraction of the judge's
bound, the largest in units of the output's last place (1: a result the two computed a hair apart, rounded
either way of an output boundary) and the largest fraction of the bound where they are more than one unit
apart, and the largest error/bound of each; it exits 1 when a verdict differs. ``--backend fast-interpret``
rehearses the check on the CPU host (the interpreter that predicted stands in for the chip).
"""

import dataclasses
import json
import os
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from rpa_harness import device, generations
from rpa_harness.chip import ChipUsageError, add_target_option

# Cases larger than this many output elements are compiled but not run (the interpreter's time).
LARGEST_RUN = 1 << 18


def verdict_of(error) -> str:
    """A verdict that two machines can compare: "compiles", or the failure's class and first words."""
    if error is None:
        return "compiles"
    first = str(error).splitlines()[0]
    return f"{type(error).__name__}: {first[:160]}"


def draw_cases(target, backend, count: int) -> list:
    from hypothesis import given
    from hypothesis import strategies as st

    from rpa_harness.drawn import same_examples
    from rpa_harness.strategies.shapes import select_buckets
    from rpa_harness.strategies.valid import valid_cases

    capabilities, excluding = target.capabilities_on(backend), target.known_issues_on(backend)
    selection = select_buckets(capabilities, ",".join(capabilities.buckets))
    strategy = st.one_of(
        valid_cases(capabilities, selection=selection, excluding=excluding),
        *(
            [valid_cases(capabilities, large=True, selection=selection, excluding=excluding)]
            if {"long", "production"} & set(selection or ())
            else []
        ),
    )
    drawn = []

    @same_examples(count)
    @given(case=strategy)
    def collect(case):
        drawn.append(dataclasses.replace(case, vmem_limit_bytes=None))

    collect()
    return drawn[:count]


def predict(args, names: list[str]) -> int:
    from rpa_harness import checks, targets
    from rpa_harness.repro import stand_ins

    folder = Path(args.folder)
    folder.mkdir(parents=True, exist_ok=True)
    compiler = device.Backend(device.TPU_COMPILER, True, args.tpu_generation)
    interpreter = device.Backend(device.FAST_INTERPRET, True, args.tpu_generation)
    checking = device.Backend(device.INTERPRET, True, args.tpu_generation)
    predictions: list[dict[str, Any]] = []
    outputs: dict[str, Any] = {}  # key -> the interpreter's output
    for name in names:
        try:
            target = targets.load(name)
        except targets.TargetError as cannot:
            print(f"{name}: not loaded ({cannot})", file=sys.stderr)
            continue
        for index, case in enumerate(draw_cases(target, compiler, args.count)):
            key = f"{name}#{index}"
            refusal: checks.PropertyFailure | None = None
            try:
                checks.check_compiles(target, compiler, stand_ins(case.array_shapes()), case.options())
            except checks.CannotRun as reason:
                print(f"{key}: not compiled here ({reason})", file=sys.stderr)
                continue
            except checks.PropertyFailure as failure:
                refusal = failure
            entry = {"key": key, "target": name, "case": case.to_json(), "verdict": verdict_of(refusal)}
            if (
                refusal is None
                and case.max_num_batched_tokens * case.num_q_heads * case.head_dim <= LARGEST_RUN
            ):
                if halts_on_the_checking_interpreter(target, checking, case):
                    entry["verdict"] = HALTS
                else:
                    out = checks.run_valid(target, interpreter, case.arrays(), case.options())
                    outputs[key] = np.asarray(out).astype(np.float32)
                    entry["interpreted"] = True
            predictions.append(entry)
            print(f"{key}: {entry['verdict']}{' (run)' if entry.get('interpreted') else ''}", flush=True)
    (folder / "predictions.json").write_text(
        json.dumps({"generation": args.tpu_generation, "entries": predictions}, indent=1)
    )
    np.savez(folder / "outputs.npz", **outputs)
    print(f"{len(predictions)} configurations predicted into {folder}")
    return 0


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
