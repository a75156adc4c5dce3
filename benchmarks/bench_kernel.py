"""Interpret-mode cost of our kernel: cold and warm time per call, and compilations, on both interpreters.

For each size, the first call (cold: trace, lower, compile, run) is timed, then ``--warm-calls`` calls with
the same shapes but a different ragged layout and data each time (warm: metadata is traced, so a new
layout must not recompile). Compilations are counted with a ``jax.monitoring`` listener on the backend
compile event (every XLA compilation in the process, the interpreter's included) and cross-checked with
the size of the kernel's jit cache.

``--products highest,default`` also times the kernel with its float32 products left at DEFAULT precision
(the kernel asks for HIGHEST, which on a TPU is several MXU passes instead of one): what HIGHEST costs on the
interpreters (on the chip it is not measured here).

    python benchmarks/bench_kernel.py [--sizes tiny,medium,upstream_scaled] [--warm-calls 3]
        [--products highest,default]
"""

import argparse
import contextlib
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import dispatch
from jax.experimental.pallas import tpu as pltpu

from rpa_harness.kernel import pallas_rpa
from rpa_harness.kernel.pallas_rpa import _ragged_paged_attention as compiled_kernel
from rpa_harness.kernel.pallas_rpa import ragged_paged_attention
from rpa_harness.strategies.case import Case
from rpa_harness.strategies.shapes import config_fields


def size(seqs, num_tokens, max_num_seqs, pages_per_seq, page_size, num_q_heads, num_kv_heads, head_dim):
    """The cold call's case: static shapes and its (q_len, kv_len) layout; warm calls permute and shrink it."""
    q_lens, kv_lens = (tuple(lens) for lens in zip(*seqs, strict=True))
    sizes = (num_tokens, max_num_seqs, pages_per_seq, max_num_seqs * pages_per_seq)
    heads = (num_kv_heads, num_q_heads // num_kv_heads, head_dim)
    return Case(
        **config_fields(sizes, page_size, heads, "float32", "float32"),
        q_lens=q_lens,
        kv_lens=kv_lens,
        poison=False,  # every slot of the cache holds data
    )


# Upstream's test layout, lengths divided by 4 (q_len <= kv_len kept), 32/8 heads divided by 4.
_UPSTREAM_SEQS = ((1, 1328), (5, 18), (1, 129), (120, 229), (1, 122), (1, 64), (32, 100), (250, 463), (1, 18),
                  (1, 17), (99, 123))  # fmt: skip
_UPSTREAM_SCALED = tuple((-(-q // 4), -(-kv // 4)) for q, kv in _UPSTREAM_SEQS)

SIZES = {
    "tiny": size(((1, 20), (6, 6)), 8, 2, 2, 16, 4, 2, 128),
    "medium": size(
        ((1, 40), (5, 18), (0, 3), (20, 60), (1, 1), (12, 64), (1, 33), (8, 8)), 64, 8, 4, 16, 4, 2, 128
    ),
    "upstream_scaled": size(
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


PRODUCTS = ("highest", "default")


@contextlib.contextmanager
def products_at(precision: str):
    """The kernel as shipped (``highest``: HIGHEST for float32 operands) or with every product at DEFAULT."""
    shipped = pallas_rpa._product_precision
    if precision == "default":
        pallas_rpa._product_precision = lambda operand_dtype: None
    jax.clear_caches()  # the kernel is traced anew with these products
    try:
        yield
    finally:
        pallas_rpa._product_precision = shipped
        jax.clear_caches()


def jax_arrays(case):
    return {name: jnp.asarray(value) for name, value in case.arrays().items()}


def warm_case(case, rng, seed):
    """The cold layout in a random order with random shorter lengths (never longer: shapes must hold)."""
    q_lens, kv_lens = [], []
    for q_len, kv_len in rng.permutation(np.array(list(zip(case.q_lens, case.kv_lens, strict=True)))):
        new_kv = int(rng.integers(max(q_len, 1), kv_len + 1))
        q_lens.append(int(rng.integers(0, min(q_len, new_kv) + 1)))
        kv_lens.append(new_kv)
    return dataclasses.replace(case, q_lens=tuple(q_lens), kv_lens=tuple(kv_lens), seed=seed)


class CompileCounter:
    """Counts XLA backend compilations reported through ``jax.monitoring``."""

    def __init__(self):
        self.count = 0
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event, duration_secs, **kwargs):
        del duration_secs, kwargs
        if event == dispatch.BACKEND_COMPILE_EVENT:
            self.count += 1


def bench(case, interpreter, warm_calls, counter):
    rng = np.random.default_rng(0)
    with pltpu.force_tpu_interpret_mode(interpreter):
        args = jax_arrays(case)
        compiles_before, cache_before = counter.count, compiled_kernel._cache_size()
        start = time.perf_counter()
        ragged_paged_attention(**args).block_until_ready()
        cold = time.perf_counter() - start
        cold_compiles = counter.count - compiles_before
        warm_args = [jax_arrays(warm_case(case, rng, seed=i + 1)) for i in range(warm_calls)]
        compiles_before = counter.count
        start = time.perf_counter()
        for args in warm_args:
            ragged_paged_attention(**args).block_until_ready()
        warm = (time.perf_counter() - start) / warm_calls
        warm_compiles = counter.count - compiles_before
        new_cache_entries = compiled_kernel._cache_size() - cache_before
    return cold, warm, cold_compiles, warm_compiles, new_cache_entries


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=",".join(SIZES), help=f"comma-separated subset of {list(SIZES)}")
    parser.add_argument("--warm-calls", type=int, default=3)
    parser.add_argument(
        "--products", default="highest", help=f"comma-separated subset of {list(PRODUCTS)} (float32 products)"
    )
    args = parser.parse_args()
    counter = CompileCounter()
    print(
        f"{'size':16} {'interpreter':20} {'products':8} {'tokens':>6} {'seqs':>4} {'cold s':>7} "
        f"{'warm s':>7} {'compiles cold/warm':>18} {'jit cache +':>11}"
    )
    for name in args.sizes.split(","):
        case = SIZES[name]
        for interpreter_name, interpreter in INTERPRETERS.items():
            for products in args.products.split(","):
                with products_at(products):
                    cold, warm, cold_compiles, warm_compiles, cache = bench(
                        case, interpreter, args.warm_calls, counter
                    )
                print(
                    f"{name:16} {interpreter_name:20} {products:8} {case.max_num_batched_tokens:6d} "
                    f"{case.num_seqs:4d} {cold:7.2f} {warm:7.3f} {cold_compiles:>9d}/{warm_compiles:<8d} "
                    f"{cache:11d}"
                )


if __name__ == "__main__":
    main()
