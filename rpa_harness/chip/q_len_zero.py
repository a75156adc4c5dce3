"""``rpa-harness chip q-len-zero``: what a TPU does with tpu-inference v3's finding
``q-len-zero-before-a-live-sequence-hangs``, step by step.

A step of v3 itself (it drives v3's adapter: its inputs, its kernel options, its returned cache), on a TPU
host with jax[tpu] and ``pip install --no-deps tpu-inference==0.32.0``. The repro, the finding's own:
sequences ``(q_len, kv_len) = (0, 1), (1, 1)``, page size 16, one head, float32. v3's program (kernel.py,
0.32.0) never copies sequence 1's query block or its new key and value: sequence 0 runs no loop iteration,
so the prefetches sequence 1 waits for are the ones started for sequence 0, a query copy of 0 bytes (the
wait for sequence 1's 512 bytes is what the TPU interpreter calls a deadlock) and a KV copy of sequence 0's
one cached row (which a wait for sequence 1's one row accepts). A chip that returns must read something for
sequence 1; this probe says what:

- ``first-call``: the repro as the process's first kernel call;
- ``after-a-sentinel-value``: first a call of the same configuration whose only sequence, ``(1, 1)``, has
  the value 3.0 in every dim, leaving it in the KV buffer's row sequence 1 reads, then the repro;
- ``after-a-nan-query``: the same with a NaN query row, left in the query buffer sequence 1 reads (with
  one key the output is the value whatever a finite query, so only NaN shows a query never fetched);
- ``checks-on``: the repro with Mosaic's bounds and semaphore checks on (v3 turns both off by default).

Each step runs in a process of its own (``rpa_harness.device.processes``; a hang is ended after
``--timeout`` seconds, a halted chip ends only its step) and ends with a call of the repro without the
empty sequence, which says whether the chip was left working. Per call it prints whether it returned, the
attention against the float64 oracle, the cache against the expected one, and what sequence 1's output row
is: its own value (right), sequence 0's cached value (what v3's copies put in the KV buffer), the sentinel
(a buffer left by the call before), or something else. ``--backend interpret`` or ``fast-interpret`` runs
the same steps on CPU.
"""

import dataclasses
import sys
import time

import numpy as np

from rpa_harness import targets
from rpa_harness.chip import ChipUsageError, add_backend_options, backend_of, child_environment
from rpa_harness.device import processes

# jax and the harness's kernels are imported by the steps only: this process leaves the chip to them.

FINDING = "q-len-zero-before-a-live-sequence-hangs"

STEPS = ("first-call", "after-a-sentinel-value", "after-a-nan-query", "checks-on")
SENTINEL = 3.0
VALUE = 1  # a key's value is combined head 1 of its page slot (heads interleave K, V)


def live_row_reads(out, arrays) -> str:
    """Which value sequence 1's output row (token 0, head 0: one key, weight 1) equals."""
    row = np.asarray(out, np.float32)[0, 0]
    kv_pages, page_indices = arrays["kv_pages"], arrays["page_indices"]
    candidates = {
        "its own value (right)": kv_pages[page_indices[1, 0], 0, VALUE],
        "sequence 0's cached value (v3's copies)": kv_pages[page_indices[0, 0], 0, VALUE],
        "the sentinel value (left by the call before)": np.full_like(row, SENTINEL),
    }
    for name, value in candidates.items():
        if np.allclose(row, np.asarray(value, np.float32), rtol=1e-3, atol=1e-6):
            return name
    return "NaN" if np.isnan(row).any() else f"something else ({row[:3].tolist()} ...)"


def precision(backend) -> tuple[str, ...]:
    return targets.load(targets.V3_TARGET).precision_on(backend)


def judged_call(what: str, backend, arrays: dict, options: dict, **kernel_options) -> None:
    """One v3 call, both outputs judged, as one printed line."""
    from rpa_harness import reference
    from rpa_harness.checks import CacheMismatch
    from rpa_harness.targets.tpu_inference.judging import check_updated_cache
    from rpa_harness.targets.tpu_inference_v3 import adapter

    inputs = adapter.v3_inputs(**arrays, **options)
    inputs = dataclasses.replace(inputs, kwargs={**inputs.kwargs, **kernel_options})
    started = time.monotonic()
    try:
        out, cache = backend.run(adapter.call_v3, inputs)
    except Exception as error:  # noqa: BLE001 - what the call raised is the observation
        print(f"  {what}: raised {type(error).__name__}: {str(error).splitlines()[0][:300]}", flush=True)
        return
    took = time.monotonic() - started
    comparison = reference.compare(
        out,
        reference.oracle(**arrays, **options),
        label=f"v3 on {backend.label}",
        precision=precision(backend),
    )
    try:
        check_updated_cache(inputs, cache)
        cache_verdict = "right"
    except CacheMismatch as mismatch:
        cache_verdict = (
            "wrong (" + " ".join(line.strip() for line in str(mismatch).splitlines()[1:2])[:200] + ")"
        )
    attention = "right" if comparison.ok else f"wrong (max error/bound {comparison.max_ratio:.3g})"
    reads = f"; sequence 1 reads {live_row_reads(out, arrays)}" if arrays["cu_q_lens"][1] == 0 else ""
    print(
        f"  {what}: returned in {took:.1f} s; attention {attention}; cache {cache_verdict}{reads}", flush=True
    )


def without_the_empty_sequence(arrays: dict) -> dict:
    """The repro's arrays with sequence 1 alone, as sequence 0 (its page, its query row)."""
    arrays = dict(arrays)
    arrays["kv_lens"] = np.array([arrays["kv_lens"][1], 0], np.int32)
    arrays["page_indices"] = np.array([arrays["page_indices"][1], arrays["page_indices"][1]], np.int32)
    arrays["cu_q_lens"] = np.array([0, 1, 1], np.int32)
    arrays["num_seqs"] = np.array([1], np.int32)
    return arrays


def with_a_sentinel(arrays: dict, step: str) -> dict:
    """One live sequence ``(1, 1)`` whose value is ``SENTINEL`` in every dim, or whose query row is NaN:
    v3 copies them into the first rows of its KV and query buffers, where sequence 1 of the repro reads."""
    arrays = without_the_empty_sequence(arrays)
    if step == "after-a-nan-query":
        q = arrays["q"].copy()
        q[0] = np.nan
        return {**arrays, "q": q}
    kv_pages = arrays["kv_pages"].copy()
    kv_pages[arrays["page_indices"][0, 0], 0, VALUE] = SENTINEL
    return {**arrays, "kv_pages": kv_pages}


def finding_repro():
    """The finding's repro, from v3's catalogue (installed with the harness)."""
    from rpa_harness import repro as repro_files
    from rpa_harness.targets import tpu_inference_v3

    (issue,) = [issue for issue in tpu_inference_v3.RPA_HARNESS_CATALOGUE if issue.name == FINDING]
    return repro_files.read(issue.repro)


def run_step(step: str, backend_name: str, generation: str) -> None:
    from rpa_harness import interpret_compat
    from rpa_harness.device import Backend

    interpret_compat.install()
    backend = Backend(backend_name, generation=generation)
    repro = finding_repro()
    arrays, options = repro.arrays, repro.options
    if step.startswith("after-a-"):
        judged_call("the call before", backend, with_a_sentinel(arrays, step), options)
    checks = (
        {"disable_bounds_checks": False, "disable_semaphore_checks": False} if step == "checks-on" else {}
    )
    judged_call("the repro", backend, arrays, options, **checks)
    judged_call(
        "then the repro without the empty sequence", backend, without_the_empty_sequence(arrays), options
    )


def add_arguments(parser, step: str) -> None:
    add_backend_options(parser)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds before a step is a hang")


def main(args) -> int:
    backend = backend_of(args)
    try:
        targets.load(targets.V3_TARGET)
    except targets.TargetError as error:
        raise ChipUsageError(
            f"the probe calls tpu-inference's v3, which does not load here: {error}"
        ) from None
    for step in STEPS:  # each in a process of its own, which holds the chip while it runs
        print(f"{step}:", flush=True)
        command = processes.python(
            "-m", "rpa_harness.chip.q_len_zero", step, backend.name, backend.generation
        )
        done = processes.run(command, timeout=args.timeout, env=child_environment())
        print(done.stdout, end="", flush=True)
        if done.timed_out:
            print(f"  HANG: the step did not end within {args.timeout:g} s", flush=True)
        elif done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            print(f"  the step's process exited {done.returncode}: {last[:300]}", flush=True)
    return 0


if __name__ == "__main__":  # one step, in a process of its own: STEP BACKEND GENERATION
    run_step(*sys.argv[1:4])
