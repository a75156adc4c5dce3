"""Run-time compatibility layer for jax's Pallas TPU interpreters.

jax's CPU interpreters cannot run upstream's ragged paged attention kernel: they lack ref views
(reshape/bitcast), check masked stores against the wrong extent, drop scalar-prefetch writes between grid
steps, and so on. This package patches the *interpreters* (never a kernel) so that real TPU kernels run on
CPU with the interpreters' own checks (out-of-bounds detection, race detection, NaN-poisoned memory) still
in force.

Each gap is decided on the running jax, not by its version string: a probe runs (or inspects) the
unpatched internals and says whether the gap exists, and a structural check says whether the internals the
patch replaces are the ones it was written against. A gap jax has closed is left alone; a gap whose
internals moved stays unpatched, with one warning naming it and the jax version, and is reported by
``unpatched_gaps()`` so that the harness can say why a target cannot run.

- ``views``: the pure-NumPy view algebra (TPU bitcast layout, reads and writes through view chains).
- ``tpu``: the TPU interpreter's gaps (``tpu-ref-views``, ``tpu-masked-swap``, ``tpu-race-history``,
  ``tpu-callback-arguments``, ``tpu-clock-order``, ``tpu-deadlock``, ``tpu-empty-copy-at-end``,
  ``tpu-wait-for-nothing``, ``tpu-empty-access-race``, ``tpu-exit-state``).
- ``generic``: the generic interpreter's gaps (``generic-literal-indices``, ``generic-view-stores``,
  ``generic-scalar-prefetch-state``, ``generic-narrow-float-bits``, ``generic-dynamic-size-copies``,
  ``generic-memory-space-operands``, ``generic-clamped-reads``).
- ``products``: float32 products at DEFAULT precision computed as a TPU does (one bfloat16 pass) while a
  TPU generation is emulated (``tpu-default-precision-products``, ``generic-default-precision-products``).
- ``limitations``: the interpreter limitations the harness recognises by their error, the only errors on
  valid input that mean "cannot run here" rather than a kernel bug.

Importing this package imports no private jax module; ``install()`` does. Install before tracing: the
interpreters bind the patched functions when a kernel is traced, so ``install`` and ``uninstall`` clear
jax's caches when they change anything.
"""

from __future__ import annotations

import dataclasses
import threading
import warnings

import jax

from rpa_harness.interpret_compat.views import tpu_bitcast

__all__ = [
    "GapStatus",
    "gap_statuses",
    "install",
    "is_installed",
    "tpu_bitcast",
    "uninstall",
    "unpatched_gaps",
]

PATCHED = "patched"
"""The gap exists on this jax and its patch applies (applied while the layer is installed)."""
CLOSED = "closed by jax"
"""This jax no longer has the gap: nothing to patch."""
UNPATCHED = "unpatched"
"""The gap may exist but its patch cannot be applied: the internals it replaces moved."""


@dataclasses.dataclass(frozen=True)
class GapStatus:
    gap: str
    interpreter: str
    state: str
    reason: str


_lock = threading.Lock()
_statuses: dict[str, GapStatus] | None = None
_applied: list = []
_installed = False


def _gaps() -> tuple:
    from rpa_harness.interpret_compat import generic, products, tpu

    return (*tpu.GAPS, *generic.GAPS, products.TPU_PRODUCTS, products.GENERIC_PRODUCTS)


def _survey(gap) -> GapStatus:
    """Probe ``gap`` on the unpatched interpreters and check the internals its patch replaces."""
    try:
        if not gap.probe():
            return GapStatus(
                gap.name, gap.interpreter, CLOSED, f"jax {jax.__version__} has no gap {gap.name}"
            )
        gap.check_internals()
    except Exception as error:  # noqa: BLE001 - whatever moved, the gap stays unpatched with the reason
        reason = (
            f"interpret_compat cannot patch gap {gap.name} ({gap.symptom}) on jax {jax.__version__}: "
            f"the interpreter internals it replaces moved ({type(error).__name__}: {error})"
        )
        return GapStatus(gap.name, gap.interpreter, UNPATCHED, reason)
    return GapStatus(gap.name, gap.interpreter, PATCHED, f"{gap.symptom}; patched")


def _surveyed() -> dict[str, GapStatus]:
    """Every gap's status on this jax, probed once per process before any patch is applied."""
    global _statuses
    if _statuses is None:
        if _applied:
            raise RuntimeError("interpret_compat: gaps must be probed before the patches are applied")
        statuses = {gap.name: _survey(gap) for gap in _gaps()}
        jax.clear_caches()
        for status in statuses.values():
            if status.state == UNPATCHED:
                warnings.warn(status.reason, stacklevel=4)
        _statuses = statuses
    return _statuses


def gap_statuses() -> dict[str, GapStatus]:
    """Every gap the layer knows, with whether it is patched, closed by jax or unpatched on this jax."""
    with _lock:
        return dict(_surveyed())


def unpatched_gaps(interpreter: str | None = None) -> dict[str, str]:
    """{gap: reason} for the gaps this jax may have that the layer cannot patch (empty when all is well).

    ``interpreter`` ("tpu" or "generic") keeps the gaps of that interpreter only.
    """
    if interpreter not in (None, "tpu", "generic"):
        raise ValueError(f"interpreter={interpreter!r}: use 'tpu', 'generic' or None (both).")
    return {
        name: status.reason
        for name, status in gap_statuses().items()
        if status.state == UNPATCHED and interpreter in (None, status.interpreter)
    }


def is_installed() -> bool:
    """Whether the layer is installed (its applicable patches applied)."""
    return _installed


def install() -> bool:
    """Apply every applicable patch (idempotent). Returns whether no gap is left unpatched.

    Gaps whose internals moved stay unpatched (one warning each, the first time); the others are patched.
    """
    global _installed
    with _lock:
        statuses = _surveyed()
        if not _installed:
            for gap in _gaps():
                if statuses[gap.name].state != PATCHED:
                    continue
                for patch in gap.patches():  # built one gap at a time: later gaps may wrap earlier ones
                    patch.apply()
                    _applied.append(patch)
            _installed = True
            jax.clear_caches()
        return all(status.state != UNPATCHED for status in statuses.values())


def uninstall() -> None:
    """Restore the interpreters' original functions (no-op when not installed)."""
    global _installed
    with _lock:
        if not _installed:
            return
        for patch in reversed(_applied):
            patch.revert()
        _applied.clear()
        _installed = False
        jax.clear_caches()
