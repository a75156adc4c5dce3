"""The standalone program of a repro: the failing call as its backend made it, and what the call gives.

``rpa-harness replay --script`` writes it and a compile report prints it; below both of them, so that a
report never reaches up into the command line for it. It needs the harness only for what jax lacks: the
interpreter compatibility layer, the emulated chip, the float64 oracle.
"""

from pathlib import Path

from rpa_harness import device, generations
from rpa_harness import repro as repro_files
from rpa_harness.device import Backend
from rpa_harness.property_names import COMPILATION, DIFFERENTIAL, KINDS, PADDING


def snippet(repro: repro_files.Repro, json_path: Path, target: str, backend: Backend) -> str:
    """A standalone Python program that makes the failing call, as the backend made it, and prints the outcome.

    Same interpreter parameters as the backend, the compatibility layer installed when the backend had it
    on; a differential repro prints the comparison with the float64 oracle (its worst element), a padding or
    determinism repro the first element that differs, a validation repro the error raised, a compile repro
    whether the chip's compiler accepts the call.
    """
    if repro.kind == COMPILATION:
        return _compile_snippet(repro, json_path, target, backend)
    lines = _call_lines(repro, json_path, target, backend)
    if repro.expected_error is not None:
        lines += _validation_lines(repro.stage, repro.expected_error)
    elif repro.kind == DIFFERENTIAL or repro.kind not in KINDS:
        lines += _comparison_lines(repro, target, backend)
    else:
        lines += _two_runs_lines(repro)
    return "\n".join(lines) + "\n"


def _run_context(backend: Backend) -> str:
    """The context managers the call runs in: the backend's interpreter, with its parameters, and the chip
    it emulates."""
    if backend.name == device.TPU:
        context = "contextlib.nullcontext()"
    elif backend.name == device.INTERPRET:
        params = ", ".join(f"{k}={v!r}" for k, v in device.CHECKING_INTERPRET_PARAMS.items())
        context = f"pltpu.force_tpu_interpret_mode(pltpu.InterpretParams({params}))"
    else:
        context = "pltpu.force_tpu_interpret_mode(True)"
    # The kernel sees the chip while it is traced (rpa_harness.generations).
    if backend.generation != generations.NONE:
        context = f"{context}, generations.emulated({backend.generation!r})"
    return context


def _call_lines(repro: repro_files.Repro, json_path: Path, target: str, backend: Backend) -> list[str]:
    """The program's imports, the repro's arrays (from its .npz) and options, and ``run``: the call."""
    npz = (repro.arrays_file or json_path.with_suffix(".npz")).resolve()
    dtypes = {name: str(value.dtype) for name, value in repro.arrays.items()}
    compat = backend.name != device.TPU and backend.interpreter_compat
    emulated = backend.generation != generations.NONE
    return [
        f'"""Standalone reproduction of {json_path} ({repro.property}, {target} on {backend.label})."""',
        "import contextlib, dataclasses, importlib",
        "import jax, jax.numpy as jnp, ml_dtypes, numpy as np",
        "from jax.experimental.pallas import tpu as pltpu",
        *(["from rpa_harness import generations"] if emulated else []),
        *(["from rpa_harness import interpret_compat", "interpret_compat.install()"] if compat else []),
        f"target = importlib.import_module({target!r})",
        f"stored = np.load({str(npz)!r})",
        f"dtypes = {dtypes!r}",
        "inputs = {k: stored[k].view(np.dtype(getattr(ml_dtypes, d, d))).reshape(stored[k].shape)",
        "          for k, d in dtypes.items()}",
        f"options = {repro.options!r}",
        "",
        "def run(inputs):",
        f"    with {_run_context(backend)}:",
        "        arrays = {k: jnp.asarray(v) for k, v in inputs.items()}",
        "        return np.asarray(jax.block_until_ready(target.ragged_paged_attention(**arrays, **options)))",
        "",
    ]


def _validation_lines(stage: str | None, expected_error: str) -> list[str]:
    """A validation repro: the error the call (or, at stage ``dynamic``, the dynamic validator) raises, and
    the one expected."""
    call = (
        "target.dynamic_validate_inputs(**{k: jnp.asarray(v) for k, v in inputs.items()}, **options)"
        if stage == "dynamic"
        else "run(inputs)"
    )
    return [
        "try:",
        f"    {call}",
        "except Exception as error:",
        '    print(f"raised {type(error).__name__}: {error}")',
        "else:",
        '    print("accepted the input")',
        f"print({'expected: ValueError: ' + expected_error!r})",
    ]


def _comparison_lines(repro: repro_files.Repro, target: str, backend: Backend) -> list[str]:
    """A differential repro (or one of the target's own properties): the output against the float64 oracle."""
    own = (
        [f"# {repro.kind!r} is the target's own property; this program compares the attention only, replay "
         "judges all it declares"]
        if repro.kind not in KINDS
        else []
    )  # fmt: skip
    return [
        *own,
        "from rpa_harness import reference",
        "out = run(inputs)",
        f"print(reference.compare(out, reference.oracle(**inputs, **options), label={target + ' on ' + backend.name!r}))",
    ]


def _two_runs_lines(repro: repro_files.Repro) -> list[str]:
    """A padding or determinism repro: two calls' valid rows, bit for bit, and the first element that differs
    (a padding repro's first call on its case with clean padding)."""
    if repro.kind == PADDING and repro.case is not None:
        first = [
            "from rpa_harness.strategies.case import Case",
            f"case = {repro.case!r}",
            "first = run(dataclasses.replace(case, poison=False, garbage=False).arrays())  # clean padding",
        ]
    else:
        first = ["first = run(inputs)"]
    return [
        *first,
        "second = run(inputs)",
        "rows = slice(0, int(inputs['cu_q_lens'][int(inputs['num_seqs'][0])]))",
        "a, b = first[rows], second[rows]",
        "differ = a.view(f'u{a.dtype.itemsize}') != b.view(f'u{b.dtype.itemsize}')",
        "print(f'{int(differ.sum())} of {differ.size} valid output elements differ')",
        "if differ.any():",
        "    row, head, dim = np.argwhere(differ)[0]",
        "    print(f'first at row {row}, head {head}, dim {dim}: {a[row, head, dim]!r} vs {b[row, head, dim]!r}')",
    ]


def _compile_snippet(repro: repro_files.Repro, json_path: Path, target: str, backend: Backend) -> str:
    """The compile property's standalone program: the call traced on shapes placed on a device of the
    generation's topology, lowered and compiled by libtpu on this host (``rpa_harness.ahead_of_time``)."""
    from rpa_harness.ahead_of_time import TOPOLOGY_NAMES

    generation = backend.generation
    shapes = {name: (tuple(value.shape), str(value.dtype)) for name, value in repro.arrays.items()}
    lines = [
        f'"""Standalone reproduction of {json_path} ({repro.property}, {target} compiled for {generation})."""',
        "import importlib, os",
        "import jax, ml_dtypes, numpy as np",
        "from jax.experimental import topologies",
        "from jax.experimental.pallas import tpu as pltpu",
        "from rpa_harness import generations",
        'os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")  # libtpu: this host is the slice',
        f"target = importlib.import_module({target!r})",
        f"topology = topologies.get_topology_desc(platform='tpu', topology_name={TOPOLOGY_NAMES.get(generation)!r})",
        "sharding = jax.sharding.SingleDeviceSharding(topology.devices[0])",
        f"shapes = {shapes!r}",
        "inputs = {k: jax.ShapeDtypeStruct(s, np.dtype(getattr(ml_dtypes, d, d)), sharding=sharding)",
        "          for k, (s, d) in shapes.items()}",
        f"options = {repro.options!r}",
        "",
        "# The kernel traced as on the chip (its generation's defaults and branches), then compiled for it.",
        f"with pltpu.force_tpu_interpret_mode(None), generations.emulated({generation!r}):",
        "    traced = jax.jit(lambda inputs: target.ragged_paged_attention(**inputs, **options)).trace(inputs)",
        "    traced.lower().compile()  # raises what the chip's compiler refuses",
        f"print('compiles for {generation}')",
    ]
    return "\n".join(lines) + "\n"
