"""``docs/targets.md``'s worked examples run: their adapters are ``tests/flat_pages/target.py`` and
``tests/fork_v3/target.py`` verbatim, short, and pass the ci profile; its catalogue table lists every
shipped known issue."""

import re
from pathlib import Path

import pytest
from hypothesis import given, settings

from rpa_harness import targets
from rpa_harness.checks import PropertyFailure, check_validation
from rpa_harness.device import FAST_INTERPRET, Backend
from rpa_harness.plugin import settings_of
from rpa_harness.reference import CONTRACTS
from rpa_harness.strategies.violations import invalid_cases
from tests.processes import run_python

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "targets.md").read_text()
ADAPTERS = {"tests.flat_pages.target": 10, "tests.fork_v3.target": 4}  # each adapter, its rule count
TARGET = "tests.flat_pages.target"
RULE_TABLE = "# The kernel's validator"
EXAMPLE = targets.load(TARGET)


def adapter_file(name: str) -> Path:
    return ROOT.joinpath(*name.split(".")).with_suffix(".py")


FAST = Backend(FAST_INTERPRET)


def code_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", text, re.MULTILINE | re.DOTALL)


def test_the_docs_show_the_tested_adapters():
    assert code_blocks(DOC) == [adapter_file(name).read_text() for name in ADAPTERS]


@pytest.mark.parametrize("name", ADAPTERS)
def test_the_adapter_is_short(name):
    """The signature mapping, without the kernel's rule table, fits in 30 non-blank lines."""
    mapping = adapter_file(name).read_text().split(RULE_TABLE)[0]
    lines = [line for line in mapping.splitlines() if line.strip()]
    assert len(lines) <= 30, len(lines)
    assert f"{len(lines)} non-blank lines map the signature" in DOC  # the docs give the count


def test_the_docs_name_every_catalogue_entry_and_contract():
    for issue in targets.shipped_catalogue():
        assert f"| `{issue.name}` |" in DOC, issue.name
    for contract in CONTRACTS:
        assert f"| `{contract}` |" in DOC, contract


def test_the_adapter_declares_the_kernels_own_rules():
    assert EXAMPLE.own_rules and "num_seqs over max_num_seqs" in EXAMPLE.rules


@settings(max_examples=20, deadline=None)
@given(invalid=invalid_cases(table=EXAMPLE.rules))
def test_the_rule_table_holds_the_kernel_to_its_messages(invalid):
    """Each rule's message is the kernel's, and a table expecting other text fails validation."""
    arrays, options, message = invalid.inputs()
    check_validation(EXAMPLE, FAST, arrays, options, invalid.stage, message)
    with pytest.raises(PropertyFailure, match="wrong message"):
        check_validation(EXAMPLE, FAST, arrays, options, invalid.stage, f"not {message}")


@pytest.mark.parametrize("name", ADAPTERS)
def test_the_example_passes_the_ci_profile(name, pytestconfig, tmp_path):
    if settings_of(pytestconfig).target.name != targets.DEFAULT_TARGET:
        pytest.skip("runs its own target")
    result = run_python(
        "-m", "pytest", "--pyargs", "rpa_harness.properties", "-p", "no:cacheprovider",
        f"--rpa-target={name}", "--rpa-backend=fast-interpret", "--hypothesis-profile=ci",
        f"--rpa-repro-dir={tmp_path}", cwd=ROOT,
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    rules = ADAPTERS[name]
    assert f"target {name}" in result.stdout and f"validation rules: its own ({rules} rules)" in result.stdout
    passed = re.search(r"\b(\d+) passed", result.stdout)
    assert passed and int(passed[1]) > rules, output[-3000:]  # every rule, and the numeric ones


def test_the_fork_example_has_its_cache_judged():
    fork = targets.load("tests.fork_v3.target")
    assert fork.updates_cache and not fork.has_validator
    assert all(rule.stage == "static" for rule in fork.rules.values())
