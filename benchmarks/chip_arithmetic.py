"""How far the chip's float32 elementwise operations are from correctly rounded, inside a Pallas kernel and
in XLA: what the tolerance model (reference/tolerance.py) may assume of exp, tanh and division.

    PYTHONPATH=. python benchmarks/chip_arithmetic.py [--interpret]

For each operation and argument range, 2**20 float32 arguments (a uniform sweep and random draws) are
computed on the chip (``--interpret``: in Pallas' generic interpreter on the CPU, the fast-interpret
backend) and compared with float64 NumPy rounded to float32: the largest and 99.99th-percentile errors in
float32 ulps of the exact result, and the share of results not correctly rounded. Each call is made as the
harness makes a kernel call (``Backend.run``: on a chip the known-good call first, then the watchdog).
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from rpa_harness import device

ROWS, LANES = 1024, 1024  # 2**20 arguments, in (8, 128)-tiled blocks
BLOCK_ROWS = 256

OPERATIONS = {
    # name: (one argument's function, or two's; NumPy float64 counterpart; argument ranges)
    "exp": (jnp.exp, np.exp, ((-87.0, 0.0), (-10.0, 10.0))),
    "tanh": (jnp.tanh, np.tanh, ((-20.0, 20.0), (-1.0, 1.0))),
    "divide": (jnp.divide, np.divide, ((0.5, 2.0), (1e-3, 1e3))),
    "reciprocal": (lambda x: 1.0 / x, lambda x: 1.0 / x, ((0.5, 2.0), (1.0, 1e6))),
    "multiply": (jnp.multiply, np.multiply, ((-2.0, 2.0),)),
}


def arguments(low: float, high: float, count: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    half = count // 2
    swept = np.linspace(low, high, half, dtype=np.float64)
    drawn = rng.uniform(low, high, count - half)
    return np.concatenate([swept, drawn]).astype(np.float32).reshape(ROWS, LANES)


def in_pallas(function, arity: int, interpret: bool):
    def kernel(*refs):
        *inputs, out = refs
        out[...] = function(*(ref[...] for ref in inputs))

    spec = pl.BlockSpec((BLOCK_ROWS, LANES), lambda i: (i, 0))
    return jax.jit(
        pl.pallas_call(
            kernel,
            grid=(ROWS // BLOCK_ROWS,),
            in_specs=[spec] * arity,
            out_specs=spec,
            out_shape=jax.ShapeDtypeStruct((ROWS, LANES), jnp.float32),
            interpret=interpret,  # a kernel without TPU parameters: the backend cannot force the interpreter
        )
    )


def ulp_errors(got: np.ndarray, exact: np.ndarray) -> np.ndarray:
    """|got - exact| in ulps of the float32 nearest the exact value (denormal results excluded)."""
    spacing = np.spacing(np.abs(exact.astype(np.float32))).astype(np.float64)
    normal = np.abs(exact) >= np.finfo(np.float32).tiny
    return (np.abs(got.astype(np.float64) - exact) / spacing)[normal]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--interpret", action="store_true", help="Pallas' generic interpreter on the CPU")
    args = parser.parse_args()
    backend = device.Backend(
        device.FAST_INTERPRET if args.interpret else device.TPU, interpreter_compat=False
    )
    computing = jax.devices()[0]
    print(f"device: {computing.device_kind} ({computing.platform}); jax {jax.__version__}")
    print("| operation | arguments | where | max ulp | 99.99% ulp | not correctly rounded |")
    print("|---|---|---|---|---|---|")
    for name, (function, exact_function, ranges) in OPERATIONS.items():
        arity = 2 if name in ("divide", "multiply") else 1
        for low, high in ranges:
            inputs = [arguments(low, high, ROWS * LANES, seed) for seed in range(arity)]
            exact = exact_function(*(x.astype(np.float64) for x in inputs))
            for where, call in (
                ("pallas", in_pallas(function, arity, args.interpret)),
                ("xla", jax.jit(function)),
            ):
                got = backend.run(call, *inputs)
                errors = ulp_errors(got, exact)
                print(
                    f"| {name} | [{low:g}, {high:g}] | {where} | {errors.max():.2f} "
                    f"| {np.quantile(errors, 0.9999):.2f} | {np.mean(errors > 0.5):.2%} |"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
