"""Which of a kernel's source lines run only on some TPU generations: the generation-specific code the
generation emulation reaches, found from the kernel's own sources rather than from a list.

    python benchmarks/generation_branches.py [--target upstream|v3|MODULE] [--generations none,v5e,v6e,7x]
        [--cases short,long,tuned]

Each case runs once per generation on the fast interpreter (through ``check_differential``, so the output is
also judged) while a line tracer records the lines executed in the target kernel's package. A line executed
under some generations but not all of them is printed with its source, the generations that ran it, and the
wall time of each call. ``none`` is the CPU device as it is (the kernel's "not a TPU" branch). Block sizes
and the VMEM limit are left to the kernel (None) wherever a generation is emulated.
"""

import argparse
import collections
import linecache
import os
import sys
import threading
import time

from rpa_harness import generations, targets
from rpa_harness.checks import CannotRun, check_differential
from rpa_harness.device import FAST_INTERPRET, Backend
from rpa_harness.strategies.case import Case

TARGETS = {"upstream": targets.UPSTREAM_TARGET, "v3": targets.V3_TARGET}
# Where each shipped target's kernel lives (a user's module: its own package).
KERNEL_PACKAGES = {
    targets.UPSTREAM_TARGET: "jax/experimental/pallas/ops/tpu/ragged_paged_attention",
    targets.V3_TARGET: "tpu_inference/kernels/ragged_paged_attention/v3",
}
CASES = {
    # A mixed batch with packed (bfloat16) queries, short enough for v3's int16 position arithmetic.
    "short": Case(
        max_num_batched_tokens=16, max_num_seqs=3, pages_per_seq=8, total_num_pages=30, page_size=16,
        num_q_heads=4, num_kv_heads=2, head_dim=128, q_dtype="bfloat16", kv_dtype="bfloat16",
        q_lens=(1, 3, 9), kv_lens=(50, 9, 100), seed=3,
    ),
    # A decode past 2^16 keys next to a short prefill chunk, 256-key pages.
    "long": Case(
        max_num_batched_tokens=16, max_num_seqs=2, pages_per_seq=512, total_num_pages=300, page_size=256,
        num_q_heads=4, num_kv_heads=2, head_dim=128, q_dtype="bfloat16", kv_dtype="bfloat16",
        q_lens=(1, 8), kv_lens=(70_001, 300), seed=5,
    ),
    # A shape with an entry in upstream's tuned tables (v5 and v6 differ: 4 pages by 32 or 128 queries).
    "tuned": Case(
        max_num_batched_tokens=512, max_num_seqs=4, pages_per_seq=4, total_num_pages=16, page_size=16,
        num_q_heads=8, num_kv_heads=1, head_dim=128, q_dtype="bfloat16", kv_dtype="bfloat16",
        q_lens=(1, 40, 64, 7), kv_lens=(64, 40, 64, 50), seed=7,
    ),
}  # fmt: skip


def trace_lines(package: str):
    """A tracer that records (file, line) for every line executed in files under ``package``."""
    executed = set()

    def local(frame, event, arg):
        if event == "line":
            executed.add((frame.f_code.co_filename, frame.f_lineno))
        return local

    def global_(frame, event, arg):
        return local if package in frame.f_code.co_filename else None

    return executed, global_


def run_traced(target, case: Case, generation: str, package: str):
    """One judged call under ``generation``; returns (lines executed, seconds, outcome)."""
    executed, tracer = trace_lines(package)
    backend = Backend(FAST_INTERPRET, generation=generation)
    options = case.options()
    if generation == generations.NONE and target.capabilities.needs_block_sizes:
        options = dict(options, num_kv_pages_per_block=min(8, case.pages_per_seq), num_queries_per_block=8)
    start = time.perf_counter()
    sys.settrace(tracer)
    threading.settrace(tracer)
    try:
        comparison = check_differential(target, backend, case.arrays(), options)
        outcome = f"passes (max error/bound {comparison.max_ratio:.3g})"
    except CannotRun as error:
        outcome = f"cannot run: {error}"
    except Exception as error:  # a failure is reported, not hidden: this is a measurement
        outcome = f"FAILS: {type(error).__name__}: {str(error).splitlines()[0][:200]}"
    finally:
        sys.settrace(None)
        threading.settrace(None)
    return executed, time.perf_counter() - start, outcome


def runs_of_lines(by_line: dict) -> list[tuple[str, int, int, list[str]]]:
    """(file, first line, last line, generations): lines the same generations ran, merged where only
    blank lines, comments or closing brackets lie between them."""
    runs = []
    for (filename, lineno), which in sorted(by_line.items()):
        previous = runs[-1] if runs else None
        if (
            previous
            and previous[0] == filename
            and previous[3] == which
            and _only_gaps(filename, previous[2], lineno)
        ):
            previous[2] = lineno
        else:
            runs.append([filename, lineno, lineno, which])
    return [tuple(run) for run in runs]


def _only_gaps(filename: str, after: int, before: int) -> bool:
    """Whether every line strictly between two line numbers is blank, a comment or a continuation."""
    between = (linecache.getline(filename, n).strip() for n in range(after + 1, before))
    return all(not text or text.startswith(("#", ")", "]", "}")) for text in between)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="v3", help="upstream, v3, or a target module (default v3)")
    parser.add_argument(
        "--generations", default=None, help="comma-separated (default: none + the declared ones)"
    )
    parser.add_argument("--cases", default="short,long,tuned", help=f"comma-separated, of {', '.join(CASES)}")
    args = parser.parse_args()
    name = TARGETS.get(args.target, args.target)
    target = targets.load(name)
    declared = target.capabilities.tpu_generations
    chosen = generations.parse(args.generations) if args.generations else (generations.NONE, *declared)
    package = KERNEL_PACKAGES.get(name, name.replace(".", "/"))
    print(
        f"target {name} ({target.version}); kernel sources under .../{package}; generations {', '.join(chosen)}"
    )
    for case_name in args.cases.split(","):
        case = CASES[case_name]
        print(f"\n== case {case_name}: {case!r}")
        ran = {}
        for generation in chosen:
            ran[generation], seconds, outcome = run_traced(target, case, generation, package)
            print(f"  {generation:>5}: {seconds:6.1f} s, {len(ran[generation])} lines, {outcome}")
        everywhere = set.intersection(*ran.values())
        by_line = collections.defaultdict(list)
        for generation, lines in ran.items():
            for line in lines - everywhere:
                by_line[line].append(generation)
        print(
            f"  lines run under some generations only: {len(by_line)}, in runs of lines run by the same ones:"
        )
        for filename, first, last, which in runs_of_lines(by_line):
            source = linecache.getline(filename, first).strip()
            where = f"{os.path.basename(filename)}:{first}" + (f"-{last}" if last > first else "")
            print(f"    {where:<22} [{','.join(which)}]  {source[:80]}")


if __name__ == "__main__":
    main()
