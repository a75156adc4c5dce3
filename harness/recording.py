"""The example in flight and the failing example, on disk: what every numeric and validation property runs in.

``recorded`` writes the example as a pending repro before the kernel runs and, when the watchdog takes a
call for a hang, writes it as the repro pair marked as a hang before the process ends; it writes the pair when
the enclosed check fails (Hypothesis replays the shrunk example last, so the pair on disk is the minimal
one), skips the test when the target cannot run here (a recognised interpreter limitation), and records
every example in the run log.
"""

import contextlib
import os

import pytest
from rpa_harness import backends, known_issues, repro, runlog
from rpa_harness.checks import CannotRun, RaisedOnValidInput
from rpa_harness.property_names import PropertyName
from rpa_harness.strategies.coverage import coverage_labels


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


def current_test() -> str:
    return os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]


@contextlib.contextmanager
def recorded(directory, name: PropertyName, target, backend, arrays: dict, options: dict, **fields):
    """Runs the enclosed check with its example on disk; a failure names the repro pair it left."""
    case = fields.get("case")
    notes = {
        "labels": coverage_labels(case) if case is not None and fields.get("expected_error") is None else []
    }
    if case is not None:
        notes.update(shape_notes(case))
    example = repro.Repro(
        str(name), target.name, backend.name, arrays, options, kind=name.kind,
        interpreter_compat=backend.interpreter_compat, tpu_generation=backend.generation, test=current_test(),
        precision=getattr(target, "precision", None), **fields,
    )  # fmt: skip
    pending = repro.write_pending(example, directory)

    def on_hang(what, seconds):
        example.hang = {"seconds": seconds}
        example.failure = f"hang: {what} did not return within {seconds:g} s"
        path = repro.write(example, directory)
        repro.discard_pending(pending)
        runlog.record(**notes, repro=str(path), hang=seconds)
        return (
            f"rpa-harness: HANG: {what} did not return within {seconds:g} s (RPA_CALL_TIMEOUT) in "
            f"{example.test or name}: {case.describe() if case is not None else 'see the repro'}\n  repro: {path}\n  replay: rpa-harness replay {path}",
            backends.HANG_EXIT_CODE,
        )

    try:
        with backends.on_hang(on_hang):
            yield notes
    except CannotRun as reason:
        raise CannotRunHere(target.name, backend.name, str(reason)) from None
    except AssertionError as failure:
        example.failure = str(failure)
        if isinstance(failure, RaisedOnValidInput):
            example.error = {"type": failure.error_type, "message": failure.error_message}
        path = repro.write(example, directory)
        runlog.record(**notes, repro=str(path))
        catalogue = known_issues.on_generation(getattr(target, "catalogue", ()), backend.generation)
        known = (
            known_issues.describe_matches(case, catalogue)
            if case is not None and fields.get("expected_error") is None  # a numeric property's failure
            else ""
        )
        kind = getattr(type(failure), "kind", type(failure).__name__)
        raise type(failure)(
            f"{failure}\n  failure kind: {kind}\n  repro: {path}\n  replay: rpa-harness replay {path}{known}"
        ) from None
    finally:
        repro.discard_pending(pending)
    runlog.record(**notes)
