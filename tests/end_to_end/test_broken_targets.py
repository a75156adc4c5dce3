"""Broken targets fail the run with their own first line and exit code, and leave a repro that replays.

Each broken target (``tests/broken/``) breaks one part of the kernel interface. The runs use the fast
interpreter, the dev profile and ``-x``: each stops at its first failure, shrunk.
"""

import json
import os
import re

import pytest

from rpa_harness import cli, device, recording
from rpa_harness.interpret_compat import limitations as interpreter_limitations
from rpa_harness.plugin import settings_of
from rpa_harness.strategies.case import Case
from tests.processes import run_python

DIFFERENTIAL = "tests/properties/test_differential.py::test_kernel_matches_oracle"
PADDING = "tests/properties/test_padding.py::test_padding_does_not_change_valid_rows"
FIRST_LINE = re.compile(r"^E\s+rpa_harness\.failures\.\w+: (.*)$", re.MULTILINE)

# target -> (property test, the failure's first line contains, repro file)
BROKEN = {
    "raises_on_batches": (
        DIFFERENTIAL,
        "raised on valid inputs: RuntimeError: internal kernel error: unsupported batch",
        "differential_fast-interpret.json",
    ),
    "wrong_dtype": (
        DIFFERENTIAL,
        "output dtype float32; the specification is q's dtype bfloat16",
        "differential_fast-interpret.json",
    ),
    "wrong_shape": (DIFFERENTIAL, "output shape (", "differential_fast-interpret.json"),
    "nan_in_a_live_row": (DIFFERENTIAL, "non-finite values in live rows", "differential_fast-interpret.json"),
    "skips_a_cache_write": (
        DIFFERENTIAL,
        "updated cache differs from the expected cache in 1 slot (1 of",
        "differential_fast-interpret.json",
    ),
    "nondeterministic": (
        PADDING,
        "non-deterministic: two identical calls gave different bits",
        "padding-isolation_fast-interpret.json",
    ),
}


@pytest.fixture(autouse=True)
def _bundled_kernel_only(pytestconfig):
    if settings_of(pytestconfig).target.name != "rpa_harness.kernel":
        pytest.skip("the broken targets' capabilities and replays assume the bundled kernel's")


def run(*args, cwd, env=None):
    return run_python(*args, cwd=cwd, env={**os.environ, **(env or {})})


def run_properties(target, tests, repro_dir, cwd, *extra, env=None):
    return run(
        "-m", "pytest", *tests, "-p", "no:cacheprovider", "-q", "-x", f"--rpa-target=tests.broken.{target}",
        "--rpa-backend=fast-interpret", "--hypothesis-profile=dev", f"--rpa-repro-dir={repro_dir}", *extra,
        cwd=cwd, env=env,
    )  # fmt: skip


@pytest.mark.parametrize("broken", BROKEN)
def test_broken_target_fails_with_its_reason_and_replays(broken, tmp_path, pytestconfig, capsys):
    test, reason, repro_name = BROKEN[broken]
    result = run_properties(broken, [test], tmp_path, pytestconfig.rootpath, "-p", "no:xdist")
    output = result.stdout + result.stderr
    assert result.returncode == 1, output[-3000:]
    first_lines = FIRST_LINE.findall(result.stdout)
    assert first_lines and reason in first_lines[0], (reason, first_lines, output[-3000:])
    path = tmp_path / repro_name
    assert path.exists() and str(path) in result.stdout, (sorted(tmp_path.iterdir()), output[-3000:])
    assert cli.main(["replay", str(path)]) == 1  # in this process: jax is imported already
    assert reason in capsys.readouterr().out
    if broken == "raises_on_batches":
        assert cli.main(["replay", str(path), "--target", "rpa_harness.kernel"]) == 0
        assert "passes now" in capsys.readouterr().out


def test_a_failure_reads_in_one_screen_and_the_summary_in_120_columns(tmp_path, pytestconfig):
    """``rpa-harness run``'s failure: its report, kind, repro and replay and the falsifying example in at most
    40 lines (one-line arguments, no wrapper source); the summary within ``cli.SUMMARY_WIDTH`` columns."""
    result = run(
        "-m", "rpa_harness.cli", "run", "--profile", "dev", "--target", "tests.broken.skips_a_cache_write",
        "--backend", "fast-interpret", "-n", "0", "--repro-dir", str(tmp_path), "--", "-x", DIFFERENTIAL,
        cwd=pytestconfig.rootpath,
    )  # fmt: skip
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    failure = result.stdout[
        result.stdout.index("_ test_kernel_matches_oracle") : result.stdout.index("short test summary")
    ]
    assert len(failure.splitlines()) <= 40, failure
    assert "replay: rpa-harness replay" in failure and "Target('tests.broken.skips_a_cache_write')" in failure
    table = result.stdout[result.stdout.index("rpa-harness summary") :].splitlines()
    wide = [line for line in table if len(line) > cli.SUMMARY_WIDTH and "repro: " not in line]
    assert all(line.startswith("pytest command:") for line in wide), wide


def test_a_failing_second_target_is_told_apart_and_its_repro_replays_against_it(
    tmp_path, pytestconfig, capsys
):
    """``rpa-harness run`` serving the bundled kernel and a broken target in one session: the kernel's property
    passes, the broken one's fails, its repro in its own folder replays against it (the repro names it), and
    the exit summary names the failing target."""
    broken = "tests.broken.raises_on_batches"
    result = run(
        "-m", "rpa_harness.cli", "run", "--profile", "dev", "--target", "rpa_harness.kernel", "--target", broken,
        "--backend", "fast-interpret", "-n", "0", "--repro-dir", str(tmp_path),
        "--", "-k", "test_kernel_matches_oracle and not any_config and not checked and not long and not production",
        cwd=pytestconfig.rootpath, env={"RPA_MAX_EXAMPLES": "2"},
    )  # fmt: skip
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    assert "FAILED tests/properties/test_differential.py::test_kernel_matches_oracle[raises_on_batches-" in (
        result.stdout
    )
    assert f"rpa-harness: failing target(s): {broken} (1 failed); passing: 1 of 2" in result.stdout
    assert not list((tmp_path / "rpa_harness.kernel").iterdir()), "the passing target left no repro"
    path = tmp_path / broken / "differential_fast-interpret.json"
    assert json.loads(path.read_text())["target"] == broken
    assert cli.main(["replay", str(path)]) == 1  # in this process: jax is imported already
    replayed = capsys.readouterr().out
    assert f"target:   {broken}" in replayed and "unsupported batch" in replayed, replayed


# tests.broken.hangs compiles nothing (it returns the oracle's output where it does not hang), so the
# watchdog's timeout only has to cover a NumPy oracle on a small case.
HANG_TIMEOUT = "2"


def hang_case(path):
    """The recorded case, checked to be the one the broken target hangs on (not an earlier one)."""
    meta = json.loads(path.read_text())
    case = json.loads(meta["case"])
    assert case["q_lens"] and case["q_lens"][0] >= 2, f"not a case tests.broken.hangs hangs on: {case}"
    return meta


def test_a_hang_fails_the_test_and_leaves_a_hang_repro(tmp_path, pytestconfig, capsys):
    root = pytestconfig.rootpath
    result = run_properties(
        "hangs", [DIFFERENTIAL], tmp_path, root, "-n", "1", env={"RPA_CALL_TIMEOUT": HANG_TIMEOUT}
    )
    output = result.stdout + result.stderr
    path = tmp_path / "differential_fast-interpret.json"
    assert result.returncode == 1, output[-3000:]
    assert (
        "crashed while running" in result.stdout
        and f"HANG: a kernel call did not return within {HANG_TIMEOUT} s" in output
    )
    assert f"repro: {path}" in result.stdout, output[-3000:]
    meta = hang_case(path)
    assert (
        meta["hang"] == {"seconds": float(HANG_TIMEOUT)} and meta["test"] == f"{DIFFERENTIAL}[fast-interpret]"
    )
    assert not list(tmp_path.glob("*.pending.*")), "the pending example becomes the hang repro"
    replay = run("-m", "rpa_harness.cli", "replay", str(path), "--timeout", "1", cwd=root)
    assert replay.returncode == 1, replay.stdout + replay.stderr
    assert "still hangs after 1 s" in replay.stderr, replay.stderr[-2000:]
    # in this process (a call that returns): the first call may compile, so give it time
    capsys.readouterr()
    assert cli.main(["replay", str(path), "--target", "rpa_harness.kernel", "--timeout", "120"]) == 0
    assert "passes now" in capsys.readouterr().out


def test_a_hang_without_xdist_ends_the_run_naming_the_repro(tmp_path, pytestconfig):
    result = run_properties(
        "hangs",
        [DIFFERENTIAL],
        tmp_path,
        pytestconfig.rootpath,
        "-p",
        "no:xdist",
        env={"RPA_CALL_TIMEOUT": HANG_TIMEOUT},
    )
    path = tmp_path / "differential_fast-interpret.json"
    assert result.returncode == 70, result.stdout[-2000:] + result.stderr[-2000:]
    assert f"repro: {path}" in result.stderr and path.exists(), result.stderr[-2000:]
    hang_case(path)


CHECKED = "tests/properties/test_differential.py::test_kernel_matches_oracle_checked"


def test_a_deadlock_fails_at_once_with_a_shrunk_repro_that_replays(tmp_path, pytestconfig, capsys):
    """A kernel that waits for a DMA it never started would stop a TPU forever; on the checking interpreter
    the deadlock check fails the example at once (no watchdog), Hypothesis shrinks it like any failure, and
    the repro replays the same failure. A hang repro of the same case (recorded where the check could not
    run) replays as still hanging."""
    result = run_properties("deadlocks", [CHECKED], tmp_path, pytestconfig.rootpath, "-p", "no:xdist",
                            "--rpa-backend=interpret")  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 1, output[-3000:]
    first_lines = FIRST_LINE.findall(result.stdout)
    deadlock = (
        "raised on valid inputs: Deadlock: the TPU interpreter found a deadlock in the kernel: a DMA wait "
    )
    assert first_lines and deadlock in first_lines[0] and "deadlocks.py:" in first_lines[0], output[-3000:]
    path = tmp_path / "differential-checked_interpret.json"
    meta = json.loads(path.read_text())
    assert json.loads(meta["case"])["q_lens"][0] == 2, "shrunk to the fewest query tokens that deadlock"
    assert cli.main(["replay", str(path)]) == 1
    assert "FAILS the same way" in capsys.readouterr().out
    hang = tmp_path / "hang.json"
    hang.write_text(json.dumps({**meta, "error": None, "hang": {"seconds": 30.0}}))  # the same arrays
    timeout = device.endings.CALL_TIMEOUT_SECONDS
    assert cli.main(["replay", str(hang)]) == 1
    assert "FAILS: still hangs: the TPU interpreter found a deadlock" in capsys.readouterr().out
    assert device.endings.CALL_TIMEOUT_SECONDS == timeout, "the replay's watchdog timeout outlived the replay"


@pytest.mark.parametrize(
    "broken, reason",
    [
        ("declares_tpu_only", "it declares backends=('tpu',)"),
        ("needs_a_tpu", "the kernel looks up TPU-tuned parameters"),
    ],
)
def test_a_run_where_no_numeric_property_ran_is_not_green(broken, reason, tmp_path, pytestconfig):
    root = pytestconfig.rootpath
    result = run_properties(broken, [DIFFERENTIAL, PADDING], tmp_path, root, "-p", "no:xdist")
    assert result.returncode == 5, result.stdout[-3000:] + result.stderr[-3000:]
    summary = result.stdout[: result.stdout.index("short test summary")]  # first, before pytest's own
    assert "NOT GREEN: no numeric property ran against target" in summary, result.stdout[-3000:]
    assert f"cannot run on fast-interpret: {reason}" in summary, result.stdout[-3000:]
    allowed = run_properties(
        broken, [DIFFERENTIAL], tmp_path, root, "-p", "no:xdist", "--rpa-allow-no-numeric"
    )
    assert allowed.returncode == 0, allowed.stdout[-3000:] + allowed.stderr[-3000:]
    assert not list(tmp_path.iterdir()), "a target that cannot run leaves no repro"


@pytest.mark.parametrize("setting", ["RPA_RUN_LOG", "--rpa-repro-dir", "--rpa-compilation-cache"])
def test_an_unusable_harness_folder_is_one_usage_error(setting, tmp_path, pytestconfig):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    folder = blocker / "logs"  # cannot be created: its parent is a file
    env, extra = (
        ({"RPA_RUN_LOG": str(folder)}, ()) if setting == "RPA_RUN_LOG" else ({}, (f"{setting}={folder}",))
    )
    result = run(
        "-m", "pytest", DIFFERENTIAL, "-p", "no:cacheprovider", "-p", "no:xdist", "--rpa-backend=fast-interpret",
        *extra, cwd=pytestconfig.rootpath, env=env,
    )  # fmt: skip
    assert result.returncode == 4, result.stdout[-2000:] + result.stderr[-2000:]
    assert f"{setting}={folder}: cannot write there" in result.stderr and "Traceback" not in result.stderr


def test_the_catalogue_recognises_only_known_limitations():
    gap = AttributeError("'ReshapeTransform' object has no attribute 'indices'")
    assert "TPU interpreter" in interpreter_limitations.recognise(gap)
    assert interpreter_limitations.recognise(RuntimeError("internal kernel error: unsupported batch")) is None
    assert (
        interpreter_limitations.recognise(AttributeError("'Foo' object has no attribute 'indices'")) is None
    )


def test_the_repro_profile_without_its_example_database_is_one_usage_error(tmp_path, pytestconfig):
    missing = tmp_path / "no-such-database"
    result = run(
        "-m", "pytest", DIFFERENTIAL, "-p", "no:cacheprovider", "-p", "no:xdist", "--hypothesis-profile=repro",
        cwd=pytestconfig.rootpath, env={"RPA_HYPOTHESIS_DB": str(missing)},
    )  # fmt: skip
    assert result.returncode == 4, result.stdout[-2000:] + result.stderr[-2000:]
    assert f"RPA_HYPOTHESIS_DB={missing}: no such folder" in result.stderr and not missing.exists()


def test_a_worker_that_dies_names_its_example_in_flight_and_its_replay_is_no_verdict(
    tmp_path, pytestconfig, capsys, monkeypatch
):
    root, marker = pytestconfig.rootpath, tmp_path / "died"
    env = {"RPA_DIES_ONCE_MARKER": str(marker)}
    result = run_properties("dies_once", [DIFFERENTIAL], tmp_path, root, "-n", "1", env=env)
    output = result.stdout + result.stderr
    path = tmp_path / "differential_fast-interpret.pending.json"
    assert result.returncode == 1 and marker.exists(), output[-3000:]
    assert "crashed while running" in result.stdout and f"example in flight: {path}" in result.stdout, output[
        -3000:
    ]
    hang_case(path)  # the case it died on, not an earlier one
    # Rebuilt from its case, it runs in this process; the crash does not recur, and that is no verdict.
    monkeypatch.setenv("RPA_DIES_ONCE_MARKER", str(marker))
    assert cli.main(["replay", str(path)]) == 0
    out = capsys.readouterr().out
    assert "recorded: in flight when its process ended" in out and "did not recur" in out, out
    assert path.with_suffix(".npz").exists(), "the standalone program's arrays are written beside it"


ONLY_THE_POOLED_PROPERTY = "test_kernel_matches_oracle and not any_config and not checked and not reference"


def test_a_halted_device_is_one_finding_its_first_case_the_repro(tmp_path, pytestconfig):
    """tests.broken.halts halts "the chip" on its first case of 2 or more query tokens and fails every call
    after it: the worker ends at that first halt, its case is the repro (marked as a halt), the run still ends
    with its summary naming it, and replaying it in a fresh process halts again."""
    root = pytestconfig.rootpath
    result = run(
        "-m", "rpa_harness.cli", "run", "--profile", "dev", "--target", "tests.broken.halts", "--backend",
        "fast-interpret", "-n", "1", "--repro-dir", str(tmp_path), "--", "-k", ONLY_THE_POOLED_PROPERTY, cwd=root,
    )  # fmt: skip
    output = result.stdout + result.stderr
    path = tmp_path / "differential_fast-interpret.json"
    assert result.returncode == 1, output[-3000:]
    assert "crashed while running" in result.stdout and "failure kind: device halted" in result.stdout, (
        output[-3000:]
    )
    meta = hang_case(path)  # the first case that halts, not a later one Hypothesis would shrink to
    assert meta["halt"] == {"error": "FAILED_PRECONDITION: The program continuator has halted unexpectedly."}
    assert meta["error"] is None and not list(tmp_path.glob("*.pending.*"))
    assert len(meta["preceded_by"]) <= recording.EXAMPLES_BEFORE_A_HALT, meta["preceded_by"]
    table = result.stdout[result.stdout.index("rpa-harness summary") :]
    assert (
        f"repro: device halted (FAILED_PRECONDITION: The program continuator has halted unexpectedly.): {path} "
        f"({cli.HALT_CONFIRMED})" in table
    ), table
    assert re.search(r"test_kernel_matches_oracle\[fast-interpret\] +\d+  FAILED", table), table
    replay = run("-m", "rpa_harness.cli", "replay", str(path), cwd=root)
    assert replay.returncode == 1, replay.stdout + replay.stderr
    assert "FAILS: still halts the device" in replay.stderr, replay.stderr[-2000:]
    assert "predecessor(s)" not in replay.stdout + replay.stderr, "it halts alone: nothing runs before it"


def test_a_halt_that_does_not_recur_is_reported_unconfirmed_not_as_a_finding(tmp_path, pytestconfig):
    """tests.broken.halts_once halts once, ever: the run replays the halt's repro in fresh processes, where it
    passes alone and after its predecessors, so the summary calls the halt unconfirmed and, that being the
    run's only failure, the run exits 0."""
    env = {**os.environ, "RPA_HALTS_ONCE_MARKER": str(tmp_path / "halted")}
    result = run(
        "-m", "rpa_harness.cli", "run", "--profile", "dev", "--target", "tests.broken.halts_once", "--backend",
        "fast-interpret", "-n", "1", "--repro-dir", str(tmp_path / "repros"), "--", "-k",
        ONLY_THE_POOLED_PROPERTY, cwd=pytestconfig.rootpath, env=env,
    )  # fmt: skip
    output = result.stdout + result.stderr
    path = tmp_path / "repros" / "differential_fast-interpret.json"
    assert result.returncode == 0, output[-3000:]
    table = result.stdout[result.stdout.index("rpa-harness summary") :]
    assert f"{path} ({cli.HALT_UNCONFIRMED})" in table, table
    assert "every failure of this run is an unconfirmed halt" in result.stdout


def test_a_halt_without_xdist_ends_the_run_with_its_code_and_summary(tmp_path, pytestconfig):
    result = run(
        "-m", "rpa_harness.cli", "run", "--profile", "dev", "--target", "tests.broken.halts", "--backend",
        "fast-interpret", "-n", "0", "--repro-dir", str(tmp_path), "--", "-k", ONLY_THE_POOLED_PROPERTY,
        cwd=pytestconfig.rootpath,
    )  # fmt: skip
    path = tmp_path / "differential_fast-interpret.json"
    assert result.returncode == device.HALT_EXIT_CODE, result.stdout[-2000:] + result.stderr[-2000:]
    assert "failure kind: device halted" in result.stderr and f"repro: {path}" in result.stderr
    hang_case(path)
    table = result.stdout[result.stdout.index("rpa-harness summary") :]
    assert "ENDED" in table and "device halted (FAILED_PRECONDITION" in table, table


def test_a_fault_a_call_leaves_for_the_next_is_replayed_after_the_calls_before_the_halt(
    tmp_path, pytestconfig
):
    """tests.broken.leaves_the_chip_faulted returns on its first case of 2 or more query tokens and leaves the
    chip faulted: the next call halts, on whatever case. That innocent case is the halt's repro, which names the
    examples its process ran before it, the faulting one last; alone it passes, and after them it halts again."""
    root = pytestconfig.rootpath
    result = run(
        "-m", "rpa_harness.cli", "run", "--profile", "dev", "--target", "tests.broken.leaves_the_chip_faulted",
        "--backend", "fast-interpret", "-n", "0", "--repro-dir", str(tmp_path), "--", "-k",
        ONLY_THE_POOLED_PROPERTY, "--hypothesis-seed=0", cwd=root,
    )  # fmt: skip
    path = tmp_path / "differential_fast-interpret.json"
    assert result.returncode == device.HALT_EXIT_CODE, result.stdout[-2000:] + result.stderr[-2000:]
    assert (
        "preceded by: 2 example(s) run just before it on the device, in the repro's preceded_by"
        in result.stderr
    )
    meta = json.loads(path.read_text())
    assert meta["halt"] is not None and len(meta["preceded_by"]) == recording.EXAMPLES_BEFORE_A_HALT
    faulting = Case.from_json(meta["preceded_by"][-1]["case"])
    assert faulting.q_lens[0] >= 2, f"the example just before the halt is the one that faulted: {faulting}"

    replay = run("-m", "rpa_harness.cli", "replay", str(path), cwd=root)
    output = replay.stdout + replay.stderr
    assert replay.returncode == 1, output[-3000:]
    assert "the device did not halt in this process)" in replay.stdout, "alone, in its own process, it passes"
    assert (
        "FAILS: halts the device after its predecessor(s) ran in the same process: the fault is left by an "
        "earlier call (" in replay.stderr
    ), output[-3000:]
    assert faulting.describe() in replay.stderr, "the verdict names the faulting case"

    alone = run("-m", "rpa_harness.cli", "replay", str(path), "--predecessors", "skip", cwd=root)
    assert alone.returncode == 0 and "passes now" in alone.stdout, alone.stdout + alone.stderr
