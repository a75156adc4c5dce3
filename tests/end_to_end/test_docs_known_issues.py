"""``docs/known-issues.md``'s example of a known issue of one's own is ``tests/own_known_issue/target.py``
verbatim, and a run of the properties on it passes: its cases moved out, its repro an expected failure."""

import re
from pathlib import Path

import pytest

from rpa_harness import targets
from rpa_harness.plugin import settings_of
from tests.processes import run_python

ROOT = Path(__file__).resolve().parents[2]
TARGET = "tests.own_known_issue.target"


def test_the_docs_show_the_tested_module():
    blocks = re.findall(
        r"^```python\n(.*?)^```$", (ROOT / "docs" / "known-issues.md").read_text(), re.M | re.S
    )
    assert blocks == [(ROOT / "tests" / "own_known_issue" / "target.py").read_text()]


def test_the_declared_issue_is_moved_out_and_replays_as_an_expected_failure(pytestconfig, tmp_path):
    if settings_of(pytestconfig).target.name != targets.DEFAULT_TARGET:
        pytest.skip("runs its own target")
    issue = targets.load(TARGET).known_issues[0]
    assert issue.name == "prefill-tail-not-written" and issue.repro.exists()
    result = run_python(
        "-m", "rpa_harness.cli", "run", "--profile", "dev", "--target", TARGET, "--backend", "fast-interpret",
        "-n", "0", "--repro-dir", str(tmp_path), "--", "-k", "matches_oracle or known_issue",
        cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    row = re.search(r"^prefill-tail-not-written +(\d+) +fast-interpret: reproduces$", result.stdout, re.M)
    assert row and int(row[1]) > 0, result.stdout[-3000:]  # drawn prefills were moved out
