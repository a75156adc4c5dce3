"""The checks behind every property, shared by the pytest properties and ``rpa-harness replay``.

Each check takes concrete inputs (NumPy arrays and keyword options), runs the target on a backend and
raises ``PropertyFailure`` with the report a kernel developer reads; it returns quietly when it holds.
"""

import dataclasses

import numpy as np

import reference
from harness.backends import Backend
from harness.targets import Target, first_line_of_error

DIFFERENTIAL = "differential"
VALIDATION = "validation"
PADDING = "padding-isolation"
DETERMINISM = "determinism"


class PropertyFailure(AssertionError):
    """A property does not hold; ``str()`` is the report."""


def check_differential(target: Target, backend: Backend, arrays: dict, options: dict):
    """The target's output matches the float64 oracle within the tolerance model of its precision
    contract (``target.precision``), on valid rows."""
    actual = run_valid(target, backend, arrays, options)
    expected = reference.oracle(**arrays, **options)
    comparison = reference.compare(
        actual, expected, label=f"{target.name} on {backend.name}", precision=target.precision
    )
    if not comparison.ok:
        raise PropertyFailure(str(comparison))
    return comparison


def run_valid(target: Target, backend: Backend, arrays: dict, options: dict) -> np.ndarray:
    """Runs the target on valid inputs: any exception (an out-of-bounds read, a race) is a failure."""
    try:
        return backend.run(target.attention, arrays, options)
    except Exception as error:
        raise PropertyFailure(
            f"{target.name} on {backend.name} raised on valid inputs: {first_line_of_error(error)}"
        ) from None


def check_validation(
    target: Target, backend: Backend, arrays: dict, options: dict, stage: str, expected: str
):
    """The target raises ValueError(expected): static rules from the kernel call, dynamic ones from the validator."""
    if stage == "static":
        call = lambda: backend.run(target.attention, arrays, options)  # noqa: E731
        where = "ragged_paged_attention"
    else:
        call = lambda: target.validate(arrays, options)  # noqa: E731
        where = "dynamic_validate_inputs"
    try:
        call()
    except ValueError as error:
        if str(error) != expected:
            raise PropertyFailure(
                f"{where} raised ValueError with the wrong message.\n  expected: {expected}\n  got:      {error}"
            ) from None
        return
    except Exception as error:
        raise PropertyFailure(
            f"{where} raised {first_line_of_error(error)}\n  expected: ValueError: {expected}"
        ) from None
    raise PropertyFailure(f"{where} accepted the input.\n  expected: ValueError: {expected}")


def valid_rows(arrays: dict) -> np.ndarray:
    """Query rows that belong to a live sequence (the rest of the output is unspecified)."""
    total = int(arrays["cu_q_lens"][int(arrays["num_seqs"][0])])
    return np.arange(total)


def check_same_bits(first: np.ndarray, second: np.ndarray, rows: np.ndarray, what: str) -> None:
    """Two outputs agree bit for bit on the given rows."""
    a, b = first[rows], second[rows]
    same = (a.view(f"u{a.dtype.itemsize}") == b.view(f"u{b.dtype.itemsize}")) if a.size else np.ones(0, bool)
    if not same.all():
        token, head, dim = np.argwhere(~same)[0]
        raise PropertyFailure(
            f"{what}: {int((~same).sum())} of {same.size} valid output elements differ; first at row "
            f"{int(rows[token])}, head {head}, dim {dim}: {a[token, head, dim]!r} vs {b[token, head, dim]!r}"
        )


def check_padding_isolation(target: Target, backend: Backend, case) -> None:
    """Valid rows are bit-identical with clean padding and with NaN pages/tails/rows and garbage metadata."""
    clean = dataclasses.replace(case, poison=False, garbage=False).arrays()
    dirty = dataclasses.replace(case, poison=True, garbage=True).arrays()
    check_same_bits(
        run_valid(target, backend, clean, case.options()),
        run_valid(target, backend, dirty, case.options()),
        valid_rows(clean),
        "padding changed the output (clean padding vs NaN pages/tails/rows and garbage metadata)",
    )


def check_determinism(target: Target, backend: Backend, arrays: dict, options: dict) -> None:
    first = run_valid(target, backend, arrays, options)
    check_same_bits(
        first, run_valid(target, backend, arrays, options), valid_rows(arrays), "two identical calls"
    )


def recheck(kind: str, target: Target, backend: Backend, repro) -> None:
    """Re-runs the property a repro was written for (raises PropertyFailure while it still fails)."""
    if kind.startswith(DIFFERENTIAL):
        check_differential(target, backend, repro.arrays, repro.options)
    elif kind == VALIDATION:
        check_validation(target, backend, repro.arrays, repro.options, repro.stage, repro.expected_error)
    elif kind == PADDING:
        check_padding_isolation(target, backend, repro.case)
    elif kind == DETERMINISM:
        check_determinism(target, backend, repro.arrays, repro.options)
    else:
        raise ValueError(f"unknown property {kind!r} in repro")
