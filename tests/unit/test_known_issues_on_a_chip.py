"""On a real chip a known issue is judged by what that chip's code has: an issue of other generations is not
replayed and its cases are drawn, a repro recorded for another generation is not replayed there (it shows
that generation's code), and `rpa-harness replay` says the same. Simulated by answering jax's device kind as
a v5e does."""

import dataclasses

import pytest

from rpa_harness import cli, device, generations, lowering, repro, targets
from rpa_harness.known_issues import recorded_generation
from tests.cases import issue_with, repro_recorded_for, skip_without_tpu_inference
from tests.processes import run_python


@pytest.fixture
def on_a_v5e(monkeypatch):
    """A v5e as jax's default device shows it and as the TPU probe states it (a chip owner's workers see
    only the stated one)."""
    monkeypatch.setattr(lowering, "default_device_kind", lambda: "TPU v5 lite")
    monkeypatch.setenv(device.TPU_PROBE_ENV, "TPU v5 lite:1")
    device.tpus.cache_clear()
    yield
    device.tpus.cache_clear()


def test_from_major_version_is_what_get_tpu_version_at_least_selects():
    assert {"v6e", "7x"} <= set(generations.from_major_version(6))
    assert not {"v4", "v5e", "v5p"} & set(generations.from_major_version(6))
    assert set(generations.from_major_version(2)) >= set(generations.DEVICE_KINDS)


def test_an_issue_of_other_generations_does_not_apply_to_the_chip(tmp_path):
    issue = issue_with(repro_recorded_for(tmp_path, "r", "v6e"), generations=("v6e", "7x"))
    assert issue.applies_to("v6e") and issue.applies_to(generations.NONE) and not issue.applies_to("v5e")
    path, why = issue.repro_on_chip("v5e")
    assert path is None and why.startswith("does not apply to v5e (it is in the code of v6e, 7x only)")


def test_a_repro_recorded_for_another_generation_is_not_replayed_on_the_chip(tmp_path):
    issue = issue_with(repro_recorded_for(tmp_path, "r", "v6e"))
    path, why = issue.repro_on_chip("v5e")
    assert path is None and why.startswith("recorded for v6e, not replayed on v5e (")
    assert issue.repro_on_chip("v6e") == (issue.repro, "")


def test_the_repro_recorded_for_the_chip_or_for_none_is_the_one_replayed(tmp_path):
    for_v6e = repro_recorded_for(tmp_path / "a", "r", "v6e")
    for_v5e = repro_recorded_for(tmp_path / "a", "s", "v5e")
    assert issue_with(for_v6e).repro_on_chip("v5e") == (for_v5e, "")
    anywhere = repro_recorded_for(tmp_path / "b", "r", generations.NONE)
    assert issue_with(anywhere).repro_on_chip("v5e") == (anywhere, "")


def test_no_shipped_issue_replays_a_repro_of_another_generation_on_a_chip():
    """Every catalogued finding either names the reason it is not replayed on a v5e, or replays a repro
    recorded for a v5e or for no generation."""
    for issue in targets.shipped_catalogue():
        path, why = issue.repro_on_chip("v5e")
        if path is None:
            assert why, issue.name
        else:
            assert recorded_generation(path) in ("v5e", generations.NONE), (issue.name, path)


def test_a_chip_draws_the_cases_of_an_issue_of_other_generations(on_a_v5e, tmp_path):
    bundled = targets.load("rpa_harness.kernel")
    path = repro_recorded_for(tmp_path, "r", "v6e")
    of_v6e = issue_with(path, generations=("v6e",))
    everywhere = dataclasses.replace(issue_with(path), name="everywhere")
    target = dataclasses.replace(bundled, known_issues=(of_v6e, everywhere))
    assert target.known_issues_on(device.Backend(device.TPU)) == (everywhere,)
    emulating_v5e = device.Backend(device.FAST_INTERPRET, True, "v5e")  # its interpreters keep avoiding it
    assert [issue.name for issue in target.known_issues_on(emulating_v5e)] == [of_v6e.name, everywhere.name]


def test_replay_on_a_chip_of_another_generation_says_so_and_runs_nothing(on_a_v5e, tmp_path, capsys):
    path = repro_recorded_for(tmp_path, "r", "v6e")
    assert cli.main(["replay", str(path), "--backend", "tpu"]) == cli.CANNOT_RUN
    error = capsys.readouterr().err
    assert "recorded for TPU v6e, and this chip is v5e" in error and "--backend fast-interpret" in error


FAULTED_CHIP_PROGRAM = """
import sys
import jax
from rpa_harness import device

def halted():
    raise jax.errors.JaxRuntimeError("FAILED_PRECONDITION: The program continuator has halted unexpectedly.")

device.chip.on_a_real_chip = lambda: True
device.chip.known_good_call = halted if sys.argv[1] == "faulted" else lambda: None
kernel_calls = []
for _ in range(2):
    device.Backend(device.TPU).run(lambda: kernel_calls.append(1) or jax.numpy.zeros(2))
print("kernel calls:", len(kernel_calls))
"""


@pytest.mark.parametrize("chip", ["faulted", "healthy"])
def test_a_chip_faulted_before_the_first_example_ends_the_process_blaming_no_case(chip, tmp_path):
    """The known-good call runs once, before the process's first kernel call on a chip; where it halts, the
    process ends with its own status before any kernel call (no halt handler, no repro)."""
    result = run_python("-c", FAULTED_CHIP_PROGRAM, chip, cwd=tmp_path)
    if chip == "healthy":
        assert result.returncode == 0 and "kernel calls: 2" in result.stdout, result.stderr[-2000:]
        return
    assert result.returncode == device.CHIP_FAULTED_EXIT_CODE, result.stderr[-2000:]
    assert device.CHIP_FAULTED in result.stderr and "program continuator has halted" in result.stderr
    assert "kernel calls" not in result.stdout


def test_a_chip_only_refusal_another_declared_issue_predicts_masks_the_replay():
    """hd64's finite-mask-value repro, left to the kernel's v5e block sizes on the chip, stops at the
    prologue's tile reshape: the declared not-whole-tiles finding predicts that for its case, so the replay
    is masked by it, as it is where an interpreter emulating a v5e predicts the chip (its predicates then
    see the v5e); its own symptom, or the same refusal off a chip, is not masked."""
    skip_without_tpu_inference()
    from tests.properties import test_known_issues as the_property

    hd64 = targets.load("rpa_harness.targets.tpu_inference_v3_hd64")
    finite = next(
        issue for issue in hd64.known_issues if issue.name == "hd64-finite-mask-value-weights-keys-by-block"
    )
    example = repro.read(finite.repro)
    refusal = AssertionError(
        "ValueError: Specified dims (2, -1, 8, 128) do not evenly divide the size of the ref"
    )
    chip, interpreter = device.Backend(device.TPU), device.Backend(device.INTERPRET)
    masked_by = "hd64-kv-block-not-whole-tiles-fails-to-trace"
    with generations.emulated("v5e"):  # the kernel's block sizes on a v5e, as the chip's predicates see them
        assert the_property.chip_refusal_masking(refusal, finite, example, chip, "v5e", hd64) == masked_by
        assert the_property.chip_refusal_masking(refusal, finite, example, interpreter, None, hd64) is None
        own = AssertionError("3 of 64 elements over the bound")
        assert the_property.chip_refusal_masking(own, finite, example, chip, "v5e", hd64) is None
    predicting = device.Backend(device.FAST_INTERPRET, generation="v5e")
    assert the_property.chip_refusal_masking(refusal, finite, example, predicting, "v5e", hd64) == masked_by
