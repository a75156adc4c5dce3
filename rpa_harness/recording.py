"""The example in flight and the failing example, on disk: what every numeric and validation property runs in.

``recorded`` writes the example as a pending repro before the kernel runs and, when the watchdog takes a
call for a hang or the call halts the device, writes it as the repro pair marked as a hang or a halt before
the process ends (a halt's with the examples the process ran just before it); it writes the pair when
the enclosed check fails (Hypothesis replays the shrunk example last, so the pair on disk is the minimal
one), skips the test when the target cannot run here (a recognised interpreter limitation), and records
every example in the run log.
"""

import collections
import contextlib
import os

import pytest

from rpa_harness import device, known_issues, repro, runlog
from rpa_harness.checks import CannotRun, RaisedOnValidInput
from rpa_harness.property_names import PropertyName
from rpa_harness.strategies.coverage import coverage_labels

# The failure kind of a call that halted the device: the first example that did is the suspect, so it is
# kept as the repro and the process ends (``device.end_on_halt``) before anything shrinks.
DEVICE_HALTED = "device halted"

# The last examples whose kernel calls ended in this process without halting the device, oldest first, as
# their pending files held them (``repro.without_arrays``): a kernel can leave work running on the chip after
# its call returns (a DMA started and never waited for), and the fault then surfaces in a later call, so a
# halt's repro names them (``preceded_by``) and ``rpa-harness replay`` runs them before the suspect. Only an
# example with a case is kept, and a halt's repro only those whose case rebuilds their arrays: their arrays
# are not kept. A compile property's example (``shapes_only``) runs nothing on a device.
EXAMPLES_BEFORE_A_HALT = 2
_ran_before: collections.deque[dict] = collections.deque(maxlen=EXAMPLES_BEFORE_A_HALT)


# pytest's public name for its Skipped class is an attribute of the skip function (typed
# ClassVar[type[Skipped]]), which mypy does not accept as a base class.
class CannotRunHere(pytest.skip.Exception):  # type: ignore[name-defined]
    """A skip because the target cannot run on this backend (declared, or a recognised interpreter
    limitation); the plugin reports the backend and the reason once per run."""

    def __init__(self, target_name: str, backend_name: str, reason: str):
        super().__init__(f"target {target_name} cannot run on {backend_name}: {reason}")
        self.backend_name, self.reason = backend_name, reason


def shape_notes(case) -> dict:
    """The case's size in the run log: the summary shows each property's largest case."""
    tokens, kv = sum(case.q_lens), max(case.kv_lens, default=0)
    shape = (
        f"{tokens}/{case.max_num_batched_tokens} tok, {case.num_seqs}/{case.max_num_seqs} seqs, kv<={kv}, "
        f"{case.num_q_heads}/{case.num_kv_heads}x{case.head_dim}, page {case.page_size}x{case.pages_per_seq}"
    )
    return {"shape": shape, "size": (tokens + case.num_seqs) * max(kv, 1) * case.num_q_heads * case.head_dim}


def closeness_notes(comparison, case) -> dict:
    """A compared case's run-log fields for the summary's error/bound figures: none where the comparison judged
    no element (a batch without live rows), which would count as a perfect 0 in the property's figures."""
    if not comparison.num_checked:
        return {}
    return {"max_ratio": comparison.max_ratio, "q_dtype": case.q_dtype, "kv_dtype": case.kv_dtype}


def preceded_by_line(halt: repro.Repro) -> str:
    """The line of a halt's message that says the examples its process ran just before it are in its repro,
    or nothing where the halt was the process's first example."""
    if not halt.preceded_by:
        return ""
    return (
        f"  preceded by: {len(halt.preceded_by)} example(s) run just before it on the device, in the repro's preceded_by "
        "(replay runs them before it where it passes alone: a call can leave a fault for the next)\n"
    )


def recorded_generation(backend) -> str:
    """The generation a repro records: the one an interpreter emulated, or the chip's own on a chip (a
    replay on an interpreter then emulates it)."""
    return backend.generation_seen


def current_test() -> str:
    return os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]


def recorded(
    directory, name: PropertyName, target, backend, arrays: dict, options: dict, **fields
) -> "Recorded":
    """Runs the enclosed check with its example on disk; a failure names the repro pair it left.
    ``with recorded(...) as notes``: ``notes`` are the example's run-log fields, which the check may add to."""
    return Recorded(directory, name, target, backend, arrays, options, fields)


class Recorded:
    """``recorded``'s context manager: a class, so that pytest hides its frames (``__tracebackhide__``) and a
    failure shows the check that failed, not this wrapper's source."""

    def __init__(
        self, directory, name: PropertyName, target, backend, arrays: dict, options: dict, fields: dict
    ):
        self.directory, self.name, self.target, self.backend, self.fields = (
            directory,
            name,
            target,
            backend,
            fields,
        )
        self.case = fields.get("case")
        self.notes: dict = {
            "labels": coverage_labels(self.case)
            if self.case is not None and fields.get("expected_error") is None
            else []
        }
        if self.case is not None:
            self.notes.update(shape_notes(self.case))
        self.example = repro.Repro(
            str(name), target.name, backend.name, arrays, options, kind=name.kind,
            interpreter_compat=backend.interpreter_compat, tpu_generation=recorded_generation(backend), test=current_test(),
            precision=getattr(target, "precision", None), **fields,
        )  # fmt: skip
        self.hang_watch = contextlib.ExitStack()

    def __enter__(self) -> dict:
        self.without_arrays = repro.without_arrays(self.example)
        self.pending = repro.write_pending(self.example, self.directory, self.without_arrays)
        self.hang_watch.enter_context(device.on_hang(self.on_hang))
        self.hang_watch.enter_context(device.on_halt(self.on_halt))
        if self.runs_on_a_device:
            device.owner.set_example_in_flight(self.without_arrays)
            self.hang_watch.callback(device.owner.set_example_in_flight, None)
        return self.notes

    @property
    def runs_on_a_device(self) -> bool:
        """Whether the example runs a kernel (a compile property's, ``shapes_only``, runs nothing) and has a
        case, which a replay before a halt's suspect rebuilds."""
        return self.case is not None and not self.example.shapes_only

    def on_halt(self, what, error):
        # Where a chip owner made the call, the calls before it on the chip were any process's.
        before = device.owner.calls_before_the_halt()
        before = list(_ran_before) if before is None else before
        self.example.preceded_by = [example for example in before if repro.rebuilds_arrays(example)]
        path = self.ended("halt", {"error": error}, error, f"{DEVICE_HALTED}: {what} raised {error}")
        return (
            f"rpa-harness: DEVICE HALTED: {what} raised {error} in {self.where()}\n"
            f"  failure kind: {DEVICE_HALTED}\n{preceded_by_line(self.example)}  repro: {path}\n"
            f"  replay: rpa-harness replay {path}",
            device.HALT_EXIT_CODE,
        )

    def on_hang(self, what, seconds):
        path = self.ended(
            "hang", {"seconds": seconds}, seconds, f"hang: {what} did not return within {seconds:g} s"
        )
        return (
            f"rpa-harness: HANG: {what} did not return within {seconds:g} s (RPA_CALL_TIMEOUT) in "
            f"{self.where()}\n  repro: {path}\n  replay: rpa-harness replay {path}",
            device.HANG_EXIT_CODE,
        )

    def ended(self, mark: str, recorded: dict, logged, failure: str):
        """The example in flight written as the repro of a call that ends the process (marked ``mark``: hang
        or halt), its pending file removed, and logged; returns the repro's path."""
        setattr(self.example, mark, recorded)
        self.example.failure = failure
        path = repro.write(self.example, self.directory)
        repro.discard_pending(self.pending)
        runlog.record(**self.notes, repro=str(path), **{mark: logged})
        return path

    def where(self) -> str:
        """The test and the case in flight, as a message that ends the process names them."""
        case = self.case.describe() if self.case is not None else "see the repro"
        return f"{self.example.test or self.name}: {case}"

    def __exit__(self, kind, failure, traceback) -> None:
        __tracebackhide__ = True
        self.hang_watch.close()
        repro.discard_pending(self.pending)
        if self.runs_on_a_device:
            _ran_before.append(self.without_arrays)
        if failure is None:
            runlog.record(**self.notes)
        elif isinstance(failure, CannotRun):
            raise CannotRunHere(self.target.name, self.backend.name, str(failure)) from None
        elif isinstance(failure, AssertionError):
            raise self.reported(failure) from None

    def reported(self, failure: AssertionError) -> AssertionError:
        """The failure, of its own class, with its kind, its repro pair (written now) and the known issues
        that fit it."""
        example, backend, case = self.example, self.backend, self.case
        example.failure = str(failure)
        if isinstance(failure, RaisedOnValidInput):
            example.error = {"type": failure.error_type, "message": failure.error_message}
        path = repro.write(example, self.directory)
        runlog.record(**self.notes, repro=str(path))
        catalogue = known_issues.on_generation(getattr(self.target, "catalogue", ()), backend.generation)
        known = (
            known_issues.describe_matches(
                case, failure, catalogue, getattr(self.target, "catalogue_kernels", {})
            )
            if case is not None and self.fields.get("expected_error") is None  # a numeric property's failure
            else ""
        )
        kind = getattr(type(failure), "kind", type(failure).__name__)
        return type(failure)(
            f"{failure}\n  failure kind: {kind}\n  repro: {path}\n  replay: rpa-harness replay {path}{known}"
        )
