"""``ci/release_matrix.py``: releases grouped by their kernel file's digest, a row's log and JUnit file read,
the table rendered, and its command line; with fake release folders and recorded run output (no network, no
JAX, no pip).

The log and JUnit samples are trimmed from a real row (tpu-inference 0.32.0, hd64, jax 0.12: exit 0 in 785 s);
the failing one has the summary lines rpa_harness/cli.py writes for a failure.
"""

import hashlib
import importlib.util
import sys
import textwrap
from pathlib import Path

import pytest

from rpa_harness.device import processes

SCRIPT = Path(__file__).resolve().parents[2] / "ci" / "release_matrix.py"
_spec = importlib.util.spec_from_file_location("release_matrix", SCRIPT)
assert _spec is not None and _spec.loader is not None
matrix = importlib.util.module_from_spec(_spec)
sys.modules["release_matrix"] = matrix  # dataclasses look their module up by name
_spec.loader.exec_module(matrix)

V3, HD64 = matrix.TARGETS["v3"], matrix.TARGETS["hd64"]

PASSING_LOG = textwrap.dedent("""\
    $ cd release-matrix/0.32.0-hd64 && PYTHONPATH=/cache/0.32.0 python -m rpa_harness.cli run --profile ci
    bringing up nodes...

    rpa-harness progress 22:57:53: 2/92 properties started, 6 examples, 0 failing
      test_differential.py::test_kernel_matches_oracle[fast-interpret-v5e] 3/200 examples, 4/min
    XFAIL ../../tests/properties/test_known_issues.py::test_known_issue_still_reproduces[hd64-sink-on-padded-q-heads-interpret-v5e] - hd64-sink-on-padded-q-heads in rpa_harness.targets.tpu_inference_v3_hd64 on interpret still reproduces
    88 passed, 33 skipped, 12 xfailed in 779.11s (0:12:59)

    rpa-harness summary
    rpa-harness 0.1.0: target rpa_harness.targets.tpu_inference_v3_hd64 (tpu-inference 0.32.0 (v3/kernel_hd64.py
        601b56634e21))
      backends: fast-interpret-v5e, fast-interpret-v6e, interpret-v5e, interpret-v6e (interpreter compat on); jax 0.12.0.1
      TPU generations emulated: v5e, v6e
      known issues declared: hd64-sink-on-padded-q-heads, hd64-kv-block-not-whole-tiles-fails-to-trace,
          hd64-finite-mask-value-weights-keys-by-block
      buckets: tiny, small, long
    property                                                                                   examples  result
    test_differential.py::test_kernel_matches_oracle[fast-interpret-v5e]                            200  passed
        largest case: 32/32 tok, 1/4 seqs, kv<=128, 8/8x64, page 64x3
        error/bound: max 0.981 (q bfloat16, kv float8_e4m3fn), median 0.778 of 200 cases
    test_differential.py::test_kernel_matches_oracle_checked[interpret-v6e]                          40  passed
        error/bound: max 0.957 (q bfloat16, kv float8_e4m3fn), median 0.47 of 40 cases
    test_differential.py::test_reference_matches_oracle                                               0  passed
    test_known_issues.py::test_known_issue_still_reproduces[hd64-sink-on-padded-q-heads-interpret-v5e]            0  xfailed
        hd64-sink-on-padded-q-heads in rpa_harness.targets.tpu_inference_v3_hd64 on interpret still reproduces:
          rpa_harness.targets.tpu_inference_v3_hd64 on interpret raised on valid inputs: JaxRuntimeError: IndexError:
    test_lowering.py::test_lowers_on_every_known_generation[7]                                        0  skipped
        lowering to Mosaic is an opt-in property (target rpa_harness.targets.tpu_inference_v3_hd64 does not opt in:
          lowers_for_tpu)
    test_validation.py::test_invalid_input_raises_specified_error[rule-03]                           10  passed
    coverage labels seen (3): GQA ratio 1 x192, attention sink x68, batch: decode x144, long corner: float32 queries,
      context just past 2^15 keys, the kernel's block sizes x2
    known issues declared (3): drawn cases moved out of each, and the replay of its repro
    issue                                         avoided  replay
    hd64-sink-on-padded-q-heads                         2  fast-interpret: reproduces, interpret: reproduces
    hd64-kv-block-not-whole-tiles-fails-to-trace       54  fast-interpret: reproduces, interpret: reproduces
    hd64-finite-mask-value-weights-keys-by-block       54  fast-interpret: reproduces, interpret: reproduces
    pytest command: /work/venv312/bin/python -m pytest --pyargs rpa_harness.properties -p no:cacheprovider -n 2
    """)  # fmt: skip

# A failing row: a property's repro (and a hang's), a fixed known issue (a failure without a repro) and a
# known issue whose long replay cell wraps. The FAILED line before the summary quotes a repro too: only the
# summary's are read.
FAILING_LOG = textwrap.dedent("""\
    FAILED ../../tests/properties/test_differential.py::test_kernel_matches_oracle[fast-interpret-v5e] - repro: /elsewhere/x.json
    1 failed, 2 passed, 1 xfailed in 12.00s

    rpa-harness summary
    rpa-harness 0.1.0: target rpa_harness.targets.tpu_inference_v3 (tpu-inference 0.19.0 (v3/kernel.py 07999f4d126f))
      buckets: tiny
    property                                                                  examples  result
    test_differential.py::test_kernel_matches_oracle[fast-interpret-v5e]            17  FAILED
        repro: /out/0.19.0-v3/repros/differential_fast-interpret-v5e.json
        largest case: 3/8 tok, 2/4 seqs, kv<=40, 8/2x128, page 16x4
    test_differential.py::test_kernel_matches_oracle_checked[interpret-v5e]          3  FAILED
        repro: hang after 300 s: /out/0.19.0-v3/repros/differential_interpret-v5e.json
    test_known_issues.py::test_known_issue_still_reproduces[window-fast-interpret-v5e]  0  FAILED
    test_known_issues.py::test_known_issue_still_reproduces[scale-interpret-v5e]         0  xfailed
    test_padding.py::test_same_call_gives_same_bits[fast-interpret-v5e]             40  passed
    coverage labels seen (0):
    known issues declared (2): drawn cases moved out of each, and the replay of its repro
    issue   avoided  replay
    window        3  fast-interpret (v5e): FIXED
    scale         0  fast-interpret (v5e): passes (not visible here), interpret (v5e):
                     reproduces
    pytest command: python -m pytest --pyargs rpa_harness.properties
    """)  # fmt: skip


def junit(*cases: str) -> str:
    """A JUnit file as pytest writes it, with one testsuite."""
    return (
        '<?xml version="1.0" encoding="utf-8"?><testsuites name="pytest tests"><testsuite name="pytest">'
        + "".join(cases)
        + "</testsuite></testsuites>"
    )


PASSED_CASE = '<testcase classname="tests.properties.test_differential" name="test_kernel_matches_oracle[fast-interpret-v5e]" time="177.6" />'  # fmt: skip
SKIPPED_CASE = '<testcase classname="tests.properties.test_lowering" name="test_lowers_on_every_known_generation[7]" time="0.01"><skipped type="pytest.skip" message="lowering to Mosaic is an opt-in property">tests/properties/test_lowering.py:48: lowering</skipped></testcase>'  # fmt: skip
XFAILED_CASE = '<testcase classname="tests.properties.test_known_issues" name="test_known_issue_still_reproduces[scale-interpret-v5e]" time="4.1"><skipped type="pytest.xfail" message="scale in rpa_harness.targets.tpu_inference_v3 on interpret still reproduces" /></testcase>'  # fmt: skip
FAILED_CASE = '<testcase classname="tests.properties.test_known_issues" name="test_known_issue_still_reproduces[window-fast-interpret-v5e]" time="2.0"><failure message="window is fixed">AssertionError</failure></testcase>'  # fmt: skip


def fake_release(cache_dir: Path, release: str, **kernels: str) -> Path:
    """An installed release as install() leaves it: its metadata folder and the named kernel files
    (``v3=...`` for kernel.py, ``hd64=...`` for kernel_hd64.py)."""
    folder = cache_dir / release
    (folder / f"tpu_inference-{release}.dist-info").mkdir(parents=True)
    v3 = folder.joinpath(*matrix.V3_FOLDER)
    v3.mkdir(parents=True)
    for name, source in kernels.items():
        (v3 / matrix.TARGETS[name].kernel_file).write_text(source)
    return folder


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def test_releases_are_grouped_by_their_kernel_files_digest(tmp_path):
    folders = {
        "0.21.0": fake_release(tmp_path, "0.21.0", v3="kernel A", hd64="hd64 X"),
        "0.11.1": fake_release(tmp_path, "0.11.1", v3="kernel C"),  # before hd64
        "0.19.0": fake_release(tmp_path, "0.19.0", v3="kernel A", hd64="hd64 X"),
        "0.22.1": fake_release(tmp_path, "0.22.1", v3="kernel B", hd64="hd64 X"),
        "0.20.0": fake_release(tmp_path, "0.20.0", v3="kernel A", hd64="hd64 X"),
    }
    v3 = matrix.group_by_kernel(folders, V3)
    assert [(group.digest, group.releases) for group in v3] == [
        (sha256("kernel C"), ["0.11.1"]),
        (sha256("kernel A"), ["0.19.0", "0.20.0", "0.21.0"]),
        (sha256("kernel B"), ["0.22.1"]),
    ]
    assert [group.newest for group in v3] == ["0.11.1", "0.21.0", "0.22.1"]
    (hd64,) = matrix.group_by_kernel(folders, HD64)
    assert hd64.digest == sha256("hd64 X") and hd64.releases == ["0.19.0", "0.20.0", "0.21.0", "0.22.1"]


def test_releases_with_one_kernel_file_but_another_module_it_imports_are_two_groups(tmp_path, capsys):
    kernel = "from tpu_inference.kernels.ragged_paged_attention.v3.util import cdiv"
    for release, util in (("0.25.0", "old util"), ("0.26.0", "new util"), ("0.31.0", "new util")):
        folder = fake_release(tmp_path, release, hd64=kernel)
        folder.joinpath(*matrix.V3_FOLDER, "util.py").write_text(util)
    groups = matrix.group_by_kernel({r: tmp_path / r for r in ("0.25.0", "0.26.0", "0.31.0")}, HD64)
    assert [(g.digest, g.siblings, g.releases) for g in groups] == [
        (sha256(kernel), {"util.py": sha256("old util")}, ["0.25.0"]),
        (sha256(kernel), {"util.py": sha256("new util")}, ["0.26.0", "0.31.0"]),
    ]
    releases = "0.25.0,0.26.0,0.31.0"
    assert (
        matrix.main(["--cache-dir", str(tmp_path), "--releases", releases, "--targets", "hd64", "--list"])
        == 0
    )
    assert capsys.readouterr().out.splitlines() == [
        "hd64 (v3/kernel_hd64.py): 2 distinct in 3 releases",
        f"  {sha256(kernel)[:12]}  0.25.0*  (util.py {sha256('old util')[:12]})",
        f"  {sha256(kernel)[:12]}  0.26.0*, 0.31.0*  (util.py {sha256('new util')[:12]})",
        "* runs",
    ]


def test_releases_are_ordered_as_pypi_orders_them():
    releases = ["0.13.3", "0.9.0", "0.13.2.post6", "0.13.2", "0.32.0"]
    assert sorted(releases, key=matrix.release_key) == ["0.9.0", "0.13.2", "0.13.2.post6", "0.13.3", "0.32.0"]
    assert list(matrix.RELEASES) == sorted(matrix.RELEASES, key=matrix.release_key)


def test_install_reuses_an_installed_release_and_replaces_an_interrupted_one(tmp_path, monkeypatch):
    installed = fake_release(tmp_path, "0.19.0", v3="kernel")
    calls = []

    def pip(command, **kwargs):  # what pip --target leaves: the package and its metadata
        calls.append(command)
        target = Path(command[command.index("--target") + 1])
        (target / "tpu_inference-0.22.1.dist-info").mkdir(parents=True)
        return processes.Finished(tuple(command), 0, "", "", 0.0)

    monkeypatch.setattr(matrix.processes, "run", pip)
    assert matrix.install("0.19.0", cache_dir=tmp_path) == installed and not calls
    (tmp_path / "0.22.1").mkdir()  # an interrupted install of old: no metadata
    (tmp_path / "0.22.1" / "stray.py").write_text("")
    folder = matrix.install("0.22.1", cache_dir=tmp_path)
    assert folder == tmp_path / "0.22.1" and matrix.is_installed(folder, "0.22.1")
    assert not (folder / "stray.py").exists() and not (tmp_path / "0.22.1.partial").exists()
    assert calls[0][-1] == "tpu-inference==0.22.1" and "--no-deps" in calls[0]


def test_a_failed_install_is_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    def pip(command, **kwargs):
        return processes.Finished(
            tuple(command),
            1,
            "",
            "ERROR: Could not find a version\nERROR: No matching distribution found\n",
            0.0,
        )

    monkeypatch.setattr(matrix.processes, "run", pip)
    with pytest.raises(matrix.InstallError, match="tpu-inference==9.9.9: ERROR: No matching distribution"):
        matrix.install("9.9.9", cache_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_a_passing_runs_log_gives_its_examples_and_the_known_issues_that_reproduce():
    found = matrix.read_log(PASSING_LOG)
    assert found.examples == 200 + 40 + 10
    assert found.ran == "601b56634e21"
    assert list(found.known_issues) == [
        "hd64-sink-on-padded-q-heads",
        "hd64-kv-block-not-whole-tiles-fails-to-trace",
        "hd64-finite-mask-value-weights-keys-by-block",
    ]
    assert all(matrix.REPRODUCES in replay for replay in found.known_issues.values())
    assert found.repros == [] and found.last_line.startswith("pytest command:")


def test_a_failing_runs_log_gives_the_summarys_repros_and_each_issues_whole_replay():
    found = matrix.read_log(FAILING_LOG)
    assert found.examples == 17 + 3 + 40
    assert found.repros == [
        "/out/0.19.0-v3/repros/differential_fast-interpret-v5e.json",
        "hang after 300 s: /out/0.19.0-v3/repros/differential_interpret-v5e.json",
    ]
    assert found.known_issues == {
        "window": "fast-interpret (v5e): FIXED",
        "scale": "fast-interpret (v5e): passes (not visible here), interpret (v5e): reproduces",
    }


def test_a_log_without_the_summary_gives_its_last_line_only():
    found = matrix.read_log(
        "$ cd x && python -m rpa_harness.cli run\nERROR: --target v3: cannot import it\n\n"
    )
    assert found.examples is None and found.known_issues == {} and found.ran is None
    assert found.last_line == "ERROR: --target v3: cannot import it"


def test_junit_gives_pytests_counts_and_the_failed_tests(tmp_path):
    path = tmp_path / "junit.xml"
    path.write_text(junit(PASSED_CASE, PASSED_CASE, SKIPPED_CASE, XFAILED_CASE, FAILED_CASE))
    found = matrix.RunSummary()
    matrix.read_junit(path, found)
    assert dict(found.counts) == {"passed": 2, "skipped": 1, "xfailed": 1, "failed": 1}
    assert found.failed_tests == ["test_known_issue_still_reproduces[window-fast-interpret-v5e]"]
    missing = matrix.RunSummary()
    matrix.read_junit(tmp_path / "none.xml", missing)  # a run that ended before pytest wrote it
    assert not missing.counts


def row(tmp_path, release, target, digest, exit_code, log, cases=()) -> "matrix.Row":
    """A row as run_row() leaves it, from a recorded log and JUnit test cases."""
    result = matrix.Row(release, target, digest, tmp_path / f"{release}-{target.name}", exit_code, 785.4)
    result.summary = matrix.read_log(log)
    result.folder.mkdir()
    result.junit.write_text(junit(*cases))
    matrix.read_junit(result.junit, result.summary)
    return result


def test_the_table_has_a_line_per_row_with_its_result_counts_and_findings(tmp_path):
    rows = [
        row(tmp_path, "0.32.0", HD64, "601b56634e21" + "0" * 52, 0, PASSING_LOG, [PASSED_CASE, XFAILED_CASE]),
        row(tmp_path, "0.19.0", V3, "07999f4d126f" + "1" * 52, 1, FAILING_LOG, [PASSED_CASE, FAILED_CASE]),
        row(tmp_path, "0.11.1", V3, "cdcfab7b82a7" + "2" * 52, 4, "ERROR: --target x: a | b\n"),
    ]
    lines = matrix.render_table(rows).splitlines()
    assert lines[:2] == [
        "| release | target | kernel digest | examples | result | wall s | findings |",
        "|---|---|---|---:|---|---:|---|",
    ]
    assert lines[2] == (
        "| 0.32.0 | hd64 | 601b56634e21 | 250 | pass (1 passed, 1 xfailed) | 785 | 3 of 3 declared known issues "
        "reproduce: hd64-sink-on-padded-q-heads, hd64-kv-block-not-whole-tiles-fails-to-trace, "
        "hd64-finite-mask-value-weights-keys-by-block |"
    )
    assert lines[3] == (
        "| 0.19.0 | v3 | 07999f4d126f | 60 | FAIL (1 passed, 1 failed) | 785 | 1 of 2 declared known issues "
        "reproduce: scale; window: fast-interpret (v5e): FIXED; "
        "repro: /out/0.19.0-v3/repros/differential_fast-interpret-v5e.json; "
        "repro: hang after 300 s: /out/0.19.0-v3/repros/differential_interpret-v5e.json |"
    )
    assert lines[4] == (  # a pipe in a cell is escaped: the row keeps its columns
        "| 0.11.1 | v3 | cdcfab7b82a7 | - | error (exit 4) | 785 | last line: ERROR: --target x: a \\| b |"
    )
    assert len(lines) == 5


def test_a_failure_without_repros_names_its_failed_tests(tmp_path):
    log = FAILING_LOG.replace("    repro: ", "    note: ")
    failing = row(tmp_path, "0.19.0", V3, "07999f4d126f" + "1" * 52, 1, log, [FAILED_CASE])
    assert matrix.findings(failing).endswith(
        "failed: test_known_issue_still_reproduces[window-fast-interpret-v5e]"
    )


def test_a_row_that_tested_another_kernel_is_an_error(tmp_path):
    """The header names the kernel the target loaded: another one (an install ahead of the release's folder
    on the path) says nothing about the release, whatever the exit status."""
    shadowed = row(tmp_path, "0.19.0", V3, "3cbb10c566ba" + "0" * 52, 0, FAILING_LOG)
    assert shadowed.result == "error"
    assert matrix.findings(shadowed).startswith("tested kernel 07999f4d126f, not the release's")


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--targets", "v3,v4"], "--targets: v4; choose from v3, hd64"),
        (["--releases", "0.19.0,latest"], "--releases: not a release: latest"),
        (["--no-such-option"], "unrecognized arguments: --no-such-option"),
        (["--cache-dir", str(SCRIPT.parent)], "inside the repo"),
    ],
)
def test_a_usage_error_is_one_line_and_exit_4(arguments, message, capsys):
    assert matrix.main(arguments) == matrix.USAGE
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.splitlines()) == 1
    assert captured.err.startswith("release_matrix: ") and message in captured.err


def test_list_prints_the_groups_and_marks_the_release_that_runs(tmp_path, capsys):
    for release, kernel in (("0.19.0", "A"), ("0.21.0", "A"), ("0.22.1", "B")):
        fake_release(tmp_path, release, v3=kernel, hd64="X")
    code = matrix.main(["--cache-dir", str(tmp_path), "--releases", "0.19.0,0.21.0,0.22.1", "--list"])
    assert code == 0
    assert (
        capsys.readouterr().out.splitlines()
        == [
            "v3 (v3/kernel.py): 2 distinct in 3 releases",
            f"  {sha256('A')[:12]}  0.19.0*, 0.21.0*",  # named: each runs
            f"  {sha256('B')[:12]}  0.22.1*",
            "hd64 (v3/kernel_hd64.py): 1 distinct in 3 releases",
            f"  {sha256('X')[:12]}  0.19.0*, 0.21.0*, 0.22.1*",
            "* runs",
        ]
    )


def test_dry_run_prints_a_command_per_row_with_the_release_first_on_the_path(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/somewhere/else")
    cache, out = tmp_path / "cache", tmp_path / "out"
    folder = fake_release(cache, "0.11.1", v3="C")  # no hd64 kernel: no hd64 row
    assert (
        matrix.main(["--cache-dir", str(cache), "--releases", "0.11.1", "--out", str(out), "--dry-run"]) == 0
    )
    captured = capsys.readouterr()
    (line,) = captured.out.splitlines()
    assert line.startswith(f"cd {out / '0.11.1-v3'} && PYTHONPATH={folder}:/somewhere/else ")
    assert (
        f"{sys.executable} -m rpa_harness.cli run --profile ci --target rpa_harness.targets.tpu_inference_v3 "
        in line
    )
    assert "--tpu-generation v5e,v6e --buckets tiny,small,long" in line
    assert f"--junit {out / '0.11.1-v3' / 'junit.xml'} --repro-dir {out / '0.11.1-v3' / 'repros'}" in line
    assert "0.11.1 ships no v3/kernel_hd64.py: no hd64 row" in captured.err
    assert not out.exists()


def test_main_runs_each_row_in_its_folder_and_exits_1_when_one_fails(tmp_path, capsys, monkeypatch):
    """The rows' runs replaced by a Python that prints a recorded log, writes the JUnit file and exits as
    the recorded run did (the release 0.19.0 fails)."""
    fake_release(tmp_path / "cache", "0.19.0", v3="A")
    fake_release(tmp_path / "cache", "0.32.0", v3="B")
    failing_log = FAILING_LOG.replace("07999f4d126f", sha256("A")[:12])  # the kernel it loaded: the release's
    recorded = {
        "0.19.0": (failing_log, junit(PASSED_CASE, FAILED_CASE), 1),
        "0.32.0": ("", junit(PASSED_CASE), 0),
    }

    def fake_command(row):
        log, cases, code = recorded[row.release]
        program = (
            "import os, pathlib, sys; assert os.getcwd() == sys.argv[1]; print(sys.argv[2], end=''); "
            "pathlib.Path(sys.argv[3]).write_text(sys.argv[4]); sys.exit(int(sys.argv[5]))"
        )
        arguments = [str(row.folder.resolve()), log, str(row.junit), cases, str(code)]
        return [sys.executable, "-c", program, *arguments]

    monkeypatch.setattr(matrix, "run_command", fake_command)
    out, table = tmp_path / "out", tmp_path / "table.md"
    arguments = ["--cache-dir", str(tmp_path / "cache"), "--releases", "0.19.0,0.32.0", "--targets", "v3"]
    assert matrix.main([*arguments, "--out", str(out), "--table", str(table)]) == matrix.FAILED
    printed = capsys.readouterr().out
    assert table.read_text() == printed
    assert [line.split(" | ")[4] for line in printed.splitlines()[2:]] == [
        "FAIL (1 passed, 1 failed)",
        "pass (1 passed)",
    ]
    assert (out / "0.19.0-v3" / "run.log").read_text().startswith(f"$ cd {out / '0.19.0-v3'} && PYTHONPATH=")
