"""Where a kernel runs: the checking TPU interpreter, the fast generic interpreter, or a real TPU.

``interpret`` simulates HBM/VMEM/SMEM, DMAs and semaphores: out-of-bounds reads raise, scratch starts as
NaN, races are detected and asserted. ``fast-interpret`` is the generic HLO interpreter: 50-200x faster,
checks nothing; it carries the volume of examples. ``tpu`` compiles for the TPU the process sees.

A kernel call reaches a device one way: ``Backend.run`` (or ``Backend.guarded``/``Backend.timed`` for a
call the caller makes itself), which on a chip makes the known-good call first, watches every call
(``endings.watchdog``) and ends the process on a halt. Where a chip owner makes this process's kernel
calls, the run installs it as the route (``route_calls``) and ``Backend.run`` sends each call there.
"""

import contextlib
import dataclasses
import time

import jax
import numpy as np
from jax.experimental.pallas import tpu as pltpu

from rpa_harness import generations
from rpa_harness.device import chip, endings, interpreter_reports

INTERPRET = "interpret"
FAST_INTERPRET = "fast-interpret"
TPU = "tpu"
AUTO = "auto"
BACKENDS = (INTERPRET, FAST_INTERPRET, TPU)
# Not a place a kernel runs, and no --rpa-backend choice: the TPU compiler on this host, compiling for one
# generation (rpa_harness.ahead_of_time). The compile property's backend, named in its repros.
TPU_COMPILER = "tpu-compiler"

# How this process's kernel calls reach the device: None, made here; else a function called as
# ``route(backend, fn, args, kwargs)`` that makes each call elsewhere (the chip owner's ``owner.call``).
_route = None


def route_calls(route) -> None:
    """Sends every later ``Backend.run`` of this process through ``route(backend, fn, args, kwargs)``
    (None: makes them here again)."""
    global _route
    _route = route


class BackendChoiceError(ValueError):
    """A ``--rpa-backend`` that cannot be honoured here: a usage error, never a run of skips."""


def resolve(choice: str) -> tuple[str, ...]:
    """The backends a ``--rpa-backend`` choice stands for.

    ``tpu`` without a TPU is an error rather than skips: a nightly that lands on a runner without a TPU
    must not go green.
    """
    if choice not in (*BACKENDS, AUTO):
        raise BackendChoiceError(f"--rpa-backend={choice!r} is not one of {', '.join((*BACKENDS, AUTO))}")
    if choice not in (TPU, AUTO):
        return (choice,)
    try:
        present = chip.tpu_available()
    except chip.TpuProbeError as error:
        raise BackendChoiceError(f"--rpa-backend={choice}: {error}") from None
    if choice == AUTO:
        return (TPU,) if present else (FAST_INTERPRET, INTERPRET)
    if not present:
        raise BackendChoiceError(
            "--rpa-backend=tpu: no TPU visible to jax (jax.devices('tpu') is empty); use auto or an "
            f"interpreter ({INTERPRET}, {FAST_INTERPRET})"
        )
    return (choice,)


@dataclasses.dataclass(frozen=True)
class Backend:
    name: str
    interpreter_compat: bool = True  # patch the interpreter so kernels that reshape/bitcast refs run
    # The TPU generation an interpreter emulates while the kernel is traced (rpa_harness.generations);
    # a real TPU is the chip it is.
    generation: str = generations.NONE

    def __post_init__(self):
        generations.check_name(self.generation)
        if self.name == TPU and self.generation != generations.NONE:
            raise generations.GenerationError(
                f"{generations.OPTION}={self.generation} with the tpu backend: a real TPU is the chip it is; "
                "emulate a generation on an interpreter"
            )
        if self.name == TPU_COMPILER and self.generation == generations.NONE:
            raise generations.GenerationError(
                f"the {TPU_COMPILER} backend compiles for a TPU generation: name one with {generations.OPTION}"
            )

    def _repr_pretty_(self, printer, cycle: bool) -> None:  # one line in Hypothesis's failing example
        printer.text(repr(self))

    @property
    def label(self) -> str:
        """The backend and its emulated generation, as test ids and repro names show it."""
        return self.name if self.generation == generations.NONE else f"{self.name}-{self.generation}"

    @property
    def generation_seen(self) -> str:
        """The TPU generation kernels traced here see: a real chip's own (``tpus``: as the process that
        holds it names it), else the emulated one (``none``: the CPU device)."""
        if self.name == TPU:
            return chip.chip_generation()
        return self.generation

    @property
    def has_tpu_generation(self) -> bool:
        """Whether kernels traced here see a TPU generation (a real chip, or an emulated one)."""
        return self.name == TPU or self.generation != generations.NONE

    @property
    def skip_reason(self) -> str | None:
        if self.name == TPU_COMPILER:
            from rpa_harness import ahead_of_time

            return ahead_of_time.unavailable_reason(self.generation)
        if self.name == TPU and not chip.tpu_available():
            return "--rpa-backend=tpu: no TPU is visible to jax (jax.devices('tpu') is empty)"
        return None

    @contextlib.contextmanager
    def context(self):
        """Runs the enclosed kernel calls on this backend (trace them inside it)."""
        if self.name == TPU:
            yield
            return
        if self.interpreter_compat:
            from rpa_harness import interpret_compat

            interpret_compat.install()
        params = True
        if self.name == INTERPRET:
            params = interpreter_reports.checking_interpret_params()
        with pltpu.force_tpu_interpret_mode(params), generations.emulated(self.generation):
            try:
                yield
            except BaseException:
                if self.name == INTERPRET:
                    pltpu.reset_tpu_interpret_mode_state()
                    interpreter_reports.drop_ordered_effect_tokens()
                raise

    @contextlib.contextmanager
    def guarded(self, what: str):
        """Kernel calls made in the enclosed block as every tool makes them here: on a chip, the known-good
        call first (once a process); the backend's context; the watchdog (a hang ends the process); and a
        halted device ends the process (``endings.end_on_halt``). ``what`` names the call in those messages."""
        if self.name == TPU:  # with no case's handlers: a hang or halt here is not the case's
            with (
                endings.on_hang(None),
                endings.on_halt(None),
                endings.watchdog("the known-good call on the chip"),
            ):
                chip.check_the_chip_once()
        try:
            with self.context(), endings.watchdog(what):
                yield
        except Exception as error:
            if (halted := endings.halt_report(error)) is not None:
                endings.end_on_halt(what, halted)
            raise

    def run(self, fn, *args, **kwargs):
        """Calls ``fn`` on this backend and returns its output as NumPy (an array, or a tuple of them for a
        kernel with several outputs); races, deadlocks and an exit that would halt a TPU raise. Where a chip
        owner makes this process's kernel calls (``route_calls``), it makes this one."""
        if _route is not None:
            return _route(self, fn, args, kwargs)
        try:
            with self.guarded(f"a kernel call on {self.name}"):
                out = jax.tree.map(np.asarray, jax.block_until_ready(fn(*args, **kwargs)))
        except Exception as error:
            if self.name == INTERPRET and (found := interpreter_reports.finding(error)) is not None:
                raise found from error
            raise
        if self.name == INTERPRET and interpreter_reports.race_flagged_after_call():
            raise interpreter_reports.RaceDetected(
                "the TPU interpreter detected a data race in the kernel (races.races_found)"
            )
        return out

    def put(self, host: dict) -> dict:
        """``host``'s arrays (by name) on the device, transferred before this returns: a timed call then
        times the kernel, not its inputs' transfer."""
        return jax.block_until_ready({name: jax.device_put(value) for name, value in host.items()})

    def timed_loop(self, what: str, fn, host: dict, calls: int) -> list[float]:
        """Seconds each of ``calls`` calls of ``fn`` on ``host``'s arrays (put on the device first) takes,
        made in a loop under one ``guarded``: without the per-call work of ``timed`` (a guard each), what is
        left is the kernel's own time. An input a call donated is put back, untimed, before the next."""
        on_device = self.put(host)
        seconds = []
        with self.guarded(what):
            for _ in range(calls):
                donated = {name: host[name] for name, value in on_device.items() if value.is_deleted()}
                on_device.update(self.put(donated))
                start = time.perf_counter()
                jax.block_until_ready(fn(**on_device))
                seconds.append(time.perf_counter() - start)
        return seconds

    def timed(self, what: str, fn, **kwargs) -> float:
        """Seconds ``fn(**kwargs)`` takes on this backend, waited for, made as ``guarded`` makes a call: a
        call whose output the caller does not need (``rpa-harness bench``'s timed calls)."""
        with self.guarded(what):
            start = time.perf_counter()
            jax.block_until_ready(fn(**kwargs))
            return time.perf_counter() - start
