"""The shell entry points parse: the TPU ones never run here (no TPU), so this is what CPU can check of them.
And `.ci/run`'s list of modules left to the newest-jax leg names modules that exist (pytest ignores a
``--deselect`` that matches nothing, so a renamed module would silently run in both legs), each named in
docs/test-suite.md."""

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted([*ROOT.glob("ci/*.sh"), ROOT / ".ci" / "run"])


@pytest.mark.parametrize("script", SCRIPTS, ids=[str(s.relative_to(ROOT)) for s in SCRIPTS])
def test_script_parses(script):
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_the_newest_jax_only_modules_exist_and_are_documented():
    listed = re.search(
        r"^NEWEST_JAX_ONLY=\((.*?)^\)", (ROOT / ".ci" / "run").read_text(), re.MULTILINE | re.DOTALL
    )
    assert listed, "NEWEST_JAX_ONLY=( ... ) not found in .ci/run"
    modules = listed[1].split()
    doc = (ROOT / "docs" / "test-suite.md").read_text()
    assert modules and [m for m in modules if not (ROOT / m).is_file()] == []
    assert [m for m in modules if Path(m).name not in doc] == []
