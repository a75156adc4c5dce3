"""What a kernel call on a real chip raises when Pallas' TPU lowering or Mosaic refuses the kernel is a
compile finding (``DoesNotCompile``, ``NeedsMoreVmem``), as the compile property reports it off a chip, not
an error raised on valid input; and a compile repro of another generation is not compiled on a chip.
Simulated by answering jax's device kind as a v5e does."""

import dataclasses
import types

import numpy as np
import pytest

from rpa_harness import ahead_of_time, checks, device, lowering
from rpa_harness.targets import load
from tests.cases import SMALL

V5E_KIND = "TPU v5 lite"
# Pallas' TPU lowering, as jax 0.10.2 words a block shape it refuses (the message's first and last lines).
LOWERING_REFUSAL = (
    "The Pallas TPU lowering currently requires that the last two dimensions of your block shape are "
    "divisible by 8 and 128 respectively, or be equal to the respective dimensions of the overall array.\n\n"
    "See details at https://docs.jax.dev/en/latest/pallas/grid_blockspec.html#pallas-blockspec"
)


class MosaicError(Exception):
    """Named as jax names the error Mosaic's compiler raises."""


@pytest.fixture
def on_a_v5e(monkeypatch):
    """A v5e as jax's default device shows it and as the TPU probe states it."""
    monkeypatch.setattr(lowering, "default_device_kind", lambda: V5E_KIND)
    monkeypatch.setenv(device.TPU_PROBE_ENV, f"{V5E_KIND}:1")
    device.tpus.cache_clear()
    yield
    device.tpus.cache_clear()


def raising(error):
    """The bundled kernel's target whose every call raises ``error``."""

    def ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options):
        raise error

    kernel = types.SimpleNamespace(ragged_paged_attention=ragged_paged_attention)
    return dataclasses.replace(load("rpa_harness.kernel"), module=kernel)


@pytest.mark.parametrize(
    ("error", "kind", "words"),
    [
        (ValueError(LOWERING_REFUSAL), checks.DoesNotCompile, "last two dimensions of your block shape"),
        (MosaicError("INTERNAL: Mosaic failed to compile TPU kernel: Not implemented"), checks.DoesNotCompile,
         "Mosaic failed to compile"),
        (RuntimeError("RESOURCE_EXHAUSTED: CompileTimeScopedVmemOom: Scoped allocation with size 20.0M and "
                      "limit 16.0M exceeded scoped vmem limit by 4.0M"), checks.NeedsMoreVmem, "scoped vmem"),
    ],
)  # fmt: skip
def test_a_refusal_on_a_chip_is_a_compile_finding(on_a_v5e, error, kind, words):
    case = SMALL
    with pytest.raises(kind) as failure:
        checks.run_valid(raising(error), device.Backend(device.TPU), case.arrays(), case.options())
    assert "v5e (TPU v5 lite)" in str(failure.value)
    assert words in str(failure.value)


def test_any_other_error_on_a_chip_is_raised_on_valid_input(on_a_v5e):
    case = SMALL
    with pytest.raises(checks.RaisedOnValidInput):
        checks.run_valid(
            raising(ValueError("q_len 3 > kv_len 2")),
            device.Backend(device.TPU),
            case.arrays(),
            case.options(),
        )


def test_on_a_chip_only_its_own_generation_is_compiled(on_a_v5e):
    assert ahead_of_time.unavailable_reason("v5e") is None
    reason = ahead_of_time.unavailable_reason("v6e")
    assert reason is not None and "real TPU v5e" in reason and "CPU host" in reason
    with pytest.raises(ahead_of_time.CompilerUnavailable, match="compile for v6e ahead of time"):
        ahead_of_time.compile_for("v6e", lambda **arrays: arrays, {"x": np.zeros(2)})
    assert device.Backend(device.TPU_COMPILER, True, "v6e").skip_reason == reason
