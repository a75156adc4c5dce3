"""The family's own property: both outputs of one call of a kernel with v3's outputs (the attention and the
returned cache) judged, the attention against the float64 oracle and the cache slot by slot
(``rpa_harness.property_names``: kinds ``v3-attention-and-cache``, ``v3-hang``).

Each target builds its judge with ``judge_with`` (its mapping, its call, its cache check and the finding its
cache errors may be attributed to) and its check with ``checks_both_outputs``.
"""

import dataclasses
from collections.abc import Callable
from typing import TypeVar

import numpy as np

from rpa_harness import reference
from rpa_harness.cache_judge import ExpectedCache, cache_mismatch
from rpa_harness.device import INTERPRET, Backend, Deadlock, WouldHaltTpu
from rpa_harness.failures import CacheMismatch, RaisedOnValidInput, numeric_failure, would_halt_a_tpu
from rpa_harness.targets.tpu_inference.arguments import KernelInputs


def check_updated_cache(inputs: KernelInputs, updated_cache) -> None:
    """The returned cache equals the expected one bit for bit: every new token written to its slot, and
    no other page, slot, padded head or padded dim changed (NaN payloads included)."""
    expected = ExpectedCache(
        inputs.expected_cache, inputs.args[3], inputs.new_slots, inputs.slot_owner, inputs.slot_position
    )
    mismatch = cache_mismatch(updated_cache, expected, who="v3", element=lambda i: f"packed element {i}")
    if mismatch is not None:
        raise mismatch


# The checking TPU interpreter with the compat layer, as the harness's ``interpret`` backend: out-of-bounds
# reads raise, scratch is NaN, races raise, a call that outlives the watchdog is a hang. (The generic
# properties also run v3 on the generic interpreter, through the compat layer's dynamic-size copies.)
CHECKING = Backend(INTERPRET)
Inputs = TypeVar("Inputs", bound=KernelInputs)

# The kinds of the repros of the property (``rpa_harness.property_names``): both outputs judged; a call
# that hangs. Named for v3, whose property it was first; every kernel with v3's outputs records them.
ATTENTION_AND_CACHE, HANG = "v3-attention-and-cache", "v3-hang"


@dataclasses.dataclass
class Verdict:
    """Both outputs of one call of a kernel with v3's outputs, judged."""

    comparison: reference.Comparison  # of the attention with the float64 oracle
    cache_error: CacheMismatch | None  # None: the updated cache is the expected one, bit for bit
    known_finding: str | None  # the folder (docs/...) of the finding that explains the cache error exactly


def judged_call(
    name: str,
    map_inputs: Callable[..., Inputs],
    call,
    arrays: dict,
    options: dict,
    backend: Backend,
    *,
    precision: tuple[str, ...],
    check_cache: Callable = check_updated_cache,
) -> tuple[reference.Comparison, CacheMismatch | None, Inputs]:
    """One call of a v3-style kernel on ``backend`` (``map_inputs`` maps the upstream-style case, ``call``
    runs it returning the attention and the updated cache), both outputs judged, the cache by
    ``check_cache(inputs, cache)``: (the attention's comparison with the float64 oracle, the cache's
    mismatch or None, the mapped inputs)."""
    inputs = map_inputs(**arrays, **options)
    out, cache = backend.run(call, inputs)
    comparison = reference.compare(
        out, reference.oracle(**arrays, **options), label=f"{name} on {backend.label}", precision=precision
    )
    try:
        check_cache(inputs, cache)
    except CacheMismatch as error:
        return comparison, error, inputs
    return comparison, None, inputs


def left_as_predicted(error: CacheMismatch, predicted: np.ndarray | None) -> bool:
    """Whether a cache error is exactly a finding's unwritten slots (bool [pages, page_size], None where the
    finding's rule cannot say): the slots that differ are those, and each still holds its input value."""
    return (
        predicted is not None
        and error.slots is not None  # None: the cache's shape or dtype differs
        and error.stale is not None
        and bool(predicted.any())
        and np.array_equal(error.slots, predicted)
        and bool(error.stale[predicted].all())
    )


def judge_with(
    name: str,
    map_inputs: Callable[..., KernelInputs],
    call,
    *,
    check_cache: Callable = check_updated_cache,
    finding: tuple[str, Callable] | None = None,
):
    """The judge of a kernel with v3's outputs (``map_inputs``, ``call`` and ``check_cache`` as
    ``judged_call`` takes them, ``name`` for its messages): ``judge_outputs(arrays, options, backend,
    precision=...)``, a ``Verdict``. ``finding``: (a finding's folder, ``unwritten(inputs)``, the slots it
    leaves unwritten): a cache error that is exactly those, each as given, is attributed to it
    (``left_as_predicted``); without one, no cache error is."""

    def judge_outputs(arrays: dict, options: dict, backend: Backend = CHECKING, *, precision) -> Verdict:
        comparison, error, inputs = judged_call(
            name, map_inputs, call, arrays, options, backend, precision=precision, check_cache=check_cache
        )
        attributed = None
        if error is not None and finding is not None:
            folder, unwritten = finding
            attributed = folder if left_as_predicted(error, unwritten(inputs)) else None
        return Verdict(comparison, error, attributed)

    return judge_outputs


def checks_both_outputs(judge_outputs):
    """The property ``judge_outputs(arrays, options, backend, precision=...)`` (a ``Verdict``) decides, as a
    check ``check(target, backend, arrays, options)`` (what ``rpa_harness.checks.recheck`` runs for this
    target's own kinds): it raises while either output is wrong, a deadlock the TPU interpreter finds is
    the call raising on valid inputs (a hang), and an exit that would halt a TPU is a failure of its own."""

    def check(target, backend, arrays: dict, options: dict) -> None:
        try:
            verdict = judge_outputs(arrays, options, backend, precision=target.precision_on(backend))
        except Deadlock as deadlock:
            raise RaisedOnValidInput(
                f"{target.name} on {backend.label} never returns: {deadlock}",
                Deadlock.__name__,
                str(deadlock),
            ) from None
        except WouldHaltTpu as halting:
            raise would_halt_a_tpu(f"{target.name} on {backend.label}: {halting}") from None
        if verdict.cache_error is not None:
            finding = f"\n  (exactly the slots of {verdict.known_finding})" if verdict.known_finding else ""
            attention = "" if verdict.comparison.ok else f"\n{verdict.comparison}"
            error = verdict.cache_error
            raise CacheMismatch(f"{error}{finding}{attention}", error.slots, error.stale) from None
        if not verdict.comparison.ok:
            raise numeric_failure(verdict.comparison, arrays, backend)

    return check
