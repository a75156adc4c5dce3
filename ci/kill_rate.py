"""Kill rate of the CI property run over the seeded-bug catalogue (``mutants``).

Runs the ci profile of the three property files against each variant and against the correct kernel, one
pytest process per variant, and prints a table: killed or survived, how many examples and seconds until
the first failing example, which test failed, and the size of the shrunk case Hypothesis left on disk.
The correct kernel must pass the same run (exit status 1 otherwise, or when a run errors).

  python ci/kill_rate.py                                  # every mutant, both interpreters as in CI
  python ci/kill_rate.py --variants causal_off_by_one,sm_scale_ignored --jobs 2
  python ci/kill_rate.py --backend fast-interpret         # the volume interpreter alone
  python ci/kill_rate.py --precision probabilities-in-value-dtype   # every run judged under that contract
  python ci/kill_rate.py --upstream                       # seeded bugs in upstream's kernel (mutants/upstream.py)

With ``--upstream`` the variants are upstream's kernel with one seeded bug each, declaring upstream's known
issues, and the correct kernel is upstream's own: a kill shows that the known issues' exclusion leaves the
rest of upstream's kernel under test.

With the fast interpreter alone the checked properties do not run, so the mutants only the TPU interpreter
can see (``dma_wait_one_page_short``, ``dma_wait_one_page_long``: the generic interpreter completes every DMA
when it starts) survive.

Examples are counted from the run log (``RPA_RUN_LOG``: one JSON line per example, in order, the failing
ones naming their repro file); the time to the first failure is when that line appeared (polled every
0.2 s). Both include the correct examples before the failure, not the shrinking after it; "run s" is the
whole pytest run, shrinking included. Validation properties that fail outside a repro writer
(``test_valid_input_passes_validation``) log their examples but write no repro: the pytest result and the
failed test name show them.
"""

import argparse
import concurrent.futures
import dataclasses
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from rpa_harness import repro, runlog  # noqa: E402
from rpa_harness.device import processes  # noqa: E402

# Validation first: it takes a minute, so a validation bug is not killed only after the numeric properties.
PROPERTY_FILES = (
    "tests/properties/test_validation.py",
    "tests/properties/test_differential.py",
    "tests/properties/test_padding.py",
)
# Properties that never call the target: a failure there says nothing about the variant.
TARGET_INDEPENDENT = ("tests/properties/test_differential.py::test_reference_matches_oracle",)
CORRECT = "rpa_harness.kernel"
POLL_SECONDS = 0.2


@dataclasses.dataclass
class Outcome:
    variant: str
    status: str  # "killed", "survived", "passed", "FAILED" (the correct kernel), "timeout", "error (rc N)"
    run_seconds: float
    examples: int  # examples logged in the whole run
    examples_to_failure: int | None = None
    seconds_to_failure: float | None = None
    failed_test: str = ""
    shrunk: str = ""  # "S seqs / T tokens" of the repro left on disk


def target_module(variant: str, correct: str = CORRECT) -> str:
    return variant if variant == correct else f"mutants.{variant}"


def first_failure(log_dir: Path) -> int | None:
    """1-based index of the first logged example that failed, if any."""
    for index, line in enumerate(runlog.read(log_dir), 1):
        if line.get("repro"):
            return index
    return None


def shrunk_size(repro_dir: Path) -> str:
    """Sequences and query tokens of the most recent repro (the shrunk example is written last)."""
    written = (p for p in repro_dir.glob("*.json") if not p.name.endswith(f"{repro.PENDING_SUFFIX}.json"))
    files = sorted(written, key=lambda p: p.stat().st_mtime)  # a pending file is an example in flight
    if not files:
        return ""
    case = repro.read(files[-1]).case
    if case is None:
        return "no case"
    return f"{case.num_seqs} seqs / {case.num_tokens} tokens"


def failed_test(output: str) -> str:
    match = re.search(r"^FAILED (\S+)", output, re.MULTILINE)
    return match.group(1).split("/")[-1] if match else ""


def run_variant(
    variant: str,
    backend: str,
    out_dir: Path,
    timeout: float,
    workers: int,
    precision: str = "",
    correct: str = CORRECT,
) -> Outcome:
    work = out_dir / variant
    log_dir, repro_dir = work / "log", work / "repros"
    log_dir.mkdir(parents=True, exist_ok=True)
    repro_dir.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable,
        "-m",
        "pytest",
        *PROPERTY_FILES,
        f"--rpa-target={target_module(variant, correct)}",
        f"--rpa-backend={backend}",
        *([f"--rpa-precision={precision}"] if precision else []),
        f"--rpa-repro-dir={repro_dir}",
        "--hypothesis-profile=ci",
        *(f"--deselect={test}" for test in TARGET_INDEPENDENT),
        "-p",
        "no:cacheprovider",
        "-x",
        "-q",
        *(["-n", str(workers)] if workers > 1 else []),
    ]
    env = {**os.environ, runlog.ENV: str(log_dir), "HYPOTHESIS_PROFILE": "ci"}
    env.pop("RPA_TARGET", None)
    env.pop("RPA_PRECISION", None)
    start = time.monotonic()
    seconds_to_failure = None
    with open(work / "pytest.out", "w") as output:
        process = processes.start(command, cwd=REPO_ROOT, env=env, stdout=output, stderr=processes.STDOUT)
        try:
            while process.poll() is None:
                if seconds_to_failure is None and first_failure(log_dir) is not None:
                    seconds_to_failure = time.monotonic() - start
                if time.monotonic() - start > timeout:
                    processes.end(process)
                    break
                time.sleep(POLL_SECONDS)
        except BaseException:  # interrupted: the run goes with it
            processes.end(process)
            raise
    run_seconds = time.monotonic() - start
    text = (work / "pytest.out").read_text()
    failure_index = first_failure(log_dir)
    if failure_index is not None and seconds_to_failure is None:
        seconds_to_failure = run_seconds  # failed within the last poll interval
    rc = process.returncode
    if rc == 2 and "xdist.dsession.Interrupted: stopping after" in text:
        rc = 1  # -x under xdist reports the stop as an interruption: it is a failure like any other
    if run_seconds > timeout and rc != 0:
        status = "timeout"
    elif rc in (0, 1):
        status = {(True, 0): "passed", (True, 1): "FAILED", (False, 0): "survived", (False, 1): "killed"}[
            (variant == correct, rc)
        ]
    else:
        status = f"error (rc {rc})"
    return Outcome(
        variant=variant,
        status=status,
        run_seconds=run_seconds,
        examples=len(runlog.read(log_dir)),
        examples_to_failure=failure_index,
        seconds_to_failure=seconds_to_failure,
        failed_test=failed_test(text) if rc == 1 else "",
        shrunk=shrunk_size(repro_dir) if rc == 1 else "",
    )


def _cell(value, fmt="{}"):
    return "-" if value is None else fmt.format(value)


def table(outcomes: list[Outcome]) -> str:
    header = (
        "variant",
        "result",
        "examples to fail",
        "s to fail",
        "run s",
        "examples",
        "failed test",
        "shrunk case",
    )
    rows = [
        (
            o.variant,
            o.status,
            _cell(o.examples_to_failure),
            _cell(o.seconds_to_failure, "{:.1f}"),
            f"{o.run_seconds:.1f}",
            str(o.examples),
            o.failed_test or "-",
            o.shrunk or "-",
        )
        for o in outcomes
    ]
    widths = [max(len(str(r[i])) for r in (header, *rows)) for i in range(len(header))]
    line = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()  # noqa: E731
    return "\n".join([line(header), line(tuple("-" * w for w in widths)), *map(line, rows)])


def totals(outcomes: list[Outcome], correct: str = CORRECT) -> str:
    mutants = [o for o in outcomes if o.variant != correct]
    killed = [o for o in mutants if o.status == "killed"]
    times = [o.seconds_to_failure for o in killed if o.seconds_to_failure is not None]
    examples = [o.examples_to_failure for o in killed if o.examples_to_failure is not None]
    parts = [
        f"kill rate {len(killed)}/{len(mutants)}"
        + (f" = {len(killed) / len(mutants):.0%}" if mutants else "")
    ]
    if times:
        parts.append(f"median time to kill {statistics.median(times):.1f} s")
    if examples:
        parts.append(f"median examples to kill {statistics.median(examples):g}")
    survivors = [o.variant for o in mutants if o.status != "killed"]
    if survivors:
        parts.append(
            "not killed: " + ", ".join(f"{o.variant} ({o.status})" for o in mutants if o.status != "killed")
        )
    return "; ".join(parts)


def main(argv=None) -> int:
    import mutants

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", help="comma-separated mutant names (default: the whole catalogue)")
    parser.add_argument("--backend", default="auto", help="--rpa-backend for every run (default: as CI)")
    parser.add_argument("--jobs", type=int, default=1, help="variants run in parallel processes (default 1)")
    parser.add_argument(
        "--workers", type=int, default=2, help="pytest-xdist workers per run, as in CI (default 2)"
    )
    parser.add_argument(
        "--timeout", type=float, default=1800.0, help="seconds per variant before it is stopped"
    )
    parser.add_argument(
        "--out-dir", type=Path, help="logs, repros and pytest output per variant (default: a temp dir)"
    )
    parser.add_argument("--no-correct", action="store_true", help="skip the run of the correct kernel")
    parser.add_argument(
        "--precision", default="", help="--rpa-precision for every run (default: each target's own, float32)"
    )
    parser.add_argument(
        "--upstream", action="store_true", help="seeded bugs in upstream's kernel (mutants/upstream.py)"
    )
    args = parser.parse_args(argv)

    catalogue, correct, prefix = mutants.BY_NAME, CORRECT, ""
    if args.upstream:
        import mutants.upstream
        from rpa_harness.targets import UPSTREAM_TARGET

        catalogue, correct, prefix = mutants.upstream.BY_NAME, UPSTREAM_TARGET, "upstream."
    names = list(catalogue)
    if args.variants:
        chosen = [v.strip() for v in args.variants.split(",") if v.strip()]
        unknown = [v for v in chosen if v not in catalogue]
        if unknown:
            parser.error(f"--variants: unknown mutant(s) {', '.join(unknown)}; known: {', '.join(names)}")
        names = chosen
    if args.precision:
        from rpa_harness.reference import PrecisionError, parse_precision

        try:
            parse_precision(args.precision)
        except PrecisionError as error:
            parser.error(f"--precision: {error}")
    names = [prefix + name for name in names]
    variants = ([] if args.no_correct else [correct]) + names
    out_dir = args.out_dir or Path(tempfile.mkdtemp(prefix="rpa-kill-rate-"))
    print(
        f"kill rate: {len(names)} mutants on {args.backend}, precision {args.precision or 'as each target declares'}, "
        f"{args.jobs} job(s); work files in {out_dir}",
        flush=True,
    )

    outcomes = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = {
            pool.submit(
                run_variant, v, args.backend, out_dir, args.timeout, args.workers, args.precision, correct
            ): v
            for v in variants
        }
        for future in concurrent.futures.as_completed(futures):
            outcome = future.result()
            outcomes[outcome.variant] = outcome
            print(f"  {table([outcome]).splitlines()[-1]}", flush=True)
    ordered = [outcomes[v] for v in variants]
    print()
    print(table(ordered))
    print()
    print(totals(ordered, correct))
    correct_outcome = outcomes.get(correct)
    if correct_outcome is not None and correct_outcome.status != "passed":
        print(
            f"the correct kernel did not pass the same run ({correct_outcome.status}): see {out_dir / correct}"
        )
        return 1
    return 1 if any(o.status.startswith(("error", "timeout")) for o in ordered) else 0


if __name__ == "__main__":
    sys.exit(main())
