"""The failures a property raises, one class per kind, and where a numeric one shows (the longest
context of the sequences it shows in).

Below the checks and the targets alike: a target's own property (v3's both outputs judged) raises the same
failures as the generic ones, so that a report, a repro and Hypothesis tell them apart the same way.
"""

import dataclasses
import functools

import numpy as np

from rpa_harness import device
from rpa_harness.reference.tolerance import BF16_MATMUL


class PropertyFailure(AssertionError):
    """A property does not hold; ``str()`` is the report.

    Its class is its identity: Hypothesis tells failures apart by exception type (and raise site), shrinks
    each apart and reports each, so every kind of failure has a class of its own (``kind`` says it in
    words), and a numeric failure's class also says past which of ``CONTEXT_BOUNDARIES`` the longest
    context it shows in lies (``located``): a long-context failure neither shrinks into, nor hides behind,
    a short-context failure of the same kind."""

    kind = "the property does not hold"


class OverTheBound(PropertyFailure):
    """Finite outputs off the float64 oracle by more than the tolerance model allows."""

    kind = "outputs over the bound"


class NonFiniteOutput(PropertyFailure):
    """NaN or Inf in rows some sequence owns."""

    kind = "non-finite outputs"


class WrongOutputLayout(PropertyFailure):
    """An output of another shape or dtype than the specification's."""

    kind = "wrong output shape or dtype"


class RaisedOnValidInput(PropertyFailure):
    """The target raised on valid input: a failure like any other, with the exception kept for replay."""

    kind = "raised on valid input"

    def __init__(self, report: str, error_type: str = "", error_message: str = ""):
        super().__init__(report)
        self.error_type, self.error_message = error_type, error_message


class OutputsDiffer(PropertyFailure):
    """Two runs that must agree bit for bit (padding isolation, determinism) do not."""

    kind = "outputs differ bit for bit"


@dataclasses.dataclass(frozen=True)
class StricterSince:
    """A check a release made stricter, named in the failures it raises: a target whose declaration was
    written against an earlier release, and passed then, reads which release changed the judge, the
    CHANGELOG.md entry that explains it, and what to declare or change."""

    version: str  # the release; CHANGELOG.md's entry of that version says it under "Stricter"
    change: str  # what the harness now reports that it did not
    remedy: str  # what a target declares or changes

    def note(self) -> str:
        """The line a failure of the check ends with."""
        return (
            f"\n  stricter since rpa-harness {self.version} (CHANGELOG.md, [{self.version}]): {self.change}; "
            f"{self.remedy}"
        )


EXIT_STATE_CHECK = StricterSince(
    "0.5.0",
    "the checking interpreter fails a kernel that ends with a DMA never waited for or a semaphore count "
    "left (it passed before: no output is wrong, but a TPU halts on that exit)",
    "wait for every copy the kernel starts (an empty batch's too), or, while it cannot be fixed, declare the "
    "case a known issue of the target (docs/known-issues.md)",
)
PRODUCTS_ON_TPU_GENERATIONS = StricterSince(
    "0.4.0",
    "an interpreter emulating a TPU generation multiplies float32 operands at DEFAULT precision in one "
    "bfloat16 pass, as the chip's MXU does (before, exactly)",
    "a kernel whose float32 products pass DEFAULT or no precision declares RPA_HARNESS_PRODUCT_PRECISION = "
    '"default" (then judged with bf16-matmul on a TPU generation); one that promises float32 passes '
    "precision=HIGHEST",
)


class WouldHaltATpu(PropertyFailure):
    """The checking TPU interpreter saw the kernel end with a DMA never waited or a semaphore count left
    (``device.WouldHaltTpu``): no output is wrong, but a chip halts on that exit."""

    kind = device.WOULD_HALT_A_TPU


class WrongRejection(PropertyFailure):
    """An invalid input accepted, or rejected with another exception or message than the specified one."""

    kind = "invalid input not rejected as specified"


class CacheMismatch(PropertyFailure):
    """The updated cache a target returns is not the expected one; ``str()`` says which slots and whose.
    ``slots`` is the bool [pages, page_size] map of the slots that differ, ``stale`` whether each still
    holds the value it had before the call (None where the cache's shape or dtype is wrong)."""

    kind = "returned cache differs from the expected one"

    def __init__(self, message: str, slots: np.ndarray | None = None, stale: np.ndarray | None = None):
        super().__init__(message)
        self.slots, self.stale = slots, stale


class DoesNotCompile(PropertyFailure):
    """The TPU compiler refuses a valid configuration for a generation (Mosaic's tiling or lowering rules):
    the chip cannot run what the interpreters run."""

    kind = "does not compile for the chip"


class NeedsMoreVmem(DoesNotCompile):
    """The kernel's buffers for a valid configuration exceed the chip's scoped VMEM limit."""

    kind = "needs more VMEM than the chip's scoped limit"


class NeedsMoreSmem(DoesNotCompile):
    """The kernel's scalar operands (e.g. a page table prefetched whole) exceed the chip's SMEM."""

    kind = "needs more SMEM than the chip has"


# Context lengths past which narrow integer arithmetic (int16, uint16 positions) breaks.
CONTEXT_BOUNDARIES = (1 << 15, 1 << 16)


@functools.cache
def _past(kind: type[PropertyFailure], boundary: int) -> type:
    name = f"{kind.__name__}Past2To{boundary.bit_length() - 1}Keys"
    words = f"{kind.kind}, in a context past 2^{boundary.bit_length() - 1} keys"
    return type(name, (kind,), {"kind": words, "__module__": __name__, "__qualname__": name})


def located(kind: type[PropertyFailure], kv_lens) -> type:
    """``kind`` for a failure that shows in sequences of these ``kv_lens``: a subclass per boundary of
    ``CONTEXT_BOUNDARIES`` the longest of them passes (made once per kind and boundary), else ``kind``."""
    longest = max((int(kv) for kv in kv_lens), default=0)
    passed = [boundary for boundary in CONTEXT_BOUNDARIES if longest > boundary]
    # mypy does not see a class as Hashable, which functools.cache asks of arguments (python/mypy#11470).
    return _past(kind, passed[-1]) if passed else kind  # type: ignore[arg-type]


def would_halt_a_tpu(message: str, kv_lens=()) -> PropertyFailure:
    """The failure of a kernel that would halt a TPU on exit, located by ``kv_lens``, naming the release
    that made the exit a failure."""
    return located(WouldHaltATpu, kv_lens)(f"{message}{EXIT_STATE_CHECK.note()}")


def numeric_failure(comparison, arrays: dict, backend=None) -> PropertyFailure:
    """The failure a numeric ``Comparison`` that does not hold raises: its kind (non-finite values, else
    values over the bound), located by the longest context among the sequences it shows in. On a TPU
    generation (``backend``'s, real or emulated), a failure whose diagnosis is float32 products in one
    bfloat16 pass, undeclared, names the release that began multiplying as the chip does."""
    kv_lens = np.asarray(arrays["kv_lens"])
    shown = comparison.error_map
    failing: list[int] | np.ndarray = (
        [] if shown is None else np.unique(shown.sequence[(shown.ratio > 1.0).any(axis=1)])
    )
    kind = (
        NonFiniteOutput if comparison.nonfinite else OverTheBound if shown is not None else WrongOutputLayout
    )
    products_at_default = (
        backend is not None
        and backend.has_tpu_generation
        and BF16_MATMUL not in comparison.precision
        and comparison.diagnosis.startswith(f"consistent with {BF16_MATMUL}")
    )
    note = PRODUCTS_ON_TPU_GENERATIONS.note() if products_at_default else ""
    return located(kind, kv_lens[failing])(f"{comparison}{note}")
