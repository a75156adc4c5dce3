"""Interpret-mode cost of our kernel: cold and warm time per call, and compilations, on both interpreters.

For each size, the first call (cold: trace, lower, compile, run) is timed, then ``--warm-calls`` calls with
the same shapes but a different ragged layout and data each time (warm: metadata is traced, so a new
layout must not recompile). Compilations are counted with a ``jax.monitoring`` listener on the backend
compile event (every XLA compilation in the process, the interpreter's included) and cross-checked with
the size of the kernel's jit cache.

    python benchmarks/bench_kernel.py [--sizes tiny,medium,upstream_scaled] [--warm-calls 3]
"""

import argparse
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import dispatch
from jax.experimental.pallas import tpu as pltpu

from kernel.pallas_rpa import ragged_paged_attention


@dataclasses.dataclass(frozen=True)
class Size:
    """Static shapes and the (q_len, kv_len) layout of the cold call; warm calls permute and shrink it."""

    seqs: tuple
    num_tokens: int
    max_num_seqs: int
    pages_per_seq: int
    page_size: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int


# Upstream's test layout, lengths divided by 4 (q_len <= kv_len kept), 32/8 heads divided by 4.
_UPSTREAM_SEQS = ((1, 1328), (5, 18), (1, 129), (120, 229), (1, 122), (1, 64), (32, 100), (250, 463), (1, 18),
                  (1, 17), (99, 123))  # fmt: skip
_UPSTREAM_SCALED = tuple((-(-q // 4), -(-kv // 4)) for q, kv in _UPSTREAM_SEQS)

SIZES = {
    "tiny": Size(((1, 20), (6, 6)), 8, 2, 2, 16, 4, 2, 128),
    "medium": Size(
        ((1, 40), (5, 18), (0, 3), (20, 60), (1, 1), (12, 64), (1, 33), (8, 8)), 64, 8, 4, 16, 4, 2, 128
    ),
    "upstream_scaled": Size(
        _UPSTREAM_SCALED,
        sum(q for q, _ in _UPSTREAM_SCALED),
        len(_UPSTREAM_SCALED),
        -(-max(kv for _, kv in _UPSTREAM_SCALED) // 16),
        16,
        8,
        2,
        128,
    ),
}
INTERPRETERS = {"tpu_interpreter": pltpu.InterpretParams(), "generic_interpreter": True}


def make_arrays(size, seqs, seed):
    """Random q and cache for ``seqs``; every page of the cache is owned by at most one sequence."""
    rng = np.random.default_rng(seed)
    total_num_pages = size.max_num_seqs * size.pages_per_seq
    q = rng.standard_normal((size.num_tokens, size.num_q_heads, size.head_dim), np.float32)
    kv = rng.standard_normal(
        (total_num_pages, size.page_size, 2 * size.num_kv_heads, size.head_dim), np.float32
    )
    page_indices = rng.permutation(total_num_pages).astype(np.int32).reshape(size.max_num_seqs, -1)
    kv_lens = np.zeros(size.max_num_seqs, np.int32)
    kv_lens[: len(seqs)] = [kv for _, kv in seqs]
    cu_q_lens = np.zeros(size.max_num_seqs + 1, np.int32)
    cu_q_lens[1 : len(seqs) + 1] = np.cumsum([q for q, _ in seqs])
    cu_q_lens[len(seqs) + 1 :] = cu_q_lens[len(seqs)]
    num_seqs = np.array([len(seqs)], np.int32)
    return [jnp.asarray(a) for a in (q, kv, kv_lens, page_indices, cu_q_lens, num_seqs)]


def warm_layout(size, rng):
    """The cold layout in a random order with random shorter lengths (never longer: shapes must hold)."""
    seqs = []
    for q_len, kv_len in rng.permutation(np.array(size.seqs)):
        new_kv = int(rng.integers(max(q_len, 1), kv_len + 1))
        seqs.append((int(rng.integers(0, min(q_len, new_kv) + 1)), new_kv))
    return seqs


class CompileCounter:
    """Counts XLA backend compilations reported through ``jax.monitoring``."""

    def __init__(self):
        self.count = 0
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event, duration_secs, **kwargs):
        del duration_secs, kwargs
        if event == dispatch.BACKEND_COMPILE_EVENT:
            self.count += 1


def bench(size, interpreter, warm_calls, counter):
    rng = np.random.default_rng(0)
    with pltpu.force_tpu_interpret_mode(interpreter):
        args = make_arrays(size, size.seqs, seed=0)
        compiles_before, cache_before = counter.count, ragged_paged_attention._cache_size()
        start = time.perf_counter()
        ragged_paged_attention(*args).block_until_ready()
        cold = time.perf_counter() - start
        cold_compiles = counter.count - compiles_before
        warm_args = [make_arrays(size, warm_layout(size, rng), seed=i + 1) for i in range(warm_calls)]
        compiles_before = counter.count
        start = time.perf_counter()
        for args in warm_args:
            ragged_paged_attention(*args).block_until_ready()
        warm = (time.perf_counter() - start) / warm_calls
        warm_compiles = counter.count - compiles_before
        new_cache_entries = ragged_paged_attention._cache_size() - cache_before
    return cold, warm, cold_compiles, warm_compiles, new_cache_entries


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=",".join(SIZES), help=f"comma-separated subset of {list(SIZES)}")
    parser.add_argument("--warm-calls", type=int, default=3)
    args = parser.parse_args()
    counter = CompileCounter()
    print(
        f"{'size':16} {'interpreter':20} {'tokens':>6} {'seqs':>4} {'cold s':>7} {'warm s':>7} "
        f"{'compiles cold/warm':>18} {'jit cache +':>11}"
    )
    for name in args.sizes.split(","):
        size = SIZES[name]
        for interpreter_name, interpreter in INTERPRETERS.items():
            cold, warm, cold_compiles, warm_compiles, cache = bench(
                size, interpreter, args.warm_calls, counter
            )
            print(
                f"{name:16} {interpreter_name:20} {size.num_tokens:6d} {len(size.seqs):4d} {cold:7.2f} "
                f"{warm:7.3f} {cold_compiles:>9d}/{warm_compiles:<8d} {cache:11d}"
            )


if __name__ == "__main__":
    main()
