"""Lowering a Pallas TPU kernel to Mosaic, on a machine without a TPU or on the chip itself.

Pallas asks ``tpu_info`` for the current device's TPU generation while lowering; on a CPU host that lookup
fails. Registering a chip's description under the CPU device kind answers it, after which a jitted function
can be traced and lowered for the "tpu" platform. The lowered text holds the serialized Mosaic kernel in a
``tpu_custom_call``; off a TPU this checks Pallas' lowering rules only. Where the default device is a real
TPU, its own generation is lowered and compiled (Mosaic's passes run too), and other generations are not
emulated: a registration would describe the chip as another one.
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


def default_device_kind() -> str:
    """The default device's kind as jax names it ("cpu", "TPU v5 lite", ...)."""
    return jax.devices()[0].device_kind


def generation_of_device_kind(device_kind: str) -> str | None:
    """The TPU generation a device kind names ("v5e" for "TPU v5 lite"), or None for one that is no TPU."""
    chip = tpu_info.chip_version_from_device_kind(device_kind)
    return None if chip is None else chip.value


def real_tpu_generation() -> str | None:
    """The generation of the default device where it is a real TPU ("v5e" for "TPU v5 lite"), else None."""
    return generation_of_device_kind(default_device_kind())


def emulation_skip_reason(chip: str) -> str | None:
    """Why lowering for ``chip`` is not checked here (the default device is a real TPU of another
    generation), or None where it is."""
    real = real_tpu_generation()
    if real is None or real == chip:
        return None
    return (
        f"the default device is a real TPU {real} ({default_device_kind()!r}): lowering is checked and "
        f"compiled for it; {chip} is emulated only off a TPU"
    )


def generations_here(wanted) -> tuple[str, ...]:
    """The generations to lower for: ``wanted`` off a TPU, the chip's own on a real TPU."""
    real = real_tpu_generation()
    return tuple(wanted) if real is None else (real,)


def register_tpu_generation(chip: str) -> None:
    """Makes lowering on this host describe the default device as one TensorCore of TPU ``chip``.

    Re-registering replaces the previous chip. Raises ValueError for an unknown chip name.
    """
    chip_version = _chip_version(chip)
    device_kind = default_device_kind()
    if tpu_info.chip_version_from_device_kind(device_kind) is not None:
        raise RuntimeError(
            f"The default device is a real TPU ({device_kind!r}); lower for it directly instead of "
            "registering a generation."
        )
    tpu_info.registry[device_kind] = lambda: tpu_info.get_tpu_info_for_chip(chip_version, 1)


def lower_for_tpu(fn, *args, chip: str = "v5e", **kwargs) -> str:
    """Lowers ``fn(*args, **kwargs)`` for TPU ``chip`` and returns the lowered StableHLO text.

    ``args`` may be arrays or ``jax.ShapeDtypeStruct``; ``kwargs`` are passed as static arguments. Nothing
    runs. Tracing happens with the Pallas interpret mode switched off (an interpreted kernel contains no
    Mosaic call). Off a TPU the chip is registered for the call and the registration undone afterwards; on a
    real TPU of generation ``chip`` the lowering is also compiled there, and another ``chip`` is a ValueError
    (``emulation_skip_reason``).
    """
    _chip_version(chip)
    real = real_tpu_generation()
    if real is not None and real != chip:
        raise ValueError(f"chip={chip!r}: {emulation_skip_reason(chip)}")
    described = contextlib.nullcontext() if real is not None else tpu_generation_registered(chip)
    # jax documents None (no forced interpret mode) but annotates the parameter InterpretParams only.
    with described, pltpu.force_tpu_interpret_mode(None):  # type: ignore[arg-type]
        traced = jax.jit(lambda *a: fn(*a, **kwargs)).trace(*args)
        lowered = traced.lower(lowering_platforms=("tpu",))
        if jax.devices()[0].platform == "tpu":  # Mosaic's own passes run as libtpu compiles the call
            lowered.compile()
        return lowered.as_text()


@contextlib.contextmanager
def tpu_generation_registered(chip: str):
    """``register_tpu_generation(chip)`` for the enclosed block; the previous registration (or none) after."""
    device_kind = default_device_kind()
    previous = tpu_info.registry.get(device_kind)
    register_tpu_generation(chip)
    try:
        yield
    finally:
        if previous is None:
            tpu_info.registry.pop(device_kind, None)
        else:
            tpu_info.registry[device_kind] = previous
