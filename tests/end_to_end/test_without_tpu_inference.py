"""Without tpu-inference the suite still passes: every test that needs v3 is skipped with the command that
installs it, and none fails for its absence (a child pytest in which the package cannot be found)."""

import pytest

from rpa_harness.plugin import settings_of
from tests.processes import run_python

# The test modules that load tpu-inference's v3 or its findings (grep: targets.tpu_inference_v3, V3_TARGET,
# tpu_inference imports, tpu-inference-v3-findings).
MODULES = (
    "tests/end_to_end/test_bug_report.py",
    "tests/unit/test_error_map.py",
    "tests/targets/test_generation_matrix.py",
    "tests/unit/test_generations.py",
    "tests/targets/test_v3_hd64_target.py",
    "tests/targets/test_v3_report.py",
    "tests/targets/test_v3_target.py",
)
# A meta path finder ahead of site-packages that finds nothing named tpu_inference: for the harness and the
# tests, the package is not installed.
WITHOUT_TPU_INFERENCE = """
import importlib.abc, importlib.util, sys

class NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "tpu_inference" or name.startswith("tpu_inference."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

find_spec = importlib.util.find_spec
importlib.util.find_spec = lambda name, *a: None if name.split(".")[0] == "tpu_inference" else find_spec(name, *a)
sys.meta_path.insert(0, NotInstalled())
"""
RUN_PYTEST = WITHOUT_TPU_INFERENCE + "import pytest\nsys.exit(pytest.main(sys.argv[1:]))\n"
# A fork's target names v3's findings; v3's own target is one usage error naming the install command.
FORK_NAMES_V3_FINDINGS = (
    WITHOUT_TPU_INFERENCE
    + """
import types
from rpa_harness import targets
from rpa_harness.kernel import dynamic_validate_inputs, ragged_paged_attention

fork = types.ModuleType("fork")
fork.ragged_paged_attention, fork.dynamic_validate_inputs = ragged_paged_attention, dynamic_validate_inputs
fork.RPA_HARNESS_KNOWN_ISSUES = ("q-len-zero-before-a-live-sequence-hangs", "hd64-sink-on-padded-q-heads")
sys.modules["fork"] = fork
print("declared:", ", ".join(issue.name for issue in targets.load("fork").known_issues))
try:
    targets.load(targets.V3_TARGET)
except targets.TargetError as error:
    print("v3:", error)
"""
)


def test_the_v3_tests_skip_with_the_install_command_and_the_rest_pass(pytestconfig, tmp_path):
    if settings_of(pytestconfig).target.name != "rpa_harness.kernel":
        pytest.skip("runs the suite's own modules against the bundled kernel")
    run = run_python(
        "-c", RUN_PYTEST, *MODULES, "-q", "-rs", "-p", "no:cacheprovider", "-p", "no:xdist",
        "--hypothesis-profile=ci", f"--rpa-repro-dir={tmp_path}", "-k", "not branching_target",
        cwd=pytestconfig.rootpath, timeout=900,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-5000:] + run.stderr[-3000:]
    skips = [line for line in run.stdout.splitlines() if line.startswith("SKIPPED")]
    v3_skips = [line for line in skips if "tpu-inference" in line or "tpu_inference" in line]
    assert v3_skips and all("pip install --no-deps tpu-inference==0.32.0" in s for s in v3_skips), skips


def test_a_target_names_v3s_findings_without_tpu_inference(pytestconfig):
    run = run_python("-c", FORK_NAMES_V3_FINDINGS, cwd=pytestconfig.rootpath)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "declared: q-len-zero-before-a-live-sequence-hangs, hd64-sink-on-padded-q-heads" in run.stdout
    assert "v3: --rpa-target=rpa_harness.targets.tpu_inference_v3: cannot import its kernel" in run.stdout
    assert "pip install --no-deps tpu-inference==0.32.0" in run.stdout
