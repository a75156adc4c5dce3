"""Compilation: jax's persistent compilation cache, the CPU compiler's flags and BLAS threads a process
starts with, and what a process (``count_compilations``) or a block on one thread (``metered``) compiled.

The count per process is what a run reports. The chip owner runs kernel calls on the chip in one thread
while other threads compile the signatures the next calls need (``owner``), so a count per process cannot
say whether a call waited for a compilation: ``metered`` charges each of jax's compile events to the block,
on its own thread, that caused it. jax reports these events on the thread that compiles (its listeners are
called synchronously there).
"""

import collections
import contextlib
import os
import threading
from pathlib import Path

import jax

# jax's compile events and the names the harness counts them by (per block here, per process in
# ``compilation_stats``).
COMPILE_EVENTS = {
    "/jax/core/compile/jaxpr_trace_duration": "trace_seconds",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_seconds",
    "/jax/core/compile/backend_compile_duration": "compile_seconds",
}
_local = threading.local()
_registered = False
_registering = threading.Lock()


class Meter(dict):
    """What one block compiled: seconds tracing, lowering and compiling, and the executables compiled."""

    def __init__(self):
        super().__init__(dict.fromkeys(COMPILE_EVENTS.values(), 0.0), executables=0)

    @property
    def seconds(self) -> float:
        return sum(self[name] for name in COMPILE_EVENTS.values())


def _on_duration(event, duration_secs, **_):  # jax's listener protocol names the parameters
    meter = getattr(_local, "meter", None)
    if meter is None or event not in COMPILE_EVENTS:
        return
    meter[COMPILE_EVENTS[event]] += duration_secs
    if COMPILE_EVENTS[event] == "compile_seconds":
        meter["executables"] += 1


def _register_once() -> None:
    global _registered
    with _registering:
        if not _registered:
            jax.monitoring.register_event_duration_secs_listener(_on_duration)
            _registered = True


@contextlib.contextmanager
def metered():
    """``with metered() as meter``: ``meter`` holds what this thread compiled within the block."""
    _register_once()
    outer, meter = getattr(_local, "meter", None), Meter()
    _local.meter = meter
    try:
        yield meter
    finally:
        _local.meter = outer
        if outer is not None:  # a nested block's compilations are the enclosing block's too
            for name, value in meter.items():
                outer[name] += value


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
