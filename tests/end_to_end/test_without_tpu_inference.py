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
import pytest
sys.exit(pytest.main(sys.argv[1:]))
"""


def test_the_v3_tests_skip_with_the_install_command_and_the_rest_pass(pytestconfig, tmp_path):
    if settings_of(pytestconfig).target.name != "rpa_harness.kernel":
        pytest.skip("runs the suite's own modules against the bundled kernel")
    run = run_python(
        "-c", WITHOUT_TPU_INFERENCE, *MODULES, "-q", "-rs", "-p", "no:cacheprovider", "-p", "no:xdist",
        "--hypothesis-profile=ci", f"--rpa-repro-dir={tmp_path}", "-k", "not branching_target",
        cwd=pytestconfig.rootpath, timeout=900,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-5000:] + run.stderr[-3000:]
    skips = [line for line in run.stdout.splitlines() if line.startswith("SKIPPED")]
    v3_skips = [line for line in skips if "tpu-inference" in line or "tpu_inference" in line]
    assert v3_skips and all("pip install --no-deps tpu-inference==0.32.0" in s for s in v3_skips), skips
