"""What XLA's CPU compiler settings cost the interpreters, and whether they change any output bit.

    PYTHONPATH=. python benchmarks/bench_cpu_compiler.py [--examples 30] [--fast-examples 100]
        [--any-config-examples 20]

For each interpreter and set of cases (pooled valid cases; whole-space cases on the TPU interpreter), runs
the bundled kernel on the same cases in two fresh processes without a persistent compilation cache: one
with XLA's defaults for the flags in ``device.FASTER_CPU_COMPILATION``, one with the harness's values.
The first pass over the cases compiles each kernel, the second times the calls alone. Prints the CPU
seconds of each pass, XLA's compile seconds, and how many of the outputs differ in any bit.
"""

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_cases(backend_name: str, examples: int, pooled: bool, outputs: str) -> dict:
    """In this process: the first and second pass over the drawn cases; the outputs go to ``outputs``."""
    import time

    import numpy as np
    from hypothesis import HealthCheck, given, settings

    from rpa_harness import device, interpret_compat
    from rpa_harness.strategies.valid import valid_cases
    from rpa_harness.targets import load

    interpret_compat.install()
    device.count_compilations()
    cases = []

    @settings(max_examples=examples, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(case=valid_cases(pooled=pooled))
    def collect(case):
        cases.append((case.arrays(), case.options()))

    collect()
    target, backend = load("rpa_harness.kernel"), device.Backend(backend_name)
    passes = []
    for _ in range(2):
        start = time.process_time()
        out = [backend.run(target.attention, arrays, options) for arrays, options in cases]
        passes.append(time.process_time() - start)
    # The bits of each output (bfloat16 has no NumPy dtype of its own to compare by).
    np.savez(outputs, *[np.ascontiguousarray(o).view(np.uint8) for o in out])
    stats = device.compilation_stats()
    return dict(cases=len(cases), first=passes[0], second=passes[1], compilations=stats["compilations"],
                compile_seconds=stats["compile_seconds"])  # fmt: skip


def in_child(setting: str, backend_name: str, examples: int, pooled: bool, outputs: Path) -> dict:
    """``run_cases`` in a fresh process, the flags at XLA's defaults or at the harness's values."""
    from rpa_harness import device

    env = dict(os.environ, PYTHONPATH=str(ROOT), RPA_COMPILATION_CACHE="off")
    flags = device.compilation.faster_cpu_compilation_flags()
    chosen = [
        f"--{flag}={default if setting == 'xla-default' else ours}" for flag, (ours, default) in flags.items()
    ]
    env["XLA_FLAGS"] = " ".join([*os.environ.get("XLA_FLAGS", "").split(), *chosen])
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); from benchmarks.bench_cpu_compiler import run_cases; "
        "print('RESULT', json.dumps(run_cases(sys.argv[2], int(sys.argv[3]), sys.argv[4] == 'pooled', sys.argv[5])))"
    )
    result = device.processes.run(
        device.processes.python(
            "-c", code, str(ROOT), backend_name, str(examples), "pooled" if pooled else "any", str(outputs)
        ),
        cwd=ROOT, env=env,
    )  # fmt: skip
    if result.returncode != 0:
        raise SystemExit(f"bench_cpu_compiler: the {setting} child failed:\n{result.stderr[-3000:]}")
    line = next(line for line in result.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def differing(first: Path, second: Path) -> int:
    import numpy as np

    with np.load(first) as a, np.load(second) as b:
        return sum(not np.array_equal(a[name], b[name]) for name in a.files)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=30, help="pooled cases on the TPU interpreter")
    parser.add_argument("--fast-examples", type=int, default=100, help="pooled cases on the fast interpreter")
    parser.add_argument("--any-config-examples", type=int, default=20,
                        help="whole-space cases on the TPU interpreter (0 skips them)")  # fmt: skip
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    import jaxlib

    from rpa_harness import device

    flags = device.compilation.faster_cpu_compilation_flags()
    if not flags:
        print(
            f"jaxlib {jaxlib.__version__}: no CPU compiler flags are set by the harness for it; nothing to compare"
        )
        return
    print(
        f"jaxlib {jaxlib.__version__}; flags: "
        + ", ".join(f"{f} (XLA {d}, harness {o})" for f, (o, d) in flags.items())
    )
    print("CPU seconds: first pass (compiles) / second pass (calls alone); XLA compile seconds")
    runs = [("interpret", args.examples, True), ("fast-interpret", args.fast_examples, True),
            ("interpret", args.any_config_examples, False)]  # fmt: skip
    with tempfile.TemporaryDirectory() as folder:
        for backend_name, examples, pooled in runs:
            if examples <= 0:
                continue
            results, paths = {}, {}
            for setting in ("xla-default", "harness"):
                paths[setting] = Path(folder) / f"{setting}-{backend_name}-{pooled}.npz"
                results[setting] = in_child(setting, backend_name, examples, pooled, paths[setting])
            cases = results["harness"]["cases"]
            print(f"  {backend_name:<15} {'pooled' if pooled else 'whole space':<12} {cases:>4} cases, "
                  f"{results['harness']['compilations']} compilations")  # fmt: skip
            for setting, r in results.items():
                print(f"    {setting:<12} first {r['first']:7.2f}  second {r['second']:6.2f}  "
                      f"compile {r['compile_seconds']:6.2f}")  # fmt: skip
            saved = 1 - results["harness"]["first"] / results["xla-default"]["first"]
            print(f"    first pass: {saved:.0%} less CPU with the harness's flags; outputs differing in any "
                  f"bit: {differing(paths['xla-default'], paths['harness'])} of {cases}")  # fmt: skip


if __name__ == "__main__":
    main()
