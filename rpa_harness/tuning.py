"""``rpa-harness bench --sweep-blocks``: a target's own block sizes against every pair its rules accept.

A kernel that picks its block sizes itself (a tuned table, a rule of thumb) may pick badly for a batch a
serving engine sends it, and no differential test sees that: the output is right, only slow. For each
batch the sweep times the target with its own choice (no block sizes given) and with each (KV pages,
queries) per block of ``KV_PAGES_PER_BLOCK`` x ``QUERIES_PER_BLOCK`` that fits the batch and that the target
accepts (its validator passes and its call does not raise). Where its own choice takes at least
``--tuning-threshold`` (1.5) times the fastest accepted pair, that is a tuning finding: a performance
report ready for the kernel's maintainers (the batch, the chip, the versions, the table, the command).

A target declares the tuning findings it knows (``RPA_HARNESS_TUNING_FINDINGS``: ``TuningFinding``), each
for the chips whose tuning has it, as known issues are declared. On a chip, each declared finding of a
swept batch gets its verdict (it reproduces, by how much; it is not seen; it does not apply to this
generation), and an undeclared finding, or a declared one not seen, fails the bench. An interpreter's times
are the CPU's: the sweep and its table run there, and no verdict is given.
"""

import dataclasses
import shlex
from pathlib import Path

from rpa_harness import device
from rpa_harness import repro as repro_files
from rpa_harness.known_issues import TuningFinding
from rpa_harness.strategies.case import Case

# The block sizes swept: KV pages and query rows per block, powers of two over what serving kernels use.
KV_PAGES_PER_BLOCK = (2, 4, 8, 16, 32, 64, 128)
QUERIES_PER_BLOCK = (8, 16, 32, 64, 128, 256)
DEFAULT_THRESHOLD = 1.5
OWN = "its own"  # the row of the target's own choice


@dataclasses.dataclass(frozen=True)
class Blocks:
    """A (KV pages, queries) per block pair, or None for the target's own choice."""

    kv_pages: int | None
    queries: int | None

    @property
    def label(self) -> str:
        return OWN if self.kv_pages is None else f"{self.kv_pages} pages x {self.queries} queries"


def candidates(case: Case, max_kv_pages_per_block: int = 0) -> list[Blocks]:
    """The pairs that fit the batch: no more pages than a sequence holds (and than the target's declared
    ``max_kv_pages_per_block``), no more query rows than the batch's tokens."""
    pages = min(case.pages_per_seq, max_kv_pages_per_block or case.pages_per_seq)
    return [
        Blocks(kv_pages, queries)
        for kv_pages in KV_PAGES_PER_BLOCK
        if kv_pages <= pages
        for queries in QUERIES_PER_BLOCK
        if queries <= case.max_num_batched_tokens
    ]


def with_blocks(case: Case, blocks: Blocks) -> Case:
    return dataclasses.replace(
        case, num_kv_pages_per_block=blocks.kv_pages, num_queries_per_block=blocks.queries
    )


@dataclasses.dataclass
class Sweep:
    """One target on one batch: the timing of its own choice and of each pair tried (``bench.Timing``;
    a pair the target refused carries why in its ``error``)."""

    target: str
    batch: str
    timings: dict  # Blocks -> bench.Timing

    @property
    def own(self):
        return self.timings[Blocks(None, None)]

    def fastest(self):
        """The fastest pair the target accepted (not its own choice), as (Blocks, Timing), or None."""
        timed = [
            (blocks, timing)
            for blocks, timing in self.timings.items()
            if blocks.kv_pages is not None and timing.median_s is not None
        ]
        return min(timed, key=lambda pair: pair[1].median_s, default=None)

    def ratio(self) -> float | None:
        """How many times the fastest accepted pair's median its own choice takes (None: either missing)."""
        best = self.fastest()
        if best is None or self.own.median_s is None:
            return None
        return self.own.median_s / best[1].median_s

    def accepted(self) -> int:
        return sum(1 for blocks, t in self.timings.items() if blocks.kv_pages is not None and t.seconds)


def table(sweep: Sweep) -> list[str]:
    """The sweep as rows, fastest first: the pair, its median (fastest), and its time over the fastest
    pair's; then one line per pair the target refused."""
    best = sweep.fastest()
    reference = best[1].median_s if best else None
    rows = [("blocks", "ms/call (fastest)", "x the fastest pair")]
    timed = sorted(
        ((blocks, t) for blocks, t in sweep.timings.items() if t.median_s is not None),
        key=lambda pair: pair[1].median_s,
    )
    for blocks, t in timed:
        ratio = "-" if not reference else f"{t.median_s / reference:.2f}"
        rows.append((blocks.label, f"{t.median_s * 1e3:.3f} ({min(t.seconds) * 1e3:.3f})", ratio))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows
    ]
    refused = [(blocks, t) for blocks, t in sweep.timings.items() if t.median_s is None]
    lines += [f"{blocks.label}: refused: {t.error or t.skipped}" for blocks, t in refused]
    return lines


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What a chip says of a swept batch for one target: the declared finding it concerns (or None for an
    undeclared one), its words, and whether it fails the bench."""

    finding: TuningFinding | None
    words: str
    fails: bool


def verdicts(sweep: Sweep, declared: tuple, chip: str | None, threshold: float) -> list[Verdict]:
    """Each declared finding of the swept batch, judged on TPU generation ``chip``, and an undeclared
    finding where the own choice loses by ``threshold`` or more; none on an interpreter (``chip`` None)."""
    if chip is None:
        return []
    ratio = sweep.ratio()
    best = sweep.fastest()
    shown = ratio is not None and ratio >= threshold
    measured = (
        f"its own choice {sweep.own.median_s * 1e3:.3f} ms, {best[0].label} {best[1].median_s * 1e3:.3f} ms: "
        f"{ratio:.2f}x"
        if ratio is not None and best is not None
        else "not measured (its own choice or every pair did not run)"
    )
    found = []
    ours = [finding for finding in declared if finding.batch == sweep.batch]
    for finding in ours:
        if not finding.applies_to(chip):
            found.append(
                Verdict(
                    finding,
                    f"does not apply to {chip} (declared for {', '.join(finding.generations)})",
                    False,
                )
            )
        elif shown:
            found.append(Verdict(finding, f"reproduces on {chip}: {measured}", False))
        else:
            found.append(Verdict(
                finding,
                f"NOT SEEN on {chip}: {measured}, under {threshold:g}x; if the kernel's choice was tuned, "
                "remove the declaration",
                True,
            ))  # fmt: skip
    if shown and not any(finding.applies_to(chip) for finding in ours):
        found.append(Verdict(None, f"TUNING FINDING on {chip}: {measured} (at least {threshold:g}x)", True))
    return found


def command(sweep: Sweep, calls: int) -> str:
    """The command that sweeps the same target and batch on a chip."""
    return shlex.join([
        "rpa-harness", "bench", "--target", sweep.target, "--batch", sweep.batch, "--sweep-blocks",
        "--baseline", "none", "--calls", str(calls), "--backend", device.TPU,
    ])  # fmt: skip


def report(
    sweep: Sweep,
    batch_description: str,
    chip_words: str,
    calls: int,
    threshold: float,
    target_version: str | None,
) -> str:
    """An upstream-ready performance report of the sweep: what is slow and by how much, the batch, the
    chip, the versions, the table, and the command that measures it again."""
    ratio, best = sweep.ratio(), sweep.fastest()
    if ratio is None or best is None:
        headline = f"{sweep.target}: its own block sizes on batch {sweep.batch} could not be compared"
    else:
        headline = (
            f"{sweep.target}: its own block sizes take {ratio:.2f}x the time of {best[0].label} per block "
            f"on batch {sweep.batch}"
        )
    versions = [f"- {sweep.target} {target_version or '(version unknown)'}"]
    versions += [f"- {name} {version}" for name, version in repro_files.versions().items()]
    return "\n".join([
        f"# {headline}",
        "",
        f"Measured on {chip_words}. The kernel's own choice (no block sizes given) against each (KV pages, "
        f"queries) per block pair that fits the batch and that the kernel accepts: {sweep.accepted()} pairs "
        f"accepted of {len(sweep.timings) - 1} tried. A tuning finding is a choice that takes at least "
        f"{threshold:g} times the fastest accepted pair. The outputs are checked elsewhere; this is speed alone.",
        "",
        "## The batch",
        "",
        batch_description,
        "",
        "## Versions",
        "",
        *versions,
        "",
        f"## Time per call ({calls} timed calls after a compiling one; median, fastest)",
        "",
        "```",
        *table(sweep),
        "```",
        "",
        "## Measure it again",
        "",
        "```",
        command(sweep, calls),
        "```",
        "",
    ])  # fmt: skip


def report_path(folder: Path, sweep: Sweep) -> Path:
    name = sweep.target.rsplit(".", 1)[-1]
    return folder / f"tuning-{name}-{sweep.batch}.md"
