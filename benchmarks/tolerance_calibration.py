"""Calibrates the tolerance model: error/bound ratios of a target against the float64 oracle.

    python benchmarks/tolerance_calibration.py N [--seed S] [--target MODULE:FUNCTION]

Draws N random ragged cases (unit-normal data, NaN poison and garbage metadata, a few static shapes so the
target compiles a bounded number of times), runs the target (default: the jnp reference) and reports, per
(q dtype, KV dtype): the largest and 99.9th-percentile error/bound ratio, the false alarms (cases whose
comparison fails), and how much tighter the bound is than upstream's tolerance (atol = rtol = 0.15 for a
float32 cache, 0.2 otherwise): the smallest and median of (atol + rtol |o|) / bound over the elements.
``calibrate(target, cases)`` accepts any iterable of ``Case``s, e.g. from the strategies.
"""

import argparse
import collections
import importlib
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from reference import compare, error_bound, oracle  # noqa: E402
from strategies.case import Case  # noqa: E402

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
    return Case(
        max_num_batched_tokens=num_tokens,
        max_num_seqs=max_seqs,
        pages_per_seq=pages_per_seq,
        total_num_pages=max_seqs * pages_per_seq + 1,
        page_size=page_size,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        q_dtype=q_dtype,
        kv_dtype=kv_dtype,
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
        tolerance = 0.15 if result.kv_dtype == F32 else 0.2
        group["tightness"].append((tolerance * (1 + np.abs(expected)) / bound).ravel())
    return groups, worst


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
    args = parser.parse_args(argv)
    target = load_target(args.target)
    rng = np.random.default_rng(args.seed)
    start = time.perf_counter()
    groups, worst = calibrate(target, (random_case(rng) for _ in range(args.num_cases)))
    print(report(groups, worst))
    print(f"{args.num_cases} cases in {time.perf_counter() - start:.1f} s")
    return 1 if any(g["false_alarms"] for g in groups.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
