"""``rpa-harness chip verdicts``: a row per declared finding, with the known-issue property's outcome on the
backend asked (here what the fast interpreter emulating a v5e predicts), and usage errors as one line, exit
4."""

import os

import pytest

from rpa_harness import cli, device, targets
from tests.processes import run_python

UPSTREAM = targets.UPSTREAM_TARGET


@pytest.fixture
def no_chip_here(monkeypatch):
    """A CPU host, stated (no probe in a child); the step's keeping off the chips undone afterwards."""
    monkeypatch.setenv(device.TPU_PROBE_ENV, "none")
    monkeypatch.setattr(device.chip, "_keep_off_the_chips", False)
    device.tpus.cache_clear()
    yield
    device.tpus.cache_clear()


@pytest.mark.parametrize(
    "args, complaint",
    [
        (["--target", "no.such.target", "--backend", "fast-interpret"], "cannot import it"),
        (["--tpu-generation", "v5e"], "a real TPU is the chip it is"),
        ([], "no TPU is visible to jax here"),
        (["--backend", "fast-interpret", "--tpu-generation", "v9"], "v9"),
    ],
    ids=["unknown target", "a generation for a chip", "no chip here", "unknown generation"],
)
def test_a_usage_error_is_one_line_and_exit_4(no_chip_here, capsys, args, complaint):
    assert cli.main(["chip", "verdicts", *args]) == cli.USAGE
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.strip().splitlines()) == 1, captured.err
    assert captured.err.startswith("rpa-harness chip verdicts: ") and complaint in captured.err


def test_an_unknown_step_is_one_line_and_exit_4(capsys):
    assert cli.main(["chip", "verdict"]) == cli.USAGE
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.strip().splitlines()) == 1, captured.err
    assert "invalid choice: 'verdict'" in captured.err and "'verdicts'" in captured.err


def test_every_declared_finding_of_upstream_gets_its_verdict(pytestconfig, tmp_path):
    """The console command's table, on the cheapest target with findings: what a user's nightly prints."""
    table = tmp_path / "verdicts.md"
    result = run_python(
        "-m", "rpa_harness.cli", "chip", "verdicts", "--backend", "fast-interpret", "--tpu-generation", "v5e",
        "--target", UPSTREAM, "--markdown", str(table),
        cwd=tmp_path, env={**os.environ, device.TPU_PROBE_ENV: "none"},
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert table.read_text() in result.stdout, "the table is printed, and the same is written"
    rows = {
        line.split(" | ")[1]: line
        for line in table.read_text().splitlines()
        if line.startswith(f"| {UPSTREAM}")
    }
    assert set(rows) == {issue.name for issue in targets.load(UPSTREAM).known_issues}
    # A compile finding is not run without libtpu (the newest jax's leg): every other one is judged.
    judged = {name: row for name, row in rows.items() if "not run" not in row}
    assert all("reproduces" in row or "passes (not visible here)" in row for row in judged.values()), rows
    assert sum("reproduces" in row for row in judged.values()) >= 4, rows
    first = table.read_text().splitlines()[0]
    assert first.startswith(tuple("0123456789")), "its first line says when, where and how"
    assert first.endswith("`rpa-harness chip verdicts --backend fast-interpret --tpu-generation v5e`")
