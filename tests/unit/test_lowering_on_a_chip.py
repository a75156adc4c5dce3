"""Lowering where the default device is a real TPU, simulated by answering jax's device kind as the chip does.

On a chip the lowering checks lower (and compile) for that chip without registering a generation, and skip
the others with a reason; off a TPU every generation is emulated as before.
"""

import jax
import jax.numpy as jnp
import pytest

from rpa_harness import lowering
from rpa_harness.kernel import ragged_paged_attention

V5E_KIND = "TPU v5 lite"  # what a v5e reports as its device_kind

SHAPES = (
    jax.ShapeDtypeStruct((16, 4, 128), jnp.float32),
    jax.ShapeDtypeStruct((12, 16, 4, 128), jnp.float32),
    jax.ShapeDtypeStruct((2,), jnp.int32),
    jax.ShapeDtypeStruct((2, 6), jnp.int32),
    jax.ShapeDtypeStruct((3,), jnp.int32),
    jax.ShapeDtypeStruct((1,), jnp.int32),
)


def test_off_a_tpu_every_generation_is_emulated():
    assert lowering.real_tpu_generation() is None
    assert lowering.emulation_skip_reason("v6e") is None
    assert lowering.generations_here(("v5e", "v6e")) == ("v5e", "v6e")


def test_on_a_chip_its_own_generation_is_lowered_and_the_others_skipped(monkeypatch):
    monkeypatch.setattr(lowering, "default_device_kind", lambda: V5E_KIND)
    assert lowering.real_tpu_generation() == "v5e"
    assert lowering.generations_here(("v5e", "v6e")) == ("v5e",)
    assert lowering.emulation_skip_reason("v5e") is None
    reason = lowering.emulation_skip_reason("v6e")
    assert reason and "real TPU v5e ('TPU v5 lite')" in reason and "v6e is emulated only off a TPU" in reason
    with pytest.raises(ValueError, match="chip='v6e': the default device is a real TPU v5e"):
        lowering.lower_for_tpu(ragged_paged_attention, *SHAPES, chip="v6e")
    with pytest.raises(RuntimeError, match="is a real TPU"):
        lowering.register_tpu_generation("v5e")


def test_on_a_chip_the_lowering_registers_no_generation(monkeypatch):
    """The chip describes itself: here the CPU is described as a v5e first (what the chip's own tpu_info
    answers), then the device kind answers as the chip, so a registration inside would raise."""
    with lowering.tpu_generation_registered("v5e"):
        monkeypatch.setattr(lowering, "default_device_kind", lambda: V5E_KIND)
        text = lowering.lower_for_tpu(ragged_paged_attention, *SHAPES, chip="v5e")
    assert "tpu_custom_call" in text
