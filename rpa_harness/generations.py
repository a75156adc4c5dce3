"""TPU generation emulation: a kernel traced on a CPU device sees the chip it would run on in production.

RPA kernels ask which chip they are on while they are traced, and take their tuned defaults (block sizes,
VMEM limits) and generation-specific branches (integer widths, tilings) from the answer. On a CPU device
every such question answers "not a TPU". Inside ``emulated(name)`` the questions that kernels ask get the
answer a real chip of that generation gives:

- ``jax.devices()[i].device_kind`` is the string the chip reports (``DEVICE_KINDS``; jax's own
  ``chip_version_from_device_kind`` maps each back to the generation), every other attribute the CPU
  device's;
- ``pltpu.get_tpu_info()`` describes one TensorCore of the chip (VMEM capacity, tilings, core count);
- jit caches are keyed on the generation (a jax configuration state in the jit key), so a function traced
  for one generation is traced again for another instead of reusing the first's trace.

A target that asks some other way (a module-level ``from jax import devices``, a device kind read at import
time) declares ``RPA_HARNESS_GENERATION_HOOK``: a function of the generation name returning a context
manager, entered around each of its calls inside the emulation (``hooked``). What emulation is not: the interpreters still run the kernel on the
CPU (same semantics, no Mosaic compilation, no VMEM limits enforced, no TPU numerics but one: with the
compatibility layer on, float32 products at DEFAULT precision inside the kernel are the MXU's one bfloat16
pass, ``interpret_compat.products``), so it tests the code a generation selects, never how that code behaves
on the chip.
"""

import contextlib
import functools

import jax
from jax._src import config as jax_config

from rpa_harness.lowering import known_tpu_generations, tpu_generation_registered

NONE = "none"  # no emulation: the CPU device, as it is
AUTO = "auto"  # the target's declared generations (Capabilities.tpu_generations), per profile
OPTION = "--rpa-tpu-generation"
ENV = "RPA_TPU_GENERATION"
# Under --rpa-tpu-generation=auto every profile but nightly emulates at most these of a target's declared
# generations (two that branch apart in the shipped kernels: v6e packs queries and tiles otherwise than v5e);
# nightly emulates every declared one.
EVERYDAY_GENERATIONS = ("v5e", "v6e")

# The device kind each generation's chip reports (the strings jax's tpu_info.chip_version_from_device_kind
# recognises; where it knows two, the one real chips report).
_REPORTED_KINDS = {
    "v2": "TPU v2",
    "v3": "TPU v3",
    "v4i": "TPU v4 lite",
    "v4": "TPU v4",
    "v5e": "TPU v5 lite",
    "v5p": "TPU v5",
    "v6e": "TPU v6 lite",
    "7": "TPU7",
    "7x": "TPU7x",
    "8i": "TPU8i",
    "8t": "TPU8t",
}


# Each generation's major version: the number a kernel's ``get_tpu_version()`` returns and Mosaic's
# ``hardware_generation``, which both branch on.
_MAJOR_VERSIONS = {
    "v2": 2, "v3": 3, "v4i": 4, "v4": 4, "v5e": 5, "v5p": 5, "v6e": 6, "7": 7, "7x": 7, "8i": 8, "8t": 8,
}  # fmt: skip


def from_major_version(major: int) -> tuple[str, ...]:
    """The generations from TPU ``major`` on: what a kernel's ``get_tpu_version() >= major`` selects."""
    return tuple(name for name, version in _MAJOR_VERSIONS.items() if version >= major)


# The generations the installed jax describes (lowering.known_tpu_generations), in its order.
DEVICE_KINDS = {name: _REPORTED_KINDS[name] for name in known_tpu_generations() if name in _REPORTED_KINDS}

# In the jit cache key and the trace context: a trace made for one generation is not reused for another.
_GENERATION = jax_config.enum_state(
    "rpa_harness_tpu_generation",
    [NONE, *DEVICE_KINDS],
    NONE,
    "The TPU generation rpa_harness emulates while it traces a kernel (none: the CPU device).",
    include_in_jit_key=True,
    include_in_trace_context=True,
)


class GenerationError(ValueError):
    """An unknown generation name, or emulation where it cannot apply; the message lists the known names."""


def parse(text: str) -> tuple[str, ...]:
    """Generation names from ``NAME[,NAME...]``; ``none`` (or nothing) is the CPU device."""
    names = tuple(dict.fromkeys(name.strip() for name in (text or "").split(",") if name.strip()))
    unknown = [name for name in names if name != NONE and name not in DEVICE_KINDS]
    if unknown:
        raise GenerationError(
            f"{OPTION}: unknown TPU generation(s) {', '.join(unknown)}; known to jax {jax.__version__}: "
            f"{', '.join(DEVICE_KINDS)} (or {NONE})"
        )
    return names or (NONE,)


def check_name(generation: str) -> None:
    """One generation name this jax knows, or ``none``."""
    if generation != NONE and generation not in DEVICE_KINDS:
        parse(generation)  # raises, naming it and the known ones
        raise GenerationError(f"{OPTION}={generation!r}: one generation is expected here, not a list")


def select(text: str, declared: tuple[str, ...], *, profile: str | None = None) -> tuple[str, ...]:
    """The generations a run emulates: ``auto`` (or nothing) picks among the target's ``declared`` ones
    (``EVERYDAY_GENERATIONS`` of them, else its first two; every one under the nightly profile; ``none`` if
    it declares none this jax knows); names are taken as given."""
    if (text or AUTO).strip() != AUTO:
        return parse(text)
    known = tuple(name for name in declared if name in DEVICE_KINDS)
    if profile != "nightly":
        known = tuple(name for name in known if name in EVERYDAY_GENERATIONS) or known[:2]
    return known or (NONE,)


def check_declared(declared: tuple[str, ...]) -> None:
    """A target's ``tpu_generations``: names of TPU generations, those of a newer jax included (``select``
    skips the ones this jax does not know), so that a typo is one error."""
    unknown = [name for name in declared if name not in _REPORTED_KINDS]
    if unknown:
        raise GenerationError(
            f"tpu_generations: {unknown} are not TPU generations; choose among {', '.join(_REPORTED_KINDS)}"
        )


def current() -> str:
    """The generation being emulated, or ``NONE``."""
    return _GENERATION.value


def on_a_tpu_generation() -> bool:
    """Whether a kernel traced now sees a TPU generation: an emulated one, or a real chip."""
    return current() != NONE or jax.devices()[0].platform == "tpu"


class _EmulatedDevice:
    """A CPU device that reports a TPU's device kind; everything else is the CPU device's."""

    def __init__(self, device, device_kind: str):
        self._device = device
        self.device_kind = device_kind

    def __getattr__(self, name):
        return getattr(self._device, name)

    def __repr__(self):
        return f"{self._device!r} (emulating {self.device_kind})"


@contextlib.contextmanager
def emulated(generation: str):
    """Traces inside see TPU ``generation`` (``NONE``: a no-op). Refused on a real TPU, whose chip is what
    it is."""
    if generation == NONE:
        yield
        return
    check_name(generation)
    cpu = jax.devices()[0]
    if cpu.platform != "cpu":
        raise GenerationError(
            f"{OPTION}={generation}: the default device is {cpu.device_kind!r}, not a CPU; emulation is for "
            "the interpreters on a CPU host"
        )
    devices = jax.devices

    @functools.wraps(devices)
    def emulating_devices(*args, **kwargs):
        found = devices(*args, **kwargs)
        return [_EmulatedDevice(d, DEVICE_KINDS[generation]) if d.platform == "cpu" else d for d in found]

    with tpu_generation_registered(generation), _GENERATION(generation):  # pltpu.get_tpu_info() answers
        jax.devices = emulating_devices
        try:
            yield
        finally:
            jax.devices = devices


def hooked(hook):
    """``hook(current())`` while a generation is emulated (a target's own way of being told), else nothing."""
    if hook is None or current() == NONE:
        return contextlib.nullcontext()
    return hook(current())
