"""Lowering a Pallas TPU kernel to Mosaic on a machine without a TPU.

Pallas asks ``tpu_info`` for the current device's TPU generation while lowering; on a CPU host that lookup
fails. Registering a chip's description under the CPU device kind answers it, after which a jitted function
can be traced and lowered for the "tpu" platform. The lowered text holds the serialized Mosaic kernel in a
``tpu_custom_call``; compiling it still needs libtpu and a TPU, so this checks Pallas' lowering rules only.
"""

import contextlib

import jax
from jax._src.pallas.mosaic import tpu_info
from jax.experimental.pallas import tpu as pltpu


def known_tpu_generations() -> list[str]:
    """TPU generation names the installed jax knows (``ChipVersion`` values, e.g. "v5e", "v6e")."""
    return [chip.value for chip in tpu_info.ChipVersion]


def _chip_version(chip: str) -> tpu_info.ChipVersion:
    try:
        return tpu_info.ChipVersion(chip)
    except ValueError:
        raise ValueError(
            f"chip={chip!r} is not a TPU generation this jax knows; use one of {known_tpu_generations()}."
        ) from None


def register_tpu_generation(chip: str) -> None:
    """Makes lowering on this host describe the default device as one TensorCore of TPU ``chip``.

    Re-registering replaces the previous chip. Raises ValueError for an unknown chip name.
    """
    chip_version = _chip_version(chip)
    device_kind = jax.devices()[0].device_kind
    if tpu_info.chip_version_from_device_kind(device_kind) is not None:
        raise RuntimeError(
            f"The default device is a real TPU ({device_kind!r}); lower for it directly instead of "
            "registering a generation."
        )
    tpu_info.registry[device_kind] = lambda: tpu_info.get_tpu_info_for_chip(chip_version, 1)


def lower_for_tpu(fn, *args, chip: str = "v5e", **kwargs) -> str:
    """Lowers ``fn(*args, **kwargs)`` for TPU ``chip`` and returns the lowered StableHLO text.

    ``args`` may be arrays or ``jax.ShapeDtypeStruct``; ``kwargs`` are passed as static arguments. Nothing
    runs, so this works on a CPU-only host. Tracing happens with the Pallas interpret mode switched off (an
    interpreted kernel contains no Mosaic call), and the chip registration is undone afterwards.
    """
    # jax documents None (no forced interpret mode) but annotates the parameter InterpretParams only.
    with tpu_generation_registered(chip), pltpu.force_tpu_interpret_mode(None):  # type: ignore[arg-type]
        traced = jax.jit(lambda *a: fn(*a, **kwargs)).trace(*args)
        return traced.lower(lowering_platforms=("tpu",)).as_text()


@contextlib.contextmanager
def tpu_generation_registered(chip: str):
    """``register_tpu_generation(chip)`` for the enclosed block; the previous registration (or none) after."""
    device_kind = jax.devices()[0].device_kind
    previous = tpu_info.registry.get(device_kind)
    register_tpu_generation(chip)
    try:
        yield
    finally:
        if previous is None:
            tpu_info.registry.pop(device_kind, None)
        else:
            tpu_info.registry[device_kind] = previous
