"""Compiling a kernel for a TPU generation on a CPU host, ahead of time, with the real Mosaic compiler.

The interpreters run what a chip refuses: a configuration Mosaic cannot tile ("Offsets along tiled
dimensions must be aligned to tiles"), or one whose buffers do not fit the chip's scoped VMEM
("CompileTimeScopedVmemOom"). libtpu (``pip install "rpa-harness[compile]"``, which brings ``jax[tpu]``)
carries the compiler, and jax's topology API describes a chip's devices without one being present: a call
traced inside ``generations.emulated(name)`` (so that the kernel picks that generation's defaults and
branches) on arguments placed on a topology device compiles for that chip, errors included, in about a
second. Nothing runs: production shapes cost what small ones do.
"""

import contextlib
import functools
import importlib.util
import os
import re

import jax
import numpy as np
from jax.experimental.pallas import tpu as pltpu

from rpa_harness import generations

INSTALL_COMMAND = 'pip install "rpa-harness[compile]"'

# The topology name libtpu knows each generation by (the smallest slice it accepts); a generation missing
# here, or one the installed libtpu does not resolve, is not compiled for.
TOPOLOGY_NAMES = {
    "v4": "v4:2x2x1",
    "v5e": "v5e:2x2",
    "v5p": "v5p:2x2x1",
    "v6e": "v6e:2x2",
    "7x": "tpu7x:2x2x1",
}

# How the compiler words a kernel whose buffers exceed the scoped VMEM limit, and scalar operands that
# exceed SMEM.
_VMEM_MARKERS = ("CompileTimeScopedVmemOom", "scoped vmem", "memory space vmem", "space=vmem")
_SMEM_MARKERS = ("space=smem",)
# How Pallas' TPU lowering and Mosaic word a refusal, where a kernel call on a chip raises one (besides
# the VMEM and SMEM overflows above).
_REFUSAL_TYPES = ("MosaicError", "LoweringException")
_REFUSAL_MARKERS = ("Mosaic failed to compile", "Pallas TPU lowering", "pallas-blockspec")


class CompilerRefusal(Exception):
    """Lowering for the chip or compiling for it failed: the chip cannot run the traced call. ``error`` is
    what Pallas' TPU lowering or the compiler (Mosaic, XLA's TPU backend) raised."""

    def __init__(self, error: BaseException):
        super().__init__(str(error))
        self.error = error


class CompilerUnavailable(RuntimeError):
    """No TPU compiler here (libtpu missing, or a jax without the topology API); the message says what to
    install."""


def unavailable_reason(generation: str | None = None) -> str | None:
    """Why nothing (nothing for ``generation``) can be compiled for a TPU on this host, or None when it can."""
    from rpa_harness import lowering

    real = lowering.real_tpu_generation()
    if real is not None:
        if generation is None or generation == real:
            return None
        return (
            f"this host's jax runs on a real TPU {real} ({lowering.default_device_kind()!r}): it compiles for "
            f"that chip; compile for {generation} ahead of time on a CPU host with libtpu"
        )
    if importlib.util.find_spec("libtpu") is None:
        return f"libtpu (the TPU compiler) is not installed: {INSTALL_COMMAND}"
    if importlib.util.find_spec("jax.experimental.topologies") is None:
        return f"jax {jax.__version__} has no jax.experimental.topologies (the TPU topology API)"
    return None


@functools.cache
def topology_device(generation: str):
    """The first device of a small slice of ``generation``, described by libtpu (no chip needed)."""
    reason = unavailable_reason()
    if reason is not None:
        raise CompilerUnavailable(reason)
    name = TOPOLOGY_NAMES.get(generation)
    if name is None:
        raise CompilerUnavailable(
            f"no TPU topology is known for generation {generation!r}; compilable: {', '.join(TOPOLOGY_NAMES)}"
        )
    from jax.experimental import topologies

    # libtpu reads the slice's workers from the environment; this host is the only one. It also lets one
    # process at a time load it (a lockfile), which would keep all but one pytest-xdist worker from
    # compiling: no chip is opened here, so the others may load it too.
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        return topologies.get_topology_desc(platform="tpu", topology_name=name).devices[0]
    except Exception as error:  # libtpu's own error: this release does not know the chip
        raise CompilerUnavailable(
            f"the installed libtpu does not describe {name} ({generation}): {str(error).splitlines()[0]}"
        ) from None


def shapes_on(arrays: dict, device) -> dict:
    """``jax.ShapeDtypeStruct`` of each array, placed on ``device``."""
    sharding = jax.sharding.SingleDeviceSharding(device)
    return {
        name: jax.ShapeDtypeStruct(np.shape(value), np.asarray(value).dtype, sharding=sharding)
        for name, value in arrays.items()
    }


def compile_for(generation: str, call, arrays: dict):
    """Compiles ``call(**arrays)`` for one chip of ``generation``; returns the compiled executable.

    Traced with the interpreters off (a forced interpret mode would compile the interpreter instead of
    the kernel) and inside the generation's emulation, so that the kernel reads that chip's parameters.
    Raises what tracing raises (the kernel's own errors), and ``CompilerRefusal`` for what lowering or
    compiling raise.
    """
    from rpa_harness import lowering

    real = lowering.real_tpu_generation()
    if real is not None and real != generation:
        raise CompilerUnavailable(str(unavailable_reason(generation)))
    # On the chip itself the kernel sees the chip and compiles for it; elsewhere for a topology's device,
    # inside the generation's emulation.
    device = jax.devices()[0] if real is not None else topology_device(generation)
    structs = shapes_on(arrays, device)
    # jax documents None (no forced interpret mode) but annotates the parameter InterpretParams only.
    with (
        pltpu.force_tpu_interpret_mode(None),  # type: ignore[arg-type]
        generations.emulated(generation) if real is None else contextlib.nullcontext(),
        _persistent_cache_off() if real is None else contextlib.nullcontext(),
    ):
        traced = jax.jit(lambda inputs: call(**inputs)).trace(structs)
        try:
            return traced.lower().compile()
        except Exception as error:
            raise CompilerRefusal(error) from error


@contextlib.contextmanager
def _persistent_cache_off():
    """jax's persistent compilation cache off for the enclosed compilations: jax writes an executable
    compiled for a topology but cannot read it back ("PjRtCompiler must be constructed with a Client"), so
    it would only fill the cache and warn. jax decides once whether the cache is used; resetting the cache
    makes it decide again, before and after."""
    if not jax.config.jax_enable_compilation_cache:
        yield
        return
    from jax.experimental.compilation_cache import compilation_cache

    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", True)
        compilation_cache.reset_cache()


def is_refusal(error: BaseException) -> bool:
    """Whether a kernel call on a chip raised because Pallas' TPU lowering or the compiler refused the
    kernel (what ``compile_for`` raises as ``CompilerRefusal``): on a chip one call traces, lowers,
    compiles and runs, so the error is told apart by its type and words."""
    seen: BaseException | None = error
    while seen is not None:
        if (
            type(seen).__name__ in _REFUSAL_TYPES
            or any(marker in str(seen) for marker in _REFUSAL_MARKERS)
            or is_vmem_overflow(seen)
            or is_smem_overflow(seen)
        ):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def is_vmem_overflow(error: BaseException) -> bool:
    """Whether the compiler refused because the kernel's buffers exceed the chip's scoped VMEM."""
    return any(marker.lower() in str(error).lower() for marker in _VMEM_MARKERS)


def is_smem_overflow(error: BaseException) -> bool:
    """Whether the compiler refused because the kernel's scalar operands exceed the chip's SMEM."""
    return any(marker in str(error) for marker in _SMEM_MARKERS)


def compiler_message(error: BaseException) -> str:
    """The compiler's words: the message up to its first blank line (its first 300 characters), then what
    it names: the MLIR operation Mosaic refused, or the scoped allocation that overflowed VMEM."""
    text = str(error).strip()
    head = " ".join(text.split("\n\n", 1)[0].split())
    lines = [head if len(head) <= 300 else head[:300] + " ..."]
    marker = "The MLIR operation involved:"
    if marker in text:
        operation = text.split(marker, 1)[1].strip().splitlines()[0].strip()
        lines.append(f"operation: {operation[:300]}")
    found = re.search(
        r"Scoped allocation with size \S+ and limit \S+ exceeded scoped vmem limit by \S+", text
    )
    if found and found.group(0) not in lines[0]:
        lines.append(found.group(0))
    return f"{type(error).__name__}: " + "\n    ".join(lines)
