"""What each shipped target's precision contract costs: its bound against float32's, on its own cases.

    python benchmarks/contract_cost.py [N] [--target NAME ...] [--seed S]

For each target (default: every shipped target that loads here) it draws N cases (default 200) from the
target's own strategies (its capabilities, the pooled configurations and the whole space, the tiny and
small buckets), computes the float64 oracle, and compares the bound under the target's declared contract
(``RPA_HARNESS_PRECISION``) with the bound under float32 alone, element by element over the live rows. It
prints, per target and (q dtype, KV dtype), the median of bound / float32's bound and the median tightness
against upstream's tolerance (0.15 or 0.2 (1 + |o|)). No kernel runs: the bound depends on the case and the
contract only, so this says how much a declared choice widens the judge, not how close a kernel comes to it
(``rpa-harness run``'s summary gives the error/bound a kernel reaches).
"""

import argparse
import collections
import sys
import time

import numpy as np
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from rpa_harness import targets
from rpa_harness.reference import error_bound, oracle
from rpa_harness.strategies.valid import valid_cases

FLOAT32 = ("float32",)


def drawn_cases(target: targets.Target, count: int, random_seed: int) -> list:
    """``count`` cases of the target's strategies, half pooled, half from the whole space, reproducibly."""
    strategy = st.one_of(valid_cases(target.capabilities, pooled=True), valid_cases(target.capabilities))
    cases: list = []

    @seed(random_seed)
    @settings(max_examples=count, database=None, deadline=None, suppress_health_check=list(HealthCheck))
    @given(strategy)
    def collect(case):
        cases.append(case)

    collect()
    return cases


def contract_cost(target: targets.Target, cases) -> dict:
    """Per (q dtype, KV dtype): the live elements' bound / float32's bound and upstream tolerance / bound."""
    groups = collections.defaultdict(lambda: {"cases": 0, "vs_f32": [], "vs_upstream": []})
    for case in cases:
        result = oracle(**case.arrays(), **case.options())
        owned = result.owned_rows
        expected = result.out[owned]
        if not expected.size:
            continue
        bound = error_bound(result, precision=target.precision)[owned]
        base = error_bound(result, precision=FLOAT32)[owned]
        upstream = (0.15 if result.kv_dtype == np.float32 else 0.2) * (1 + np.abs(expected))
        group = groups[(str(result.q_dtype), str(result.kv_dtype))]
        group["cases"] += 1
        group["vs_f32"].append((bound / base).ravel())
        group["vs_upstream"].append((upstream / bound).ravel())
    return groups


def report(name: str, precision, groups: dict) -> str:
    lines = [f"{name}: precision {', '.join(precision)}"]
    everything_f32, everything_upstream = [], []
    for (q, kv), group in sorted(groups.items()):
        vs_f32, vs_upstream = np.concatenate(group["vs_f32"]), np.concatenate(group["vs_upstream"])
        everything_f32.append(vs_f32)
        everything_upstream.append(vs_upstream)
        lines.append(
            f"  {q:>9} {kv:>14} {group['cases']:>5} cases  bound/f32 median {np.median(vs_f32):>8.3g}  "
            f"upstream/bound median {np.median(vs_upstream):>8.3g}"
        )
    if everything_f32:
        lines.append(
            f"  {'all':>24} {sum(g['cases'] for g in groups.values()):>5} cases  bound/f32 median "
            f"{np.median(np.concatenate(everything_f32)):>8.3g}  upstream/bound median "
            f"{np.median(np.concatenate(everything_upstream)):>8.3g}"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("num_cases", type=int, nargs="?", default=200, help="cases per target (default 200)")
    parser.add_argument(
        "--target", action="append", help="a target module (repeatable; default: every shipped one)"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.num_cases < 1:
        parser.error(f"num_cases={args.num_cases}: give at least 1 case per target")
    names = args.target or [shipped.name for shipped in targets.SHIPPED]
    for name in names:
        try:
            target = targets.load(name)
        except targets.TargetError as error:
            print(f"{name}: not here: {str(error).splitlines()[0][:200]}")
            continue
        start = time.perf_counter()
        groups = contract_cost(target, drawn_cases(target, args.num_cases, args.seed))
        print(report(target.name, target.precision, groups))
        print(f"  ({time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
