"""Where a kernel runs: the checking TPU interpreter, the fast generic interpreter, or a real TPU.

``interpret`` simulates HBM/VMEM/SMEM, DMAs and semaphores: out-of-bounds reads raise, scratch starts as
NaN, races are detected and asserted. ``fast-interpret`` is the generic HLO interpreter: 50-200x faster,
checks nothing; it carries the volume of examples. ``tpu`` compiles for the TPU the process sees.
"""

import collections
import contextlib
import dataclasses
import faulthandler
import functools
import os
import sys
import threading
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from rpa_harness import generations, lowering
from rpa_harness.compile_meter import COMPILE_EVENTS

INTERPRET = "interpret"
FAST_INTERPRET = "fast-interpret"
TPU = "tpu"
AUTO = "auto"
BACKENDS = (INTERPRET, FAST_INTERPRET, TPU)
# Not a place a kernel runs, and no --rpa-backend choice: the TPU compiler on this host, compiling for one
# generation (rpa_harness.ahead_of_time). The compile property's backend, named in its repros.
TPU_COMPILER = "tpu-compiler"


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

# The TPU interpreter's parameters on the checking backend (also written into replay's standalone snippet).
CHECKING_INTERPRET_PARAMS = dict(detect_races=True, out_of_bounds_reads="raise", uninitialized_memory="nan")

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


# A process's first kernel call on a chip is preceded by a known-good call (``known_good_call``): a process
# killed in a call, or a kernel of an earlier process that left a DMA running, can leave the chip faulted,
# and the next process's first call then halts whatever its case. Failing there, the process ends before any
# example is in flight (no case is blamed, no repro written) with this status and a message that says so.
CHIP_FAULTED_EXIT_CODE = 73
CHIP_FAULTED = "CHIP FAULTED BEFORE THE FIRST EXAMPLE"
_chip_checked = False


def _copy_and_add_one(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1.0


def known_good_call() -> None:
    """A small Pallas kernel whose inputs and output are copied by DMA (the engine a faulted chip fails in),
    checked for its value: it runs right on every TPU."""
    x = jnp.arange(8 * 128, dtype=jnp.float32).reshape(8, 128)
    out = pl.pallas_call(_copy_and_add_one, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x)
    if not np.array_equal(np.asarray(out), np.asarray(x) + 1.0):
        raise RuntimeError("the known-good call returned a wrong value: the chip computes wrongly")


def on_a_real_chip() -> bool:
    """Whether the default device is a TPU: its platform, which neither an emulated generation nor a test's
    simulated device kind changes."""
    return jax.devices()[0].platform == "tpu"


def check_the_chip_once() -> None:
    """The known-good call, once a process, before its first kernel call on a chip; a chip that fails it
    ends the process (``CHIP_FAULTED_EXIT_CODE``) before an example is blamed."""
    global _chip_checked
    if _chip_checked or not on_a_real_chip():
        return
    try:
        known_good_call()
    except Exception as error:
        reason = halt_report(error) or f"{type(error).__name__}: {str(error).strip().splitlines()[0]}"
        if _release_captured_output is not None:
            _release_captured_output()
        sys.stderr.write(
            f"\nrpa-harness: {CHIP_FAULTED}: a known-good call on the chip raised {reason}\n(the chip was faulted "
            "before this process ran any example, e.g. by a process killed in a call: no case is blamed; a "
            "fresh process starts on a fresh chip)\n"
        )
        sys.stderr.flush()
        os._exit(CHIP_FAULTED_EXIT_CODE)
    _chip_checked = True


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


# jax's persistent compilation cache: compiled executables on disk, reused by later processes (CI restores the
# folder between runs). Executables with host callbacks are never written (jax's rule): that is every kernel
# on the TPU interpreter, whose simulated memory is Python callbacks; the fast interpreter's kernels and
# the harness's other jitted functions are.
COMPILATION_CACHE_ENV = "RPA_COMPILATION_CACHE"
DEFAULT_COMPILATION_CACHE = ".jax-compilation-cache"
COMPILATION_CACHE_OFF = ("", "off", "none", "0")
# Every executable jax may write is written. jax's own threshold (1 s) would leave out most interpreted
# kernels (0.2-1 s each here), and even the 10-30 ms compilations of single operations pay: jax looks each
# one up in the cache anyway, and code run op by op (tpu-inference's reference) compiles hundreds of them
# (tests/targets/test_v3_target.py's reference agreement: 18.7 s warm with a 0.05 s threshold, 7.9 s without).
CACHE_MIN_COMPILE_SECONDS = 0.0


# A BLAS library reads its thread count once, when it loads, so the count is set in the environment the
# worker processes start with. Left to OpenBLAS's default (a thread per core), two workers on two cores
# oversubscribe them: the fast interpreter's pooled property runs at half the examples per minute, the CPU
# spent per example doubled (benchmarks/bench_harness.py --blas-threads).
BLAS_THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "OMP_NUM_THREADS")


def one_blas_thread_per_worker(environ) -> dict:
    """``environ`` (a mapping) with one BLAS thread wherever the user has not chosen a count."""
    return {**{name: "1" for name in BLAS_THREAD_VARIABLES}, **environ}


# XLA's CPU compiler settings that compile the interpreters' programs faster and leave every output bit
# the same, per jaxlib (major, minor) where that was measured: flag -> (the harness's value, XLA's default).
# jaxlib 0.10's CPU compiler emits each fusion through its newer fusion emitters by default; with its
# elemental emitters a first pass over new kernels (mostly compilation) takes 22-49% less CPU time
# (benchmarks/bench_cpu_compiler.py: TPU interpreter and fast interpreter, the same bits for every
# output). Only where measured: XLA ends the process on a flag it does not know, and jaxlib 0.12 no longer
# knows this one.
FASTER_CPU_COMPILATION = {(0, 10): {"xla_cpu_use_fusion_emitters": ("false", "true")}}


def faster_cpu_compilation_flags() -> dict[str, tuple[str, str]]:
    """This jaxlib's entry of FASTER_CPU_COMPILATION (empty where none was measured)."""
    import jaxlib

    major, minor = jaxlib.__version__.split(".")[:2]
    return FASTER_CPU_COMPILATION.get((int(major), int(minor)), {})


def faster_cpu_compilation(environ) -> dict:
    """``environ`` (a mapping) with XLA_FLAGS extended by this jaxlib's faster-compilation flags, each only
    where the user's XLA_FLAGS do not set it already. XLA reads XLA_FLAGS once, when jax first initialises
    a backend: this process only if nothing has computed yet, and every process started from ``environ``."""
    flags = environ.get("XLA_FLAGS", "")
    chosen = {word.lstrip("-").split("=", 1)[0] for word in flags.split()}
    added = [
        f"--{flag}={value}"
        for flag, (value, _) in faster_cpu_compilation_flags().items()
        if flag not in chosen
    ]
    if not added:
        return dict(environ)
    return {**environ, "XLA_FLAGS": " ".join([*flags.split(), *added])}


def compilation_cache_setting(value: str | None = None) -> Path | None:
    """The cache folder a setting names (default: RPA_COMPILATION_CACHE, else DEFAULT_COMPILATION_CACHE);
    None when it is off."""
    value = os.environ.get(COMPILATION_CACHE_ENV, DEFAULT_COMPILATION_CACHE) if value is None else value
    return None if value.strip().lower() in COMPILATION_CACHE_OFF else Path(value)


def enable_compilation_cache(path) -> None:
    """Makes jax read and write compiled executables in ``path``; call it before the first compilation
    (jax decides once per process whether the cache is used)."""
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", CACHE_MIN_COMPILE_SECONDS)


_CACHE_EVENTS = {
    "/jax/compilation_cache/compile_requests_use_cache": "cache_requests",
    "/jax/compilation_cache/cache_hits": "cache_hits",
    "/jax/compilation_cache/cache_misses": "cache_writes",  # jax counts a miss when it writes the entry
}
_compilation_stats: collections.Counter | None = None


def count_compilations() -> None:
    """Starts counting this process's compilations and cache use (idempotent); read ``compilation_stats()``."""
    global _compilation_stats
    if _compilation_stats is not None:
        return
    _compilation_stats = collections.Counter()

    def on_duration(event, duration_secs, **_):  # jax's listener protocol names the parameters
        if event in COMPILE_EVENTS:
            _compilation_stats[COMPILE_EVENTS[event]] += duration_secs
            if event == "/jax/core/compile/backend_compile_duration":
                _compilation_stats["compilations"] += 1

    def on_event(event, **_):
        if event in _CACHE_EVENTS:
            _compilation_stats[_CACHE_EVENTS[event]] += 1

    jax.monitoring.register_event_duration_secs_listener(on_duration)
    jax.monitoring.register_event_listener(on_event)


def compilation_stats() -> dict:
    """Compilations since ``count_compilations()``: how many, seconds tracing / lowering / compiling (a cache
    hit counts as a compilation that took its read time), and cache requests, hits and entries written; a
    request that is neither a hit nor written was not cacheable (host callbacks) or compiled too fast."""
    stats = dict.fromkeys(("compilations", *COMPILE_EVENTS.values(), *_CACHE_EVENTS.values()), 0)
    stats.update(_compilation_stats or {})
    stats["cache_not_written"] = stats["cache_requests"] - stats["cache_hits"] - stats["cache_writes"]
    return stats


class RaceDetected(AssertionError):
    """The TPU interpreter saw a data race (e.g. a VMEM buffer read while a DMA still writes it)."""


class Deadlock(AssertionError):
    """The TPU interpreter saw a wait nothing can signal: on a TPU the call would never return."""


class WouldHaltTpu(AssertionError):
    """The TPU interpreter saw the kernel end with a DMA never waited or a semaphore count left: a TPU
    halts on that (RuntimeUnexpectedCoreHalt), in the call or the next one."""


# What a kernel that ends so does on a chip, as the failure says it (its kind, and known issues' symptoms).
WOULD_HALT_A_TPU = "would halt a TPU"


# How jax's race detector words a race, in the exception it raises (jax >= 0.11, ``on_race="raise"``).
_RACE_MESSAGE = "RACE DETECTED"


def checking_interpret_params() -> pltpu.InterpretParams:
    """The TPU interpreter as the ``interpret`` backend runs it: every check on, races raise.

    jax >= 0.11 raises a race inside the interpreter's callback when ``on_race="raise"``; jax 0.10 has no
    ``on_race`` and only sets ``races.races_found``, which ``Backend.run`` reads after the call.
    """
    options: dict[str, Any] = dict(CHECKING_INTERPRET_PARAMS)
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


def _interpreter_report(error: BaseException, marker: str, what: str) -> str | None:
    """The first line of one of the compat layer's checks (its message starting ``marker``) in ``error``,
    as "the TPU interpreter found WHAT: ...", or None where the error is not that check's."""
    text = str(error)
    start = text.find(marker)
    if start < 0:
        return None
    return f"the TPU interpreter found {what}: " + text[start:].splitlines()[0].removeprefix(marker).strip()


def _deadlock_report(error: BaseException) -> str | None:
    """The deadlock check's account (``interpret_compat`` gap tpu-deadlock), or None if not a deadlock."""
    from rpa_harness.interpret_compat.tpu import DEADLOCK_MESSAGE

    return _interpreter_report(error, DEADLOCK_MESSAGE, "a deadlock in the kernel")


def _exit_state_report(error: BaseException) -> str | None:
    """The exit check's account (``interpret_compat`` gap tpu-exit-state), or None if the error is not its."""
    from rpa_harness.interpret_compat.tpu import WOULD_HALT_MESSAGE

    return _interpreter_report(error, WOULD_HALT_MESSAGE, f"that the kernel {WOULD_HALT_A_TPU}")


def _drop_ordered_effect_tokens() -> None:
    """Forgets this thread's ordered-effect tokens, so that the next call starts on a fresh one.

    The TPU interpreter orders each kernel call with ordered io_callbacks at its start and end; jax threads
    one token through every computation with such effects. A call that fails in between can leave its error
    in that token, and on jax 0.10.2 the next interpreted call then fails with the same error without
    running (upstream's kernel, after an exit that would halt a TPU: every later call of its configuration
    "failed" the same way, so a shrinker would shrink onto passing cases)."""
    from jax._src import dispatch

    tokens = getattr(dispatch, "runtime_tokens", None)
    if tokens is not None:
        tokens.clear()


def _race_flagged_after_call() -> bool:
    """jax 0.10's verdict: ``races.races_found`` of the last interpreted call (False where jax has none)."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call

    races = getattr(interpret_pallas_call, "races", None)
    return bool(races is not None and getattr(races, "races_found", False))


# Whether a TPU is present is asked in one of two ways. A process that runs kernels (an xdist worker, or a run
# without workers) asks jax directly, which opens the chips: it is the process that will use them. The xdist
# controller runs no kernel and must leave the chips closed, since libtpu lets one process open a chip and
# the workers it starts need it: it asks a short-lived child process, which opens the chips, prints what it
# saw and exits (releasing them) before any worker starts. A child rather than a guess from the environment
# (PCI ids, /dev/accel*): it answers with jax's own verdict, so a chip jax cannot open is no chip.
# Without libtpu, jax can see no TPU, and no child is started (a CPU machine pays nothing).
TPU_PROBE_ENV = "RPA_TPU_PROBE"  # "none" or "KIND:COUNT" (e.g. "TPU v5 lite:1"): the answer, without asking
PROBE_SECONDS = 300.0
_PROBE_PROGRAM = """
import json, jax
try:
    devices = jax.devices("tpu")
except RuntimeError:
    devices = []
print(json.dumps({"count": len(devices), "kinds": sorted({d.device_kind for d in devices})}))
"""


@dataclasses.dataclass(frozen=True)
class Tpus:
    """The TPU devices a process sees: how many, and their kind as jax names it (e.g. "TPU v5 lite")."""

    count: int = 0
    kind: str = ""

    def __bool__(self) -> bool:
        return self.count > 0


class TpuProbeError(RuntimeError):
    """The child process that looks for TPUs did not answer; the message says why and what to do."""


_keep_off_the_chips = False


def keep_off_the_chips() -> None:
    """Marks this process as one that runs no kernel (the xdist controller): it asks a child process whether
    a TPU is present, and computes on the CPU if anything (a target computing at import) initialises jax,
    so that it never holds a chip its workers need."""
    global _keep_off_the_chips
    _keep_off_the_chips = True
    jax.config.update("jax_platforms", "cpu")
    tpus.cache_clear()


def _stated_tpus(answer: str) -> Tpus:
    if answer.strip().lower() in ("", "none", "0"):
        return Tpus()
    kind, _, count = answer.rpartition(":")
    if not kind or not count.strip().isdigit():
        raise TpuProbeError(
            f"{TPU_PROBE_ENV}={answer!r} is not 'none' or KIND:COUNT (e.g. 'TPU v5 lite:1'); "
            "unset it to ask jax"
        )
    return Tpus(int(count), kind.strip())


def _libtpu_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("libtpu") is not None or bool(os.environ.get("TPU_LIBRARY_PATH"))


def _probe_in_a_child() -> Tpus:
    import json
    import subprocess

    try:
        done = subprocess.run(
            [sys.executable, "-c", _PROBE_PROGRAM], capture_output=True, text=True, timeout=PROBE_SECONDS
        )
    except subprocess.TimeoutExpired:
        raise TpuProbeError(
            f"the child process asking jax for TPUs did not answer within {PROBE_SECONDS:g} s; check that no "
            f"other process holds the chips, or set {TPU_PROBE_ENV}=KIND:COUNT"
        ) from None
    try:
        seen = json.loads(done.stdout.strip().splitlines()[-1])
        return Tpus(seen["count"], ", ".join(seen["kinds"]))
    except (IndexError, ValueError, KeyError):
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise TpuProbeError(
            f"the child process asking jax for TPUs exited {done.returncode} without an answer ({last}); "
            f"run {sys.executable} -c 'import jax; print(jax.devices())' to see why"
        ) from None


@functools.cache
def tpus() -> Tpus:
    """The TPUs this process may use: from TPU_PROBE_ENV when set, else asked of jax (here, or in a child
    process where this process keeps off the chips)."""
    if TPU_PROBE_ENV in os.environ:
        return _stated_tpus(os.environ[TPU_PROBE_ENV])
    if not _libtpu_installed():
        return Tpus()
    if _keep_off_the_chips:
        return _probe_in_a_child()
    try:
        devices = jax.devices("tpu")
    except RuntimeError:
        return Tpus()
    return Tpus(len(devices), ", ".join(sorted({device.device_kind for device in devices})))


def tpu_available() -> bool:
    return bool(tpus())


def chip_generation() -> str:
    """The generation of the chip this process's kernel calls run on (``tpus``: as the process that holds it
    names it, its own or a chip owner's), or ``none``."""
    return lowering.generation_of_device_kind(tpus().kind) or generations.NONE


def chip_in_words() -> str:
    """That chip as the compile property names a generation: "v5e (TPU v5 lite)"."""
    return f"{chip_generation()} ({tpus().kind})"


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
        present = tpu_available()
    except TpuProbeError as error:
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
            return chip_generation()
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
        with pltpu.force_tpu_interpret_mode(params), generations.emulated(self.generation):
            try:
                yield
            except BaseException:
                if self.name == INTERPRET:
                    pltpu.reset_tpu_interpret_mode_state()
                    _drop_ordered_effect_tokens()
                raise

    @contextlib.contextmanager
    def guarded(self, what: str):
        """Kernel calls made in the enclosed block as every tool makes them here: on a chip, the known-good
        call first (once a process); the backend's context; the watchdog (a hang ends the process); and a
        halted device ends the process (``end_on_halt``). ``what`` names the call in those messages."""
        if self.name == TPU:  # with no case's handlers: a hang or halt here is not the case's
            with on_hang(None), on_halt(None), watchdog("the known-good call on the chip"):
                check_the_chip_once()
        try:
            with self.context(), watchdog(what):
                yield
        except Exception as error:
            if (halted := halt_report(error)) is not None:
                end_on_halt(what, halted)
            raise

    def run(self, fn, *args, **kwargs):
        """Calls ``fn`` on this backend and returns its output as NumPy (an array, or a tuple of them for a
        kernel with several outputs); races, deadlocks and an exit that would halt a TPU raise. Where a chip
        owner makes this process's kernel calls (``rpa_harness.chip_owner``), it makes this one."""
        from rpa_harness import chip_owner

        if chip_owner.address() is not None:
            return chip_owner.call(self, fn, args, kwargs)
        try:
            with self.guarded(f"a kernel call on {self.name}"):
                out = jax.tree.map(np.asarray, jax.block_until_ready(fn(*args, **kwargs)))
        except Exception as error:
            if self.name == INTERPRET:
                if (report := _race_report(error)) is not None:
                    raise RaceDetected(report) from error
                if (report := _deadlock_report(error)) is not None:
                    raise Deadlock(report) from error
                if (report := _exit_state_report(error)) is not None:
                    raise WouldHaltTpu(report) from error
            raise
        if self.name == INTERPRET and _race_flagged_after_call():
            raise RaceDetected("the TPU interpreter detected a data race in the kernel (races.races_found)")
        return out
