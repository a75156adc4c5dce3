"""What the checking TPU interpreter finds in a kernel, raised as the harness's own exceptions: a data race,
a deadlock, an exit that would halt a TPU; the interpreter's parameters on the checking backend; and the
state a failed interpreted call leaves behind, cleared so the next call is judged on its own.
"""

import dataclasses
from typing import Any

from jax.experimental.pallas import tpu as pltpu

# The TPU interpreter's parameters on the checking backend (also written into replay's standalone snippet).
CHECKING_INTERPRET_PARAMS = dict(detect_races=True, out_of_bounds_reads="raise", uninitialized_memory="nan")


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
    ``on_race`` and only sets ``races.races_found``, which ``race_flagged_after_call`` reads after the call.
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


def drop_ordered_effect_tokens() -> None:
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


def race_flagged_after_call() -> bool:
    """jax 0.10's verdict: ``races.races_found`` of the last interpreted call (False where jax has none)."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call

    races = getattr(interpret_pallas_call, "races", None)
    return bool(races is not None and getattr(races, "races_found", False))


def finding(error: BaseException) -> AssertionError | None:
    """What the checking interpreter found behind ``error``, as the harness raises it (``RaceDetected``,
    ``Deadlock``, ``WouldHaltTpu``), or None where the error is none of its checks'."""
    for report, kind in (
        (_race_report, RaceDetected),
        (_deadlock_report, Deadlock),
        (_exit_state_report, WouldHaltTpu),
    ):
        if (found := report(error)) is not None:
            return kind(found)
    return None
