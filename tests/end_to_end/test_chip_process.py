"""The process model on a TPU, simulated on CPU: the xdist controller never opens the chip; one worker does,
or a chip owner for several.

``RPA_TPU_PROBE`` states what the TPU probe would answer, so the controller's path runs here as on a chip
host: its child process is not started, and a worker that asks for the chip gets the stated one. The witness
plugin (``tests/backends_witness.py``) reports which processes initialised a jax backend.
"""

import json
import os
import types

import pytest

from rpa_harness import cli, device, plugin, repro, runlog
from tests.cases import SMALL
from tests.processes import run_python

# Needs no kernel call: a worker runs it on the stated chip without one.
NO_KERNEL_TEST = "tests/properties/test_lowering.py::test_known_generations_include_v5e_and_v6e"


def run_on_a_stated_chip(tmp_path, pytestconfig, *options):
    """The no-kernel test with -n 2 on a stated v5e; (its output, the witnessed processes, the run log)."""
    witness, log = tmp_path / "witness", tmp_path / "log"
    log.mkdir()
    env = {
        **os.environ,
        device.TPU_PROBE_ENV: "TPU v5 lite:1",
        "RPA_WITNESS_DIR": str(witness),
        runlog.ENV: str(log),
        "PYTHONPATH": str(
            pytestconfig.rootpath
        ),  # workers load the -p plugin before the rootdir is on the path
    }
    result = run_python(
        "-m", "pytest", NO_KERNEL_TEST, "-p", "tests.backends_witness", "-p", "no:cacheprovider", "-n", "2",
        "--rpa-backend=tpu", f"--rpa-repro-dir={tmp_path / 'repros'}", *options, cwd=pytestconfig.rootpath,
        env=env,
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    processes = [json.loads(path.read_text()) for path in witness.glob("*.json")]
    controllers = [seen for seen in processes if not seen["worker"]]
    # A target module may compute as it is imported (the shipped catalogue imports them all): in the
    # controller that computation runs on the CPU, the only platform it allows, never on the chip.
    assert len(controllers) == 1 and controllers[0]["allowed"] == "cpu", processes
    assert set(controllers[0]["platforms"]) <= {"cpu"}, processes
    header = runlog.read_session(log)["header"]
    assert any(line.startswith("  TPU: TPU v5 lite, real;") for line in header), header
    assert not any("TPU generations emulated" in line for line in header), header
    return output, [seen for seen in processes if seen["worker"]]


def test_without_a_chip_owner_the_controller_never_opens_the_chip_and_starts_one_worker(
    tmp_path, pytestconfig
):
    output, workers = run_on_a_stated_chip(tmp_path, pytestconfig, "--rpa-chip-owner=off")
    assert len(workers) == 1, f"one worker on a chip, whatever -n asked: {workers}"
    assert (
        "TPU: a real chip, named in the summary by the worker that opens it; 1 worker (-n 2 asked" in output
    )


def test_with_a_chip_owner_every_worker_keeps_off_the_chip(tmp_path, pytestconfig):
    """-n 2 on a chip (``--rpa-chip-owner=auto``): the owner holds the chip, and the workers, which make their
    kernel calls there, allow their own jax the CPU only."""
    output, workers = run_on_a_stated_chip(tmp_path, pytestconfig)
    assert len(workers) == 2 and all(seen["allowed"] == "cpu" for seen in workers), workers
    assert "TPU: TPU v5 lite, real; one chip owner process makes the kernel calls of 2 workers" in output, (
        output
    )


def test_the_stated_probe_answer_is_read_and_a_bad_one_says_what_to_write(monkeypatch):
    monkeypatch.setenv(device.TPU_PROBE_ENV, "TPU v5 lite:4")
    device.tpus.cache_clear()
    try:
        assert device.tpus() == device.Tpus(4, "TPU v5 lite") and device.resolve("auto") == ("tpu",)
        monkeypatch.setenv(device.TPU_PROBE_ENV, "none")
        device.tpus.cache_clear()
        assert not device.tpus() and device.resolve("auto") == (
            device.FAST_INTERPRET,
            device.INTERPRET,
        )
        with pytest.raises(device.BackendChoiceError, match="no TPU visible to jax"):
            device.resolve("tpu")
        monkeypatch.setenv(device.TPU_PROBE_ENV, "a v5e")
        device.tpus.cache_clear()
        with pytest.raises(device.BackendChoiceError, match="is not 'none' or KIND:COUNT"):
            device.resolve("tpu")
    finally:
        device.tpus.cache_clear()


def test_the_child_probe_answers_with_jaxs_own_verdict():
    """On this CPU host the child's jax sees no TPU; the answer comes back whole."""
    assert device.chip._probe_in_a_child() == device.Tpus()


def test_a_worker_that_died_in_a_call_on_the_chip_names_its_example_as_the_suspect(tmp_path, monkeypatch):
    """A libtpu abort ends the worker inside the kernel call: the pending example it left is reported as the
    suspect of a crash of the device, in the failure and in the run's summary."""
    log = tmp_path / "log"
    log.mkdir()
    monkeypatch.setenv(runlog.ENV, str(log))
    test = "tests/properties/test_differential.py::test_kernel_matches_oracle[tpu]"
    example = repro.Repro(
        "differential[tpu]", "rpa_harness.kernel", "tpu", SMALL.arrays(), {}, case=SMALL, test=test
    )
    pending = repro.write_pending(example, tmp_path)
    config = types.SimpleNamespace(getoption=lambda name: str(tmp_path))
    note = plugin._crash_note(config, test, started=0.0)
    assert "the worker died during a kernel call on the TPU (a crash of the device" in note, note
    assert f"example in flight: {pending}" in note, note
    junit = tmp_path / "junit.xml"
    junit.write_text(
        '<testsuite><testcase classname="tests.properties.test_differential" '
        'name="test_kernel_matches_oracle[tpu]"><failure/></testcase></testsuite>'
    )
    table = cli.summary(junit, [], events=runlog.read_events(log))
    assert f"suspect of a crash of the device: {pending}" in table, table
