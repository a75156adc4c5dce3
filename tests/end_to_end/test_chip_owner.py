"""One process makes every kernel call for the xdist workers (``rpa_harness.device.owner``): on a CPU host the
fast interpreter in the owner stands in for the chip. A run through an owner judges as a run without one; a
halt, a hang or a fault a call leaves for the next ends the owner and is reported by the worker whose case
it was, as the process holding the chip would report it, and a fresh owner serves the rest of the run."""

import dataclasses
import json
import os
import pickle
import re
import types

import pytest
from hypothesis import _settings as hypothesis_settings

from rpa_harness import device, plugin, recording
from rpa_harness.device import Backend
from rpa_harness.plugin import settings_of
from rpa_harness.targets import Target, load
from tests.cases import sized_case
from tests.processes import run_python

DIFFERENTIAL = "tests/properties/test_differential.py::test_kernel_matches_oracle"
OWNER_LINE = re.compile(
    r"chip owner: (\d+) kernel calls, busy [\d.]+ s of [\d.]+ s \(\d+%\); (\d+) owner process"
)


@pytest.fixture(autouse=True)
def _bundled_kernel_only(pytestconfig):
    if settings_of(pytestconfig).target.name != "rpa_harness.kernel":
        pytest.skip("the broken targets' capabilities assume the bundled kernel's")


def run_through_an_owner(target: str, repro_dir, root, *extra, workers=1, env=None, environ=None):
    """The pooled differential property, ``workers`` feeding one owner on the fast interpreter (one worker
    where several add nothing to what a test checks: each is a process on CI's two cores), in ``environ``
    (default: this process's) with ``env`` added."""
    return run_python(
        "-m", "pytest", DIFFERENTIAL, "-p", "no:cacheprovider", "-n", str(workers), "--rpa-chip-owner=on",
        f"--rpa-target={target}", "--rpa-backend=fast-interpret", "--hypothesis-profile=dev",
        f"--rpa-repro-dir={repro_dir}", *extra, cwd=root, env={**(environ or os.environ), **(env or {})},
    )  # fmt: skip


def off_ci(environ) -> dict:
    """``environ`` without the variables by which Hypothesis knows it runs on a CI service: there every
    profile inherits its built-in ``ci`` profile's derandomize, and a derandomized run has no shards."""
    on_ci = getattr(hypothesis_settings, "_CI_VARS", {"CI": None})
    return {name: value for name, value in environ.items() if name not in on_ci}


def owner_line(output: str) -> tuple[int, int]:
    found = OWNER_LINE.search(output)
    assert found is not None, output[-3000:]
    return int(found[1]), int(found[2])


CHIP_LINE = re.compile(
    r"chip owner on chip (\d+): (\d+) kernel calls, busy [\d.]+ s of [\d.]+ s \(\d+%\); (\d+) owner"
)
SEVERAL_OWNERS_LINE = re.compile(
    r"chip owner: (\d+) kernel calls, busy [\d.]+ s of 2 chips x [\d.]+ s \(\d+%\); (\d+) owner process\(es\) "
    r"on 2 chips"
)


def test_a_run_with_an_owner_a_chip_spreads_the_workers_and_makes_every_call_in_an_owner(
    tmp_path, pytestconfig
):
    """Two owners (the fast interpreter standing in for two chips) and two workers: each worker feeds its own
    owner, so each serves calls, and the summary counts every call the run made, each chip's and in all."""
    result = run_through_an_owner(
        "rpa_harness.kernel", tmp_path, pytestconfig.rootpath, "--rpa-chip-owners=2", workers=2,
        env={"RPA_MAX_EXAMPLES": "2"}, environ=off_ci(os.environ),
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert "2 chip owner processes, one a chip, make the kernel calls of 2 workers" in output, output[:3000]
    together = SEVERAL_OWNERS_LINE.search(output)
    chips = {int(chip): (int(calls), int(owners)) for chip, calls, owners in CHIP_LINE.findall(output)}
    assert together is not None and set(chips) == {0, 1}, output[-3000:]
    assert all(calls > 0 and owners == 1 for calls, owners in chips.values()), output[-3000:]
    assert int(together[1]) == sum(calls for calls, _ in chips.values()) and int(together[2]) == 2


def test_a_halt_in_the_owner_is_the_workers_finding_and_a_fresh_owner_serves_on(tmp_path, pytestconfig):
    """tests.broken.halts halts "the chip" (the owner's process) on its first case of 2 or more query tokens:
    the worker whose call it was writes the halt's repro and ends; a fresh owner (a fresh chip) serves the
    calls that follow."""
    result = run_through_an_owner("tests.broken.halts", tmp_path, pytestconfig.rootpath)
    output = result.stdout + result.stderr
    path = tmp_path / "differential_fast-interpret.json"
    assert result.returncode == 1, output[-3000:]
    assert "crashed while running" in result.stdout and "failure kind: device halted" in result.stdout, (
        output[-3000:]
    )
    meta = json.loads(path.read_text())
    assert meta["halt"] == {"error": "FAILED_PRECONDITION: The program continuator has halted unexpectedly."}
    assert json.loads(meta["case"])["q_lens"][0] >= 2, "the case that halted, not an earlier one"
    _, owners = owner_line(output)
    assert owners >= 2, f"a fresh owner after the halt: {output[-3000:]}"


def test_a_fault_left_for_the_next_call_names_the_calls_before_it_on_the_chip(tmp_path, pytestconfig):
    """tests.broken.leaves_the_chip_faulted faults "the chip" on a call that returns; the next call halts,
    whichever worker made it: its repro names the calls the owner ran just before it."""
    result = run_through_an_owner(
        "tests.broken.leaves_the_chip_faulted", tmp_path, pytestconfig.rootpath, "--hypothesis-seed=0"
    )
    output = result.stdout + result.stderr
    assert result.returncode == 1, output[-3000:]
    meta = json.loads((tmp_path / "differential_fast-interpret.json").read_text())
    assert meta["halt"] is not None and len(meta["preceded_by"]) == recording.EXAMPLES_BEFORE_A_HALT, meta
    faulting = json.loads(meta["preceded_by"][-1]["case"])
    assert faulting["q_lens"][0] >= 2, f"the call just before the halt is the one that faulted: {faulting}"


def test_a_hang_in_the_owner_is_the_workers_hang_repro(tmp_path, pytestconfig):
    result = run_through_an_owner(
        "tests.broken.hangs", tmp_path, pytestconfig.rootpath, env={"RPA_CALL_TIMEOUT": "2"}
    )
    output = result.stdout + result.stderr
    path = tmp_path / "differential_fast-interpret.json"
    assert result.returncode == 1, output[-3000:]
    assert (
        "HANG: a kernel call on fast-interpret (in the chip's owner process) did not return within 2 s"
        in output
    )
    assert json.loads(path.read_text())["hang"] == {"seconds": 2.0}


UPSTREAM = "jax.experimental.pallas.ops.tpu.ragged_paged_attention"  # one jitted function: it compiles ahead
SIGNATURES_LINE = re.compile(
    r"chip owner: (\d+) static signatures, (\d+) compiled ahead of their calls .*?, (\d+) compiling in their "
    r"calls .*?; calls per signature (\d+) to (\d+)"
)


def test_an_owner_compiles_each_signature_once_off_the_chips_path_and_each_worker_runs_a_shard(
    tmp_path, pytestconfig
):
    """Two workers feeding one owner: the pooled property runs as two items, one a worker, and the owner
    compiles each static signature once, on a compiler thread before its calls take the chip, and none in a
    call. (No emulated generation: its device kind is the owner process's, so calls emulating one compile
    in their calls, and the summary counts them there.)"""
    result = run_through_an_owner(
        UPSTREAM, tmp_path, pytestconfig.rootpath, "--rpa-tpu-generation=none", "-v",
        workers=2, env={"RPA_MAX_EXAMPLES": "2"}, environ=off_ci(os.environ),
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert "one chip owner process makes the kernel calls of 2 workers" in output, output[:3000]
    calls, owners = owner_line(output)
    assert calls >= 2 and owners == 1 and "chip owner on chip" not in output, output[-3000:]
    for shard in ("shard1of2", "shard2of2"):
        assert f"PASSED {DIFFERENTIAL}[fast-interpret-{shard}]" in output, output[-3000:]
    found = SIGNATURES_LINE.search(output)
    assert found is not None, output[-3000:]
    signatures, ahead, in_calls, _, most = map(int, found.groups())
    assert signatures == ahead >= 1 and in_calls == 0 and most > 1, found[0]


def test_a_call_compiled_ahead_compiles_nothing_in_the_call():
    target, backend = load(UPSTREAM), Backend(device.FAST_INTERPRET)
    blocks = dict(num_kv_pages_per_block=1, num_queries_per_block=8)
    first = sized_case([2], [8], num_q_heads=2, num_kv_heads=1, head_dim=128, page_size=8, **blocks)
    second = dataclasses.replace(first, q_lens=(1,), kv_lens=(5,), seed=7)
    assert target.signature(first.arrays(), first.options()) == target.signature(
        second.arrays(), second.options()
    )
    with backend.context():
        assert target.precompile(first.arrays(), first.options())
    with device.metered() as compiled:
        backend.run(target.attention, second.arrays(), second.options())
    assert compiled["executables"] == 0, compiled


def test_a_signature_counts_run_time_options_by_whether_they_are_given():
    """The bundled kernel takes sm_scale as a scalar at run time: its values share a compilation, None
    (absent) does not; a block size is static."""
    target = load("rpa_harness.kernel")
    case = sized_case([2], [8], num_q_heads=2, num_kv_heads=1, head_dim=64, page_size=8)
    signature = target.signature(case.arrays(), case.options())
    scaled = dataclasses.replace(case, sm_scale=0.5)
    assert target.signature(scaled.arrays(), scaled.options()) == target.signature(
        scaled.arrays(), dataclasses.replace(scaled, sm_scale=0.25).options()
    )
    assert target.signature(scaled.arrays(), scaled.options()) != signature
    blocked = dataclasses.replace(case, num_queries_per_block=4)
    assert target.signature(blocked.arrays(), blocked.options()) != signature


def test_a_targets_method_travels_by_the_targets_name():
    carried = pickle.loads(pickle.dumps(load("rpa_harness.kernel").validate))
    assert carried.__self__.name == "rpa_harness.kernel" and carried.__func__ is Target.validate


def test_a_call_that_cannot_travel_says_what_to_pass():
    with (
        device.owner.calls_routed_to("/nonexistent/owner.sock"),
        pytest.raises(TypeError, match="must pickle .*pass a module-level function or a target's method"),
    ):
        Backend(device.FAST_INTERPRET).run(lambda: None)


def test_an_error_that_does_not_pickle_keeps_its_class_name_and_message():
    class Unpicklable(Exception):
        def __reduce__(self):
            raise TypeError("no")

    kind, *carried = device.owner._raised(Unpicklable("the kernel's words"))
    rebuilt = device.owner.stand_in(*pickle.loads(pickle.dumps(carried)))
    assert (
        kind == "raised-as"
        and type(rebuilt).__name__ == "Unpicklable"
        and str(rebuilt) == "the kernel's words"
    )


def test_within_endings_raise_a_halt_is_an_exception_and_a_fresh_owner_takes_the_next_call():
    """What `rpa-harness chip agreement` relies on to go on after a configuration that halts the chip."""
    supervisor = device.owner.Supervisor(dict(os.environ)).start()
    target, backend = load("tests.broken.halts"), Backend(device.FAST_INTERPRET)
    halting, passing = (
        sized_case([q_len], [8], num_q_heads=2, num_kv_heads=1, head_dim=64, page_size=8) for q_len in (2, 1)
    )
    try:
        with device.owner.calls_routed_to(supervisor.where):
            with device.owner.endings_raise(), pytest.raises(device.owner.CallEndedTheOwner) as ended:
                backend.run(target.attention, halting.arrays(), halting.options())
            out = backend.run(target.attention, passing.arrays(), passing.options())
    finally:
        owners = supervisor.stop()
    assert ended.value.kind == "halted" and "The program continuator has halted" in ended.value.report[1]
    assert out.shape == (passing.max_num_batched_tokens, passing.num_q_heads, 64)
    assert owners["calls"] == 2 and owners["owners"] == 2 and owners["exits"] == [device.HALT_EXIT_CODE]


def test_each_owner_of_several_is_pinned_to_its_own_chip_and_a_single_owner_to_none():
    pinned = [device.owner.chip_pinning(chip, 4) for chip in range(4)]
    assert [env["TPU_VISIBLE_CHIPS"] for env in pinned] == ["0", "1", "2", "3"]
    assert all(env["TPU_CHIPS_PER_PROCESS_BOUNDS"] == env["TPU_PROCESS_BOUNDS"] == "1,1,1" for env in pinned)
    ports = [env["TPU_PROCESS_PORT"] for env in pinned]
    assert len(set(ports)) == 4, "each owner's libtpu a port of its own"
    assert [env["TPU_PROCESS_ADDRESSES"] for env in pinned] == [f"localhost:{port}" for port in ports]
    assert device.owner.chip_pinning(0, 1) == {}, "one owner opens every chip, as a run without owners does"


def test_the_supervisors_start_each_owner_in_its_chips_environment():
    owners = device.owner.Owners({"PATH": os.environ["PATH"], "TPU_VISIBLE_CHIPS": "0,1"}, 2)
    environs = [supervisor.environ for supervisor in owners.supervisors]
    assert [environ["TPU_VISIBLE_CHIPS"] for environ in environs] == ["0", "1"]
    assert owners.where.split(os.pathsep) == [supervisor.where for supervisor in owners.supervisors]


@pytest.mark.parametrize(("worker", "expected"), [("gw0", 0), ("gw1", 1), ("gw2", 0), ("gw5", 1), (None, 0)])
def test_worker_i_sends_its_calls_to_owner_i_mod_n(monkeypatch, worker, expected):
    monkeypatch.setenv(device.owner.ADDRESS_ENV, os.pathsep.join(["/run/a/owner.sock", "/run/b/owner.sock"]))
    if worker is None:
        monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    else:
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
    assert device.owner.address() == ["/run/a/owner.sock", "/run/b/owner.sock"][expected]


def make_devices(root, accel=0, vfio=(), google=()):
    """A /dev and a /sys/kernel/iommu_groups as a TPU host's: ``accel`` accel files; VFIO groups ``vfio``,
    those in ``google`` a Google device's."""
    dev, groups = root / "dev", root / "iommu_groups"
    (dev / "vfio").mkdir(parents=True)
    (dev / "vfio" / "vfio").touch()  # VFIO's own control file, no group
    for number in range(accel):
        (dev / f"accel{number}").touch()
    for group in vfio:
        (dev / "vfio" / str(group)).touch()
        (groups / str(group) / "devices" / "0000:00:04.0").mkdir(parents=True)
        vendor = device.chip.GOOGLE_PCI_VENDOR if group in google else "0x15b3"
        (groups / str(group) / "devices" / "0000:00:04.0" / "vendor").write_text(vendor + "\n")
    return dev, groups


@pytest.mark.parametrize(
    ("accel", "vfio", "google", "chips"),
    [(4, (), (), 4), (0, range(8), range(8), 8), (0, (0, 1, 96), (0, 1), 2), (0, (), (), 0)],
    ids=["accel", "vfio", "vfio-not-all-google", "none"],
)
def test_the_chips_of_a_host_are_counted_from_its_device_files(tmp_path, accel, vfio, google, chips):
    dev, groups = make_devices(tmp_path, accel, vfio, google)
    assert device.chips_on_this_host(dev, groups) == chips


class OwnersConfig:
    """What ``_chip_owners_wanted`` reads of a pytest configuration: the option, and the workers asked."""

    def __init__(self, owners: str, workers: int):
        self.owners, self.option = owners, types.SimpleNamespace(tx=["popen"] * workers)

    def getoption(self, name):
        assert name == plugin.CHIP_OWNERS_OPTION
        return self.owners


@pytest.mark.parametrize(
    ("owners", "workers", "on_a_tpu", "chips", "wanted"),
    [("auto", 12, True, 4, 4), ("auto", 2, True, 8, 2), ("auto", 4, False, 0, 1), ("3", 4, False, 0, 3),
     ("2", 12, True, 4, 2), ("auto", 4, True, 0, 1)],
)  # fmt: skip
def test_owners_are_one_a_chip_on_a_tpu_at_most_one_a_worker(
    monkeypatch, owners, workers, on_a_tpu, chips, wanted
):
    monkeypatch.setattr(plugin, "_on_a_tpu", lambda config: on_a_tpu)
    monkeypatch.setattr(device, "chips_on_this_host", lambda: chips)
    assert plugin._chip_owners_wanted(OwnersConfig(owners, workers)) == wanted


@pytest.mark.parametrize(
    ("owners", "words"),
    [("0", "'0' is not a number of chip owners; pass a number from 1 up, or auto"),
     ("two", "'two' is not a number of chip owners"),
     ("8", "--rpa-chip-owners=8: this host has 4 TPU chip(s) (/dev/accel*, /dev/vfio), one owner a chip; "
      "pass 4 or fewer, or auto")],
)  # fmt: skip
def test_a_number_of_owners_the_host_cannot_have_is_a_usage_error(monkeypatch, owners, words):
    monkeypatch.setattr(plugin, "_on_a_tpu", lambda config: True)
    monkeypatch.setattr(device, "chips_on_this_host", lambda: 4)
    with pytest.raises(pytest.UsageError) as error:
        plugin._chip_owners_wanted(OwnersConfig(owners, 12))
    assert words in str(error.value) and "\n" not in str(error.value)


def owners_summary(*per_chip: tuple[int, float, int, list]) -> dict:
    calls = sum(chip[0] for chip in per_chip)
    return {
        "calls": calls, "busy_s": sum(chip[1] for chip in per_chip), "owners": sum(chip[2] for chip in per_chip),
        "exits": [code for chip in per_chip for code in chip[3]], "wall_s": 10.0,
        "busy_fraction": sum(chip[1] for chip in per_chip) / (10.0 * len(per_chip)),
        "per_chip": [
            {"chip": str(number) if len(per_chip) > 1 else "all", "calls": chip[0], "busy_s": chip[1],
             "owners": chip[2], "exits": chip[3], "busy_fraction": chip[1] / 10.0}
            for number, chip in enumerate(per_chip)
        ],
        "seconds": {"run_s": 1.0}, "calls_per_signature": [],
    }  # fmt: skip


def test_the_summary_of_one_owner_is_one_line_and_of_several_one_a_chip_after_their_total():
    assert plugin.chip_owner_lines(owners_summary((8, 4.0, 2, [72]))) == [
        "chip owner: 8 kernel calls, busy 4.0 s of 10.0 s (40%); 2 owner process(es); 1 ended early (exit [72])",
        "chip owner: per call: 0.0 ms receiving, 0.0 ms waiting for its compilation, 0.0 ms waiting for the "
        "chip, 125.0 ms running (transfers, dispatch, the chip), 0.0 ms replying",
    ]
    assert plugin.chip_owner_lines(owners_summary((6, 3.0, 1, []), (2, 1.0, 2, [72])))[:3] == [
        "chip owner: 8 kernel calls, busy 4.0 s of 2 chips x 10.0 s (20%); 3 owner process(es) on 2 chips; 1 ended "
        "early (exit [72])",
        "chip owner on chip 0: 6 kernel calls, busy 3.0 s of 10.0 s (30%); 1 owner process(es)",
        "chip owner on chip 1: 2 kernel calls, busy 1.0 s of 10.0 s (10%); 2 owner process(es); 1 ended early "
        "(exit [72])",
    ]


def test_a_halt_ends_the_owner_of_one_chip_and_a_fresh_one_opens_it_while_the_other_serves_on(monkeypatch):
    """Worker gw1's call halts its owner's chip: a fresh owner serves that chip's next call, and the other
    chip's owner, never ended, serves gw0's."""
    owners = device.owner.Owners(dict(os.environ), 2).start()
    target, backend = load("tests.broken.halts"), Backend(device.FAST_INTERPRET)
    halting, passing = (
        sized_case([q_len], [8], num_q_heads=2, num_kv_heads=1, head_dim=64, page_size=8) for q_len in (2, 1)
    )
    try:
        with device.owner.calls_routed_to(owners.where), device.owner.endings_raise():
            for worker, case in (("gw1", halting), ("gw1", passing), ("gw0", passing)):
                monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
                device.owner._drop_connection()  # each worker a process, a connection of its own
                try:
                    backend.run(target.attention, case.arrays(), case.options())
                except device.owner.CallEndedTheOwner as ended:
                    assert ended.kind == "halted" and case is halting
    finally:
        device.owner._drop_connection()
        summary = owners.stop()
    assert [(chip["chip"], chip["calls"], chip["owners"], chip["exits"]) for chip in summary["per_chip"]] == [
        ("0", 1, 1, []),
        ("1", 2, 2, [device.HALT_EXIT_CODE]),
    ]
    assert summary["calls"] == 3 and summary["owners"] == 3


def test_one_run_and_one_owner_serve_two_targets(tmp_path, pytestconfig):
    """``rpa-harness run`` with two targets: one pytest session, one worker and one owner (the fast interpreter
    standing in for the chip) make every call of both; each target's property (the determinism one: two
    calls an example) runs under its own id and passes, and the summary names both targets."""
    result = run_python(
        "-m", "rpa_harness.cli", "run", "--profile", "dev", "--target", "rpa_harness.kernel", "--target", UPSTREAM,
        "--backend", "fast-interpret", "--tpu-generation", "none", "-n", "1", "--repro-dir", str(tmp_path),
        "--", "--rpa-chip-owner=on", "-k", "test_same_call_gives_same_bits",
        cwd=pytestconfig.rootpath, env={**os.environ, "RPA_MAX_EXAMPLES": "2"},
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    calls, owners = owner_line(output)
    assert calls >= 2 and owners == 1, output[-3000:]
    table = result.stdout[result.stdout.index("rpa-harness summary") :]
    for test_id in ("kernel-fast-interpret", "ragged_paged_attention-fast-interpret"):
        assert f"test_same_call_gives_same_bits[{test_id}]" in table, table
    assert "target rpa_harness.kernel" in table and f"target {UPSTREAM}" in table, table
    assert f"targets (2):\n    rpa_harness.kernel: 1 passed\n    {UPSTREAM}: 1 passed" in table, table
