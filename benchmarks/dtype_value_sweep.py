"""Every (q dtype, KV dtype) pair a target takes, with every value profile: false alarms and how close it comes.

    python benchmarks/dtype_value_sweep.py [--targets NAME,...] [--generations auto|none|NAME,...]
                                           [--examples N] [--seed S] [--backend fast-interpret|interpret]
                                           [--q-dtypes NAME,...]

For each target (default: the shipped ones that import here), each TPU generation (``auto``: the ones
``rpa-harness run`` emulates for it), each (q dtype, KV dtype) pair of its capabilities and each value
profile (normal, large, ties, tiny), draws N cases of the whole static space as the properties do (the
target's declared known issues moved out of the draw, as a run moves them) and judges the target against
the float64 oracle under its precision contract. It prints, per row, the examples judged, the failures
(each a false alarm of the judge or a finding: the first one's case is printed to replay), the largest
and median error/bound, and the known-issue avoidances. A profile a pair rarely reaches in a run (``ties``
with bfloat16 queries, say) gets its own examples here.
"""

import argparse
import collections
import dataclasses
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hypothesis  # noqa: E402
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from rpa_harness import generations, targets  # noqa: E402
from rpa_harness.checks import CannotRun, PropertyFailure, check_differential  # noqa: E402
from rpa_harness.device import FAST_INTERPRET, INTERPRET, Backend  # noqa: E402
from rpa_harness.strategies.valid import outside_known_issues, valid_cases  # noqa: E402

SHIPPED = (
    targets.DEFAULT_TARGET,
    targets.UPSTREAM_TARGET,
    targets.V3_TARGET,
    targets.V3_HD64_TARGET,
)
VALUE_PROFILES = ("normal", "large", "ties", "tiny")


@dataclasses.dataclass
class Row:
    judged: int = 0
    ratios: list = dataclasses.field(default_factory=list)
    failures: list = dataclasses.field(default_factory=list)  # (kind, case repr, first report line)
    avoided: collections.Counter = dataclasses.field(default_factory=collections.Counter)


def sweep(
    target, backend: Backend, q_dtype: str, kv_dtype: str, values: str, examples: int, seed: int
) -> Row | None:
    """One row of the table, or None when the capabilities hold no case of the pair."""
    row = Row()
    capabilities = dataclasses.replace(
        target.capabilities_on(backend), q_dtypes=(q_dtype,), kv_dtypes=(kv_dtype,)
    )
    issues = target.known_issues_on(backend)

    @settings(max_examples=examples, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(data=st.data())
    def judge(data):
        case = data.draw(valid_cases(capabilities, values=(values,)))
        for issue in issues:
            if issue.matches(case):
                row.avoided[issue.name] += 1
        case = outside_known_issues(case, issues)
        moved_out = (case.q_dtype, case.values) != (q_dtype, values)
        if moved_out or case.num_tokens == 0:
            return
        try:
            comparison = check_differential(target, backend, case.arrays(), case.options())
        except CannotRun:
            return
        except PropertyFailure as failure:
            row.judged += 1
            row.failures.append((type(failure).__name__, repr(case), str(failure).splitlines()[0][:160]))
            return
        row.judged += 1
        row.ratios.append(comparison.max_ratio)

    try:
        hypothesis.seed(seed)(judge)()
    except hypothesis.errors.InvalidArgument:  # the capabilities hold no case of this pair
        return None
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", default=",".join(SHIPPED))
    parser.add_argument("--generations", default="auto")
    parser.add_argument("--examples", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", default=FAST_INTERPRET, choices=(FAST_INTERPRET, INTERPRET))
    parser.add_argument("--q-dtypes", default="", help="only these q dtypes (comma-separated; default: all)")
    args = parser.parse_args(argv)
    print(
        f"{'target':34} {'gen':4} {'q/kv':26} {'values':7} {'judged':>6} {'fail':>4} {'max':>7} {'median':>7}  avoided"
    )
    total_failures = 0
    for name in args.targets.split(","):
        try:
            target = targets.load(name)
        except targets.TargetError as error:
            print(f"{name}: not run: {error}")
            continue
        chosen = generations.select(args.generations, target.capabilities.tpu_generations)
        for generation in chosen or (generations.NONE,):
            backend = Backend(args.backend, generation=generation)
            capabilities = target.capabilities_on(backend)
            wanted = set(filter(None, args.q_dtypes.split(","))) or set(capabilities.q_dtypes)
            for q_dtype in (d for d in capabilities.q_dtypes if d in wanted):
                for kv_dtype in capabilities.kv_dtypes:
                    for index, values in enumerate(VALUE_PROFILES):
                        started = time.perf_counter()
                        row = sweep(
                            target, backend, q_dtype, kv_dtype, values, args.examples, args.seed + index
                        )
                        if row is None:
                            print(
                                f"{target.name[-34:]:34} {generation[:4]:4} {q_dtype}/{kv_dtype}: not drawable"
                            )
                            break
                        ratios = row.ratios or [float("nan")]
                        avoided = ", ".join(f"{k} {v}" for k, v in row.avoided.items())
                        print(f"{target.name[-34:]:34} {generation[:4]:4} {q_dtype + '/' + kv_dtype:26} {values:7} "
                              f"{row.judged:6} {len(row.failures):4} {max(ratios):7.3g} "
                              f"{statistics.median(ratios):7.3g}  {avoided} ({time.perf_counter() - started:.0f} s)",
                              flush=True)  # fmt: skip
                        for kind, case, line in row.failures[:1]:
                            print(f"    {kind}: {line}\n    {case}", flush=True)
                        total_failures += len(row.failures)
    print(f"failures: {total_failures}")
    return 1 if total_failures else 0


if __name__ == "__main__":
    sys.exit(main())
