"""Repro files: a failing example on disk, replayable without Hypothesis (the file format only).

A repro is a pair ``NAME.json`` + ``NAME.npz``. The JSON says which property failed, on which target and
backend (and whether the interpreter compatibility layer was on), with which versions, the case (its repr
and JSON), the keyword options, for a validation property the expected message, and how it failed: the
report, the exception raised on valid input (``error``: type and message), a hang (``hang``: the
timeout), or a halted device (``halt``: the runtime error's first line). The NPZ holds the exact input arrays (as raw bits, so bfloat16 and fp8 survive; the JSON names
each dtype). Both are written atomically.

Where the arrays are large (a long context's cache: hundreds of MiB) and the case rebuilds them bit for
bit, the JSON stands alone: it keeps the case and the arrays' checksum, and ``read`` rebuilds them
(``arrays_from_case``). A repro of a long context then fits in a findings folder and a CI artifact.

``NAME.pending.json`` is the example in flight, written before the kernel runs (see ``write_pending``);
when the watchdog takes a call for a hang, or the device halts, the example is written as the pair, marked
``hang`` or ``halt``. When the
process ends some other way (a crash), the pending file is what is left: ``read`` rebuilds its arrays from
its case when their checksum says they are the case's own.

A halt's repro also names the examples its process ran before it (``preceded_by``, oldest first, each as its
pending file held it): a kernel can leave work running on the chip after its call returns, and the fault
then surfaces in a later call. ``predecessors`` rebuilds them.

A property that reads only the arrays' shapes and dtypes (``compiles``: the kernel compiled for a chip,
never called) stores those alone (``shapes_only``), and ``read`` gives back zero-strided stand-ins of them:
a production case's repro is a few KiB.
"""

import dataclasses
import io
import json
import os
import platform
import re
import tempfile
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from rpa_harness import property_names
from rpa_harness.strategies.case import DTYPES, Case

DEFAULT_REPRO_DIR = "rpa-repros"
# 2: the property's kind is stored apart from its name ("kind"); a file without it is schema 1 (its name
# is parsed, ``property_names.parse``).
SCHEMA = 2
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
    interpreter_compat: bool = True  # whether the backend ran with rpa_harness.interpret_compat installed
    error: dict | None = None  # {"type", "message"} of the exception the target raised on valid input
    hang: dict | None = None  # {"seconds": N}: the call did not return within N s
    halt: dict | None = None  # {"error": first line}: the call halted the device (device.HALT_MESSAGES)
    # A halt's: the examples its process ran before it, oldest first, without their arrays (``predecessors``)
    preceded_by: list[dict] = dataclasses.field(default_factory=list)
    test: str = ""  # the pytest node id that wrote it
    precision: tuple[str, ...] | None = None  # the target's precision contract when it failed
    tpu_generation: str = "none"  # the TPU generation emulated, or the chip's own (rpa_harness.generations)
    kind: str = ""  # which check re-runs it (``property_names.KINDS``); empty: read from ``property``
    arrays_file: Path | None = None  # the NPZ ``read`` took the arrays from
    in_flight: bool = False  # a pending file's example, its arrays rebuilt from its case
    arrays_from_case: bool = False  # its arrays were too large to store and are rebuilt from its case
    shapes_only: bool = False  # only the arrays' shapes and dtypes matter: stored alone, read as stand-ins

    def __post_init__(self):
        if not self.kind:
            self.kind = property_names.parse(self.property).kind


REQUIRED_FIELDS = ("property", "target", "backend", "options", "dtypes", "arrays")
PENDING_SUFFIX = ".pending"
# Arrays of more bytes than this are not stored where the case rebuilds them bit for bit.
LARGEST_STORED_ARRAYS = 32 * 2**20


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


def path_for(property_name: str, directory: str | os.PathLike, *, pending: bool = False) -> Path:
    """The JSON path of a property's repro (one pair per property), or of its pending pair."""
    return Path(directory) / f"{file_stem(property_name)}{PENDING_SUFFIX if pending else ''}.json"


def write(repro: Repro, directory: str | os.PathLike) -> Path:
    """Writes NAME.json and NAME.npz (one pair per property), or NAME.json alone where the arrays are
    large and the case rebuilds them; returns the JSON path."""
    json_path = path_for(repro.property, directory)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    if repro.shapes_only:
        _atomic_write(json_path, _encoded(_metadata(repro, None)))
        json_path.with_suffix(".npz").unlink(missing_ok=True)
    elif (checksum := checksum_if_rebuilt(repro)) is None:
        write_arrays(repro.arrays, json_path.with_suffix(".npz"))
        _atomic_write(json_path, _encoded(_metadata(repro, json_path)))
    else:
        _atomic_write(json_path, _encoded(_metadata(repro, None, checksum=checksum, from_case=True)))
        json_path.with_suffix(".npz").unlink(missing_ok=True)  # a larger example's, written before
    return json_path


def checksum_if_rebuilt(repro: Repro) -> int | None:
    """The arrays' checksum where they are larger than ``LARGEST_STORED_ARRAYS`` and the case rebuilds
    them bit for bit (a property may change the arrays after drawing the case); None otherwise."""
    size = sum(np.asarray(value).nbytes for value in repro.arrays.values())
    if repro.case is None or size <= LARGEST_STORED_ARRAYS:
        return None
    checksum = arrays_checksum(repro.arrays)
    return checksum if arrays_checksum(repro.case.arrays()) == checksum else None


def write_arrays(arrays: dict, npz_path: Path) -> None:
    """The NPZ of a repro pair: each array as its raw bits (the JSON names each dtype)."""
    buffer = io.BytesIO()
    bits: dict[str, Any] = {}  # Any: unpacked into savez, whose allow_pickle mypy would match an array to
    for name, value in arrays.items():
        value = np.asarray(value)
        bits[name] = (
            value.view(f"u{value.dtype.itemsize}")
            if value.dtype.kind == "V" or value.dtype.name in DTYPES
            else value
        )
    np.savez(buffer, **bits)
    _atomic_write(npz_path, buffer.getvalue())


def without_arrays(repro: Repro) -> dict:
    """The example's JSON without its arrays but with their checksum (~0.5 ms for 2 MB), so that ``read``
    can rebuild them from the case and tell whether they are the ones that ran: what a pending file holds,
    and each entry of a halt's ``preceded_by``."""
    checksum = None if repro.shapes_only else arrays_checksum(repro.arrays)
    return _metadata(repro, None, checksum=checksum)


def write_pending(repro: Repro, directory: str | os.PathLike, contents: dict | None = None) -> Path:
    """Writes NAME.pending.json, the example in flight (``contents``: its ``without_arrays``, computed here
    when not given); returns its path.

    Only the JSON: it is written before every example, and the arrays (~2 MB, ~15 ms to write) stay in
    memory until a hang needs them (``write`` of the example marked as a hang, from the watchdog thread).
    A process that dies some other way still leaves the case on disk, with the arrays' checksum.
    """
    pending = path_for(repro.property, directory, pending=True)
    _atomic_write(pending, _encoded(without_arrays(repro) if contents is None else contents))
    return pending


def rebuilds_arrays(contents: dict) -> bool:
    """Whether an example stored ``without_arrays`` gets them back from its case: not where the property
    changed them after drawing it (a validation property's broken rule)."""
    recorded = contents.get("arrays_crc32")
    if not contents.get("case") or recorded is None:
        return False
    return arrays_checksum(Case.from_json(contents["case"]).arrays()) == recorded


def arrays_checksum(arrays: dict) -> int:
    """CRC-32 of the arrays' names, dtypes, shapes and bytes."""
    crc = 0
    for name in sorted(arrays):
        value = np.ascontiguousarray(arrays[name])
        crc = zlib.crc32(f"{name}:{value.dtype}:{value.shape};".encode(), crc)
        crc = zlib.crc32(value.view(np.uint8).reshape(-1).data if value.size else b"", crc)
    return crc


def _metadata(
    repro: Repro, json_path: Path | None, checksum: int | None = None, *, from_case: bool = False
) -> dict:
    return {
        "schema": SCHEMA,
        "property": repro.property,
        "kind": repro.kind,
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
        "precision": list(repro.precision) if repro.precision is not None else None,
        "interpreter_compat": repro.interpreter_compat,
        "tpu_generation": repro.tpu_generation,
        "error": repro.error,
        "hang": repro.hang,
        "halt": repro.halt,
        "preceded_by": repro.preceded_by,
        "test": repro.test,
        "arrays": json_path.with_suffix(".npz").name if json_path else None,
        "arrays_crc32": checksum,
        "arrays_from_case": from_case,
        "shapes_only": repro.shapes_only,
        "shapes": {name: list(np.shape(value)) for name, value in repro.arrays.items()}
        if repro.shapes_only
        else None,
    }


def _encoded(meta: dict) -> bytes:
    return (json.dumps(meta, indent=2, default=_json_default) + "\n").encode()


def _json_default(value):
    if isinstance(value, np.generic):  # e.g. an invalid np.float32 k_scale: keep its type visible
        return {"numpy_scalar": str(value.dtype), "value": value.item()}
    raise TypeError(f"cannot store {value!r} of type {type(value).__name__} in a repro")


def _option_from_json(value):
    if isinstance(value, dict) and "numpy_scalar" in value:
        return np.dtype(value["numpy_scalar"]).type(value["value"])
    if isinstance(value, list):  # a tuple option (attention_sink): JSON has only lists
        return tuple(value)
    return value


def read(path: str | os.PathLike) -> Repro:
    path = Path(path)
    try:
        meta = json.loads(path.read_text())
        if not isinstance(meta, dict):
            raise ReproError(f"{path}: not a repro: the JSON is a {type(meta).__name__}, not an object")
        missing = [name for name in REQUIRED_FIELDS if name not in meta]
        if missing:
            raise ReproError(
                f"{path}: not a repro: missing field {', '.join(map(repr, missing))} "
                f"(a repro JSON has {', '.join(REQUIRED_FIELDS)})"
            )
        return _from_metadata(path, meta)
    except FileNotFoundError as error:
        raise ReproError(
            f"{error.filename}: no such file (a repro is a NAME.json with its NAME.npz beside it)"
        ) from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise ReproError(f"{path}: not a readable repro file ({type(error).__name__}: {error})") from None


def predecessors(path: str | os.PathLike, repro: Repro) -> list[Repro]:
    """The examples a halt's process ran before it (``preceded_by``), oldest first, each with its arrays
    rebuilt from its case (the halt's repro keeps only those whose case rebuilds them)."""
    path = Path(path)
    try:
        return [_from_metadata(path, entry, preceding=index) for index, entry in enumerate(repro.preceded_by)]
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise ReproError(
            f"{path}: its preceded_by is not readable ({type(error).__name__}: {error})"
        ) from None


def _from_metadata(path: Path, meta: dict, *, preceding: int | None = None) -> Repro:
    """The repro the JSON object ``meta`` of the file at ``path`` describes: the file's own, or its
    ``preceded_by[preceding]``."""
    case = Case.from_json(meta["case"]) if meta.get("case") else None
    from_case = bool(meta.get("arrays_from_case"))
    shapes_only = bool(meta.get("shapes_only"))
    if shapes_only:
        shapes = {
            name: (shape, _dtype_by_name(meta["dtypes"][name])) for name, shape in meta["shapes"].items()
        }
        arrays, arrays_file = stand_ins(shapes), None
    elif meta["arrays"] is None:
        arrays, arrays_file = _rebuilt(path, meta, case, preceding), None
    else:
        arrays_file = _arrays_beside(path, meta["arrays"])
        stored = np.load(arrays_file)
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
        case=case,
        expected_error=meta.get("expected_error"),
        stage=meta.get("stage"),
        failure=meta.get("failure", ""),
        versions=meta.get("versions", {}),
        interpreter_compat=meta.get("interpreter_compat", True),
        tpu_generation=meta.get("tpu_generation", "none"),
        error=meta.get("error"),
        hang=meta.get("hang"),
        halt=meta.get("halt"),
        preceded_by=meta.get("preceded_by") or [],
        test=meta.get("test", ""),
        precision=tuple(meta["precision"]) if meta.get("precision") is not None else None,
        kind=meta.get("kind", ""),
        arrays_file=arrays_file,
        in_flight=meta["arrays"] is None and not from_case and not shapes_only,
        arrays_from_case=from_case,
        shapes_only=shapes_only,
    )


def stand_ins(shapes: dict) -> dict[str, np.ndarray]:
    """A zero-strided zero array per ``{name: (shape, dtype)}``: the shapes and dtypes without the memory."""
    return {
        name: np.broadcast_to(np.zeros((), dtype), tuple(shape)) for name, (shape, dtype) in shapes.items()
    }


def _rebuilt(path: Path, meta: dict, case: Case | None, preceding: int | None) -> dict[str, np.ndarray]:
    """The arrays of a pending file, of a repro too large to store them or of a halt's ``preceded_by``
    entry, rebuilt from its case: only when they are the ones that ran (a validation property's arrays
    break a rule after the case built them, and no checksum predates it)."""
    recorded = meta.get("arrays_crc32")
    arrays = case.arrays() if case is not None and recorded is not None else None
    if arrays is not None and arrays_checksum(arrays) == recorded:
        return arrays
    if meta.get("arrays_from_case"):
        what = "a repro stored without its arrays (too large)"
    elif preceding is not None:
        what = f"the example its preceded_by[{preceding}] names, without its arrays"
    else:
        what = "the example in flight when its process ended, without its arrays"
    if arrays is None:
        why = "the file has no case or no checksum of them"
    elif meta.get("arrays_from_case") or preceding is not None:  # the case rebuilt them when it was written
        why = f"this NumPy and harness build other arrays from it than the ones recorded ({meta.get('versions')})"
    else:
        why = "the property changed them after drawing it"
    raise ReproError(
        f"{path}: {what}, and they cannot be rebuilt from its case ({why}); its case is in the file's case_repr"
    )


def _arrays_beside(json_path: Path, recorded: str) -> Path:
    """The NPZ the JSON names, or, when the pair was renamed together, the one of the JSON's own name."""
    named = json_path.parent / recorded
    own = json_path.with_suffix(".npz")
    return own if not named.exists() and own.exists() else named


def discard_pending(pending_path: Path) -> None:
    pending_path.unlink(missing_ok=True)
