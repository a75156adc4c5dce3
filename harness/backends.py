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

try:  # private: where jax 0.10 keeps the race detector's verdict
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as _interpreter
except ImportError:  # another jax layout: races are still detected and printed, but not asserted
    _interpreter = None

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
            params = pltpu.InterpretParams(
                detect_races=True, out_of_bounds_reads="raise", uninitialized_memory="nan"
            )
        with pltpu.force_tpu_interpret_mode(params):
            try:
                yield
            except BaseException:
                if self.name == INTERPRET:
                    pltpu.reset_tpu_interpret_mode_state()
                raise

    def run(self, fn, *args, **kwargs) -> np.ndarray:
        """Calls ``fn`` on this backend and returns its output as a NumPy array (races raise)."""
        with self.context(), watchdog(f"a kernel call on {self.name}"):
            out = np.asarray(jax.block_until_ready(fn(*args, **kwargs)))
        if self.name == INTERPRET and _interpreter is not None:
            races = getattr(_interpreter, "races", None)
            if races is not None and races.races_found:
                raise RaceDetected(
                    "the TPU interpreter detected a data race in the kernel (races.races_found)"
                )
        return out
