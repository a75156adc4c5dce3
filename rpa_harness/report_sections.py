"""What every upstream-ready report says the same way, whichever API the kernel has: its sections in order
(``UpstreamReadyReport``), the case in words, the worst element as a table, the map of where the output
is wrong, the closing line, and the refusal to report a repro that does not reproduce.
``rpa_harness.bug_report`` (upstream's API) and each target's own report (``RPA_HARNESS_REPORT``, e.g.
tpu-inference v3's) fill the sections with what their kernel's call, reference and cache need said."""

import dataclasses

from rpa_harness import repro as repro_files


class NothingToReport(Exception):
    """The repro does not reproduce here (it passes now, or the call fails otherwise than recorded); the
    message says what happened instead and how to replay it."""


# The most entries of a page table row the case's words list; a longer row is cut, its length said.
MAX_LISTED_PAGES = 64


def page_table_row(row) -> str:
    """One sequence's page table row in the report's words: whole, or its first ``MAX_LISTED_PAGES`` entries
    and how many follow (a row of thousands of pages is a long page table, not a list to read)."""
    entries = [int(page) for page in row]
    if len(entries) <= MAX_LISTED_PAGES:
        return f"`{entries}`"
    return f"`{entries[:MAX_LISTED_PAGES]}` and {len(entries) - MAX_LISTED_PAGES:,} more"


def case_in_words(repro: repro_files.Repro) -> list[str]:
    arrays, options = repro.arrays, repro.options
    q, kv_pages = arrays["q"], arrays["kv_pages"]
    n = int(arrays["num_seqs"][0])
    cu, kv_lens, pages = arrays["cu_q_lens"], arrays["kv_lens"], arrays["page_indices"]
    seqs = [(int(cu[i + 1] - cu[i]), int(kv_lens[i])) for i in range(n)]
    total_pages, page_size, combined, head_dim = kv_pages.shape
    lines = [
        f"- {n} sequence{'s' * (n != 1)}, as `(q_len, kv_len)`: "
        + (", ".join(f"`({a}, {b})`" for a, b in seqs) or "none")
        + f" ({int(cu[n])} query row(s) of `max_num_batched_tokens = {q.shape[0]}`; "
        f"`max_num_seqs = {pages.shape[0]}`)",
        f"- heads: {q.shape[1]} query, {combined // 2} KV (combined K/V axis {combined}), head_dim {head_dim}",
        f"- dtypes: q {q.dtype}, KV cache {kv_pages.dtype}",
        f"- paged cache: {total_pages} pages of {page_size} tokens, `pages_per_seq = {pages.shape[1]}`; "
        "page table rows of the sequences: " + ", ".join(page_table_row(pages[i]) for i in range(n)),
        "- options: " + (", ".join(f"`{k}={v!r}`" for k, v in options.items()) or "none (defaults)"),
    ]
    if repro.case is not None:
        lines.append(
            f"- data: `values={repro.case.values!r}` (seed {repro.case.seed}), NaN in padding: "
            f"{repro.case.poison}, garbage in unused metadata slots: {repro.case.garbage}"
        )
    return lines


def worst_element_table(comparison, *, expected: str, own_reference, actual: str) -> list[str]:
    """The worst element as a Markdown table: the oracle's value, the kernel's own reference's (a
    ``(label, value)`` pair, or None), the kernel's, and the error against the harness's bound."""
    w = comparison.worst
    lines = ["| | value |", "|---|---|", f"| {expected} | {w.expected:.9g} |"]
    if own_reference is not None:
        label, value = own_reference
        lines.append(f"| {label} | {value:.9g} |")
    return lines + [
        f"| {actual} | {w.actual:.9g} |",
        f"| error | {w.error:.3g} (the harness's bound for this element: {w.bound:.3g}) |",
    ]


def error_map_block(comparison) -> list[str]:
    """The map of where the output is wrong, as a Markdown code block (none for a non-numeric failure)."""
    if comparison.error_map is None:
        return []
    return ["", "```", comparison.error_map.render(indent=""), "```"]


def environment(recorded: dict, *, leave_out: tuple[str, ...] = ()) -> list[str]:
    """The versions this report ran with (its values and script output are of this environment), and the
    ones the repro was recorded with where they differ."""
    current = {name: version for name, version in repro_files.versions().items() if name not in leave_out}
    lines = [f"- {name} {version}" for name, version in current.items()]
    differing = {
        name: version for name, version in recorded.items() if name in current and current[name] != version
    }
    if differing:
        lines.append(
            "- the repro was recorded with "
            + ", ".join(f"{name} {version}" for name, version in differing.items())
        )
    return lines


def script_output(heading: str, output: str) -> list[str]:
    """The standalone script's output, under ``heading`` (which says where it ran and its verdict)."""
    return ["", heading, "", "```", output, "```"]


def found_by(shown_path: str) -> list[str]:
    """The closing line: how the harness re-runs the exact failing inputs."""
    return [
        "",
        "Found by rpa-harness (property-based differential testing of RPA kernels): "
        f"`rpa-harness replay {shown_path}` re-runs the exact failing inputs.",
    ]


def code_block(text: str, language: str = "python") -> list[str]:
    """``text`` as a fenced Markdown block (``language`` empty for plain text, such as a compiler's words)."""
    return [f"```{language}", text, "```"]


@dataclasses.dataclass(frozen=True)
class UpstreamReadyReport:
    """The sections every upstream-ready report has, in this order, each under its heading: the environment,
    the case, what was expected against what happened, why (a known issue's explanation, when it has one),
    how to reproduce it without the harness, the script's output when it was run, and the closing line."""

    title: str
    environment: list[str]
    case: list[str]
    outcome: list[str]
    reproduce: list[str]  # what the standalone script needs and does, and the script
    shown_path: str  # the repro as the closing line names it
    why: str | None = None
    script_output: list[str] = dataclasses.field(default_factory=list)  # ``script_output``'s lines
    case_heading: str = "The case"
    outcome_heading: str = "Expected and actual"

    def markdown(self) -> str:
        sections = [
            ("Environment", self.environment),
            (self.case_heading, self.case),
            (self.outcome_heading, self.outcome),
            *([("Why", [self.why])] if self.why else []),
            ("Reproduce", self.reproduce),
        ]
        lines = [f"# {self.title}"]
        for heading, body in sections:
            lines += ["", f"## {heading}", "", *body]
        return "\n".join([*lines, *self.script_output, *found_by(self.shown_path)]) + "\n"
