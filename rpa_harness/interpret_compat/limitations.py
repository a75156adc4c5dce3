"""Interpreter limitations the harness recognises by their error: the only errors that mean "cannot run here".

A kernel that raises on valid input has a bug, unless the error is one of these known gaps of the Pallas
interpreters (or of a kernel's TPU-only setup) that say nothing about the kernel's correctness. Each entry
is a regular expression searched in the error's text and the reason reported instead of a failure. Keep
the patterns narrow: an error that matches by accident hides a kernel bug as a skip.
"""

import dataclasses
import re

import jax

from rpa_harness import interpret_compat


@dataclasses.dataclass(frozen=True)
class Limitation:
    # A regular expression searched in "ExceptionType: message" (the whole text, traceback included).
    pattern: str
    reason: str  # what cannot be done, and what to do about it


LIMITATIONS = (
    Limitation(
        r"'ReshapeTransform' object has no attribute 'indices'",
        "the TPU interpreter cannot index a reshaped ref (interpreter gap; --rpa-interpreter-compat=on patches it)",
    ),
    Limitation(
        r"'TypedInt' object has no attribute 'shape'",
        "the generic interpreter cannot bitcast or reshape this ref (interpreter gap; "
        "--rpa-interpreter-compat=on patches it)",
    ),
    Limitation(
        r"Shapes must be 1D sequences of concrete values",
        "the generic interpreter cannot copy a data-dependent size (pl.ds with a traced length; "
        "--rpa-interpreter-compat=on patches local DMAs of that kind); use --rpa-backend=interpret",
    ),
    Limitation(
        r"TPU version must be 4 or higher|Unsupported tpu_version=-1|Unsupported TPU device kind: cpu",
        "the kernel looks up TPU-tuned parameters and needs a TPU for them; declare needs_block_sizes "
        "(and pass vmem_limit_bytes) in RPA_HARNESS_CAPABILITIES, or run on a TPU",
    ),
)


def recognise(error: BaseException) -> str | None:
    """The reason an error means "cannot run on this backend", or None when it is not a known limitation.

    Where the compat layer is installed but could not patch a gap on this jax, the reason names those gaps:
    that, not the kernel, is what to look at.
    """
    text = f"{type(error).__name__}: {error}"
    for limitation in LIMITATIONS:
        if re.search(limitation.pattern, text):
            return limitation.reason + _unpatched_note()
    return None


def _unpatched_note() -> str:
    if not interpret_compat.is_installed():
        return ""
    gaps = interpret_compat.unpatched_gaps()
    if not gaps:
        return ""
    named = "; ".join(f"{gap}: {reason}" for gap, reason in gaps.items())
    return f" [the compat layer could not patch on jax {jax.__version__}: {named}]"
