"""The shell entry points parse: the TPU ones never run here (no TPU), so this is what CPU can check of them:
their arguments, which targets they run (a stand-in ``rpa-harness`` records its calls) and that a chip
session's step ends what it leaves running, and nothing else. And `.ci/run`'s list of modules left to the
newest-jax leg names modules that exist (pytest ignores a ``--deselect`` that matches nothing, so a renamed
module would silently run in both legs), each named in docs/test-suite.md."""

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from rpa_harness import targets
from tests.cases import loadable
from tests.processes import running

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


# Stands in for `rpa-harness` on a chip: records each call's subcommand (``chip-STEP`` for `rpa-harness chip
# STEP`), its targets (comma-separated) and --junit (whose name says the nightly's round), takes
# $STAND_IN_SECONDS and, with STAND_IN_LEAVES_A_CHILD=1, leaves a child running, its pid written to
# $STAND_IN_CHILDREN.
STAND_IN = """#!/usr/bin/env bash
command=$1 targets= junit=-
[ "$1" = chip ] && command="chip-$2"
while [ $# -gt 0 ]; do
  case "$1" in
    --target) targets="${targets:+$targets,}$2" ;;
    --junit) junit=$2 ;;
    --json) : >"$2" ;;
  esac
  shift
done
echo "$command ${targets:--} $junit" >>"$STAND_IN_CALLS"
if [ "${STAND_IN_LEAVES_A_CHILD:-0}" = 1 ]; then
  sleep 300 &
  echo $! >>"$STAND_IN_CHILDREN"
fi
sleep "${STAND_IN_SECONDS:-0}"
"""
# What the chip session's steps once ended by name on the whole host: a user's process so named survives.
MATCHING_NAME = "pytest chip_agreement bench_throughput chip_arithmetic rpa-harness bench"
USAGE = "usage: bash ci/nightly_tpu.sh [--targets MODULE[,MODULE...]]"
SHIPPED = [shipped.name for shipped in targets.SHIPPED]
UPSTREAM = targets.UPSTREAM_TARGET


def calibrate_groups() -> list[list[str]]:
    text = (ROOT / "ci" / "chip_session.sh").read_text()
    listed = re.search(r"^CALIBRATE_GROUPS=\((.*?)^\)", text, re.MULTILINE | re.DOTALL)
    assert listed, "CALIBRATE_GROUPS=( ... ) not found in ci/chip_session.sh"
    return [group.split() for group in re.findall(r'"([^"]*)"', listed[1])]


@pytest.fixture
def chip_host(tmp_path):
    """A checkout's TPU scripts in ``tmp_path/checkout`` (what they write lands there) and their environment:
    the stand-in first on PATH, then this environment's python and rpa_harness. Whatever children the
    stand-in left are ended afterwards."""
    checkout = tmp_path / "checkout"
    (checkout / "ci").mkdir(parents=True)
    for script in ("chip_session.sh", "nightly_tpu.sh", "install_for_tpu.sh"):
        shutil.copy(ROOT / "ci" / script, checkout / "ci" / script)
    stand_in = tmp_path / "bin" / "rpa-harness"
    stand_in.parent.mkdir()
    stand_in.write_text(STAND_IN)
    stand_in.chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{stand_in.parent}:{Path(sys.executable).parent}:{os.environ['PATH']}",
        "STAND_IN_CALLS": str(tmp_path / "calls"),
        "STAND_IN_CHILDREN": str(tmp_path / "children"),
        "RPA_CHIP_LOGS": "chip-logs",
        "RPA_SKIP_INSTALL": "1",
    }
    yield checkout, env
    for pid in stand_in_children(env):
        if running(pid):
            os.kill(pid, signal.SIGKILL)


def stand_in_calls(env: dict) -> list[tuple[str, str, str]]:
    """(subcommand, target, junit) of each call, ``-`` where it passed none."""
    path = Path(env["STAND_IN_CALLS"])
    return [tuple(line.split()) for line in path.read_text().splitlines()] if path.exists() else []


def stand_in_children(env: dict) -> list[int]:
    path = Path(env["STAND_IN_CHILDREN"])
    return [int(line) for line in path.read_text().split()] if path.exists() else []


def run_script(checkout: Path, env: dict, script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(checkout / "ci" / script), *args], cwd=checkout, env=env, capture_output=True, text=True
    )


def test_the_calibrate_groups_hold_every_shipped_target_once_and_are_documented():
    """Every jax's targets, those of the other jax (mla_swa, stacked RPA) included."""
    named = [target for group in calibrate_groups() for target in group]
    assert sorted(named) == sorted(SHIPPED)
    doc = (ROOT / "docs" / "nightly-tpu.md").read_text()
    steps = [f"calibrate-{number}" for number in range(1, len(calibrate_groups()) + 1)]
    assert [step for step in steps if f"`{step}`" not in doc] == []


@pytest.mark.parametrize("step", ["smoke-test", "calibrate-0", "calibrate-9", "calibrate-", "verdicts-9"])
def test_an_unknown_chip_session_step_is_a_one_line_usage_error(chip_host, step):
    checkout, env = chip_host
    result = run_script(checkout, env, "chip_session.sh", "smoke", step)
    assert result.returncode == 4 and result.stdout == "", result.stdout + result.stderr
    numbers = range(1, len(calibrate_groups()) + 1)
    groups = " ".join(f"calibrate-{number} verdicts-{number} agreement-{number}" for number in numbers)
    assert result.stderr.splitlines() == [
        f"chip_session: unknown step '{step}'; steps: smoke owner calibrate verdicts {groups} agreement arithmetic "
        "throughput-pooled throughput-any-config speed v3-speed v3-tuning q-len-zero"
    ]
    assert not (checkout / "chip-logs").exists()  # nothing ran, not even the smoke step before it


def test_each_calibrate_group_is_one_chip_step_that_ends_what_it_leaves(chip_host):
    """Each group is one `rpa-harness chip calibrate` on its targets (the step shares their time:
    tests/end_to_end/test_chip_steps.py); each leaves a child running, which the step's end kills, while a
    process of the user's whose name matches what the session once killed by name (``pkill -f``) survives."""
    checkout, env = chip_host
    env = {**env, "STAND_IN_LEAVES_A_CHILD": "1"}
    bystander = subprocess.Popen(["bash", "-c", f'exec -a "{MATCHING_NAME}" sleep 300'])
    try:
        result = run_script(checkout, env, "chip_session.sh", "calibrate")
        assert running(bystander.pid)
    finally:
        bystander.kill()
        bystander.wait()
    assert result.returncode == 0, result.stdout + result.stderr
    assert stand_in_calls(env) == [("chip-calibrate", ",".join(group), "-") for group in calibrate_groups()]
    children = stand_in_children(env)
    assert len(children) == len(calibrate_groups()) and not any(running(pid) for pid in children)
    steps = re.findall(r"^=== (calibrate-\d): exit 0 in \d+ s$", result.stdout, re.MULTILINE)
    assert steps == [f"calibrate-{number}" for number in range(1, len(calibrate_groups()) + 1)]
    assert (checkout / "chip-logs.tgz").is_file()


def test_every_chip_step_of_the_session_is_a_command_of_the_installed_harness(chip_host):
    """The session's steps are `rpa-harness` commands on the groups' targets: what a user's own session runs
    from the wheel (docs/nightly-tpu.md)."""
    checkout, env = chip_host
    steps = ["verdicts-1", "agreement-2", "v3-speed", "q-len-zero"]  # 2 s each: the chip's release
    result = run_script(checkout, env, "chip_session.sh", *steps)
    assert result.returncode == 0, result.stdout + result.stderr
    groups = calibrate_groups()
    assert stand_in_calls(env) == [
        ("chip-verdicts", ",".join(groups[0]), "-"),
        ("chip-agreement", ",".join(groups[1]), "-"),
        ("chip-speed", f"{UPSTREAM},{targets.V3_TARGET}", "-"),
        ("chip-q-len-zero", "-", "-"),
    ]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--night"], f"nightly: unknown argument '--night'; {USAGE}"),
        (["--targets"], f"nightly: --targets needs a list of target modules; {USAGE}"),
        (
            ["--targets", "rpa_harness.kernel,no_such.kernel"],
            "nightly: --rpa-target=no_such.kernel: cannot import it (No module named 'no_such'). Pass an "
            "importable module that defines ragged_paged_attention, e.g. --rpa-target=rpa_harness.kernel.",
        ),
    ],
)
def test_a_nightly_usage_error_is_one_line(chip_host, args, message):
    checkout, env = chip_host
    result = run_script(checkout, env, "nightly_tpu.sh", *args)
    assert result.returncode == 4 and result.stderr.splitlines() == [message], result.stdout + result.stderr
    assert stand_in_calls(env) == []


@pytest.mark.parametrize(
    "args, variable, expected",
    [
        ([], None, None),  # every shipped target this jax loads
        (["--targets", "rpa_harness.kernel,rpa_harness.tpu_inference_v2"], None,
         ["rpa_harness.kernel", "rpa_harness.tpu_inference_v2"]),
        (["--targets=rpa_harness.tpu_inference_v2"], "rpa_harness.kernel", ["rpa_harness.tpu_inference_v2"]),
        ([], f"rpa_harness.kernel,{UPSTREAM}", ["rpa_harness.kernel", UPSTREAM]),
    ],
)  # fmt: skip
def test_the_nightly_runs_the_named_targets_else_every_shipped_one_this_jax_loads(
    chip_host, args, variable, expected
):
    checkout, env = chip_host
    env = {**env, "RPA_TIME_BUDGET": "1", **({"RPA_NIGHTLY_TARGETS": variable} if variable else {})}
    expected = expected or loadable(SHIPPED)
    result = run_script(checkout, env, "nightly_tpu.sh", *args)
    assert result.returncode == 0, result.stdout + result.stderr
    first_round = [target for _, target, junit in stand_in_calls(env) if junit.endswith("-round1.xml")]
    assert first_round == expected
    assert f"nightly targets: {' '.join(expected)}" in result.stdout
    assert [call for call in stand_in_calls(env) if call[0] == "bench"] == [
        ("bench", "rpa_harness.kernel", "-")
    ]
