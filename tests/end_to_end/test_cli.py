"""End to end: a buggy target fails, leaves a repro pair, and `rpa-harness replay` pins it down."""

import collections
import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rpa_harness import bug_report, cli, device, plugin, recording, reference, targets
from rpa_harness import repro as repro_files
from rpa_harness.plugin import settings_of
from rpa_harness.property_names import DIFFERENTIAL, PropertyName
from rpa_harness.recording import recorded
from rpa_harness.reference import parse_precision
from rpa_harness.strategies.case import Case
from tests.processes import run_python, without_checkout_names

BUGGY = "tests.injected.head_swap"


@pytest.fixture(scope="module")
def failing_repro(tmp_path_factory, pytestconfig):
    if settings_of(pytestconfig).target.name != "rpa_harness.kernel":
        pytest.skip("the CLI test injects its own bug into the bundled kernel")
    repro_dir = tmp_path_factory.mktemp("repros")
    result = run_python(
        "-m", "pytest", "tests/properties/test_differential.py::test_kernel_matches_oracle", "-p", "no:cacheprovider",
        "-q", "-x", f"--rpa-target={BUGGY}", "--rpa-backend=fast-interpret", "--hypothesis-profile=ci",
        f"--rpa-repro-dir={repro_dir}", cwd=pytestconfig.rootpath,
    )  # fmt: skip
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    paths = sorted(repro_dir.glob("*.json"))
    assert [p.name for p in paths] == ["differential_fast-interpret.json"], result.stdout[-3000:]
    assert str(paths[0]) in result.stdout, "the failure message must name the repro file"
    assert not list(repro_dir.glob("*.pending.*")), "the pending example in flight is removed"
    return paths[0], pytestconfig.rootpath


def test_buggy_target_writes_a_shrunk_repro(failing_repro):
    path, _ = failing_repro
    meta = json.loads(path.read_text())
    assert meta["target"] == BUGGY and meta["backend"] == "fast-interpret"
    assert path.with_suffix(".npz").exists()
    assert set(meta["versions"]) >= {"python", "jax", "jaxlib", "hypothesis"}
    case = json.loads(meta["case"])
    assert len(case["q_lens"]) == 2, f"the bug needs two sequences, and shrinking should stop there: {case}"


def replay(*args, capsys) -> tuple[int, str, str]:
    """``rpa-harness replay ARGS`` in this process (jax is imported and the kernel compiled already):
    (exit status, stdout, stderr)."""
    capsys.readouterr()
    code = cli.main(["replay", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


def test_replay_names_the_sequence_and_head(failing_repro, capsys):
    path, _ = failing_repro
    code, out, err = replay(path, capsys=capsys)
    assert code == 1, out + err
    assert "worst: sequence 1," in out and ", head 1," in out, out
    assert "where the output is wrong: rows (by sequence) x q heads" in out, out
    assert "target = importlib.import_module('tests.injected.head_swap')" in out


def test_replay_passes_against_the_correct_kernel(failing_repro, capsys):
    path, _ = failing_repro
    code, out, err = replay(path, "--target", "rpa_harness.kernel", capsys=capsys)
    assert code == 0 and "passes now" in out, out + err


def test_replay_and_report_judge_a_repro_alike(failing_repro, tmp_path, monkeypatch, capsys):
    """Both rebuild the run from the repro (``run_settings.for_repro``): its backend with its compatibility
    setting and generation, and the precision contract it failed under, not the target's own."""
    path, _ = failing_repro
    meta = json.loads(path.read_text())
    meta.update(precision=["bf16x3-matmul"], interpreter_compat=False)
    altered = tmp_path / "altered.json"  # renamed with its NPZ
    altered.write_text(json.dumps(meta))
    shutil.copy(path.with_suffix(".npz"), altered.with_suffix(".npz"))
    judged = []
    compare, run = reference.compare, device.Backend.run

    def compare_noting(*args, precision, **kwargs):
        judged.append(("precision", tuple(precision)))
        return compare(*args, precision=precision, **kwargs)

    def run_noting(self, *args, **kwargs):
        judged.append(("backend", self))
        return run(self, *args, **kwargs)

    monkeypatch.setattr(reference, "compare", compare_noting)
    monkeypatch.setattr(device.Backend, "run", run_noting)
    code, out, err = replay(altered, capsys=capsys)
    assert code == 1, out + err
    by_replay, judged[:] = list(judged), []
    bug_report.render(altered)
    assert judged == by_replay
    assert set(by_replay) == {
        ("precision", parse_precision(["bf16x3-matmul"])),
        ("backend", device.Backend("fast-interpret", interpreter_compat=False)),
    }


def test_replay_of_a_missing_or_malformed_file_is_one_clear_error(tmp_path, capsys):
    """Exit 2 and one line on stderr, before anything runs (in this process: a traceback would raise here)."""
    code, _, err = replay(tmp_path / "nope.json", capsys=capsys)
    assert code == 2 and "no such file" in err
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    code, _, err = replay(bad, capsys=capsys)
    assert code == 2 and "not a readable repro file" in err
    not_a_repro = tmp_path / "other.json"
    not_a_repro.write_text(
        json.dumps({"property": "differential[interpret]", "target": "rpa_harness.kernel"})
    )
    code, out, err = replay(not_a_repro, capsys=capsys)
    assert code == 2, out + err
    assert "missing field 'backend', 'options', 'dtypes', 'arrays'" in err
    assert err.count("\n") == 1 and "KeyError" not in err


def test_a_pending_file_rebuilds_its_arrays_only_when_they_are_its_cases_own(tmp_path, capsys):
    """A crash leaves only NAME.pending.json: its arrays come back from its case when their checksum matches,
    never otherwise (a validation property breaks a rule in the arrays after drawing the case)."""
    case = Case(max_num_batched_tokens=8, max_num_seqs=2, pages_per_seq=2, total_num_pages=4, page_size=4,
                num_q_heads=2, num_kv_heads=1, head_dim=64, q_lens=(2,), kv_lens=(5,))  # fmt: skip
    example = repro_files.Repro("differential[fast-interpret]", "rpa_harness.kernel", "fast-interpret",
                                case.arrays(), case.options(), case=case)  # fmt: skip
    pending = repro_files.write_pending(example, tmp_path)
    read = repro_files.read(pending)
    assert read.in_flight and read.arrays_file is None
    assert repro_files.arrays_checksum(read.arrays) == repro_files.arrays_checksum(example.arrays)
    broken = case.arrays()
    broken["num_seqs"][0] = 3
    repro_files.write_pending(dataclasses.replace(example, arrays=broken), tmp_path)
    code, _, err = replay(pending, capsys=capsys)
    assert code == 2 and "cannot be rebuilt from its case" in err and err.count("\n") == 1, err


def test_a_repro_too_large_to_store_keeps_its_case_and_replays_from_it(tmp_path, monkeypatch, capsys):
    """Arrays over ``LARGEST_STORED_ARRAYS`` that the case rebuilds are not written (a long context's cache:
    hundreds of MiB); arrays a property changed after drawing the case always are."""
    monkeypatch.setattr(repro_files, "LARGEST_STORED_ARRAYS", 0)
    case = Case(max_num_batched_tokens=8, max_num_seqs=2, pages_per_seq=2, total_num_pages=4, page_size=4,
                num_q_heads=2, num_kv_heads=1, head_dim=64, q_lens=(2,), kv_lens=(5,))  # fmt: skip
    example = repro_files.Repro("differential[fast-interpret]", "rpa_harness.kernel", "fast-interpret",
                                case.arrays(), case.options(), case=case)  # fmt: skip
    path = repro_files.write(example, tmp_path)
    assert not path.with_suffix(".npz").exists()
    read = repro_files.read(path)
    assert read.arrays_from_case and not read.in_flight
    assert repro_files.arrays_checksum(read.arrays) == repro_files.arrays_checksum(example.arrays)
    code, out, err = replay(path, capsys=capsys)
    assert code == 0 and "rebuilt from the case" in out, out + err
    assert not path.with_suffix(".npz").exists()  # the standalone program's arrays went elsewhere
    broken = case.arrays()
    broken["q"][0] += 1
    path = repro_files.write(dataclasses.replace(example, arrays=broken), tmp_path)
    assert path.with_suffix(".npz").exists() and not repro_files.read(path).arrays_from_case


def test_a_halts_repro_names_the_last_examples_before_it_whose_case_rebuilds_them(tmp_path, monkeypatch):
    """A call can leave a fault on the chip that the next call meets: a halt's repro keeps the last
    ``EXAMPLES_BEFORE_A_HALT`` examples its process ran, oldest first, but those whose arrays the case does
    not rebuild (a validation property's broken ones); a repro written without the field reads as none."""
    monkeypatch.setattr(recording, "_ran_before", collections.deque(maxlen=recording.EXAMPLES_BEFORE_A_HALT))
    target, backend = targets.load("rpa_harness.kernel"), device.Backend(device.FAST_INTERPRET)
    name = PropertyName(DIFFERENTIAL, label="x")

    def case(q_len):
        return Case(max_num_batched_tokens=8, max_num_seqs=2, pages_per_seq=2, total_num_pages=4, page_size=4,
                    num_q_heads=2, num_kv_heads=1, head_dim=64, q_lens=(q_len,), kv_lens=(5,))  # fmt: skip

    for q_len in (1, 2, 3):
        with recorded(
            tmp_path, name, target, backend, case(q_len).arrays(), case(q_len).options(), case=case(q_len)
        ):
            pass
    broken = case(4).arrays()
    broken["num_seqs"][0] = 3
    with recorded(tmp_path, name, target, backend, broken, case(4).options(), case=case(4)):
        pass
    suspect = recorded(tmp_path, name, target, backend, case(0).arrays(), case(0).options(), case=case(0))
    with suspect:
        message, code = suspect.on_halt("a kernel call on fast-interpret", "TPU_EXECUTE_ERROR: halted")
    assert (
        code == device.HALT_EXIT_CODE
        and "preceded by: 1 example(s) run just before it on the device" in message
    ), message
    path = tmp_path / "differential_x.json"
    halt = repro_files.read(path)
    [before] = repro_files.predecessors(path, halt)
    assert before.case == case(3) and before.property == str(name)
    assert repro_files.arrays_checksum(before.arrays) == repro_files.arrays_checksum(case(3).arrays())
    meta = json.loads(path.read_text())
    del meta["preceded_by"]
    path.write_text(json.dumps(meta))
    assert repro_files.read(path).preceded_by == []


def test_replay_writes_the_failing_run_as_a_script(failing_repro, tmp_path, capsys):
    path, root = failing_repro
    script = tmp_path / "repro.py"
    code, out, err = replay(path, "--script", script, capsys=capsys)
    assert code == 1, out + err
    program = script.read_text()
    assert "interpret_compat.install()" in program and "force_tpu_interpret_mode(True)" in program
    blocked = without_checkout_names(program)  # a user's copy imports only what is installed
    # PYTHONPATH: where the target lives.
    printed = run_python("-c", blocked, cwd=root, env={**os.environ, "PYTHONPATH": str(root)})
    assert printed.returncode == 0, printed.stderr[-2000:]
    assert "FAIL" in printed.stdout and "worst: sequence 1," in printed.stdout, printed.stdout


def test_replay_snippet_uses_the_checking_backends_parameters(failing_repro):
    path, root = failing_repro
    result = run_python("-m", "rpa_harness.cli", "replay", str(path), "--backend", "interpret", "--interpreter-compat", "off",
                 cwd=root)  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    assert (
        "pltpu.InterpretParams(detect_races=True, out_of_bounds_reads='raise', uninitialized_memory='nan')"
        in (result.stdout)
    )
    assert "interpret_compat.install()" not in result.stdout


def test_replay_of_a_crash_is_not_a_reproduced_bug(failing_repro, tmp_path, capsys):
    """A numeric repro that now raises, or an exception other than the recorded one, exits 3 ("cannot run")."""
    path, _ = failing_repro
    code, out, err = replay(path, "--target", "tests.broken.raises_on_batches", capsys=capsys)
    assert code == 3, out + err
    assert "cannot run here: an interpreter or backend crash: raised RuntimeError" in out
    meta = json.loads(path.read_text())
    meta["error"] = {"type": "RuntimeError", "message": "another message"}
    other = tmp_path / path.name
    other.write_text(json.dumps(meta))
    (tmp_path / meta["arrays"]).write_bytes(path.with_suffix(".npz").read_bytes())
    code, out, err = replay(other, "--target", "tests.broken.raises_on_batches", capsys=capsys)
    assert code == 3, out + err
    assert "a different error than recorded" in out and "another message" in out


def test_unknown_target_is_one_usage_error(pytestconfig):
    result = run_python("-m", "pytest", "tests/properties/test_validation.py", "--rpa-target=no_such_module", "-p", "no:cacheprovider",
                 cwd=pytestconfig.rootpath)  # fmt: skip
    assert result.returncode == 4, result.stdout + result.stderr
    assert "cannot import it" in result.stderr and "Traceback" not in result.stderr


def test_run_shows_a_usage_error_in_one_line_naming_its_own_options(pytestconfig):
    """The second of two targets does not load: the run is a usage error naming it, as for one target."""
    result = run_python(
        "-m", "rpa_harness.cli", "run", "--target", "rpa_harness.kernel", "--target", "no_such_module", "-n", "0",
        cwd=pytestconfig.rootpath,
    )  # fmt: skip
    assert result.returncode == 4, result.stdout + result.stderr
    assert result.stdout.strip() == "", result.stdout  # no pytest command, no summary
    error = result.stderr.strip().splitlines()
    assert len(error) == 1 and "--target no_such_module: cannot import it" in error[0], result.stderr
    assert "--rpa-target" not in result.stderr


def test_a_target_past_its_share_of_the_runs_seconds_has_its_tests_skipped(pytestconfig):
    """``--rpa-seconds`` shares a run's time among its targets: with none to share, every test of both targets
    is skipped, saying why (the validator property: no kernel runs)."""
    result = run_python(
        "-m", "pytest", "tests/properties/test_validation.py::test_valid_input_passes_validation", "-p",
        "no:cacheprovider", "-p", "no:xdist", "-rs", "--rpa-target=rpa_harness.kernel,tests.broken.wrong_shape",
        "--rpa-seconds=0", "--hypothesis-profile=dev", cwd=pytestconfig.rootpath,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for name in ("rpa_harness.kernel", "tests.broken.wrong_shape"):
        assert f"target {name} is past its share of the run's 0 s (--rpa-seconds)" in result.stdout, (
            result.stdout
        )
    assert "2 skipped" in result.stdout, result.stdout[-3000:]


def test_each_target_gets_what_is_left_over_the_targets_still_to_run():
    assert plugin.target_share_ends(deadline=100.0, now=40.0, targets_left=3) == 60.0
    assert plugin.target_share_ends(deadline=100.0, now=90.0, targets_left=1) == 100.0
    assert plugin.target_share_ends(deadline=100.0, now=120.0, targets_left=2) == 120.0  # past it: no time


def test_a_targets_test_id_is_the_shortest_tail_of_its_name_no_other_shares():
    names = ["rpa_harness.kernel", "mine.a.rpa", "mine.b.rpa", "rpa"]
    assert plugin.target_ids(names) == {
        "rpa_harness.kernel": "kernel",
        "mine.a.rpa": "a.rpa",
        "mine.b.rpa": "b.rpa",
        "rpa": "rpa",
    }


def test_a_replay_error_names_the_option_the_user_typed(failing_repro, capsys):
    path, _ = failing_repro
    assert cli.main(["replay", str(path), "--target", "no_such_module"]) == cli.USAGE
    error = capsys.readouterr().err
    assert "--target no_such_module: cannot import it" in error and "--rpa-target" not in error, error


def test_tpu_backend_without_a_tpu_is_one_usage_error(pytestconfig):
    result = run_python("-m", "pytest", "tests/properties/test_validation.py", "--rpa-backend=tpu", "-p", "no:cacheprovider",
                 cwd=pytestconfig.rootpath)  # fmt: skip
    assert result.returncode == 4, result.stdout + result.stderr
    assert "no TPU visible to jax" in result.stderr and "use auto or an interpreter" in result.stderr
    assert "skipped" not in result.stdout and "Traceback" not in result.stderr


def test_run_shows_an_unknown_pytest_argument_as_is(tmp_path):
    """Outside any checkout: pytest's own usage error, exit 4, and no summary table under it."""
    result = run_python(
        "-m", "rpa_harness.cli", "run", "-n", "0", "--", "--no-such-pytest-option", cwd=tmp_path
    )
    assert result.returncode == 4, result.stdout + result.stderr
    assert "--no-such-pytest-option" in result.stderr and "rpa-harness summary" not in result.stdout


def test_plugin_is_inert_in_a_suite_that_does_not_run_the_harness(tmp_path):
    """A user's own tests in an environment with the harness: Hypothesis' profiles untouched, no target imported."""
    (tmp_path / "test_theirs.py").write_text(
        "import sys\nfrom hypothesis import settings\n\n"
        "def test_untouched():\n"
        "    assert settings.default.max_examples == 100, settings.default  # Hypothesis' own, default or ci\n"
        "    assert 'rpa_harness.kernel' not in sys.modules\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RPA_", "HYPOTHESIS_"))}
    result = run_python("-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path), cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stdout + result.stderr


def test_kernel_names_the_bundled_kernel_in_a_checkout_and_says_what_to_use_elsewhere(pytestconfig, tmp_path):
    code = (
        "from rpa_harness import targets\n"
        "try:\n    print('loaded', targets.load('kernel').name)\n"
        "except targets.TargetError as error:\n    print('error', error)\n"
    )
    in_checkout = run_python("-c", code, cwd=pytestconfig.rootpath)
    assert in_checkout.stdout.strip() == "loaded rpa_harness.kernel", in_checkout.stdout + in_checkout.stderr
    elsewhere = run_python("-c", code, cwd=tmp_path)
    assert "The bundled kernel is --rpa-target=rpa_harness.kernel" in elsewhere.stdout, (
        elsewhere.stdout + elsewhere.stderr
    )


def test_help_is_plain_text_and_every_run_option_says_what_it_does(capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["--help"])
    assert exited.value.code == 0
    top = capsys.readouterr().out
    assert "``" not in top and "--version" in top
    with pytest.raises(SystemExit):
        cli.main(["run", "--help"])
    run_help = capsys.readouterr().out
    for option in ("--profile", "--target", "--backend", "--repro-dir", "--buckets", "--tpu-generation"):
        described = run_help.split(option, 2)[-1].split("\n  -")[0]  # the option's entry under "options:"
        assert len(described.split()) > 3, (option, described)
    assert "exit codes" in run_help and "4 usage error" in " ".join(run_help.split())


def test_version_names_the_package_and_jax(capsys):
    import jax

    with pytest.raises(SystemExit) as exited:
        cli.main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.startswith("rpa-harness ") and f"jax {jax.__version__}" in cli._version()


@pytest.mark.parametrize(
    "argv",
    [[], ["run", "--no-such-option"], ["replay"], ["run", "--profile", "fast"], ["report"]],
    ids=["no-command", "unknown-option", "missing-file", "bad-choice", "report-without-file"],
)
def test_a_usage_error_is_one_line_and_exit_4(argv, capsys):
    assert cli.main(argv) == cli.USAGE
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.strip().splitlines()) == 1, captured.err
    assert captured.err.startswith("rpa-harness") and "--help" in captured.err


def test_a_bad_target_on_the_command_line_is_a_usage_error_and_in_the_file_a_bad_file(
    failing_repro, tmp_path, capsys
):
    path, _ = failing_repro
    assert cli.main(["replay", str(path), "--target", "no_such_module"]) == cli.USAGE
    assert cli.main(["report", str(path), "--target", "no_such_module"]) == cli.USAGE
    assert cli.main(["replay", str(path), "--tpu-generation", "v9"]) == cli.USAGE
    meta = json.loads(path.read_text())
    meta["target"] = "no_such_module"
    moved = tmp_path / path.name
    moved.write_text(json.dumps(meta))
    (tmp_path / meta["arrays"]).write_bytes(path.with_suffix(".npz").read_bytes())
    assert cli.main(["replay", str(moved)]) == cli.BAD_FILE
    assert "cannot import it" in capsys.readouterr().err


def test_the_summary_says_how_close_each_property_came_to_its_bound(tmp_path):
    junit = tmp_path / "junit.xml"
    junit.write_text(
        '<testsuite><testcase classname="tests.properties.test_differential" name="test_kernel_matches_oracle"/>'
        "</testsuite>"
    )
    test = "tests/properties/test_differential.py::test_kernel_matches_oracle"
    examples = [
        {"test": test, "max_ratio": ratio, "q_dtype": q, "kv_dtype": "bfloat16"}
        for ratio, q in ((0.02, "float32"), (0.9, "bfloat16"), (0.1, "float32"))
    ]
    text = cli.summary(junit, examples + [{"test": test, "labels": []}])
    assert "error/bound: max 0.9 (q bfloat16, kv bfloat16), median 0.1 of 3 cases" in text, text
    assert "error/bound" not in cli.summary(junit, [{"test": test, "labels": []}])


def test_the_run_passes_pytests_output_through_without_xdists_repeated_status(tmp_path, capsys):
    printing = "print('bringing up nodes...'); print('bringing up nodes...'); print('1 passed')"
    assert cli._call_with_progress([sys.executable, "-c", printing], dict(os.environ), str(tmp_path)) == 0
    assert capsys.readouterr().out == "bringing up nodes...\n1 passed\n"


def test_the_summary_fits_120_columns_orders_rows_and_names_expected_failures(tmp_path):
    long_reason = "the target does not declare the long bucket " + "because " * 30 + "(the end)"
    junit = tmp_path / "junit.xml"
    junit.write_text(
        "<testsuite>"
        '<testcase classname="tests.properties.test_production" name="test_kernel_matches_oracle_long[x]">'
        f'<skipped type="pytest.skip" message="{long_reason}"/></testcase>'
        '<testcase classname="tests.properties.test_known_issues" name="test_known_issue_still_fails[a]">'
        '<skipped type="pytest.xfail" message="finding a: still fails"/></testcase>'
        '<testcase classname="tests.properties.test_differential" name="test_kernel_matches_oracle[x]"/>'
        "</testsuite>"
    )
    repro = "/a/" + "very-long-folder-name/" * 8 + "differential_x.json"
    test = "tests/properties/test_differential.py::test_kernel_matches_oracle[x]"
    examples = [{"test": test, "labels": [f"label {i}" for i in range(40)], "repro": repro}]
    header = [
        "rpa-harness 0.1.0: target t",
        "  known issues declared: " + ", ".join(f"issue-{i}" for i in range(30)),
    ]
    lines = cli.summary(junit, examples, {"header": header}).splitlines()
    assert all(len(line) <= cli.SUMMARY_WIDTH for line in lines if repro not in line), lines
    assert "issue-29" in "".join(lines)
    assert f"    repro: {repro}" in lines  # a path is never broken
    rows = [line.split()[0] for line in lines if line.startswith("test_")]
    assert rows == sorted(rows) and len(rows) == 3, rows
    text = "\n".join(lines)
    assert "xfailed" in text and "finding a: still fails" in text
    assert "(the end)" in text  # a skip's reason in full, wrapped


def test_the_console_script_replays_a_repro_of_a_module_in_the_current_folder(tmp_path):
    """``rpa-harness run --target mymod`` from mymod's folder records target ``mymod``; the replay command it
    prints then works from the same folder, as ``python -m`` would, without PYTHONPATH."""
    (tmp_path / "mymod.py").write_text(
        "from rpa_harness.kernel import dynamic_validate_inputs, ragged_paged_attention  # noqa: F401\n"
    )
    case = Case(max_num_batched_tokens=8, max_num_seqs=2, pages_per_seq=2, total_num_pages=4, page_size=4,
                num_q_heads=2, num_kv_heads=1, head_dim=64, q_lens=(2,), kv_lens=(5,))  # fmt: skip
    path = repro_files.write(
        repro_files.Repro("differential[fast-interpret]", "mymod", "fast-interpret", case.arrays(), case.options(),
                          case=case),
        tmp_path,
    )  # fmt: skip
    script = Path(sys.executable).with_name("rpa-harness")
    result = subprocess.run([str(script), "replay", path.name], cwd=tmp_path, capture_output=True, text=True,
                            env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, timeout=600)  # fmt: skip
    assert result.returncode == 0 and "passes now" in result.stdout, (
        result.stdout[-2000:] + result.stderr[-2000:]
    )


def test_run_with_one_worker_keeps_a_crash_in_the_worker():
    """``-n 1`` is one xdist worker (a segfault in a compiler ends it, pytest reports and replaces it);
    ``-n 0`` is the one process."""
    parsed = cli.parser().parse_args(["run", "-n", "1", "--", "-k", "padding"])
    command = cli.pytest_command(parsed, Path("junit.xml"))
    assert command[command.index("-n") + 1] == "1" and command[-2:] == ["-k", "padding"]
    assert "-n" not in cli.pytest_command(cli.parser().parse_args(["run", "-n", "0"]), Path("junit.xml"))


def test_a_bare_assert_is_the_recorded_one_by_file_and_function_not_line():
    """A message-less exception is known by where it was raised; its line moves between releases and forks
    (upstream's kernel.py:476, RPA v2's :462), its file and function stay. A repro that recorded one without
    its site (an empty message) matches any of that type; a message is compared whole."""
    _same_error = cli._same_error
    site = "AssertionError (raised at kernel.py:476 in flash_attention)"
    recorded = {
        "type": "AssertionError",
        "message": "AssertionError (raised at kernel.py:462 in flash_attention)",
    }
    assert _same_error(recorded, "AssertionError", site)
    assert not _same_error(recorded, "AssertionError", "AssertionError (raised at kernel.py:476 in prefetch)")
    assert not _same_error(recorded, "ValueError", site)
    assert _same_error({"type": "AssertionError", "message": ""}, "AssertionError", site)
    assert not _same_error({"type": "AssertionError", "message": ""}, "AssertionError", "shapes differ")
    assert _same_error({"type": "ValueError", "message": "bad"}, "ValueError", "bad")
    assert not _same_error({"type": "ValueError", "message": "bad"}, "ValueError", "worse")
