"""End to end: a buggy target fails, leaves a repro pair, and `rpa-harness replay` pins it down."""

import json
import subprocess
import sys

import pytest

BUGGY = "tests.injected.head_swap"


def run(*args, cwd):
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def failing_repro(tmp_path_factory, pytestconfig):
    if pytestconfig.rpa_target.name != "kernel":
        pytest.skip("the CLI test injects its own bug into the bundled kernel")
    repro_dir = tmp_path_factory.mktemp("repros")
    result = run(
        "-m", "pytest", "tests/test_differential.py::test_kernel_matches_oracle", "-p", "no:cacheprovider",
        "-q", "-x", f"--rpa-target={BUGGY}", "--rpa-backend=fast-interpret", "--hypothesis-profile=ci",
        f"--rpa-repro-dir={repro_dir}", cwd=pytestconfig.rootpath,
    )  # fmt: skip
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    paths = sorted(repro_dir.glob("*.json"))
    assert [p.name for p in paths] == ["differential_fast-interpret.json"], result.stdout[-3000:]
    assert str(paths[0]) in result.stdout, "the failure message must name the repro file"
    return paths[0], pytestconfig.rootpath


def test_buggy_target_writes_a_shrunk_repro(failing_repro):
    path, _ = failing_repro
    meta = json.loads(path.read_text())
    assert meta["target"] == BUGGY and meta["backend"] == "fast-interpret"
    assert path.with_suffix(".npz").exists()
    assert set(meta["versions"]) >= {"python", "jax", "jaxlib", "hypothesis"}
    case = json.loads(meta["case"])
    assert len(case["q_lens"]) == 2, f"the bug needs two sequences, and shrinking should stop there: {case}"


def test_replay_names_the_sequence_and_head(failing_repro):
    path, root = failing_repro
    result = run("-m", "harness.cli", "replay", str(path), cwd=root)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "worst: sequence 1," in result.stdout and ", head 1," in result.stdout, result.stdout
    assert "target = importlib.import_module('tests.injected.head_swap')" in result.stdout


def test_replay_passes_against_the_correct_kernel(failing_repro):
    path, root = failing_repro
    result = run("-m", "harness.cli", "replay", str(path), "--target", "kernel", cwd=root)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "passes now" in result.stdout


def test_replay_of_a_missing_or_malformed_file_is_one_clear_error(tmp_path, pytestconfig):
    missing = run("-m", "harness.cli", "replay", str(tmp_path / "nope.json"), cwd=pytestconfig.rootpath)
    assert missing.returncode == 2 and "no such file" in missing.stderr and "Traceback" not in missing.stderr
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    malformed = run("-m", "harness.cli", "replay", str(bad), cwd=pytestconfig.rootpath)
    assert malformed.returncode == 2 and "not a readable repro file" in malformed.stderr


def test_unknown_target_is_one_usage_error(pytestconfig):
    result = run("-m", "pytest", "tests/test_validation.py", "--rpa-target=no_such_module", "-p", "no:cacheprovider",
                 cwd=pytestconfig.rootpath)  # fmt: skip
    assert result.returncode == 4, result.stdout + result.stderr
    assert "cannot import it" in result.stderr and "Traceback" not in result.stderr
