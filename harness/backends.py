"""Where a kernel runs: the checking TPU interpreter, the fast generic interpreter, or a real TPU.

``interpret`` simulates HBM/VMEM/SMEM, DMAs and semaphores: out-of-bounds reads raise, scratch starts as
NaN, races are detected and asserted. ``fast-interpret`` is the generic HLO interpreter: 50-200x faster,
checks nothing; it carries the volume of examples. ``tpu`` compiles for the TPU the process sees.
"""

import contextlib
import dataclasses
import faulthandler
import functools
import os
import sys
import threading

import jax
import numpy as np
from jax.experimental.pallas import tpu as pltpu

INTERPRET = "interpret"
FAST_INTERPRET = "fast-interpret"
TPU = "tpu"
AUTO = "auto"
BACKENDS = (INTERPRET, FAST_INTERPRET, TPU)


# A kernel call that takes longer is taken for a hang (a DMA wait with nothing pending never returns and
# ignores signals, and a Python thread cannot be stopped): the process ends, and pytest-xdist replaces the worker.
CALL_TIMEOUT_SECONDS = float(os.environ.get("RPA_CALL_TIMEOUT", "300"))
HANG_EXIT_CODE = 70

# The TPU interpreter's parameters on the checking backend (also written into replay's standalone snippet).
CHECKING_INTERPRET_PARAMS = dict(detect_races=True, out_of_bounds_reads="raise", uninitialized_memory="nan")

# Set by a test runner that captures output (pytest's capture manager): restores the real stderr before the
# watchdog writes its message and ends the process, so that the message is not lost in a capture buffer.
release_captured_output = None

# Set while a case is in flight: called with (what, seconds) when the watchdog fires; returns (message, exit code).
_hang_handler = None


@contextlib.contextmanager
def on_hang(handler):
    """While the enclosed block runs, a hang calls ``handler(what, seconds) -> (message, exit code)`` before exiting.

    The handler turns the case on disk into a hang repro and names it, so the hang is not lost with the process.
    """
    global _hang_handler
    previous, _hang_handler = _hang_handler, handler
    try:
        yield
    finally:
        _hang_handler = previous


@contextlib.contextmanager
def watchdog(what: str, seconds: float | None = None):
    """Ends the process if the enclosed call has not returned after ``seconds`` (default RPA_CALL_TIMEOUT)."""
    seconds = CALL_TIMEOUT_SECONDS if seconds is None else seconds

    def expire():
        message, code = f"rpa-harness: {what} did not return within {seconds:g} s (RPA_CALL_TIMEOUT)", HANG_EXIT_CODE
        if _hang_handler is not None:
            try:
                message, code = _hang_handler(what, seconds)
            except Exception as error:  # the hang is still reported, without its repro
                message += f"; writing the hang repro failed: {type(error).__name__}: {error}"
        if release_captured_output is not None:
            release_captured_output()
        sys.stderr.write(
            f"\n{message}\n(taken for a hang, e.g. a DMA wait with nothing pending). Stacks:\n"
        )
        faulthandler.dump_traceback(all_threads=True)
        sys.stderr.write(f"\n{message}\n")
        sys.stderr.flush()
        os._exit(code)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


class RaceDetected(AssertionError):
    """The TPU interpreter saw a data race (e.g. a VMEM buffer read while a DMA still writes it)."""


# How jax's race detector words a race, in the exception it raises (jax >= 0.11, ``on_race="raise"``).
_RACE_MESSAGE = "RACE DETECTED"


def checking_interpret_params() -> pltpu.InterpretParams:
    """The TPU interpreter as the ``interpret`` backend runs it: every check on, races raise.

    jax >= 0.11 raises a race inside the interpreter's callback when ``on_race="raise"``; jax 0.10 has no
    ``on_race`` and only sets ``races.races_found``, which ``Backend.run`` reads after the call.
    """
    options = dict(CHECKING_INTERPRET_PARAMS)
    if "on_race" in {field.name for field in dataclasses.fields(pltpu.InterpretParams)}:
        options["on_race"] = "raise"
    return pltpu.InterpretParams(**options)


def _race_report(error: BaseException) -> str | None:
    """The race detector's account of the race behind ``error`` (its first lines), or None if not a race."""
    text = str(error)
    start = text.find(_RACE_MESSAGE)
    if start < 0:
        return None
    lines = [line.strip() for line in text[start:].splitlines()[:5] if line.strip()]
    return "the TPU interpreter detected a data race in the kernel: " + "; ".join(lines[1:] or lines)


def _race_flagged_after_call() -> bool:
    """jax 0.10's verdict: ``races.races_found`` of the last interpreted call (False where jax has none)."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call

    races = getattr(interpret_pallas_call, "races", None)
    return bool(races is not None and getattr(races, "races_found", False))


@functools.cache
def tpu_available() -> bool:
    try:
        return bool(jax.devices("tpu"))
    except RuntimeError:
        return False


def resolve(choice: str) -> tuple[str, ...]:
    """The backends a ``--rpa-backend`` choice stands for."""
    if choice == AUTO:
        return (TPU,) if tpu_available() else (FAST_INTERPRET, INTERPRET)
    if choice not in BACKENDS:
        raise ValueError(f"--rpa-backend={choice!r} is not one of {', '.join((*BACKENDS, AUTO))}")
    return (choice,)


@dataclasses.dataclass(frozen=True)
class Backend:
    name: str
    interpreter_compat: bool = True  # patch the interpreter so kernels that reshape/bitcast refs run

    @property
    def skip_reason(self) -> str | None:
        if self.name == TPU and not tpu_available():
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
            params = checking_interpret_params()
        with pltpu.force_tpu_interpret_mode(params):
            try:
                yield
            except BaseException:
                if self.name == INTERPRET:
                    pltpu.reset_tpu_interpret_mode_state()
                raise

    def run(self, fn, *args, **kwargs):
        """Calls ``fn`` on this backend and returns its output as NumPy (an array, or a tuple of them for a
        kernel with several outputs); races raise."""
        try:
            with self.context(), watchdog(f"a kernel call on {self.name}"):
                out = jax.tree.map(np.asarray, jax.block_until_ready(fn(*args, **kwargs)))
        except Exception as error:
            report = _race_report(error) if self.name == INTERPRET else None
            if report is not None:
                raise RaceDetected(report) from error
            raise
        if self.name == INTERPRET and _race_flagged_after_call():
            raise RaceDetected("the TPU interpreter detected a data race in the kernel (races.races_found)")
        return out
