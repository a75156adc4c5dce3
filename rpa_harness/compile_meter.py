"""The seconds jax spends tracing, lowering and compiling, charged to the thread that spends them.

``backends.count_compilations`` counts a whole process. The chip owner runs kernel calls on the chip in one
thread while other threads compile the signatures the next calls need (``chip_owner``), so a count per
process cannot say whether a call waited for a compilation: ``metered`` charges each of jax's compile
events to the block, on its own thread, that caused it. jax reports these events on the thread that
compiles (its listeners are called synchronously there).
"""

import contextlib
import threading

import jax

# jax's compile events and the names the harness counts them by (here and in ``backends.compilation_stats``).
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
