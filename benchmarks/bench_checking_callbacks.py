"""Where a warm call on the checking (TPU) interpreter spends its time: callbacks by kind and race checks.

    PYTHONPATH=. python benchmarks/bench_checking_callbacks.py [--examples 20] [--races pruned|unpruned|off]
        [--leave-out GAP[,GAP...]]

Runs the bundled kernel on pooled valid cases twice (the first pass compiles) and times the second pass:
per example, the interpreter's callbacks (calls, time inside them) and the race detector's checks with the
number of earlier accesses each one scans. ``--races unpruned`` leaves out the compat layer's
``tpu-race-history`` patch, ``off`` runs without race detection; ``--leave-out`` leaves out other compat
gaps' patches (``tpu-callback-arguments``, ``tpu-clock-order``: the before of each lever). Times are wall
clock inside the callbacks (they run on XLA's threads); the per-example CPU time is the process's.
"""

import argparse
import collections
import functools
import threading
import time


def instrument(
    interpreter, races_module
) -> tuple[collections.Counter, collections.Counter, collections.Counter]:
    """Wrap the interpreter's callbacks and the race checks with counters (before anything is traced)."""
    calls, seconds, scanned = collections.Counter(), collections.Counter(), collections.Counter()
    lock = threading.Lock()

    def timed(name, function):
        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                with lock:
                    calls[name] += 1
                    seconds[name] += time.perf_counter() - start

        return wrapper

    for name in ("get", "store", "swap", "dma_start", "dma_wait", "_allocate_buffer"):
        setattr(interpreter, name, timed(name, getattr(interpreter, name)))
    state = races_module.RaceDetectionState
    for name in ("check_read", "check_write"):
        check = getattr(state, name)

        def counting(self, *args, _check=check, _name=name, **kwargs):
            key = kwargs.get("buffer_key", args[-2] if len(args) >= 2 else None)
            earlier = len(self.writes[key]) + (len(self.reads[key]) if _name == "check_write" else 0)
            with lock:
                scanned[_name] += earlier
            return _check(self, *args, **kwargs)

        setattr(state, name, timed(name, counting))
    return calls, seconds, scanned


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=20, help="pooled valid cases (each run twice)")
    parser.add_argument("--races", choices=("pruned", "unpruned", "off"), default="pruned")
    parser.add_argument(
        "--leave-out", default="", help="compat gaps whose patches are not applied (comma-separated)"
    )
    args = parser.parse_args()

    from hypothesis import given

    from rpa_harness import device, interpret_compat
    from rpa_harness.drawn import same_examples
    from rpa_harness.interpret_compat import tpu as tpu_gaps

    if args.races == "off":
        device.CHECKING_INTERPRET_PARAMS["detect_races"] = False
    left_out = {name for name in args.leave_out.split(",") if name}
    unknown = left_out - {gap.name for gap in tpu_gaps.GAPS}
    if unknown:
        names = ", ".join(gap.name for gap in tpu_gaps.GAPS)
        parser.exit(4, f"bench_checking_callbacks: --leave-out={args.leave_out!r}: not a gap; use {names}\n")
    if args.races == "unpruned":
        left_out.add(tpu_gaps.RACE_HISTORY.name)
    tpu_gaps.GAPS = tuple(gap for gap in tpu_gaps.GAPS if gap.name not in left_out)
    interpret_compat.install()
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call, race_detection_state

    from rpa_harness.strategies.valid import valid_cases
    from rpa_harness.targets import load

    calls, seconds, scanned = instrument(interpret_pallas_call, race_detection_state)
    target, backend = load("rpa_harness.kernel"), device.Backend(device.INTERPRET)
    cases = []

    @same_examples(args.examples)
    @given(case=valid_cases(pooled=True))
    def collect(case):
        cases.append((case.arrays(), case.options()))

    collect()
    for arrays, options in cases:  # compiles
        backend.run(target.attention, arrays, options)
    for counter in (calls, seconds, scanned):
        counter.clear()
    wall, cpu = time.perf_counter(), time.process_time()
    for arrays, options in cases:
        backend.run(target.attention, arrays, options)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    n = len(cases)
    without = f", without {', '.join(sorted(left_out))}" if left_out else ""
    print(
        f"races {args.races}{without}, {n} warm pooled examples: {wall / n * 1e3:.0f} ms wall, "
        f"{cpu / n * 1e3:.0f} ms CPU each"
    )
    for name in sorted(calls, key=lambda name: -seconds[name]):
        print(
            f"  {name:<17} {calls[name] / n:7.0f} calls/example {seconds[name] / n * 1e3:8.1f} ms/example "
            f"{seconds[name] / calls[name] * 1e6:7.0f} us/call"
        )
    for name in sorted(scanned):
        print(f"  {name}: {scanned[name] / calls[name]:.0f} earlier accesses scanned per check")


if __name__ == "__main__":
    main()
