"""``ci/chip_verdicts.py``: a row per declared finding, with the known-issue property's outcome on the backend
asked (here what the fast interpreter emulating a v5e predicts), and usage errors as one line, exit 4."""

import os

import pytest

from rpa_harness import device, targets
from tests.processes import run_python

UPSTREAM = targets.UPSTREAM_TARGET


def verdicts(*args, cwd):
    env = {**os.environ, device.TPU_PROBE_ENV: "none"}
    return run_python("ci/chip_verdicts.py", *args, cwd=cwd, env=env)


@pytest.mark.parametrize(
    "args",
    [("--target", "no.such.target"), ("--tpu-generation", "v5e"), ()],
    ids=["unknown target", "a generation for a chip", "no chip here"],
)
def test_a_usage_error_is_one_line_and_exit_4(args, pytestconfig):
    result = verdicts(*args, cwd=pytestconfig.rootpath)
    assert result.returncode == 4, result.stdout + result.stderr
    assert len(result.stdout.strip().splitlines()) == 1 and result.stdout.startswith("chip_verdicts: ")


def test_every_declared_finding_of_upstream_gets_its_verdict(pytestconfig, tmp_path):
    table = tmp_path / "verdicts.md"
    result = verdicts(
        "--backend", "fast-interpret", "--tpu-generation", "v5e", "--target", UPSTREAM, "--markdown", str(table),
        cwd=pytestconfig.rootpath,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
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
    assert table.read_text().startswith(tuple("0123456789")), "its first line says when, where and how"
