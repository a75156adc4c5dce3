"""tpu-inference's RPA v3 on both interpreters: per-example cost, and whether the generic one agrees.

    PYTHONPATH=. python benchmarks/bench_v3_interpreters.py [--examples 6] [--any-config]

For drawn valid cases (v3's declared capabilities; pooled configurations unless --any-config), runs v3 on
the generic interpreter (fast-interpret, with the compat layer's dynamic-size copies) and on the checking
TPU interpreter: the first call (compilation included) and a warm one, wall and CPU; judges the fast run
against the float64 oracle and v3's expected cache (``rpa_harness.targets.tpu_inference.judging``'s rules) and says
whether both interpreters returned the same bits. Needs tpu-inference (``pip install --no-deps
tpu-inference==0.32.0``).
"""

import argparse
import time


def timed(backend, call, inputs) -> tuple[object, float, float, float]:
    """(outputs, first-call wall seconds, warm wall seconds, warm CPU seconds)."""
    start = time.perf_counter()
    backend.run(call, inputs)
    first = time.perf_counter() - start
    wall, cpu = time.perf_counter(), time.process_time()
    outputs = backend.run(call, inputs)
    return outputs, first, time.perf_counter() - wall, time.process_time() - cpu


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=6)
    parser.add_argument(
        "--any-config", action="store_true", help="draw any configuration, not the pooled ones"
    )
    args = parser.parse_args()

    import numpy as np
    from hypothesis import given

    from rpa_harness.device import FAST_INTERPRET, INTERPRET, Backend
    from rpa_harness.drawn import same_examples
    from rpa_harness.strategies.capabilities import Capabilities
    from rpa_harness.strategies.valid import valid_cases
    from rpa_harness.targets import tpu_inference_v3 as v3target

    capabilities = Capabilities(**v3target.RPA_HARNESS_CAPABILITIES)
    fast, checking = Backend(FAST_INTERPRET), Backend(INTERPRET)
    totals = {"fast": [0.0, 0.0], "checking": [0.0, 0.0]}
    count = 0

    @same_examples(args.examples)
    @given(case=valid_cases(capabilities, pooled=not args.any_config))
    def run(case):
        nonlocal count
        arrays, options = case.arrays(), case.options()
        inputs = v3target.v3_inputs(**arrays, **options)
        (fast_out, fast_cache), fast_first, fast_warm, fast_cpu = timed(fast, v3target.call_v3, inputs)
        (out, cache), first, warm, cpu = timed(checking, v3target.call_v3, inputs)
        verdict = v3target.judge(arrays, options, fast, precision=v3target.RPA_HARNESS_PRECISION)
        same = all(
            np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
            for a, b in ((fast_out, out), (fast_cache, cache))
        )
        print(
            f"{case.q_dtype}/{case.kv_dtype} q_lens={case.q_lens} kv_lens={case.kv_lens}: oracle "
            f"{'ok' if verdict.comparison.ok else 'FAILS'}, cache "
            f"{'ok' if verdict.cache_error is None else verdict.known_finding or 'WRONG'}, same bits as the "
            f"TPU interpreter: {same} | fast first {fast_first:.1f} s, warm {fast_warm * 1e3:.0f} ms "
            f"({fast_cpu * 1e3:.0f} ms CPU) | checking first {first:.1f} s, warm {warm * 1e3:.0f} ms "
            f"({cpu * 1e3:.0f} ms CPU)",
            flush=True,
        )
        totals["fast"][0] += fast_warm
        totals["fast"][1] += fast_cpu
        totals["checking"][0] += warm
        totals["checking"][1] += cpu
        count += 1

    run()
    for name, (wall, cpu) in totals.items():
        print(
            f"{name}: warm {wall / count * 1e3:.0f} ms wall, {cpu / count * 1e3:.0f} ms CPU per example ({count})"
        )


if __name__ == "__main__":
    main()
