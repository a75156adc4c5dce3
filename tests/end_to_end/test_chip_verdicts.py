"""``rpa-harness chip verdicts``: a row per declared finding, with the known-issue property's outcome on the
backend asked (here what the interpreters emulating a v5e predict, compared with the v5e's own tables of
2026-12-07), and usage errors as one line, exit 4."""

import os
from pathlib import Path

import pytest

from rpa_harness import ahead_of_time, cli, device, targets
from rpa_harness.chip import verdicts
from tests.cases import skip_without_tpu_inference
from tests.processes import run_python

UPSTREAM = targets.UPSTREAM_TARGET
HD64 = "rpa_harness.targets.tpu_inference_v3_hd64"
# The v5e's verdicts as its session wrote them: upstream's in the first group's table, hd64's in the second.
CHIP_TABLES = Path(__file__).resolve().parents[2] / "docs" / "chip-results" / "2026-12-07-v5e"
# Without the v5e compiler the prediction cannot see what the chip's compiler refuses (masks, compile
# findings), so it is compared with the chip only where libtpu is installed.
NO_V5E_COMPILER = ahead_of_time.unavailable_reason("v5e")


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
        (["--backend", "fast-interpret", "--compare", "no-such-table.md"], "--compare no-such-table.md"),
        (["--backend", "fast-interpret", "--compare", __file__], "no row of a verdicts table"),
    ],
    ids=[
        "unknown target", "a generation for a chip", "no chip here", "unknown generation", "no chip table",
        "not a table",
    ],
)  # fmt: skip
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


def predict(target: str, folder: Path, *options: str):
    """``rpa-harness chip verdicts`` predicting a v5e for one target on this CPU host."""
    return run_python(
        "-m", "rpa_harness.cli", "chip", "verdicts", "--backend", "fast-interpret", "--tpu-generation", "v5e",
        "--target", target, *options,
        cwd=folder, env={**os.environ, device.TPU_PROBE_ENV: "none"},
    )  # fmt: skip


def test_every_declared_finding_of_upstream_gets_the_chips_verdict(pytestconfig, tmp_path):
    """The console command's table, on the cheapest target with findings: what a user's nightly prints;
    with the v5e compiler here, the verdict the v5e gave each finding (verdicts-1.md: two masked by a
    refusal of the chip's compiler, one halting the chip)."""
    table = tmp_path / "verdicts.md"
    chip_table = CHIP_TABLES / "verdicts-1.md"
    compare = [] if NO_V5E_COMPILER else ["--compare", str(chip_table)]
    result = predict(UPSTREAM, tmp_path, "--markdown", str(table), *compare)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    if compare:
        assert f"agreement with {chip_table}: 8 of 8 rows" in result.stdout, result.stdout[-3000:]
    assert table.read_text() in result.stdout, "the table is printed, and the same is written"
    rows = {
        line.split(" | ")[1]: line
        for line in table.read_text().splitlines()
        if line.startswith(f"| {UPSTREAM}")
    }
    assert set(rows) == {issue.name for issue in targets.load(UPSTREAM).known_issues}
    # A compile finding is not run without libtpu (the newest jax's leg): every other one is judged.
    judged = {name: row for name, row in rows.items() if "not run" not in row}
    seen = ("reproduces", "passes (not visible here)", "masked by ")
    assert all(any(words in row for words in seen) for row in judged.values()), rows
    assert sum("reproduces" in row for row in judged.values()) >= 4, rows
    first = table.read_text().splitlines()[0]
    assert first.startswith(tuple("0123456789")), "its first line says when, where and how"
    assert first.endswith("`rpa-harness chip verdicts --backend fast-interpret --tpu-generation v5e`")


@pytest.mark.skipif(bool(NO_V5E_COMPILER), reason=f"the v5e compiler predicts hd64's mask: {NO_V5E_COMPILER}")
def test_hd64s_prediction_is_the_chips(tmp_path):
    """hd64's finite-mask finding is masked on a v5e by its tiling finding, whose case the kernel's own
    block sizes for a v5e are (verdicts-2.md): the v5e compiler ahead of time sees it on this host."""
    skip_without_tpu_inference()
    chip_table = CHIP_TABLES / "verdicts-2.md"
    result = predict(HD64, tmp_path, "--compare", str(chip_table))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"agreement with {chip_table}: 2 of 2 rows" in result.stdout, result.stdout[-3000:]
    assert "masked by hd64-kv-block-not-whole-tiles-fails-to-trace (fast-interpret-v5e)" in result.stdout


def test_a_prediction_is_compared_by_verdict_and_not_by_backend():
    chip = verdicts.table_rows(
        "2026-12-07, TPU v5 lite (v5e); `rpa-harness chip verdicts --backend tpu`\n\n"
        "| target | finding | generations | verdict |\n|---|---|---|---|\n"
        "| t | compiles | all | reproduces (tpu-compiler-v5e) |\n"
        "| t | halts | all | reproduces: halts the chip |\n"
        "| t | unseen | all | passes (not visible here) (tpu) |\n"
        "| t | masked | all | masked by compiles (tpu) |\n"
        "| t | elsewhere | all | recorded for v6e, not replayed on v5e (tpu) |\n"
        "| u | (not loaded) | | cannot import its kernel |\n"
    )
    assert ("u", "(not loaded)") not in chip
    predicted = {
        ("t", "compiles"): "reproduces (tpu-compiler-v5e)",
        ("t", "halts"): "reproduces: halts the chip (interpret-v5e)",
        ("t", "unseen"): "passes (not visible here) (fast-interpret-v5e)",
        ("t", "masked"): "reproduces (fast-interpret-v5e)",
        ("t", "elsewhere"): "reproduces (fast-interpret-v5e)",
    }
    compared, differing = verdicts.disagreements(predicted, {key: (v, "chip.md") for key, v in chip.items()})
    assert compared == 4, "a row the chip did not judge is not compared"
    assert differing == [
        "t masked: here reproduces (fast-interpret-v5e); the chip (chip.md) masked by compiles (tpu)"
    ]
