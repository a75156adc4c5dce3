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
# ignores signals): the process prints every thread's stack and exits, and pytest-xdist replaces the worker.
CALL_TIMEOUT_SECONDS = float(os.environ.get("RPA_CALL_TIMEOUT", "300"))


@contextlib.contextmanager
def watchdog(what: str, seconds: float = CALL_TIMEOUT_SECONDS):
    """Kills the process if the enclosed call has not returned after ``seconds``."""

    def expire():
        sys.stderr.write(
            f"\nrpa-harness: {what} did not return within {seconds:.0f} s (RPA_CALL_TIMEOUT); "
            "taking it for a hang (e.g. a DMA wait with nothing pending). Stacks:\n"
        )
        faulthandler.dump_traceback(all_threads=True)
        os._exit(70)

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
    options = dict(detect_races=True, out_of_bounds_reads="raise", uninitialized_memory="nan")
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
            from harness import interpret_compat

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

    def run(self, fn, *args, **kwargs) -> np.ndarray:
        """Calls ``fn`` on this backend and returns its output as a NumPy array (races raise)."""
        try:
            with self.context(), watchdog(f"a kernel call on {self.name}"):
                out = np.asarray(jax.block_until_ready(fn(*args, **kwargs)))
        except Exception as error:
            report = _race_report(error) if self.name == INTERPRET else None
            if report is not None:
                raise RaceDetected(report) from error
            raise
        if self.name == INTERPRET and _race_flagged_after_call():
            raise RaceDetected("the TPU interpreter detected a data race in the kernel (races.races_found)")
        return out
