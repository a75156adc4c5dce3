"""Calibrates the tolerance model: error/bound ratios of a target against the float64 oracle.

    python benchmarks/tolerance_calibration.py N [--seed S] [--target MODULE:FUNCTION]
    python benchmarks/tolerance_calibration.py N --contracts [--seed S]

Draws N random ragged cases (unit-normal data, NaN poison and garbage metadata, a few static shapes so the
target compiles a bounded number of times), runs the target (default: the jnp reference) and reports, per
(q dtype, KV dtype): the largest and 99.9th-percentile error/bound ratio, the false alarms (cases whose
comparison fails), and how much tighter the bound is than upstream's tolerance (atol = rtol = 0.15 for a
float32 cache, 0.2 otherwise): the smallest and median of (atol + rtol |o|) / bound over the elements.
``calibrate(target, cases)`` accepts any iterable of ``Case``s, e.g. from the strategies.

``--contracts`` calibrates the precision contracts instead: on each case, for float32, each contract alone
and all of them combined, ``rpa_harness.reference.variants.contract_attention`` makes exactly the contract's choices
(KV blocks of 1, 2 or 8 pages) and is judged under that contract (false alarms: must be 0) and under
float32 alone ("alarms off": what the choice costs without the contract). Per contract and dtype pair it
reports the largest error/bound under the contract and under float32, and the median bound relative to the
float32 bound and to upstream's tolerance.
"""

import argparse
import collections
import importlib
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rpa_harness.reference import CONTRACTS, compare, error_bound, oracle  # noqa: E402
from rpa_harness.reference.variants import contract_attention  # noqa: E402
from rpa_harness.strategies.case import Case  # noqa: E402
from rpa_harness.strategies.shapes import config_fields  # noqa: E402

F32 = np.dtype(np.float32)
DTYPE_PAIRS = (
    ("float32", "float32"),
    ("float32", "bfloat16"),
    ("float32", "float8_e5m2"),
    ("bfloat16", "bfloat16"),
    ("bfloat16", "float32"),
    ("bfloat16", "float8_e4m3fn"),
)
# (max_num_batched_tokens, max_num_seqs, pages_per_seq, page_size, num_q_heads, num_kv_heads, head_dim)
SHAPES = (
    (16, 3, 8, 4, 4, 2, 64),
    (48, 4, 12, 8, 8, 2, 128),
    (24, 2, 40, 1, 2, 1, 128),
)
OPTIONS = (
    {},
    {"sliding_window": 5},
    {"soft_cap": 5.0},
    {"mask_value": -1.0},
    {"k_scale": 0.5, "v_scale": 2.0},
    {"sm_scale": 1.0},  # unscaled logits: a peaked softmax
)
KV_PAGES_PER_BLOCK = (1, 2, 8)
CONTRACT_SETS = (
    *((name,) for name in CONTRACTS),
    tuple(CONTRACTS),
)


def random_case(rng) -> Case:
    """One random valid case (NaN poison, garbage metadata)."""
    num_tokens, max_seqs, pages_per_seq, page_size, num_q_heads, num_kv_heads, head_dim = SHAPES[
        rng.integers(len(SHAPES))
    ]
    q_dtype, kv_dtype = DTYPE_PAIRS[rng.integers(len(DTYPE_PAIRS))]
    capacity = pages_per_seq * page_size
    q_lens, kv_lens = [], []
    for _ in range(rng.integers(1, max_seqs + 1)):
        kv_len = int(rng.integers(1, capacity + 1))
        kind = rng.integers(4)  # decode, prefill, chunked prefill, no query rows
        q_len = [1, kv_len, int(rng.integers(1, kv_len + 1)), 0][kind]
        q_len = min(q_len, num_tokens - sum(q_lens))
        q_lens.append(q_len)
        kv_lens.append(kv_len)
    sizes = (num_tokens, max_seqs, pages_per_seq, max_seqs * pages_per_seq + 1)
    heads = (num_kv_heads, num_q_heads // num_kv_heads, head_dim)
    return Case(
        **config_fields(sizes, page_size, heads, q_dtype, kv_dtype),
        q_lens=tuple(q_lens),
        kv_lens=tuple(kv_lens),
        seed=int(rng.integers(2**32)),
        garbage=True,
        **{"sm_scale": head_dim**-0.5, **OPTIONS[rng.integers(len(OPTIONS))]},
    )


def calibrate(target, cases):
    """Runs ``target`` on each ``Case``; returns per-dtype-pair statistics (element
    ratios, bound tightness, case and false-alarm counts) and the worst comparison seen."""
    groups = collections.defaultdict(lambda: {"cases": 0, "false_alarms": 0, "ratios": [], "tightness": []})
    worst = None
    for case in cases:
        arrays, options = case.arrays(), case.options()
        result = oracle(**arrays, **options)
        actual = target(**arrays, **options)
        comparison = compare(actual, result, label="target")
        if worst is None or comparison.max_ratio > worst.max_ratio:
            worst = comparison
        group = groups[(str(result.q_dtype), str(result.kv_dtype))]
        group["cases"] += 1
        group["false_alarms"] += not comparison.ok
        owned = result.owned_rows
        expected = result.out[owned]
        bound = error_bound(result)[owned]
        got = np.asarray(actual).astype(np.float64)[owned]
        group["ratios"].append((np.abs(got - expected) / bound).ravel())
        group["tightness"].append((upstream_tolerance(result, expected) / bound).ravel())
    return groups, worst


def upstream_tolerance(result, expected):
    return (0.15 if result.kv_dtype == F32 else 0.2) * (1 + np.abs(expected))


def calibrate_contracts(cases, contract_sets=CONTRACT_SETS, seed=0):
    """For each case, runs the variant of each contract set and judges it under that set and under
    float32; returns per (contract set, q dtype, KV dtype) statistics and the worst comparison seen."""
    rng = np.random.default_rng(seed)
    groups = collections.defaultdict(
        lambda: {"cases": 0, "alarms": 0, "alarms_off": 0, "ratios": [], "ratios_off": [], "vs_f32": [],
                 "vs_upstream": []}
    )  # fmt: skip
    worst = None
    for case in cases:
        arrays, options = case.arrays(), case.options()
        result = oracle(**arrays, **options)
        owned = result.owned_rows
        expected = result.out[owned]
        base_bound = error_bound(result)[owned]
        blocks = int(rng.choice(KV_PAGES_PER_BLOCK))
        for contracts in contract_sets:
            actual = contract_attention(
                **arrays,
                **options,
                precision=contracts,
                kv_pages_per_block=blocks,
                seed=int(rng.integers(1 << 30)),
            )
            comparison = compare(actual, result, label=" + ".join(contracts), precision=contracts)
            off = compare(actual, result, label=" + ".join(contracts))
            if comparison.max_ratio > (worst.max_ratio if worst else -1):
                worst = comparison
            group = groups[(contracts, str(result.q_dtype), str(result.kv_dtype))]
            group["cases"] += 1
            group["alarms"] += not comparison.ok
            group["alarms_off"] += not off.ok
            group["ratios"].append(comparison.max_ratio)
            group["ratios_off"].append(off.max_ratio)
            if expected.size:
                bound = error_bound(result, precision=contracts)[owned]
                group["vs_f32"].append((bound / base_bound).ravel())
                group["vs_upstream"].append((upstream_tolerance(result, expected) / bound).ravel())
    return groups, worst


def contract_report(groups, worst):
    header = (
        f"{'contract':<30} {'q':>8} {'kv':>13} {'cases':>5} {'alarms':>6} {'max ratio':>9} "
        f"{'off: alarms':>11} {'max ratio':>9} {'bound/f32':>9} {'upstream/bound':>14}"
    )
    lines = [header]
    for (contracts, q_dtype, kv_dtype), group in groups.items():
        vs_f32 = np.concatenate(group["vs_f32"] or [np.full(1, np.nan)])
        vs_upstream = np.concatenate(group["vs_upstream"] or [np.full(1, np.nan)])
        name = "all" if len(contracts) == len(CONTRACTS) else contracts[-1]
        lines.append(
            f"{name:<30} {q_dtype:>8} {kv_dtype:>13} {group['cases']:>5} {group['alarms']:>6} "
            f"{max(group['ratios']):>9.3g} {group['alarms_off']:>11} {max(group['ratios_off']):>9.3g} "
            f"{np.median(vs_f32):>9.3g} {np.median(vs_upstream):>14.3g}"
        )
    totals = collections.Counter()
    for (contracts, _, _), group in groups.items():
        totals[contracts] += group["alarms"]
    lines.append(
        "false alarms per contract: "
        + ", ".join(f"{'all' if len(c) == len(CONTRACTS) else c[-1]} {n}" for c, n in totals.items())
    )
    lines.append(
        "max ratio: largest error/bound of a case under the contract; off: the same output judged under "
        "float32; "
        "bound/f32 and upstream/bound: medians over elements (upstream = 0.15 or 0.2 (1 + |o|))"
    )
    if worst is not None:
        lines.append("worst case under its contract:\n" + str(worst))
    return "\n".join(lines)


def report(groups, worst):
    header = (
        f"{'q':>9} {'kv':>14} {'cases':>6} {'alarms':>6} {'max ratio':>10} {'p99.9':>9} "
        f"{'tighter min':>11} {'median':>9}"
    )
    lines = [header]
    for (q_dtype, kv_dtype), group in sorted(groups.items()):
        ratios = np.concatenate(group["ratios"] or [np.zeros(0)])
        tightness = np.concatenate(group["tightness"] or [np.zeros(0)])
        if not ratios.size:
            lines.append(f"{q_dtype:>9} {kv_dtype:>14} {group['cases']:>6} (no owned rows)")
            continue
        lines.append(
            f"{q_dtype:>9} {kv_dtype:>14} {group['cases']:>6} {group['false_alarms']:>6} {ratios.max():>10.3g} "
            f"{np.quantile(ratios, 0.999):>9.3g} {tightness.min():>11.3g} {np.median(tightness):>9.3g}"
        )
    total_cases = sum(g["cases"] for g in groups.values())
    total_alarms = sum(g["false_alarms"] for g in groups.values())
    lines.append(f"all: {total_cases} cases, {total_alarms} false alarms")
    lines.append(
        "tighter = (upstream atol + rtol |o|) / bound, upstream atol = rtol = 0.15 (f32 cache) or 0.2"
    )
    if worst is not None:
        lines.append("worst case:\n" + str(worst))
    return "\n".join(lines)


def load_target(spec):
    module_name, _, function_name = spec.partition(":")
    if not function_name:
        raise SystemExit(
            f"--target {spec!r} must look like MODULE:FUNCTION, e.g. reference:ragged_paged_attention"
        )
    return getattr(importlib.import_module(module_name), function_name)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("num_cases", type=int, help="number of random cases")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target", default="reference:ragged_paged_attention", help="MODULE:FUNCTION")
    parser.add_argument(
        "--contracts", action="store_true", help="calibrate the precision contracts on their NumPy variants"
    )
    args = parser.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    start = time.perf_counter()
    if args.contracts:
        groups, worst = calibrate_contracts((random_case(rng) for _ in range(args.num_cases)), seed=args.seed)
        print(contract_report(groups, worst))
        print(
            f"{args.num_cases} cases x {len(CONTRACT_SETS)} variants in {time.perf_counter() - start:.1f} s"
        )
        return 1 if any(g["alarms"] for g in groups.values()) else 0
    target = load_target(args.target)
    groups, worst = calibrate(target, (random_case(rng) for _ in range(args.num_cases)))
    print(report(groups, worst))
    print(f"{args.num_cases} cases in {time.perf_counter() - start:.1f} s")
    return 1 if any(g["false_alarms"] for g in groups.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
