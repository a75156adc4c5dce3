"""How far apart two computations of one kernel land when their float32 results differ by a few ulps before
the output is rounded to bfloat16: the part of |chip - interpreter| no emulation short of the chip's bits
removes.

    PYTHONPATH=. python benchmarks/output_rounding_flips.py [--count 60] [--ulps 86]

Draws ``--count`` valid configurations of the bundled kernel with bfloat16 queries (so a bfloat16 output),
runs each on the fast interpreter emulating a v5e as it is, then with every exp inside the kernel off by up
to ``--ulps`` float32 ulps (the largest error of the v5e's exp measured by benchmarks/chip_arithmetic.py, a
deterministic pseudo-random amount per argument), and reports per KV dtype what `rpa-harness chip agreement`
reports for a chip, under the chip's contract (``tpu-transcendentals`` included): the largest and median |perturbed - plain| as a fraction of the judge's bound, the
largest in units of the output's last place, and the largest fraction of the bound where the two are more
than one unit apart.
"""

import argparse
import dataclasses
from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given
from jax import lax

from rpa_harness.drawn import same_examples


def perturbed_exp(ulps: int):
    """exp, its float32 result moved by a pseudo-random whole number of ulps in [-ulps, ulps] that the
    argument's bits decide (the same argument, the same error, as a chip's exp)."""

    def exp(x):
        result = jnp.exp(x)
        if result.dtype != jnp.float32:
            return result
        seed = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32) * jnp.uint32(2654435761)
        offset = (seed >> 9).astype(jnp.int32) % (2 * ulps + 1) - ulps
        moved = lax.bitcast_convert_type(lax.bitcast_convert_type(result, jnp.int32) + offset, jnp.float32)
        return jnp.where(result > 0, moved, result)

    return exp


def draw(count: int, target, backend) -> list:
    from rpa_harness.strategies.valid import valid_cases

    capabilities = dataclasses.replace(target.capabilities_on(backend), q_dtypes=("bfloat16",))
    drawn = []

    @same_examples(count)
    @given(case=valid_cases(capabilities, pooled=True, excluding=target.known_issues_on(backend)))
    def collect(case):
        drawn.append(case)

    collect()
    return drawn[:count]


def outputs(target, backend, cases) -> list[np.ndarray]:
    from rpa_harness import checks

    return [checks.run_valid(target, backend, case.arrays(), case.options()) for case in cases]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--count", type=int, default=60, help="configurations (default 60)")
    parser.add_argument(
        "--ulps", type=int, default=86, help="the largest exp error in float32 ulps (default 86)"
    )
    args = parser.parse_args()
    from rpa_harness import checks, device, reference, targets
    from rpa_harness.kernel import pallas_rpa
    from rpa_harness.reference.tolerance import error_bound, half_ulp

    target = targets.load(targets.DEFAULT_TARGET)
    backend = device.Backend(device.FAST_INTERPRET, True, "v5e")
    cases = draw(args.count, target, backend)
    plain = outputs(target, backend, cases)
    jax.clear_caches()
    pallas_rpa.jnp = type(
        "PerturbedNumpy", (), {"__getattr__": staticmethod(lambda name: getattr(jnp, name))}
    )()
    pallas_rpa.jnp.exp = perturbed_exp(args.ulps)
    try:
        moved = outputs(target, backend, cases)
    finally:
        pallas_rpa.jnp = jnp
    # The chip's contract, as `rpa-harness chip agreement` judges the chip's outputs: its exp is not correctly rounded.
    chip_precision = target.precision_on(device.Backend(device.TPU))
    rows: dict[str, dict] = defaultdict(lambda: {"n": 0, "gaps": [], "units": 0.0, "beyond": 0.0, "flips": 0})
    for case, first, second in zip(cases, plain, moved, strict=True):
        arrays, options = case.arrays(), case.options()
        expected = reference.oracle(**arrays, **options)
        bound = error_bound(expected, precision=chip_precision)
        live = checks.valid_rows(arrays)
        apart = np.abs(second.astype(np.float64) - first.astype(np.float64))[live]
        gap = apart / bound[live]
        larger = np.maximum(np.abs(first.astype(np.float64)), np.abs(second.astype(np.float64)))[live]
        units = apart / (2 * half_ulp(larger, first.dtype))
        row = rows[case.kv_dtype]
        row["n"] += 1
        row["gaps"].append(float(gap.max(initial=0.0)))
        row["units"] = max(row["units"], float(units.max(initial=0.0)))
        row["beyond"] = max(row["beyond"], float(gap[units > 1].max(initial=0.0)))
        row["flips"] += int((units > 0).sum())
    print(
        f"bundled kernel, bfloat16 queries, fast interpreter emulating a v5e; exp off by up to {args.ulps} ulps"
    )
    print(
        "| q / kv | configurations | abs(moved - plain) / bound: max, median | output units apart: max "
        "| / bound where over 1 unit | elements that moved |"
    )
    print("|---|---|---|---|---|---|")
    for kv, row in sorted(rows.items()):
        gaps = sorted(row["gaps"])
        print(
            f"| bfloat16 / {kv} | {row['n']} | {gaps[-1]:.3g}, {gaps[len(gaps) // 2]:.3g} | {row['units']:.3g} "
            f"| {row['beyond']:.3g} | {row['flips']} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
