"""The map of where an output is wrong: its shapes are visible (a head block, every head of a sequence, the
last row of each query block), it fits a terminal at production sizes, and it shows the shipped findings."""

import re
from pathlib import Path

import numpy as np
import pytest

from rpa_harness import repro, targets
from rpa_harness.checks import PropertyFailure, check_differential
from rpa_harness.device import FAST_INTERPRET, Backend
from rpa_harness.reference.error_map import MAX_LINES_PER_SEQUENCE, ErrorMap, cell
from tests.cases import skip_without_tpu_inference

ROOT = Path(__file__).resolve().parents[2]


def drawn(sequence_lens, heads, wrong) -> str:
    """The map of a layout with ``wrong(sequence, token, head)`` cells at 5x the bound, others at 0.5x."""
    sequence = np.repeat(np.arange(len(sequence_lens)), sequence_lens)
    token = np.concatenate([np.arange(n) for n in sequence_lens])
    ratio = np.array(
        [[5.0 if wrong(s, t, h) else 0.5 for h in range(heads)] for s, t in zip(sequence, token, strict=True)]
    )
    return ErrorMap(sequence, token, ratio).render()


def map_lines(text: str) -> dict[str, tuple[str, str]]:
    """Each drawn row line of a map: its label, then (cells, the line's largest error/bound)."""
    found = (
        re.match(r"\s*(sequence \d+, tokens? [\d-]+)\s+(\S+)\s+(\S+)$", line) for line in text.splitlines()
    )
    return {match[1]: (match[2], match[3]) for match in found if match}


def test_a_cell_counts_the_decades_over_the_bound():
    assert [cell(r) for r in (0.0, 1.0, 1.5, 10.0, 11.0, 1e30, np.inf, np.nan)] == list("..1129!!")


def test_one_head_block_of_one_sequence():
    text = drawn([1, 3, 2], 8, lambda s, t, h: s == 1 and 4 <= h < 8)
    assert "sequence 0 (1 row)" in text and "sequence 2 (2 rows)" in text
    for token in range(3):
        assert f"sequence 1, token {token}  ....1111  5" in text, text


def test_the_last_row_of_each_query_block():
    text = drawn([8], 4, lambda s, t, h: t % 4 == 3)
    rows = [line for line in text.splitlines() if line.strip().startswith("sequence 0, token")]
    assert [row.split()[-2] for row in rows] == ["....", "....", "....", "1111"] * 2, text


def test_production_sizes_fit_a_terminal():
    """8,192 rows of 512 sequences and 128 q heads: grouped heads, banded rows, clean sequences collapsed."""
    lens = [1] * 510 + [4096, 3586]
    text = drawn(lens, 128, lambda s, t, h: s == 511 or (s == 510 and t > 4000 and h == 127))
    assert max(map(len, text.splitlines())) <= 120, text
    assert "(each column is 2 consecutive q heads)" in text
    (clean,) = [line.split() for line in text.splitlines() if "sequences 0-509" in line]
    assert clean == ["sequences", "0-509", "(510", "rows)", "all", "within", "the", "bound"], text
    bands = [line for line in text.splitlines() if "sequence 510, tokens" in line]
    assert len(bands) == MAX_LINES_PER_SEQUENCE and bands[-1].split()[-2].endswith(".1")
    assert all(line.split()[-2] == "1" * 64 for line in text.splitlines() if "sequence 511, tokens" in line)


def failure_text(path: Path, backend: Backend) -> str:
    recorded = repro.read(path)
    target = targets.load(recorded.target)
    with pytest.raises(PropertyFailure) as failure:
        check_differential(target, backend, recorded.arrays, recorded.options)
    return str(failure.value)


def test_the_map_shows_upstreams_skipped_head_blocks():
    """zero-query-tail-skips-head-blocks: the only live row ends a query block and a q_len == 0 sequence
    follows; the later KV-head blocks skip every sequence, so q heads 0-3 are right and 4-7 wrong."""
    path = ROOT / "docs/upstream-findings/zero-query-tail-skips-head-blocks/differential_fast-interpret.json"
    text = failure_text(path, Backend(FAST_INTERPRET))
    cells, worst = map_lines(text)["sequence 0, token 0"]
    assert cells[:4] == "...." and "." not in cells[4:] and float(worst) > 1e7, text


def test_the_map_shows_v3s_finite_mask_value_finding():
    """finite-mask-value-counts-keys-by-block, shrunk to one row and one head: that cell, ~10^5 x the bound."""
    skip_without_tpu_inference()
    path = ROOT / "docs/tpu-inference-v3-findings/finite-mask-value-counts-keys-by-block"
    text = failure_text(path / "differential-checked_interpret.json", Backend(FAST_INTERPRET))
    assert map_lines(text) == {"sequence 0, token 0": ("6", "4.32e+05")}, text
