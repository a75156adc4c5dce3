"""How a process that holds the device ends when a kernel call cannot be judged: a hang, a call too slow to
judge, a halted device, a chip faulted before the first example; their exit codes, and the watchdog that
ends a call taken for a hang.

A hung call cannot be stopped (a DMA wait with nothing pending never returns and ignores signals, and a
Python thread cannot be interrupted), and a halted chip fails every later call: the process ends, its
handlers (set by the case in flight, or the chip owner) first keeping what it needs as the repro.
"""

import contextlib
import faulthandler
import os
import sys
import threading

import jax

# A kernel call that takes longer is taken for a hang (a DMA wait with nothing pending never returns and
# ignores signals, and a Python thread cannot be stopped): the process ends, and pytest-xdist replaces the worker.
CALL_TIMEOUT_SECONDS = float(os.environ.get("RPA_CALL_TIMEOUT", "300"))
HANG_EXIT_CODE = 70
# Unless the TPU interpreter is still stepping through the kernel (its callbacks keep returning): a large
# checked case on a loaded machine, not a wait. Its watch is then extended, a timeout at a time, up to this
# many timeouts in all; a call still running then ends the process as too slow to judge, an error of the
# run (exit 71, no hang repro), not a verdict on the kernel.
SLOW_CALL_TIMEOUTS = 4
SLOW_EXIT_CODE = 71


# Set by a test runner that captures output (pytest's capture manager, ``set_output_release``): restores
# the real stderr before the watchdog writes its message and ends the process, so that the message is not
# lost in a capture buffer.
_release_captured_output = None


def set_output_release(release) -> None:
    """``release()`` is called before the watchdog writes a hang's message (None: nothing to release)."""
    global _release_captured_output
    _release_captured_output = release


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


# Called with the message when a call that was still stepping ends the process as too slow; returns
# (message, exit code). Set by the chip's owner process, which passes the verdict to the caller.
_slow_handler = None


@contextlib.contextmanager
def on_slow(handler):
    """While the enclosed block runs, a call too slow to judge calls ``handler(message) -> (message, exit
    code)`` before the process ends (``end_too_slow``)."""
    global _slow_handler
    previous, _slow_handler = _slow_handler, handler
    try:
        yield
    finally:
        _slow_handler = previous


# A kernel that faults a TPU halts it for the process: that call and every later one raise a runtime error
# (these messages are libtpu's). The first is the finding; nothing after it can be judged, so the process
# ends (HALT_EXIT_CODE) once the handler has kept the example in flight as the halt's repro. Recognised on
# every backend: no interpreter raises these messages, and a CPU test can then simulate a halt.
HALT_MESSAGES = (
    "program continuator has halted",
    "TPU_EXECUTE_ERROR",
    "slice failed",
    "RuntimeUnexpectedCoreHalt",  # v5e, jax 0.10.2: "E0200: RuntimeUnexpectedCoreHalt: Core halted unexpectedly"
)
HALT_EXIT_CODE = 72

# Set while a case is in flight: called with (what, error's first line) on a halt; returns (message, exit code).
_halt_handler = None


@contextlib.contextmanager
def on_halt(handler):
    """While the enclosed block runs, a halted device calls ``handler(what, error) -> (message, exit code)``
    before the process ends (``end_on_halt``): it keeps the example in flight as the halt's repro."""
    global _halt_handler
    previous, _halt_handler = _halt_handler, handler
    try:
        yield
    finally:
        _halt_handler = previous


def halt_report(error: BaseException | None) -> str | None:
    """The first line of a runtime error that says the device halted (in ``error`` or what it was raised
    from), or None."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, jax.errors.JaxRuntimeError):
            text = str(error)
            if any(message in text for message in HALT_MESSAGES):
                return (text.strip().splitlines() or [type(error).__name__])[0]
        error = error.__cause__ or error.__context__
    return None


def _reported_by(handler, default: tuple[str, int], event: str, *args) -> tuple[str, int]:
    """``handler(*args)``'s (message, exit code), which write the event's repro; ``default`` without a
    handler, or with why the handler failed (the event is still reported, without its repro)."""
    if handler is None:
        return default
    try:
        return handler(*args)
    except Exception as failure:
        return (
            f"{default[0]}; writing the {event} repro failed: {type(failure).__name__}: {failure}",
            default[1],
        )


def end_on_halt(what: str, error: str):
    """Ends the process after a halt: the handler's message (or a default one) on stderr, then its exit code."""
    default = (f"rpa-harness: DEVICE HALTED: {what} raised {error}", HALT_EXIT_CODE)
    message, code = _reported_by(_halt_handler, default, "halt", what, error)
    if _release_captured_output is not None:
        _release_captured_output()
    sys.stderr.write(f"\n{message}\n(no later call on this device can be judged: the process ends)\n")
    sys.stderr.flush()
    os._exit(code)


# A process's first kernel call on a chip is preceded by a known-good call (``chip.known_good_call``): a
# process killed in a call, or a kernel of an earlier process that left a DMA running, can leave the chip
# faulted, and the next process's first call then halts whatever its case. Failing there, the process ends
# before any example is in flight (no case is blamed, no repro written) with this status and a message that
# says so.
CHIP_FAULTED_EXIT_CODE = 73
CHIP_FAULTED = "CHIP FAULTED BEFORE THE FIRST EXAMPLE"


def end_chip_faulted(reason: str):
    """Ends the process whose known-good call failed (``reason``: what it raised), before any example."""
    if _release_captured_output is not None:
        _release_captured_output()
    sys.stderr.write(
        f"\nrpa-harness: {CHIP_FAULTED}: a known-good call on the chip raised {reason}\n(the chip was faulted "
        "before this process ran any example, e.g. by a process killed in a call: no case is blamed; a "
        "fresh process starts on a fresh chip)\n"
    )
    sys.stderr.flush()
    os._exit(CHIP_FAULTED_EXIT_CODE)


@contextlib.contextmanager
def call_timeout(seconds: float):
    """The watchdog's timeout of every kernel call made in the enclosed block (then the previous one again)."""
    global CALL_TIMEOUT_SECONDS
    previous, CALL_TIMEOUT_SECONDS = CALL_TIMEOUT_SECONDS, float(seconds)
    try:
        yield
    finally:
        CALL_TIMEOUT_SECONDS = previous


def _interpreter_steps() -> int:
    """The TPU interpreter's returned callbacks so far (constant where the compatibility layer is off)."""
    from rpa_harness.interpret_compat.tpu import returned_callbacks

    return returned_callbacks()


def end_too_slow(what: str, seconds: float, slow_timeouts: int, steps: int):
    """Ends the process after a call that was still stepping when its watch ran out: an error of the run
    (``SLOW_EXIT_CODE``), no verdict on the kernel."""
    message = (
        f"rpa-harness: TOO SLOW: {what} was still running after {seconds * slow_timeouts:g} s "
        f"({slow_timeouts} x RPA_CALL_TIMEOUT; the TPU interpreter made {steps} steps in the last "
        f"{seconds:g} s): not a hang, and no verdict on the kernel. Run it on a less loaded machine or "
        "raise RPA_CALL_TIMEOUT."
    )
    message, code = _reported_by(_slow_handler, (message, SLOW_EXIT_CODE), "slow", message)
    if _release_captured_output is not None:
        _release_captured_output()
    sys.stderr.write(f"\n{message}\n")
    sys.stderr.flush()
    os._exit(code)


def end_on_hang(what: str, seconds: float, *, stacks: bool = True):
    """Ends the process after a call taken for a hang: the handler's message (it writes the hang's repro),
    this process's stacks where ``stacks``, then its exit code."""
    default = (f"rpa-harness: {what} did not return within {seconds:g} s (RPA_CALL_TIMEOUT)", HANG_EXIT_CODE)
    message, code = _reported_by(_hang_handler, default, "hang", what, seconds)
    if _release_captured_output is not None:
        _release_captured_output()
    sys.stderr.write(f"\n{message}\n(taken for a hang, e.g. a DMA wait with nothing pending).")
    if stacks:
        sys.stderr.write(" Stacks:\n")
        faulthandler.dump_traceback(all_threads=True)
    sys.stderr.write(f"\n{message}\n")
    sys.stderr.flush()
    os._exit(code)


@contextlib.contextmanager
def watchdog(what: str, seconds: float | None = None, *, slow_timeouts: int = SLOW_CALL_TIMEOUTS):
    """Ends the process if the enclosed call has not returned after ``seconds`` (default RPA_CALL_TIMEOUT)
    in which the TPU interpreter made no step: as a hang. A call that is still stepping is watched for
    another ``seconds``, up to ``slow_timeouts`` in all, then ends the process as too slow."""
    seconds = CALL_TIMEOUT_SECONDS if seconds is None else seconds

    returned = threading.Event()

    def watch():
        steps = _interpreter_steps()
        for _ in range(slow_timeouts):
            if returned.wait(seconds):
                return
            steps, before = _interpreter_steps(), steps
            if steps == before:
                end_on_hang(what, seconds)
        end_too_slow(what, seconds, slow_timeouts, steps - before)

    watcher = threading.Thread(target=watch, name="rpa-harness watchdog", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        returned.set()
