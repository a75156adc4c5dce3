"""One process makes every kernel call for the xdist workers (``rpa_harness.device.owner``): on a CPU host the
fast interpreter in the owner stands in for the chip. A run through an owner judges as a run without one; a
halt, a hang or a fault a call leaves for the next ends the owner and is reported by the worker whose case
it was, as the process holding the chip would report it, and a fresh owner serves the rest of the run."""

import dataclasses
import json
import os
import pickle
import re

import pytest
from hypothesis import _settings as hypothesis_settings

from rpa_harness import device, recording
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


def test_a_run_through_an_owner_makes_every_call_there(tmp_path, pytestconfig):
    result = run_through_an_owner("rpa_harness.kernel", tmp_path, pytestconfig.rootpath, workers=2)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert "one chip owner process makes the kernel calls of 2 workers" in output, output[:3000]
    calls, owners = owner_line(output)
    assert calls >= 10 and owners == 1, output[-3000:]


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
