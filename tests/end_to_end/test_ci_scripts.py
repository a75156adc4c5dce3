"""The shell entry points parse: the TPU ones never run here (no TPU), so this is what CPU can check of them.
And `.ci/run`'s list of modules left to the newest-jax leg names modules that exist (pytest ignores a
``--deselect`` that matches nothing, so a renamed module would silently run in both legs), each named in
docs/test-suite.md."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from rpa_harness import targets

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted([*ROOT.glob("ci/*.sh"), ROOT / ".ci" / "run"])


@pytest.mark.parametrize("script", SCRIPTS, ids=[str(s.relative_to(ROOT)) for s in SCRIPTS])
def test_script_parses(script):
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_the_tpu_install_step_needs_no_network_where_jax_and_libtpu_import(tmp_path):
    """A chip host with jax[tpu] and the harness installed and no network: the step installs nothing. A stand-in
    ``libtpu`` package makes this CPU host look like one; pip is never reached (it would need the network)."""
    (tmp_path / "libtpu").mkdir()
    (tmp_path / "libtpu" / "__init__.py").write_text("")
    bin_folder = str(Path(sys.executable).parent)  # this environment's python and rpa-harness
    env = {**os.environ, "PATH": f"{bin_folder}:{os.environ['PATH']}", "PYTHONPATH": str(tmp_path)}
    for extra, reason in (
        ({}, "jax, libtpu and rpa_harness import"),
        ({"RPA_SKIP_INSTALL": "1"}, "RPA_SKIP_INSTALL=1"),
    ):
        result = subprocess.run(
            ["bash", str(ROOT / "ci" / "install_for_tpu.sh")],
            env={**env, **extra},
            capture_output=True,
            text=True,
        )
        assert result.returncode == 0 and f"install: skipped ({reason}" in result.stdout, (
            result.stdout + result.stderr
        )
    for script in ("tpu_smoke.sh", "nightly_tpu.sh"):
        text = (ROOT / "ci" / script).read_text()
        assert "bash ci/install_for_tpu.sh" in text and "pip install" not in text, script


def test_the_newest_jax_only_modules_exist_and_are_documented():
    listed = re.search(
        r"^NEWEST_JAX_ONLY=\((.*?)^\)", (ROOT / ".ci" / "run").read_text(), re.MULTILINE | re.DOTALL
    )
    assert listed, "NEWEST_JAX_ONLY=( ... ) not found in .ci/run"
    modules = listed[1].split()
    doc = (ROOT / "docs" / "test-suite.md").read_text()
    assert modules and [m for m in modules if not (ROOT / m).is_file()] == []
    assert [m for m in modules if Path(m).name not in doc] == []


def test_a_chip_session_names_its_steps_and_calibrates_every_shipped_target_this_jax_runs(tmp_path):
    """An unknown step is a usage error (exit 4) naming the steps; the calibration covers every shipped
    target but the two ci/tpu_smoke.sh runs and the one that needs jax >= 0.12."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    env["RPA_CHIP_LOGS"] = str(tmp_path / "logs")
    result = subprocess.run(
        ["bash", str(ROOT / "ci" / "chip_session.sh"), "smoke-test"], env=env, capture_output=True, text=True
    )
    assert result.returncode == 4, result.stdout + result.stderr
    assert (
        "unknown step 'smoke-test'; steps: smoke calibrate agreement arithmetic throughput speed"
        in result.stderr
    )
    text = (ROOT / "ci" / "chip_session.sh").read_text()
    calibrated = set(re.findall(r"rpa_harness\.targets\.\w+", text))
    shipped = {s.name for s in targets.SHIPPED if s.name.startswith("rpa_harness.targets.")}
    assert calibrated == shipped - {"rpa_harness.targets.tpu_inference_mla_swa"}, shipped ^ calibrated
