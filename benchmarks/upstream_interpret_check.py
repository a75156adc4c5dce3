"""Run upstream's ragged paged attention kernel in jax's CPU interpreters across its configuration space.

For each configuration (one axis varied at a time around a base case) and each interpreter, prints the
largest error / bound against the float64 oracle under the tolerance model (``reference.compare``), the
cold (trace + compile) and warm time per call, and whether upstream accepted the configuration. The summary at the end lists, per
axis, which values run in interpret mode: the harness narrows its strategies per target from it.

    python benchmarks/upstream_interpret_check.py            # full sweep (several minutes on 2 cores)
    python benchmarks/upstream_interpret_check.py --quick    # a handful of configurations
    python benchmarks/upstream_interpret_check.py --only page_size --interpreters tpu
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as upstream

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import reference  # noqa: E402
from rpa_harness import interpret_compat  # noqa: E402
from rpa_harness.spec import ARRAY_NAMES  # noqa: E402
from rpa_harness.strategies.case import Case  # noqa: E402

BASE_SEQS = ((5, 37), (1, 9), (6, 6))  # (q_len, kv_len); one padding slot follows
BASE = Case(
    max_num_batched_tokens=16,
    max_num_seqs=len(BASE_SEQS) + 1,
    pages_per_seq=4,
    total_num_pages=(len(BASE_SEQS) + 1) * 4,
    page_size=16,
    num_q_heads=4,
    num_kv_heads=2,
    head_dim=128,
    q_lens=tuple(q for q, _ in BASE_SEQS),
    kv_lens=tuple(kv for _, kv in BASE_SEQS),
    sm_scale=128**-0.5,
    num_kv_pages_per_block=2,
    num_queries_per_block=8,
    poison=False,  # poison=True puts NaN in every KV slot no sequence reads (vLLM poisons unused slots)
)


@dataclasses.dataclass(frozen=True)
class Config:
    """One configuration of the sweep: the axis it varies and its case."""

    axis: str
    case: Case

    def label(self) -> str:
        changed = [
            f"{field.name}={getattr(self.case, field.name)}"
            for field in dataclasses.fields(Case)
            if field.name not in ("total_num_pages", "sm_scale")
            and getattr(self.case, field.name) != getattr(BASE, field.name)
        ]
        return ", ".join(changed) or "base"


def variant(axis: str, seqs=BASE_SEQS, **fields) -> Config:
    """BASE with ``fields`` and the layout ``seqs`` (one padding slot); sm_scale = head_dim ** -0.5."""
    case = dataclasses.replace(
        BASE,
        q_lens=tuple(q for q, _ in seqs),
        kv_lens=tuple(kv for _, kv in seqs),
        max_num_seqs=len(seqs) + 1,
        **fields,
    )
    return Config(
        axis,
        dataclasses.replace(
            case, total_num_pages=case.max_num_seqs * case.pages_per_seq, sm_scale=case.head_dim**-0.5
        ),
    )


def sweep() -> list[Config]:
    configs = [variant("base")]
    configs += [variant("head_dim", head_dim=d) for d in (64, 256)]
    for q_dtype, kv_dtype, scales in [
        ("bfloat16", "bfloat16", None),
        ("float32", "bfloat16", None),
        ("float32", "float8_e4m3fn", None),
        ("bfloat16", "float8_e4m3fn", (0.5, 2.0)),
        ("bfloat16", "float8_e5m2", None),
    ]:
        k_scale, v_scale = scales or (None, None)
        configs.append(
            variant("dtypes", q_dtype=q_dtype, kv_dtype=kv_dtype, k_scale=k_scale, v_scale=v_scale)
        )
    for q_dtype, kv_dtype in [
        ("float32", "float32"),
        ("bfloat16", "bfloat16"),
        ("bfloat16", "float8_e4m3fn"),
    ]:
        for q_heads, kv_heads in [(1, 1), (8, 1), (6, 3), (4, 4), (16, 8)]:
            configs.append(
                variant(
                    "heads", q_dtype=q_dtype, kv_dtype=kv_dtype, num_q_heads=q_heads, num_kv_heads=kv_heads
                )
            )
    configs += [variant("page_size", page_size=p, pages_per_seq=-(-40 // p)) for p in (1, 5, 8, 32)]
    configs += [variant("kv_pages_per_block", num_kv_pages_per_block=b) for b in (1, 3, 4)]
    configs += [variant("queries_per_block", num_queries_per_block=b) for b in (1, 4, 16, 32)]
    configs += [
        variant("features", sliding_window=8),
        variant("features", soft_cap=5.0),
        variant("features", sliding_window=20, soft_cap=30.0, k_scale=0.5, v_scale=1.5),
        variant("features", poison=True),
        variant("features", q_dtype="bfloat16", kv_dtype="bfloat16", poison=True),
        variant("edges", seqs=((3, 20), (0, 9), (4, 4))),  # empty query run between sequences
        variant("edges", seqs=((3, 20), (0, 0), (4, 4))),  # empty sequence
        variant("edges", seqs=((16, 16),)),  # one prefill filling every token
        variant("edges", seqs=((1, 40), (1, 1), (1, 17), (1, 33))),  # decode batch
        variant("edges", num_queries_per_block=4, seqs=((3, 30), (3, 7), (6, 6))),  # straddling q blocks
        variant(
            "size",
            num_q_heads=8,
            num_kv_heads=2,
            max_num_batched_tokens=64,
            pages_per_seq=8,
            num_queries_per_block=16,
            seqs=((20, 100), (1, 77), (1, 3), (16, 16), (9, 128), (2, 50)),
        ),
    ]
    return configs


QUICK_AXES = ("base", "dtypes")


@dataclasses.dataclass
class Result:
    status: str  # ok | DISCREPANCY | rejected | interpreter-error
    max_ratio: float = float("nan")  # largest error / bound of the tolerance model
    cold_s: float = float("nan")
    warm_s: float = float("nan")
    detail: str = ""


def last_line(error: BaseException) -> str:
    """The exception's last message line; for a bare assert, the failing source line instead."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    if not lines:
        frame = traceback.extract_tb(error.__traceback__)[-1]
        lines = [f"{Path(frame.filename).name}:{frame.lineno} {frame.line}"]
    return f"{type(error).__name__}: {lines[-1]}"[:160]


def run_one(config: Config, interpreter: str, warm_calls: int) -> Result:
    arrays, options = config.case.arrays(), config.case.options()
    args = [jnp.asarray(arrays[name]) for name in ARRAY_NAMES]
    params = pltpu.InterpretParams() if interpreter == "tpu" else True
    try:
        upstream.dynamic_validate_inputs(*args, **options)
    except (ValueError, AssertionError, NotImplementedError) as error:
        return Result("rejected", detail=last_line(error))
    try:
        with pltpu.force_tpu_interpret_mode(params):
            start = time.perf_counter()
            out = upstream.ragged_paged_attention(*args, **options).block_until_ready()
            cold = time.perf_counter() - start
            start = time.perf_counter()
            for _ in range(warm_calls):
                upstream.ragged_paged_attention(*args, **options).block_until_ready()
            warm = (time.perf_counter() - start) / max(warm_calls, 1)
    except (ValueError, AssertionError, NotImplementedError) as error:
        return Result("rejected", detail=last_line(error))
    except Exception as error:  # noqa: BLE001 - an interpreter failure is a finding, keep sweeping
        pltpu.reset_tpu_interpret_mode_state()
        return Result("interpreter-error", detail=last_line(error))
    comparison = reference.compare(out, reference.oracle(**arrays, **options), label="upstream")
    status = "ok" if comparison.ok else "DISCREPANCY"
    detail = "" if comparison.ok else str(comparison).replace("\n", ";")
    return Result(status, comparison.max_ratio, cold, warm if warm_calls else float("nan"), detail)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help=f"only the axes {QUICK_AXES}")
    parser.add_argument("--only", help="comma-separated axes to run (see the summary for names)")
    parser.add_argument("--interpreters", default="tpu,generic", help="tpu, generic or both (default)")
    parser.add_argument("--warm-calls", type=int, default=2, help="calls timed after the first (default 2)")
    arguments = parser.parse_args(argv)

    if not interpret_compat.install():
        print(
            f"upstream cannot run in interpret mode: {'; '.join(interpret_compat.unpatched_gaps().values())}"
        )
        return 2
    axes = set(QUICK_AXES) if arguments.quick else None
    if arguments.only:
        axes = set(arguments.only.split(","))
    configs = [c for c in sweep() if axes is None or c.axis in axes]
    interpreters = arguments.interpreters.split(",")
    print(f"jax {jax.__version__}, {len(configs)} configurations x {interpreters}")
    header = f"{'axis':<19} {'configuration':<62} {'interp':<8} {'status':<17} {'err/bound':>9} {'cold s':>7} {'warm s':>7}"
    print(header)
    print("-" * len(header))
    results: list[tuple[Config, str, Result]] = []
    for config in configs:
        for interpreter in interpreters:
            result = run_one(config, interpreter, arguments.warm_calls)
            results.append((config, interpreter, result))
            print(
                f"{config.axis:<19} {config.label()[:62]:<62} {interpreter:<8} {result.status:<17} "
                f"{result.max_ratio:>9.2e} {result.cold_s:>7.2f} {result.warm_s:>7.3f}"
                + (f"  {result.detail}" if result.detail else ""),
                flush=True,
            )
    print("\nSummary (configurations that are not ok):")
    problems = [(c, i, r) for c, i, r in results if r.status != "ok"]
    for config, interpreter, result in problems:
        print(f"  [{interpreter}] {config.axis}: {config.label()} -> {result.status} {result.detail}")
    if not problems:
        print("  none")
    return 1 if any(r.status in ("DISCREPANCY", "interpreter-error") for _, _, r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
