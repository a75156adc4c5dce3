"""``rpa-harness chip smoke`` and ``calibrate``: which targets they run and how, the time their targets share,
and that a run cut off is ended with what it started. A stand-in for the ``rpa-harness run`` of a campaign
records its calls (no campaign runs here: that needs a chip)."""

import os
import re
import signal
import time

import pytest

from rpa_harness import cli, device, targets
from rpa_harness.chip import campaign, throughput
from rpa_harness.plugin import target_ids
from tests.cases import loadable
from tests.processes import running

# Stands in for `rpa-harness run`: records its targets (comma-separated), -n, --repro-dir, the examples and the
# seconds the targets share, takes $STAND_IN_SECONDS and, with STAND_IN_LEAVES_A_CHILD=1, leaves a child
# running, its pid written to $STAND_IN_CHILDREN.
STAND_IN = """#!/usr/bin/env bash
target="" workers=- repros=-
while [ $# -gt 0 ]; do
  case "$1" in
    --target) target="${target:+$target,}$2" ;;
    -n) workers=$2 ;;
    --repro-dir) repros=$2 ;;
  esac
  shift
done
echo "${target:--} $workers $repros $RPA_MAX_EXAMPLES ${RPA_SECONDS:--}" >>"$STAND_IN_CALLS"
echo "summary of $target"
if [ "${STAND_IN_LEAVES_A_CHILD:-0}" = 1 ]; then
  sleep 300 &
  echo $! >>"$STAND_IN_CHILDREN"
fi
sleep "${STAND_IN_SECONDS:-0}"
"""
SHIPPED = [shipped.name for shipped in targets.SHIPPED]


@pytest.fixture
def stand_in(tmp_path, monkeypatch):
    """The stand-in as each target's campaign, on a CPU host stated as one; the calls it records, and
    whatever children it left ended afterwards."""
    script = tmp_path / "rpa-harness-run"
    script.write_text(STAND_IN)
    monkeypatch.setattr(campaign, "harness", lambda *args: ["bash", str(script), *args])
    monkeypatch.setattr(campaign, "CHIP_RELEASE_SECONDS", 0.0)
    monkeypatch.setenv("STAND_IN_CALLS", str(tmp_path / "calls"))
    monkeypatch.setenv("STAND_IN_CHILDREN", str(tmp_path / "children"))
    monkeypatch.delenv("RPA_MAX_EXAMPLES", raising=False)
    monkeypatch.setenv(device.TPU_PROBE_ENV, "none")
    monkeypatch.setattr(device.chip, "_keep_off_the_chips", False)
    device.tpus.cache_clear()
    calls = tmp_path / "calls"
    yield lambda: [tuple(line.split()) for line in calls.read_text().splitlines()] if calls.exists() else []
    device.tpus.cache_clear()
    children = tmp_path / "children"
    for pid in [int(line) for line in children.read_text().split()] if children.exists() else []:
        if running(pid):
            os.kill(pid, signal.SIGKILL)


def all_ended(pids: list[int], seconds: float = 10.0) -> bool:
    """Whether every one of ``pids`` is gone within ``seconds`` (a process sent SIGKILL dies when it is next
    scheduled, not when kill() returns)."""
    deadline = time.monotonic() + seconds
    while any(running(pid) for pid in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_calibrate_runs_every_target_this_jax_loads_in_one_run_and_names_the_others(
    stand_in, tmp_path, capsys
):
    """One run serves the group (one start-up, one chip owner), each target's repros in a folder of its own
    (the run's doing), the run sharing --seconds among the targets, less the summary's reserve."""
    logs = tmp_path / "logs"
    code = cli.main(
        ["chip", "calibrate", "--backend", "fast-interpret", "--logs", str(logs), "--workers", "3"]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    calibrated = loadable(SHIPPED)
    shared = f"{campaign.DEFAULTS['calibrate'][3] * (1 - campaign.SUMMARY_RESERVE):g}"
    assert stand_in() == [(",".join(calibrated), "3", str(logs / "repros"), "3", shared)]
    for target in set(SHIPPED) - set(calibrated):
        assert f"not run here: --rpa-target={target}: " in out
    log = "calibrate-" + "+".join(target_ids(calibrated).values()) + ".log"
    ended = re.findall(r"^=== calibrate \((\d+) targets, (\S+)\): exit 0 in \d+ s$", out, re.MULTILINE)
    assert ended == [(str(len(calibrated)), log)], out
    assert (logs / log).read_text() == f"summary of {','.join(calibrated)}\n"


def test_a_calibration_of_one_target_keeps_its_repros_in_their_folder(stand_in, tmp_path, capsys):
    logs = tmp_path / "logs"
    assert cli.main(["chip", "calibrate", "--backend", "fast-interpret", "--logs", str(logs), "--target",
                     targets.DEFAULT_TARGET]) == 0  # fmt: skip
    (called,) = stand_in()
    assert called[:3] == (targets.DEFAULT_TARGET, "12", str(logs / "repros" / targets.DEFAULT_TARGET))


def test_a_calibration_past_its_seconds_is_ended_with_what_it_started(
    stand_in, tmp_path, capsys, monkeypatch
):
    """The run that outlives --seconds ends there (exit 124), its child with it, and the step within its
    budget; a target past its share inside the run is the run's to skip (tests/end_to_end/test_cli.py)."""
    monkeypatch.setenv("STAND_IN_LEAVES_A_CHILD", "1")
    monkeypatch.setenv("STAND_IN_SECONDS", "60")
    monkeypatch.setattr(campaign, "KILL_GRACE_SECONDS", 1.0)
    two = [targets.DEFAULT_TARGET, targets.UPSTREAM_TARGET]
    started = time.monotonic()
    code = cli.main(
        ["chip", "calibrate", "--backend", "fast-interpret", "--seconds", "3", "--logs", str(tmp_path / "logs"),
         *(option for target in two for option in ("--target", target))]
    )  # fmt: skip
    assert time.monotonic() - started < 30
    out = capsys.readouterr().out
    assert code == 1, out
    assert re.findall(r"^=== calibrate \(2 targets, \S+\): exit 124 in \d+ s$", out, re.MULTILINE), out
    assert [called[0] for called in stand_in()] == [",".join(two)]
    children = [int(line) for line in (tmp_path / "children").read_text().split()]
    assert len(children) == 1 and all_ended(children)


def test_smoke_shows_the_versions_and_each_targets_summary_one_worker_each(stand_in, tmp_path, capsys):
    logs = tmp_path / "logs"
    assert cli.main(["chip", "smoke", "--backend", "fast-interpret", "--logs", str(logs)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("fast-interpret emulating none on a CPU") and ", jax " in out
    two = [targets.DEFAULT_TARGET, targets.UPSTREAM_TARGET]
    assert stand_in() == [(target, "1", str(logs / "repros" / "smoke" / target), "4", "-") for target in two]
    assert all(f"summary of {target}\n=== smoke-{target}: exit 0" in out for target in two), out


def test_a_target_of_the_users_that_does_not_load_is_one_usage_error(stand_in, tmp_path, capsys):
    code = cli.main(["chip", "calibrate", "--backend", "fast-interpret", "--target", "my_kernels.no_such"])
    assert code == cli.USAGE and stand_in() == []
    err = capsys.readouterr().err
    assert err.startswith("rpa-harness chip calibrate: --target my_kernels.no_such: cannot import it")
    assert len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize(
    "argv, complaint",
    [
        (["speed", "--batch", "huge"], "--batch=huge: not a batch; choose from "),
        (["speed", "--calls", "0"], "--calls=0 must be at least 1"),
        (
            ["throughput", "--properties", "pooled,fast"],
            "--properties: fast is not one of pooled, any-config",
        ),
        (["throughput", "--workers", "two"], "--workers=two: give worker counts of 1 or more"),
        (["calibrate", "--workers", "0"], "--workers=0 must be at least 1"),
        (["agreement", "--folder", "no-such-folder"], "no predictions.json there; write it on the CPU host"),
        (
            ["agreement", "--predict", "--folder", "f", "--tpu-generation", "none"],
            "--predict compiles for a TPU",
        ),
        (["agreement", "--predict", "--folder", "f", "--large", "-1"], "--large=-1 must be 0 or more"),
        (["q-len-zero", "--tpu-generation", "v5e"], "a real TPU is the chip it is"),
    ],
)
def test_a_steps_usage_error_is_one_line_and_exit_4(stand_in, capsys, argv, complaint):
    assert cli.main(["chip", *argv]) == cli.USAGE
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.strip().splitlines()) == 1, captured.err
    assert captured.err.startswith(f"rpa-harness chip {argv[0]}: ") and complaint in captured.err, (
        captured.err
    )


def test_a_throughput_row_with_an_owner_a_chip_counts_how_busy_a_chip_was_on_average():
    """Two owners' 160 s running in a 90 s window are two chips 89% busy, the row bound by the chips; four
    owners' are four chips 44% busy, the row bound by the host."""
    owner = {"calls": 100, "wall_s": 100.0, "seconds": {"run_s": 160.0}, "per_chip": [{}, {}]}
    row = {"wall_s": 100.0, "before_first_s": 5.0, "warm_after_s": 10.0, "window_s": 90.0, "owner": owner}
    assert throughput.bound(row, 4) == "chip (89% busy)"
    owner["per_chip"] = [{}, {}, {}, {}]
    assert throughput.bound(row, 4) == "host (4 workers)"
