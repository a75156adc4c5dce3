"""Where an output is wrong, at a glance: live rows (grouped by sequence) against q heads, each cell the
largest error/bound over head_dim, in plain text that fits a terminal and a CI log.

A kernel bug has a shape, and the shape names the bug: every head of one sequence (its page table or
length), one block of heads (a head loop), the last row of each query block (a block boundary), every row
past some token (a causal or window offset). The map shows that shape before anyone reads a number.
"""

import dataclasses

import numpy as np

WITHIN = "."  # error within the bound
NONFINITE = "!"  # NaN or Inf where the oracle is finite
LEGEND = f"{WITHIN} within the bound; digit d: over it, by up to 10^d times (9: or more); {NONFINITE} NaN/Inf"
MAX_COLUMNS = 64  # q heads shown one per column up to this many; more are grouped, several per column
MAX_LINES_PER_SEQUENCE = 16  # a sequence with more rows shows bands of consecutive tokens
MAX_SEQUENCE_LINES = 48  # then the remaining sequences are counted, not drawn


def cell(ratio: float) -> str:
    """One character for a largest error/bound: the decades it exceeds the bound by."""
    if not np.isfinite(ratio):
        return NONFINITE
    if ratio <= 1.0:
        return WITHIN
    return str(min(9, max(1, int(np.ceil(np.log10(ratio))))))


@dataclasses.dataclass(frozen=True, eq=False)
class ErrorMap:
    """Per checked output row: its sequence, its token within the sequence, and the largest error/bound of
    each q head over head_dim (inf where the output is NaN or Inf)."""

    sequence: np.ndarray  # int [rows]
    token: np.ndarray  # int [rows]
    ratio: np.ndarray  # float [rows, num_q_heads]

    def render(self, indent: str = "  ") -> str:
        heads = self.ratio.shape[1]
        per_column = -(-heads // MAX_COLUMNS)
        first_heads = range(0, heads, per_column)
        entries = self._entries([slice(h, min(h + per_column, heads)) for h in first_heads])
        width = max(len("q head"), *(len(label) for label, _ in entries)) + 2
        lines = [
            f"{indent}where the output is wrong: rows (by sequence) x q heads, each cell the largest "
            "error/bound over head_dim",
            f"{indent}  ({LEGEND})",
        ]
        if per_column > 1:
            lines.append(f"{indent}  (each column is {per_column} consecutive q heads)")
        if heads > 10:
            lines.append(
                f"{indent}{'':<{width}}" + "".join(str(h // 10 % 10) if h >= 10 else " " for h in first_heads)
            )
        lines.append(f"{indent}{'q head':<{width}}" + "".join(str(h % 10) for h in first_heads))
        lines += [f"{indent}{label:<{width}}{text}" for label, text in entries]
        return "\n".join(lines)

    def _entries(self, columns: list[slice]) -> list[tuple[str, str]]:
        """(label, cells and the line's largest error/bound) per line: a failing sequence's rows (or bands of
        them), and one line for each run of sequences within the bound."""
        entries: list[tuple[str, str]] = []
        clean: list[int] = []  # a run of sequences within the bound, not yet written

        def close_clean_run():
            if clean:
                rows = int(np.isin(self.sequence, clean).sum())
                name = f"sequence {clean[0]}" if len(clean) == 1 else f"sequences {clean[0]}-{clean[-1]}"
                entries.append((f"{name} ({rows} row{'s' * (rows != 1)})", "all within the bound"))
                clean.clear()

        sequences = list(dict.fromkeys(self.sequence.tolist()))
        failing = [s for s in sequences if np.any(self.ratio[self.sequence == s] > 1.0)]
        for sequence in sequences:
            if sequence not in failing:
                clean.append(sequence)
                continue
            close_clean_run()
            if failing.index(sequence) == MAX_SEQUENCE_LINES:
                entries.append(
                    (f"... and {len(failing) - MAX_SEQUENCE_LINES} more sequences with errors", "")
                )
                return entries
            rows = np.flatnonzero(self.sequence == sequence)
            for band in np.array_split(rows, min(len(rows), MAX_LINES_PER_SEQUENCE)):
                first, last = int(self.token[band[0]]), int(self.token[band[-1]])
                tokens = f"token {first}" if first == last else f"tokens {first}-{last}"
                block = self.ratio[band]
                cells = "".join(cell(float(np.max(block[:, c]))) for c in columns)
                entries.append((f"sequence {sequence}, {tokens}", f"{cells}  {float(np.max(block)):.3g}"))
        close_clean_run()
        return entries
