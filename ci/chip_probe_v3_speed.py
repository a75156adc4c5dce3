"""Where v3's time on the serving batches goes: the harness's call path, or the kernel's block sizes.

    python3 ci/chip_probe_v3_speed.py [--backend tpu] [--batch mixed,decode,prefill] [--calls 20]

On a TPU host from a checkout (the harness and tpu-inference installed). ``rpa-harness bench`` timed v3 at
2.7x upstream's time on the mixed batch of a v5e (10.99 ms against 4.05), and at upstream's on decode and
prefill. Per batch this prints the median time per call of:

- ``bench``: the call as ``rpa-harness bench`` makes it (``bench.time_target``: the target's kernel call
  through ``Backend.guarded``, its inputs on the device);
- ``bare``: the same kernel function on the same device arrays, called in a plain loop (no guard, no
  generation hook, no adapter): what is left is the kernel's own time;
- v3 with each of ``BLOCK_SWEEP``'s block sizes passed to all three of its kernels (decode, prefill, mixed),
  next to its own choice for the chip (as its adapter reads it).

If ``bench`` and ``bare`` agree, the gap to upstream's is the kernel's; if a swept size beats v3's own
choice by much, the choice is (a performance finding, with these numbers). ``--backend fast-interpret
--batch small`` rehearses it on a CPU (the times are then the interpreter's).
"""

import argparse
import dataclasses
import statistics
import sys
import time

# (num_kv_pages_per_block, num_queries_per_block) in upstream's terms, which v3's adapter passes to v3's
# three kernels as (bq, bkv, bq_chunk, bkv_chunk).
BLOCK_SWEEP = ((8, 16), (16, 32), (32, 32), (64, 32), (32, 64), (128, 64))
V3 = "rpa_harness.targets.tpu_inference_v3"


def bare_median(target, backend, case, calls: int) -> float:
    """The kernel function ``bench`` times, called in a plain loop on its device arrays."""
    import jax

    from rpa_harness.checks import kernel_call

    call, host = kernel_call(target, backend.generation, case.arrays(), case.options())
    device = {name: jax.block_until_ready(jax.device_put(value)) for name, value in host.items()}
    seconds = []
    with backend.context():
        for _ in range(calls + 1):
            for name, value in device.items():
                if value.is_deleted():  # donated by the last call
                    device[name] = jax.block_until_ready(jax.device_put(host[name]))
            start = time.perf_counter()
            jax.block_until_ready(call(**device))
            seconds.append(time.perf_counter() - start)
    return statistics.median(seconds[1:])  # the first compiles


def v3_own_choice(case, backend) -> str:
    """v3's (bq, bkv, bq_chunk, bkv_chunk) for its decode and mixed kernels on this chip (or the emulated
    one), as its adapter reads them."""
    from rpa_harness.targets.tpu_inference_v3 import adapter as v3

    with backend.context():
        inputs = v3.v3_inputs(**case.arrays(), **case.options())
    return f"decode {inputs.decode_block_sizes}, mixed {inputs.mixed_block_sizes}"


def milliseconds(timing) -> str:
    return f"{timing.median_s * 1e3:.3f}" if timing.median_s is not None else timing.error or timing.skipped


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backend", default="tpu", choices=("tpu", "fast-interpret", "interpret"))
    parser.add_argument("--batch", default="mixed,decode,prefill", help="bench's batches, comma-separated")
    parser.add_argument("--calls", type=int, default=20, help="timed calls per row (default 20)")
    args = parser.parse_args()
    from rpa_harness import bench, device
    from rpa_harness.targets import UPSTREAM_TARGET, load

    backend = device.Backend(args.backend, generation="none" if args.backend == device.TPU else "v5e")
    v3, upstream = load(V3), load(UPSTREAM_TARGET)
    print(f"backend {backend.label}; median ms per call of {args.calls}")
    print("| batch | what | bench ms | bare ms |")
    print("|---|---|---|---|")
    for name in args.batch.split(","):
        batch = bench.BATCHES[name]
        for label, target in (("upstream", upstream), ("v3, its own blocks", v3)):
            timing = bench.time_target(target, backend, batch, args.calls)
            bare = (
                bare_median(target, backend, batch.case, args.calls) if timing.median_s is not None else None
            )
            print(
                f"| {name} | {label} | {milliseconds(timing)} | {'-' if bare is None else f'{bare * 1e3:.3f}'} |"
            )
        print(f"| {name} | v3's own choice (decode, mixed) | {v3_own_choice(batch.case, backend)} | |")
        for pages, queries in BLOCK_SWEEP:
            case = dataclasses.replace(
                batch.case, num_kv_pages_per_block=pages, num_queries_per_block=queries
            )
            timing = bench.time_target(v3, backend, dataclasses.replace(batch, case=case), args.calls)
            print(f"| {name} | v3, {pages} pages x {queries} queries | {milliseconds(timing)} | |")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
