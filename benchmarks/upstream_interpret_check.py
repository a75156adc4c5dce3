"""Run upstream's ragged paged attention kernel in jax's CPU interpreters across its configuration space.

For each configuration (one axis varied at a time around a base case) and each interpreter, prints the
maximum absolute error against a float64 NumPy computation written here, the cold (trace + compile) and
warm time per call, and whether upstream accepted the configuration. The summary at the end lists, per
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
import numpy as np
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as upstream

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness import interpret_compat  # noqa: E402

# Error above which a result counts as a discrepancy, by query dtype: the oracle reads the same stored
# (already rounded) inputs, so only the kernel's own arithmetic contributes.
TOLERANCE = {"float32": 1e-4, "bfloat16": 5e-2}


@dataclasses.dataclass(frozen=True)
class Config:
    axis: str
    q_dtype: str = "float32"
    kv_dtype: str = "float32"
    q_heads: int = 4
    kv_heads: int = 2
    head_dim: int = 128
    page_size: int = 16
    pages_per_seq: int = 4
    kv_pages_per_block: int = 2
    queries_per_block: int = 8
    num_tokens: int = 16
    seqs: tuple[tuple[int, int], ...] = ((5, 37), (1, 9), (6, 6))  # (q_len, kv_len); rest is padding
    sliding_window: int | None = None
    soft_cap: float | None = None
    k_scale: float | None = None
    v_scale: float | None = None
    poison_unused_kv: bool = False  # NaN in every KV slot no sequence reads (vLLM poisons unused slots)

    def label(self) -> str:
        base = Config(axis="")
        changed = [
            f"{field.name}={getattr(self, field.name)}"
            for field in dataclasses.fields(self)
            if field.name != "axis" and getattr(self, field.name) != getattr(base, field.name)
        ]
        return ", ".join(changed) or "base"


def sweep() -> list[Config]:
    configs = [Config("base")]
    configs += [Config("head_dim", head_dim=d) for d in (64, 256)]
    for q_dtype, kv_dtype, scales in [
        ("bfloat16", "bfloat16", None),
        ("float32", "bfloat16", None),
        ("float32", "float8_e4m3fn", None),
        ("bfloat16", "float8_e4m3fn", (0.5, 2.0)),
        ("bfloat16", "float8_e5m2", None),
    ]:
        k_scale, v_scale = scales or (None, None)
        configs.append(Config("dtypes", q_dtype=q_dtype, kv_dtype=kv_dtype, k_scale=k_scale, v_scale=v_scale))
    for q_dtype, kv_dtype in [
        ("float32", "float32"),
        ("bfloat16", "bfloat16"),
        ("bfloat16", "float8_e4m3fn"),
    ]:
        for q_heads, kv_heads in [(1, 1), (8, 1), (6, 3), (4, 4), (16, 8)]:
            configs.append(
                Config("heads", q_dtype=q_dtype, kv_dtype=kv_dtype, q_heads=q_heads, kv_heads=kv_heads)
            )
    configs += [Config("page_size", page_size=p, pages_per_seq=-(-40 // p)) for p in (1, 5, 8, 32)]
    configs += [Config("kv_pages_per_block", kv_pages_per_block=b) for b in (1, 3, 4)]
    configs += [Config("queries_per_block", queries_per_block=b) for b in (1, 4, 16, 32)]
    configs += [
        Config("features", sliding_window=8),
        Config("features", soft_cap=5.0),
        Config("features", sliding_window=20, soft_cap=30.0, k_scale=0.5, v_scale=1.5),
        Config("features", poison_unused_kv=True),
        Config("features", q_dtype="bfloat16", kv_dtype="bfloat16", poison_unused_kv=True),
        Config("edges", seqs=((3, 20), (0, 9), (4, 4))),  # empty query run between sequences
        Config("edges", seqs=((3, 20), (0, 0), (4, 4))),  # empty sequence
        Config("edges", seqs=((16, 16),)),  # one prefill filling every token
        Config("edges", seqs=((1, 40), (1, 1), (1, 17), (1, 33))),  # decode batch
        Config("edges", queries_per_block=4, seqs=((3, 30), (3, 7), (6, 6))),  # sequences straddle q blocks
        Config(
            "size",
            q_heads=8,
            kv_heads=2,
            num_tokens=64,
            pages_per_seq=8,
            queries_per_block=16,
            seqs=((20, 100), (1, 77), (1, 3), (16, 16), (9, 128), (2, 50)),
        ),
    ]
    return configs


QUICK_AXES = ("base", "dtypes")


def make_inputs(config: Config, seed: int = 0):
    rng = np.random.default_rng(seed)
    max_num_seqs = len(config.seqs) + 1  # one padding slot
    total_pages = max_num_seqs * config.pages_per_seq
    q = rng.standard_normal((config.num_tokens, config.q_heads, config.head_dim)).astype(np.float32)
    kv = rng.standard_normal((total_pages, config.page_size, 2 * config.kv_heads, config.head_dim))
    kv = kv.astype(np.float32)
    kv_lens = np.zeros(max_num_seqs, np.int32)
    cu_q_lens = np.zeros(max_num_seqs + 1, np.int32)
    for i, (q_len, kv_len) in enumerate(config.seqs):
        kv_lens[i], cu_q_lens[i + 1] = kv_len, cu_q_lens[i] + q_len
    cu_q_lens[len(config.seqs) + 1 :] = cu_q_lens[len(config.seqs)]
    page_indices = rng.permutation(total_pages).reshape(max_num_seqs, config.pages_per_seq).astype(np.int32)
    if config.poison_unused_kv:
        used = np.zeros((total_pages, config.page_size), bool)
        for i, (_, kv_len) in enumerate(config.seqs):
            slots = np.arange(kv_len)
            used[page_indices[i, slots // config.page_size], slots % config.page_size] = True
        kv[~used] = np.nan
    return (
        jnp.asarray(q, config.q_dtype),
        jnp.asarray(kv, config.kv_dtype),
        jnp.asarray(kv_lens),
        jnp.asarray(page_indices),
        jnp.asarray(cu_q_lens),
        jnp.asarray([len(config.seqs)], jnp.int32),
    )


def float64_attention(config: Config, q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale):
    """Attention per sequence in float64 from the stored (already rounded) inputs; -inf masking."""
    q = np.asarray(q.astype(jnp.float32), np.float64)
    kv_pages = np.asarray(kv_pages.astype(jnp.float32), np.float64)
    group = config.q_heads // config.kv_heads
    outputs = []
    for i in range(int(num_seqs[0])):
        q_start, q_end, kv_len = int(cu_q_lens[i]), int(cu_q_lens[i + 1]), int(kv_lens[i])
        if q_end == q_start:
            continue  # no query rows: nothing to produce (kv_len may be 0)
        pages = kv_pages[np.asarray(page_indices[i])].reshape(-1, 2 * config.kv_heads, config.head_dim)[
            :kv_len
        ]
        keys = np.repeat(pages[:, 0::2] * (config.k_scale or 1.0), group, axis=1)
        values = np.repeat(pages[:, 1::2] * (config.v_scale or 1.0), group, axis=1)
        logits = np.einsum("qhd,khd->hqk", q[q_start:q_end], keys) * sm_scale
        if config.soft_cap is not None:
            logits = config.soft_cap * np.tanh(logits / config.soft_cap)
        position = kv_len - (q_end - q_start) + np.arange(q_end - q_start)[:, None]
        key = np.arange(kv_len)[None, :]
        masked = key > position
        if config.sliding_window is not None:
            masked |= position - config.sliding_window >= key
        logits = np.where(masked[None], -np.inf, logits)
        weights = np.exp(logits - logits.max(axis=-1, keepdims=True))
        weights /= weights.sum(axis=-1, keepdims=True)
        outputs.append(np.einsum("hqk,khd->qhd", weights, values))
    return np.concatenate(outputs, axis=0) if outputs else np.zeros((0, config.q_heads, config.head_dim))


@dataclasses.dataclass
class Result:
    status: str  # ok | DISCREPANCY | rejected | interpreter-error
    max_abs_error: float = float("nan")
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
    args = make_inputs(config)
    sm_scale = config.head_dim**-0.5
    options = dict(
        sm_scale=sm_scale,
        sliding_window=config.sliding_window,
        soft_cap=config.soft_cap,
        k_scale=config.k_scale,
        v_scale=config.v_scale,
        num_kv_pages_per_block=config.kv_pages_per_block,
        num_queries_per_block=config.queries_per_block,
    )
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
    expected = float64_attention(config, *args, sm_scale=sm_scale)
    got = np.asarray(out.astype(jnp.float32), np.float64)[: expected.shape[0]]
    error = float(np.max(np.abs(got - expected))) if np.isfinite(got).all() else float("nan")
    tolerance = TOLERANCE[config.q_dtype]
    status = "ok" if error <= tolerance else "DISCREPANCY"
    detail = f"{int((~np.isfinite(got)).sum())} non-finite outputs" if np.isnan(error) else ""
    return Result(status, error, cold, warm if warm_calls else float("nan"), detail)


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
    header = f"{'axis':<19} {'configuration':<62} {'interp':<8} {'status':<17} {'max|err|':>9} {'cold s':>7} {'warm s':>7}"
    print(header)
    print("-" * len(header))
    results: list[tuple[Config, str, Result]] = []
    for config in configs:
        for interpreter in interpreters:
            result = run_one(config, interpreter, arguments.warm_calls)
            results.append((config, interpreter, result))
            print(
                f"{config.axis:<19} {config.label()[:62]:<62} {interpreter:<8} {result.status:<17} "
                f"{result.max_abs_error:>9.2e} {result.cold_s:>7.2f} {result.warm_s:>7.3f}"
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
