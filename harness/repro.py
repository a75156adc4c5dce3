"""Repro files: a failing example on disk, replayable without Hypothesis.

A repro is a pair ``NAME.json`` + ``NAME.npz``. The JSON says which property failed, on which target and
backend, with which versions, the case (its repr and JSON), the keyword options and, for a validation
property, the expected message. The NPZ holds the exact input arrays (as raw bits, so bfloat16 and fp8
survive; the JSON names each dtype). Both are written atomically, and rewritten on every failing call:
Hypothesis replays the shrunk example last, so the pair on disk is the minimal one.
"""

import contextlib
import dataclasses
import io
import json
import os
import platform
import re
import tempfile
from pathlib import Path

import numpy as np

from harness import known_issues, runlog
from strategies.case import DTYPES, Case
from strategies.valid import coverage_labels

DEFAULT_REPRO_DIR = "rpa-repros"
INT_DTYPES = {str(np.dtype(t)): np.dtype(t) for t in (np.int16, np.int32, np.uint32, np.float32)}


class ReproError(Exception):
    """A repro file that is missing or malformed; the message names the file and the problem."""


@dataclasses.dataclass
class Repro:
    property: str
    target: str
    backend: str
    arrays: dict[str, np.ndarray]
    options: dict
    case: Case | None = None
    expected_error: str | None = None  # the exact ValueError message a validation property expects
    stage: str | None = None  # "static" or "dynamic" for validation properties
    failure: str = ""  # the report or error seen when it was written
    versions: dict = dataclasses.field(default_factory=dict)


def versions() -> dict:
    import hypothesis
    import jax
    import jaxlib

    return {
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "hypothesis": hypothesis.__version__,
        "numpy": np.__version__,
    }


def _dtype_by_name(name: str) -> np.dtype:
    dtype = DTYPES.get(name) or INT_DTYPES.get(name)
    if dtype is None:
        raise ReproError(f"unknown dtype {name!r} in repro (known: {sorted({**DTYPES, **INT_DTYPES})})")
    return dtype


def _atomic_write(path: Path, data: bytes) -> None:
    with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.", delete=False) as tmp:
        tmp.write(data)
    os.replace(tmp.name, path)


def file_stem(property_name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", property_name).strip("_")


def write(repro: Repro, directory: str | os.PathLike) -> Path:
    """Writes NAME.json and NAME.npz (one pair per property); returns the JSON path."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    json_path = directory / f"{file_stem(repro.property)}.json"
    buffer = io.BytesIO()
    bits = {}
    for name, value in repro.arrays.items():
        value = np.asarray(value)
        bits[name] = (
            value.view(f"u{value.dtype.itemsize}")
            if value.dtype.kind == "V" or value.dtype.name in DTYPES
            else value
        )
    np.savez(buffer, **bits)
    meta = {
        "property": repro.property,
        "target": repro.target,
        "backend": repro.backend,
        "options": repro.options,
        "dtypes": {name: str(np.asarray(value).dtype) for name, value in repro.arrays.items()},
        "case": repro.case.to_json() if repro.case else None,
        "case_repr": repr(repro.case) if repro.case else None,
        "expected_error": repro.expected_error,
        "stage": repro.stage,
        "failure": repro.failure,
        "versions": repro.versions or versions(),
        "arrays": json_path.with_suffix(".npz").name,
    }
    _atomic_write(json_path.with_suffix(".npz"), buffer.getvalue())
    _atomic_write(json_path, (json.dumps(meta, indent=2, default=_json_default) + "\n").encode())
    return json_path


def _json_default(value):
    if isinstance(value, np.generic):  # e.g. an invalid np.float32 k_scale: keep its type visible
        return {"numpy_scalar": str(value.dtype), "value": value.item()}
    raise TypeError(f"cannot store {value!r} of type {type(value).__name__} in a repro")


def _option_from_json(value):
    if isinstance(value, dict) and "numpy_scalar" in value:
        return np.dtype(value["numpy_scalar"]).type(value["value"])
    return value


def read(path: str | os.PathLike) -> Repro:
    path = Path(path)
    try:
        meta = json.loads(path.read_text())
        stored = np.load(path.parent / meta["arrays"])
        arrays = {
            name: stored[name].view(_dtype_by_name(dtype)).reshape(stored[name].shape)
            for name, dtype in meta["dtypes"].items()
        }
        return Repro(
            property=meta["property"],
            target=meta["target"],
            backend=meta["backend"],
            arrays=arrays,
            options={k: _option_from_json(v) for k, v in meta["options"].items()},
            case=Case.from_json(meta["case"]) if meta.get("case") else None,
            expected_error=meta.get("expected_error"),
            stage=meta.get("stage"),
            failure=meta.get("failure", ""),
            versions=meta.get("versions", {}),
        )
    except FileNotFoundError as error:
        raise ReproError(
            f"{error.filename}: no such file (a repro is a NAME.json with its NAME.npz beside it)"
        ) from None
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ReproError(f"{path}: not a readable repro file ({type(error).__name__}: {error})") from None


@contextlib.contextmanager
def written_on_failure(directory, property_name: str, target, backend, arrays: dict, options: dict, **fields):
    """Writes the repro pair when the enclosed check fails, and names it in the failure message.

    Every example passing through here is also recorded in the run log (for ``rpa-harness run`` and the
    benchmarks), with whatever the body adds to the yielded dict (e.g. the comparison's max error/bound).
    """
    case = fields.get("case")
    notes = {
        "labels": coverage_labels(case) if case is not None and fields.get("expected_error") is None else []
    }
    try:
        yield notes
    except AssertionError as failure:
        repro = Repro(
            property_name, target.name, backend.name, arrays, options, failure=str(failure), **fields
        )
        path = write(repro, directory)
        runlog.record(**notes, repro=str(path))
        numeric = case is not None and fields.get("expected_error") is None
        known = known_issues.describe_matches(case) if numeric else ""
        raise type(failure)(
            f"{failure}\n  repro: {path}\n  replay: rpa-harness replay {path}{known}"
        ) from None
    runlog.record(**notes)
