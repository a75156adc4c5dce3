"""``rpa-harness chip speed``: where a target's time on the serving batches goes, the harness's call path or
the kernel's block sizes.

``rpa-harness bench`` timed tpu-inference's v3 at 2.7x upstream's time on the mixed batch of a v5e (10.99
ms against 4.05), and at upstream's on decode and prefill. Per batch and target this prints the median time
per call of:

- ``bench``: the call as ``rpa-harness bench`` makes it (``bench.time_target``: the target's kernel call,
  its inputs on the device, each call guarded);
- ``bare``: the same kernel function on the same device arrays, called in a loop under one guard of the
  backend (``Backend.guarded``: the known-good call on a chip, the watchdog), without the adapter's
  per-call work: what is left is the kernel's own time;
- v3's own choice of block sizes for the chip (as its adapter reads it) where v3 is a target.

If ``bench`` and ``bare`` agree, the gap to another kernel is the kernel's, and ``rpa-harness bench
--sweep-blocks`` says whether its own block sizes are the cause (a tuning finding). ``--backend
fast-interpret --tpu-generation v5e --batch small`` rehearses it on a CPU (the times are then the
interpreter's).
"""

import statistics
import sys

from rpa_harness import bench, device, targets
from rpa_harness.chip import (
    ChipUsageError,
    add_backend_options,
    add_target_option,
    backend_of,
    loaded_targets,
)

DEFAULT_TARGETS = (targets.UPSTREAM_TARGET, targets.V3_TARGET)


def add_arguments(parser, step: str) -> None:
    add_target_option(parser, DEFAULT_TARGETS, "module to time")
    add_backend_options(parser)
    parser.add_argument(
        "--batch", default="mixed,decode,prefill",
        help=f"bench's batches, comma-separated, of: {', '.join(bench.BATCHES)} (default mixed,decode,prefill)",
    )  # fmt: skip
    parser.add_argument("--calls", type=int, default=20, help="timed calls per row (default 20)")


def bare_median(target: targets.Target, backend: device.Backend, case, calls: int) -> float:
    """The kernel function ``bench`` times, called in a loop on its device arrays under one guard
    (``Backend.timed_loop``)."""
    from rpa_harness.checks import kernel_call

    call, host = kernel_call(target, backend.generation, case.arrays(), case.options())
    seconds = backend.timed_loop(
        f"{target.name}'s kernel in a loop on {backend.label}", call, host, calls + 1
    )
    return statistics.median(seconds[1:])  # the first compiles


def v3_own_choice(case, backend: device.Backend) -> str:
    """v3's (bq, bkv, bq_chunk, bkv_chunk) for its decode and mixed kernels on this chip (or the emulated
    one), as its adapter reads them."""
    from rpa_harness.targets.tpu_inference_v3 import adapter as v3

    with backend.context():
        inputs = v3.v3_inputs(**case.arrays(), **case.options())
    return f"decode {inputs.decode_block_sizes}, mixed {inputs.mixed_block_sizes}"


def milliseconds(timing) -> str:
    return f"{timing.median_s * 1e3:.3f}" if timing.median_s is not None else timing.error or timing.skipped


def main(args) -> int:
    if args.calls < 1:
        raise ChipUsageError(f"--calls={args.calls} must be at least 1")
    batches = [name for name in args.batch.split(",") if name]
    unknown = [name for name in batches if name not in bench.BATCHES]
    if unknown:
        raise ChipUsageError(
            f"--batch={','.join(unknown)}: not a batch; choose from {', '.join(bench.BATCHES)}"
        )
    backend = backend_of(args, opens_the_chip=True)
    timed, not_timed = loaded_targets(args.target or DEFAULT_TARGETS)
    for reason in not_timed.values():
        print(f"not run here: {reason}")
    print(f"backend {backend.label}; median ms per call of {args.calls}")
    print("| batch | what | bench ms | bare ms |")
    print("|---|---|---|---|")
    for name in batches:
        batch = bench.BATCHES[name]
        for target in timed:
            timing = bench.time_target(target, backend, batch, args.calls)
            bare = (
                bare_median(target, backend, batch.case, args.calls) if timing.median_s is not None else None
            )
            shown = "-" if bare is None else f"{bare * 1e3:.3f}"
            print(f"| {name} | {target.name}, its own blocks | {milliseconds(timing)} | {shown} |")
            if target.name == targets.V3_TARGET:
                print(
                    f"| {name} | v3's own choice (decode, mixed) | {v3_own_choice(batch.case, backend)} | |"
                )
        sys.stdout.flush()
    return 0
