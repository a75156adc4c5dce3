"""``rpa-harness bench``: how fast a target is at serving-sized batches, next to a baseline target.

Each target is called on a few named batches (``BATCHES``): one compiling call, then timed calls on the
same inputs, each waited for. Reported per call: the median and the fastest time, the HBM bandwidth that
time implies for the bytes the batch must move at least (``hbm_bytes``: the pages of K and V its sequences
read, the queries and the output) and the attention FLOP rate (``attention_flops``), both against the
chip's peak where it is known (``PEAKS``). A target that declares ``RPA_HARNESS_COMPILED_CALL`` is timed on
the kernel call it maps to (its host mapping done once, outside the timing); any other on its
``ragged_paged_attention`` with the inputs already on the device.

A nightly fails on a regression: exit 1 where a target takes more than ``--max-slowdown`` times its own
time in an earlier run's ``--json`` file (``--previous``), or more than ``--max-ratio`` times its
baseline's on a batch. On an interpreter the times are the CPU's: a dry run of the setup, nothing about speed.
"""

import dataclasses
import json
import statistics
import sys
import warnings
from pathlib import Path

from rpa_harness import device, generations, lowering, tuning
from rpa_harness.checks import kernel_call
from rpa_harness.strategies.case import DTYPES, Case
from rpa_harness.targets import (
    ALIASES,
    DEFAULT_TARGET,
    UPSTREAM_TARGET,
    Target,
    TargetError,
    first_line_of_error,
    load,
)

PASSES, REGRESSED, USAGE = 0, 1, 4


class BenchUsageError(ValueError):
    """A bench command line that cannot be honoured: one line, exit 4."""


@dataclasses.dataclass(frozen=True)
class Peak:
    """A chip's peak HBM bandwidth (GB/s) and bfloat16 matrix rate (TFLOP/s), per chip."""

    hbm_gbps: float
    bf16_tflops: float


# Google Cloud's TPU pages (docs.cloud.google.com/tpu/docs/v5e, v5p, v6e): per chip.
PEAKS = {"v5e": Peak(819, 197), "v5p": Peak(2765, 459), "v6e": Peak(1638, 918)}


# The VMEM limit every batch passes, as a caller of upstream's kernel must: with its tuned block sizes it
# needs more than v5e's default scoped 16 MiB at each of them (upstream finding 6, docs/upstream-findings/);
# v3 takes 120 MiB when given none. 48 MiB is 3/4 of the smallest VMEM jax describes (v5p's and 7x's 64
# MiB; v5e's and v6e's is 128). Bundled, upstream's and v3 compile for v5e and v6e at each batch under it.
SERVING_VMEM_LIMIT = 48 * 2**20


@dataclasses.dataclass(frozen=True)
class Batch:
    name: str
    description: str
    case: Case


def serving_batch(
    name: str, description: str, seqs, *, tokens: int, max_num_seqs: int, heads=(32, 8), head_dim=128,
    page_size=16, dtype="bfloat16", model_len=8192,
) -> Batch:  # fmt: skip
    """A batch of ``seqs`` ``(q_len, kv_len)`` in a cache that holds exactly their pages (plus one), with a
    VMEM limit of ``SERVING_VMEM_LIMIT``."""
    q_lens, kv_lens = (tuple(lens) for lens in zip(*seqs, strict=True))
    pages = sum(-(-kv // page_size) for kv in kv_lens)
    case = Case(
        max_num_batched_tokens=tokens, max_num_seqs=max_num_seqs, pages_per_seq=model_len // page_size,
        total_num_pages=pages + 1, page_size=page_size, num_q_heads=heads[0], num_kv_heads=heads[1],
        head_dim=head_dim, q_dtype=dtype, kv_dtype=dtype, q_lens=q_lens, kv_lens=kv_lens, poison=False,
        vmem_limit_bytes=SERVING_VMEM_LIMIT,
    )  # fmt: skip
    return Batch(name, description, case)


_LLAMA_8B = "Llama-3-8B-like: 32 query and 8 KV heads of 128, bfloat16, pages of 16"
BATCHES = {
    batch.name: batch
    for batch in (
        serving_batch(
            "decode", f"64 decodes of 1,024-4,048 keys; {_LLAMA_8B}",
            [(1, 1024 + 48 * i) for i in range(64)], tokens=512, max_num_seqs=256,
        ),
        serving_batch(
            "mixed", f"4 prefill chunks of 96 tokens (1,024-4,096 keys) and 128 decodes (512-4,068 keys); "
            f"{_LLAMA_8B}",
            [(96, 1024 * (i + 1)) for i in range(4)] + [(1, 512 + 28 * i) for i in range(128)],
            tokens=512, max_num_seqs=256,
        ),
        serving_batch(
            "prefill", f"2 prefill chunks of 256 tokens at 4,096 and 8,192 keys; {_LLAMA_8B}",
            [(256, 4096), (256, 8192)], tokens=512, max_num_seqs=256,
        ),
        serving_batch(
            "small", "3 decodes and a chunk of 8 tokens, 4 query and 2 KV heads of 128, bfloat16, pages of "
            "16: the setup checked on a CPU (the interpreters' times say nothing about a chip)",
            [(1, 40), (1, 17), (1, 64), (8, 24)], tokens=16, max_num_seqs=4, heads=(4, 2), model_len=64,
        ),
    )
}  # fmt: skip
DEFAULT_BATCHES = ("decode", "mixed", "prefill")


def hbm_bytes(case: Case) -> int:
    """The bytes a call must move at least: every page of K and V its sequences read (kernels copy whole
    pages), the queries read and the output written (in q's dtype)."""
    kv_item, q_item = DTYPES[case.kv_dtype].itemsize, DTYPES[case.q_dtype].itemsize
    pages = sum(-(-kv_len // case.page_size) for kv_len in case.kv_lens)
    kv = pages * case.page_size * case.num_kv_heads * 2 * case.head_dim * kv_item
    return kv + 2 * case.num_tokens * case.num_q_heads * case.head_dim * q_item


def attention_flops(case: Case) -> int:
    """A multiply-add (2 FLOPs) per (query row, key it sees, q head, dim) in Q K^T and another in P V; with
    the causal mask row i of a sequence sees ``kv_len - q_len + i + 1`` keys."""
    seen = sum(
        q_len * (kv_len - q_len) + q_len * (q_len + 1) // 2
        for q_len, kv_len in zip(case.q_lens, case.kv_lens, strict=True)
    )
    return 4 * seen * case.num_q_heads * case.head_dim


def unsupported(target: Target, case: Case) -> str | None:
    """Why the target does not take the batch (its declared capabilities), or None."""
    capabilities = target.capabilities
    if capabilities.value_head_dims:
        return "latent attention (its value is its key's prefix): these batches are ordinary attention"
    for what, value, allowed in (
        ("head_dim", case.head_dim, capabilities.head_dims),
        ("page_size", case.page_size, capabilities.page_sizes),
        ("q dtype", case.q_dtype, capabilities.q_dtypes),
        ("KV dtype", case.kv_dtype, capabilities.kv_dtypes),
    ):
        if value not in allowed:
            return f"{what} {value} is not one it takes ({', '.join(map(str, allowed))})"
    return None


@dataclasses.dataclass
class Timing:
    target: str
    batch: str
    first_call_s: float | None = None
    seconds: list[float] = dataclasses.field(default_factory=list)
    skipped: str | None = None  # why it did not run
    error: str | None = None  # what it raised

    @property
    def median_s(self) -> float | None:
        return statistics.median(self.seconds) if self.seconds else None


class Call:
    """The target's call on the batch (``checks.kernel_call``: a compiled call's kernel function, or its
    ``ragged_paged_attention``), its inputs on the device, made as every kernel call is
    (``Backend.timed``: the known-good call, the watchdog, a halt ends the bench), timed inside. An input
    the call donated is put back before the next call."""

    def __init__(self, target: Target, backend: device.Backend, case: Case, what: str):
        self.backend, self.what = backend, what
        self.call, self.host = kernel_call(target, backend.generation, case.arrays(), case.options())
        self.on_device = backend.put(self.host)

    def __call__(self) -> float:
        donated = {name: self.host[name] for name, value in self.on_device.items() if value.is_deleted()}
        self.on_device.update(self.backend.put(donated))
        return self.backend.timed(self.what, self.call, **self.on_device)


def time_target(target: Target, backend: device.Backend, batch: Batch, calls: int) -> Timing:
    timing = Timing(target.name, batch.name)
    timing.skipped = unsupported(target, batch.case)
    if timing.skipped is not None:
        return timing
    try:
        call = Call(target, backend, batch.case, f"{target.name} on batch {batch.name}")
        timing.first_call_s = call()
        timing.seconds = [call() for _ in range(calls)]
    except Exception as error:  # reported in its row; the other targets still run (a halt ends the bench)
        timing.error = first_line_of_error(error)
    return timing


def sweep(target: Target, backend: device.Backend, batch: Batch, calls: int) -> tuning.Sweep:
    """The target on ``batch`` with its own block sizes and with each pair of ``tuning.candidates``: a
    pair its validator rejects is not called, and one whose call raises is refused with what it raised."""
    pairs = [
        tuning.Blocks(None, None),
        *tuning.candidates(batch.case, target.capabilities.max_kv_pages_per_block),
    ]
    timings = {}
    for blocks in pairs:
        case = tuning.with_blocks(batch.case, blocks)
        swept = Batch(batch.name, batch.description, case)
        if blocks.kv_pages is not None and target.has_validator:
            try:
                target.validate(case.arrays(), case.options())
            except Exception as error:  # the rules refuse the pair: not timed
                timings[blocks] = Timing(target.name, batch.name, error=first_line_of_error(error))
                continue
        timings[blocks] = time_target(target, backend, swept, calls)
    return tuning.Sweep(target.name, batch.name, timings)


def report_sweeps(targets: list[Target], backend: device.Backend, batches: dict, args, where: str) -> bool:
    """Sweeps each target's block sizes on each batch, prints each table and the chip's verdicts, and
    writes a report of each sweep whose own choice loses by ``--tuning-threshold`` where ``--report-dir``
    is given; whether a verdict fails the bench."""
    chip = lowering.real_tpu_generation() if backend.name == device.TPU else None
    failed = False
    for target in targets:
        for batch in batches.values():
            if unsupported(target, batch.case) is not None:
                continue
            swept = sweep(target, backend, batch, args.calls)
            print(f"{target.name} on batch {batch.name}, block sizes swept:")
            print("\n".join(f"  {line}" for line in tuning.table(swept)))
            if chip is None:
                print("  no tuning verdict: an interpreter's times are the CPU's")
            for verdict in tuning.verdicts(swept, target.tuning_findings, chip, args.tuning_threshold):
                name = verdict.finding.name if verdict.finding else "undeclared"
                print(f"  {'TUNING' if verdict.fails else 'tuning'} {name}: {verdict.words}")
                failed = failed or verdict.fails
            ratio = swept.ratio()
            if args.report_dir and ratio is not None and ratio >= args.tuning_threshold:
                path = tuning.report_path(Path(args.report_dir), swept)
                path.write_text(
                    tuning.report(
                        swept, batch.description, where, args.calls, args.tuning_threshold, target.version
                    )
                )
                print(f"  report: {path}")
    return failed


def chip_peak(backend: device.Backend) -> tuple[str, Peak | None]:
    """What the times were measured on, and its peak where the times are a chip's."""
    if backend.name != device.TPU:
        emulating = "" if backend.generation == generations.NONE else f", emulating a {backend.generation}"
        return f"{backend.name} on a CPU{emulating}: the interpreter's times, nothing about a chip", None
    generation = lowering.real_tpu_generation()
    peak = None if generation is None else PEAKS.get(generation)
    said = (
        "peak unknown here"
        if peak is None
        else f"peak {peak.hbm_gbps:,.0f} GB/s, {peak.bf16_tflops:,.0f} TFLOP/s"
    )
    return f"{lowering.default_device_kind()} ({generation}; {said})", peak


def _ratio(value: float | None, reference: float | None) -> float | None:
    return None if value is None or not reference else value / reference


def table(timings: list[Timing], batches: dict, baselines: dict, peak: Peak | None) -> list[str]:
    """One row per (batch, target) measured, in columns; one line per one that did not run or raised."""
    header = ("batch", "target", "ms/call (fastest)", "GB/s", "of HBM peak", "TFLOP/s", "x its baseline")
    rows, notes = [header], []
    medians = {(t.batch, t.target): t.median_s for t in timings}
    for t in timings:
        if t.median_s is None:
            notes.append((t.batch, t.target, f"not run: {t.skipped}" if t.skipped else f"raised: {t.error}"))
            continue
        case = batches[t.batch].case
        gbps = hbm_bytes(case) / t.median_s / 1e9
        tflops = attention_flops(case) / t.median_s / 1e12
        baseline = baselines.get(t.target)
        ratio = _ratio(t.median_s, medians.get((t.batch, baseline))) if baseline else None
        rows.append((
            t.batch, t.target, f"{t.median_s * 1e3:.3f} ({min(t.seconds) * 1e3:.3f})", f"{gbps:,.1f}",
            f"{gbps / peak.hbm_gbps:.0%}" if peak else "-", f"{tflops:,.2f}",
            "-" if ratio is None else f"{ratio:.2f}",
        ))  # fmt: skip
    widths = [max(len(row[i]) for row in rows + notes if i < len(row)) for i in range(2)]
    widths += [max(len(row[i]) for row in rows) for i in range(2, len(header))]
    return [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=False)).rstrip()
        for row in rows + notes
    ]


def regressions(
    timings: list[Timing],
    baselines: dict,
    previous: dict,
    max_slowdown: float | None,
    max_ratio: float | None,
) -> list[str]:
    """Each (batch, target) whose median is more than ``max_slowdown`` times its own in the earlier run
    ``previous`` ((batch, target) -> seconds), or more than ``max_ratio`` times its baseline's."""
    medians = {(t.batch, t.target): t.median_s for t in timings}
    found = []
    for t in timings:
        if t.median_s is None:
            continue
        checks = [
            (
                "its time in the previous run",
                previous.get((t.batch, t.target)),
                "--max-slowdown",
                max_slowdown,
            )
        ]
        if (baseline := baselines.get(t.target)) is not None:
            checks.append(
                (f"its baseline {baseline}'s", medians.get((t.batch, baseline)), "--max-ratio", max_ratio)
            )
        for what, reference, flag, limit in checks:
            ratio = _ratio(t.median_s, reference)
            if limit is not None and reference is not None and ratio is not None and ratio > limit:
                found.append(
                    f"{t.target} on batch {t.batch}: {t.median_s * 1e3:.3f} ms per call, {ratio:.2f} times "
                    f"{what} ({reference * 1e3:.3f} ms); {flag} is {limit:g}"
                )
    return found


def read_previous(path: Path) -> dict:
    """An earlier ``--json`` file as (batch, target) -> median seconds; a missing file is no earlier run."""
    if not path.exists():
        return {}
    try:
        rows = json.loads(path.read_text())["timings"]
        return {(row["batch"], row["target"]): row["median_s"] for row in rows if row["median_s"] is not None}
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise BenchUsageError(
            f"--previous={path}: not a file `rpa-harness bench --json` wrote ({type(error).__name__}: {error}); "
            "pass one, or a path that does not exist yet"
        ) from None


def default_baseline(target: Target) -> str | None:
    """The target's declared ``RPA_HARNESS_BASELINE``, else upstream's kernel (none for upstream's own)."""
    if target.baseline is not None:
        return target.baseline
    return None if target.name == UPSTREAM_TARGET else UPSTREAM_TARGET


def resolve_backend(choice: str, generation: str | None) -> device.Backend:
    try:
        name = device.resolve(choice)[0]
    except device.BackendChoiceError as error:
        raise BenchUsageError(str(error)) from None
    if name == device.TPU:
        if generation not in (None, generations.NONE):
            raise BenchUsageError(f"--tpu-generation={generation} with a TPU: the chip is what it is")
        return device.Backend(device.TPU)
    generation = generation or "v5e"
    if generation != generations.NONE and generation not in generations.DEVICE_KINDS:
        raise BenchUsageError(
            f"--tpu-generation={generation} is not one this jax knows ({', '.join(generations.DEVICE_KINDS)}, none)"
        )
    return device.Backend(name, generation=generation)


def bench(args) -> int:
    try:
        for flag, limit in (("--max-slowdown", args.max_slowdown), ("--max-ratio", args.max_ratio)):
            if limit is not None and not limit > 0:
                raise BenchUsageError(f"{flag}={limit:g} must be positive: a time ratio, e.g. 1.2")
        if not args.tuning_threshold > 1:
            raise BenchUsageError(
                f"--tuning-threshold={args.tuning_threshold:g} must be above 1: how many times the fastest "
                "accepted block sizes a target's own choice may take, e.g. 1.5"
            )
        if args.report_dir and not Path(args.report_dir).is_dir():
            raise BenchUsageError(f"--report-dir={args.report_dir}: not a folder; create it or name another")
        if args.calls < 1:
            raise BenchUsageError(f"--calls={args.calls} must be at least 1")
        unknown = [name for name in args.batch if name not in BATCHES]
        if unknown:
            raise BenchUsageError(
                f"--batch={','.join(unknown)}: not a batch; choose from {', '.join(BATCHES)}"
            )
        backend = resolve_backend(args.backend, args.tpu_generation)
        try:
            targets = [load(name) for name in args.target or [DEFAULT_TARGET]]
            baselines = {}
            for target in list(targets):
                baseline = default_baseline(target) if args.baseline is None else args.baseline
                if baseline is None or baseline in ("", "none"):
                    continue
                baseline = ALIASES.get(baseline, baseline)
                if baseline == target.name:
                    continue
                baselines[target.name] = baseline
                if baseline not in [t.name for t in targets]:
                    targets.append(load(baseline))
        except TargetError as error:
            raise BenchUsageError(str(error)) from None
        previous = read_previous(Path(args.previous)) if args.previous else {}
        if args.json and not Path(args.json).parent.is_dir():
            raise BenchUsageError(f"--json={args.json}: its folder does not exist; create it or name another")
    except BenchUsageError as error:
        print(f"rpa-harness bench: {error}", file=sys.stderr)
        return USAGE
    warnings.filterwarnings("ignore", "Some donated buffers were not usable")  # the interpreters' note
    batches = {name: BATCHES[name] for name in args.batch}
    where, peak = chip_peak(backend)
    print(f"rpa-harness bench on {where}; {args.calls} timed call(s) after a compiling one, median (fastest)")
    for batch in batches.values():
        case = batch.case
        print(f"  {batch.name}: {batch.description} ({hbm_bytes(case) / 1e6:,.4g} MB to move, "
              f"{attention_flops(case) / 1e9:,.4g} GFLOP)")  # fmt: skip
    if args.sweep_blocks:
        named = targets[: len(args.target or [DEFAULT_TARGET])]  # the baselines come after: not swept
        return REGRESSED if report_sweeps(named, backend, batches, args, where) else PASSES
    timings = [time_target(t, backend, batch, args.calls) for batch in batches.values() for t in targets]
    print("\n".join(table(timings, batches, baselines, peak)))
    for target in targets:
        timed = (
            "the kernel call it maps to"
            if target.compiled_call
            else "ragged_paged_attention, as users call it"
        )
        compared = (
            f"; x its baseline: over {baselines[target.name]}'s median" if target.name in baselines else ""
        )
        print(f"{target.name}: timed on {timed}{compared}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "device": where, "baselines": baselines,
            "timings": [dict(dataclasses.asdict(t), median_s=t.median_s) for t in timings],
        }, indent=1))  # fmt: skip
    found = regressions(timings, baselines, previous, args.max_slowdown, args.max_ratio)
    for line in found:
        print(f"REGRESSION: {line}")
    raised = [t for t in timings if t.error is not None]
    for t in raised:
        print(f"RAISED: {t.target} on batch {t.batch}: {t.error}")
    return REGRESSED if found or raised else PASSES


def add_parser(commands) -> None:
    parser = commands.add_parser(
        "bench", help="time targets at serving-sized batches against a baseline",
        description="Time each --target (and its baseline) on named serving batches: time per call, the HBM "
        "bandwidth and attention FLOP rate it implies, against the chip's peak, and the ratio to the baseline.",
        epilog="exit codes: 0 measured (nothing past --max-slowdown or --max-ratio); 1 a time past one, or a target "
        "raised; 4 usage "
        "error. On an interpreter the times are the CPU's: a dry run of the setup only.",
    )  # fmt: skip
    parser.add_argument(
        "--target", action="append", default=None,
        help=f"module to time (repeat for several; default {DEFAULT_TARGET})",
    )  # fmt: skip
    parser.add_argument(
        "--baseline", help="module every target is compared with (default: each target's "
        f"RPA_HARNESS_BASELINE, else {UPSTREAM_TARGET}; none: no baseline)",
    )  # fmt: skip
    parser.add_argument(
        "--batch", default=",".join(DEFAULT_BATCHES), type=lambda text: [b for b in text.split(",") if b],
        help=f"batches, comma-separated, of: {', '.join(BATCHES)} (default {','.join(DEFAULT_BATCHES)})",
    )  # fmt: skip
    parser.add_argument(
        "--backend", default=device.AUTO, choices=(*device.BACKENDS, device.AUTO),
        help="auto (default): a TPU if jax sees one, else the fast interpreter",
    )  # fmt: skip
    parser.add_argument(
        "--tpu-generation", help="on an interpreter, the TPU generation to emulate (default v5e; none: a CPU)"
    )
    parser.add_argument("--calls", type=int, default=20, help="timed calls per target and batch (default 20)")
    parser.add_argument(
        "--max-slowdown", type=float,
        help="exit 1 where a target's median is more than this many times its own in --previous",
    )  # fmt: skip
    parser.add_argument(
        "--max-ratio",
        type=float,
        help="exit 1 where a target's median is more than this many times its baseline's",
    )
    parser.add_argument(
        "--sweep-blocks", action="store_true",
        help="time each target's own block sizes against every (KV pages, queries) per block pair it "
        "accepts; on a chip, a tuning finding where its own choice loses by --tuning-threshold",
    )  # fmt: skip
    parser.add_argument(
        "--tuning-threshold", type=float, default=tuning.DEFAULT_THRESHOLD,
        help=f"with --sweep-blocks: the times the fastest accepted pair's that a target's own choice may take "
        f"(default {tuning.DEFAULT_THRESHOLD:g})",
    )  # fmt: skip
    parser.add_argument(
        "--report-dir", help="with --sweep-blocks: write a performance report of each tuning finding here"
    )
    parser.add_argument("--json", help="also write the timings to this file (a later run's --previous)")
    parser.add_argument("--previous", help="an earlier run's --json file to compare with (missing: none)")
