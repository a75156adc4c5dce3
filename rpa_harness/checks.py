"""The checks behind every property, shared by the pytest properties and ``rpa-harness replay``.

Each check takes concrete inputs (NumPy arrays and keyword options), runs the target on a backend and
raises ``PropertyFailure`` (a kind of ``rpa_harness.failures``) with the report a kernel developer reads;
it returns quietly when it holds.
"""

import concurrent.futures
import dataclasses
import functools
import re
import time

import jax
import numpy as np

from rpa_harness import ahead_of_time, device, generations, reference
from rpa_harness.cache_judge import check_updated_cache
from rpa_harness.device import Backend
from rpa_harness.failures import (  # noqa: F401  (the failures the checks raise, part of their interface)
    CacheMismatch,
    DoesNotCompile,
    NeedsMoreSmem,
    NeedsMoreVmem,
    NonFiniteOutput,
    OutputsDiffer,
    OverTheBound,
    PropertyFailure,
    RaisedOnValidInput,
    WouldHaltATpu,
    WrongOutputLayout,
    WrongRejection,
    located,
    numeric_failure,
    would_halt_a_tpu,
)
from rpa_harness.interpret_compat.limitations import recognise
from rpa_harness.property_names import COMPILATION, DETERMINISM, DIFFERENTIAL, KINDS, PADDING, VALIDATION
from rpa_harness.targets import Target, first_line_of_error

# Raised while a kernel is traced on shapes alone by a target that reads its inputs' values in Python (an
# adapter converting with NumPy): such a target cannot be compiled ahead of time, which is no finding.
_NEEDS_CONCRETE_VALUES = (
    jax.errors.ConcretizationTypeError,
    jax.errors.TracerArrayConversionError,
    jax.errors.TracerBoolConversionError,
    jax.errors.TracerIntegerConversionError,
)


def check_compiles(target: Target, backend: Backend, arrays: dict, options: dict) -> None:
    """The target's kernel compiles for the backend's TPU generation (``ahead_of_time``: the real Mosaic
    compiler on this host; only the arrays' shapes and dtypes are read, nothing is called)."""
    generation = backend.generation
    chip = f"{generation} ({generations.DEVICE_KINDS.get(generation, 'unknown')})"
    try:
        call, inputs = kernel_call(target, generation, arrays, options)
        ahead_of_time.compile_for(generation, call, inputs)
    except ahead_of_time.CompilerUnavailable as error:
        raise CannotRun(str(error)) from None
    except _NEEDS_CONCRETE_VALUES as error:
        raise CannotRun(
            f"it reads its inputs' values while it is traced, so it cannot be compiled from shapes alone "
            f"({first_line_of_error(error)})"
        ) from None
    except ahead_of_time.CompilerRefusal as refusal:
        raise _refused(target, chip, options, refusal.error) from None
    except Exception as error:  # raised by the kernel itself while it was traced
        error_type = type(error).__name__
        message = first_line_of_error(error)
        raise RaisedOnValidInput(
            f"{target.name} raised on valid inputs while traced for {chip}: {message}",
            error_type,
            message.removeprefix(f"{error_type}: "),
        ) from None


def kernel_call(target: Target, generation: str, arrays: dict, options: dict):
    """What the compile property compiles (and ``rpa-harness bench`` times), and on which arrays: the
    target's call on the case's arrays, or the kernel function and arguments its ``compiled_call`` maps
    them to on the host (under the generation's emulation, as the call would map them on that chip). The
    call takes the arrays as keywords."""
    if target.compiled_call is None:
        return (lambda **inputs: target.attention(inputs, options)), arrays
    with generations.emulated(generation), generations.hooked(target.generation_hook):
        function, arguments = target.compiled_call(arrays, options)
    present = {f"argument_{index}": value for index, value in enumerate(arguments) if value is not None}

    def call(**inputs):
        with generations.hooked(target.generation_hook):
            return function(*(inputs.get(f"argument_{index}") for index in range(len(arguments))))

    return call, present


def _refused(target: Target, chip: str, options: dict, error: BaseException) -> DoesNotCompile:
    """The failure a compiler's refusal is: of VMEM, of SMEM, or any other."""
    said = ahead_of_time.compiler_message(error)
    if ahead_of_time.is_vmem_overflow(error):
        limit = options.get("vmem_limit_bytes")
        given = f"vmem_limit_bytes={limit}" if limit is not None else "vmem_limit_bytes not given"
        return NeedsMoreVmem(f"{target.name} needs more VMEM than {chip}'s scoped limit ({given}): {said}")
    if ahead_of_time.is_smem_overflow(error):
        return NeedsMoreSmem(f"{target.name} needs more SMEM than {chip} has: {said}")
    return DoesNotCompile(f"{target.name} does not compile for {chip}: {said}")


class CannotRun(Exception):
    """The target cannot run on this backend for a recognised reason (an interpreter limitation)."""


def declared_unrunnable(target: Target, backend: Backend, *, by_default: bool = False) -> str | None:
    """The reason the target declares it does not run on the backend, or None. ``by_default``: the backend
    was not chosen by name (--rpa-backend=auto), so one the target declares slow does not run either."""
    capabilities = target.capabilities
    # Compiling for a chip is for a kernel that runs on one.
    runs_on = device.TPU if backend.name == device.TPU_COMPILER else backend.name
    if runs_on not in capabilities.backends:
        return (
            f"it declares backends={capabilities.backends} in RPA_HARNESS_CAPABILITIES "
            f"(declared, not {runs_on})"
        )
    if by_default and backend.name in capabilities.slow_backends:
        return (
            f"it declares slow_backends={capabilities.slow_backends} in RPA_HARNESS_CAPABILITIES (too slow "
            f"for a campaign; --rpa-backend={backend.name} runs it there)"
        )
    return None


def check_differential(
    target: Target, backend: Backend, arrays: dict, options: dict, seconds: dict | None = None
):
    """The target's output matches the float64 oracle within the tolerance model of its precision
    contract on this backend (``target.precision_on``), on valid rows. On a chip the oracle runs on a host
    thread while the chip runs the kernel (on the interpreters the kernel's call keeps the host's cores
    busy). ``seconds``, where given, receives the seconds of the kernel's call (``call_s``), the oracle
    (``oracle_s``) and the comparison (``judge_s``)."""
    seconds = {} if seconds is None else seconds
    started = time.perf_counter()
    if backend.name == device.TPU:
        expected = _oracle_thread().submit(_timed, reference.oracle, arrays, options)
        actual = run_valid(target, backend, arrays, options)
        seconds["call_s"] = time.perf_counter() - started
        expected, seconds["oracle_s"] = expected.result()
    else:
        actual = run_valid(target, backend, arrays, options)
        seconds["call_s"] = time.perf_counter() - started
        expected, seconds["oracle_s"] = _timed(reference.oracle, arrays, options)
    judging = time.perf_counter()
    comparison = reference.compare(
        actual, expected, label=f"{target.name} on {backend.label}", precision=target.precision_on(backend)
    )
    seconds["judge_s"] = time.perf_counter() - judging
    if not comparison.ok:
        raise numeric_failure(comparison, arrays, backend)
    return comparison


def _timed(function, arrays: dict, options: dict) -> tuple:
    started = time.perf_counter()
    return function(**arrays, **options), time.perf_counter() - started


@functools.cache
def _oracle_thread() -> concurrent.futures.ThreadPoolExecutor:
    """The one thread that computes oracles beside the chip (NumPy releases the GIL in its array work)."""
    return concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="rpa-oracle")


def run_valid(target: Target, backend: Backend, arrays: dict, options: dict) -> np.ndarray:
    """Runs the target on valid inputs and checks the output's contract (shape, dtype, finite live rows).

    An exception is a failure (an out-of-bounds read, a race, a crash of the kernel; an exit that would halt
    a TPU is one of its own kind), unless it is a recognised interpreter limitation (``CannotRun``).
    """
    label = f"{target.name} on {backend.name}"
    try:
        result = backend.run(target.attention, arrays, options)
    except device.WouldHaltTpu as error:
        raise would_halt_a_tpu(f"{label}: {error}", _live_kv_lens(arrays)) from None
    except Exception as error:
        message = first_line_of_error(error)
        reason = recognise(error)
        if reason is not None:
            raise CannotRun(f"{reason} (recognised: {message})") from None
        if backend.name == device.TPU and ahead_of_time.is_refusal(error):
            raise _refused(target, device.chip_in_words(), options, error) from None
        error_type = type(error).__name__
        raise located(RaisedOnValidInput, _live_kv_lens(arrays))(
            f"{label} raised on valid inputs: {message}{jax_drift_hint(error)}",
            error_type,
            message.removeprefix(f"{error_type}: "),
        ) from None
    out, cache = attention_and_cache(target, result, label)
    check_contract(out, arrays, label)
    if target.updates_cache:
        check_updated_cache(cache, arrays, label)
    return out


def _live_kv_lens(arrays: dict) -> np.ndarray:
    return np.asarray(arrays["kv_lens"])[: int(np.asarray(arrays["num_seqs"])[0])]


def attention_and_cache(target: Target, result, label: str) -> tuple:
    """A call's result as (attention, updated cache): a target declaring ``RPA_HARNESS_UPDATES_CACHE``
    returns the pair, any other the attention alone (the cache then None)."""
    if not target.updates_cache:
        return result, None
    if not (isinstance(result, tuple | list) and len(result) == 2):
        raise WrongOutputLayout(
            f"{label}: returned {type(result).__name__}; a target declaring RPA_HARNESS_UPDATES_CACHE returns "
            "(attention, updated kv_pages)"
        )
    return result[0], result[1]


_JAX_NAME_MISSING = re.compile(
    r"module '(?P<module>jax[\w.]*)' has no attribute '(?P<name>\w+)'|cannot import name '(?P<imported>\w+)' from "
    r"'(?P<source>jax[\w.]*)'"
)


def jax_drift_hint(error: BaseException) -> str:
    """For a kernel that uses a jax name the installed jax lacks (``pltpu.ANY``, a private ``jax._src``
    helper), what it means and what to do; else ''."""
    if not isinstance(error, AttributeError | ImportError):
        return ""
    found = _JAX_NAME_MISSING.search(str(error))
    if found is None:
        return ""
    name = f"{found['module'] or found['source']}.{found['name'] or found['imported']}"
    return (
        f"\n  (jax {jax.__version__} has no {name}: the kernel was written against another jax version. Run "
        "it on the jax it supports, or update the kernel to this jax's API; a private jax._src name may move "
        "in any release)"
    )


def check_contract(out: np.ndarray, arrays: dict, label: str) -> None:
    """The output has q's shape and dtype, and no NaN or Inf in a row some sequence owns."""
    q = np.asarray(arrays["q"])
    if out.shape != q.shape:
        raise WrongOutputLayout(
            f"{label}: output shape {out.shape}; the specification is q's shape {q.shape} "
            "([max_num_batched_tokens, num_q_heads, head_dim])"
        )
    if out.dtype != q.dtype:
        raise WrongOutputLayout(
            f"{label}: output dtype {out.dtype}; the specification is q's dtype {q.dtype}"
        )
    rows = valid_rows(arrays)
    finite = np.isfinite(out[rows].astype(np.float64))
    if not finite.all():
        token, head, dim = np.argwhere(~finite)[0]
        row = int(rows[token])
        cu_q_lens = np.asarray(arrays["cu_q_lens"])
        num_seqs = int(np.asarray(arrays["num_seqs"])[0])
        sequence = int(np.searchsorted(cu_q_lens[1 : num_seqs + 1], row, side="right"))
        owners = np.searchsorted(cu_q_lens[1 : num_seqs + 1], rows[~finite.all(axis=(1, 2))], side="right")
        raise located(NonFiniteOutput, np.asarray(arrays["kv_lens"])[owners])(
            f"{label}: {int((~finite).sum())} non-finite values in live rows (of {finite.size}); first at "
            f"sequence {sequence}, token {row - int(cu_q_lens[sequence])} (row {row}), head {head}, dim {dim}: "
            f"{out[row, head, dim]!r}"
        )


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
            raise WrongRejection(
                f"{where} raised ValueError with the wrong message.\n  expected: {expected}\n  got:      {error}"
            ) from None
        return
    except Exception as error:
        raise WrongRejection(
            f"{where} raised {first_line_of_error(error)}\n  expected: ValueError: {expected}"
        ) from None
    raise WrongRejection(f"{where} accepted the input.\n  expected: ValueError: {expected}")


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
        raise OutputsDiffer(
            f"{what}: {int((~same).sum())} of {same.size} valid output elements differ; first at row "
            f"{int(rows[token])}, head {head}, dim {dim}: {a[token, head, dim]!r} vs {b[token, head, dim]!r}"
        )


def check_padding_isolation(target: Target, backend: Backend, case, dirty: dict | None = None) -> None:
    """Valid rows are bit-identical with clean padding and with NaN pages/tails/rows and garbage metadata.

    The clean call runs twice first: a non-deterministic kernel is reported as such, not as a padding leak.
    ``dirty``: the dirty case's arrays when the caller has built them already (to record the example).
    """
    clean = dataclasses.replace(case, poison=False, garbage=False).arrays()
    if dirty is None:
        dirty = dataclasses.replace(case, poison=True, garbage=True).arrays()
    clean_out = run_valid(target, backend, clean, case.options())
    check_same_bits(
        clean_out,
        run_valid(target, backend, clean, case.options()),
        valid_rows(clean),
        NON_DETERMINISTIC,
    )
    check_same_bits(
        clean_out,
        run_valid(target, backend, dirty, case.options()),
        valid_rows(clean),
        "padding changed the output (clean padding vs NaN pages/tails/rows and garbage metadata)",
    )


NON_DETERMINISTIC = "non-deterministic: two identical calls gave different bits"


def check_determinism(target: Target, backend: Backend, arrays: dict, options: dict) -> None:
    first = run_valid(target, backend, arrays, options)
    check_same_bits(first, run_valid(target, backend, arrays, options), valid_rows(arrays), NON_DETERMINISTIC)


def recheck(target: Target, backend: Backend, repro) -> None:
    """Re-runs the property a repro was written for (raises PropertyFailure while it still fails)."""
    kind = repro.kind
    if kind in target.properties:  # a property of the target's own
        target.properties[kind](target, backend, repro.arrays, repro.options)
    elif kind == DIFFERENTIAL:
        check_differential(target, backend, repro.arrays, repro.options)
    elif kind == VALIDATION:
        check_validation(target, backend, repro.arrays, repro.options, repro.stage, repro.expected_error)
    elif kind == PADDING:
        check_padding_isolation(target, backend, repro.case)
    elif kind == DETERMINISM:
        check_determinism(target, backend, repro.arrays, repro.options)
    elif kind == COMPILATION:
        check_compiles(target, backend, repro.arrays, repro.options)
    else:
        raise ValueError(
            f"unknown property kind {kind!r} in the repro: neither built in ({', '.join(KINDS)}) nor declared by "
            f"target {target.name} (its RPA_HARNESS_PROPERTIES)"
        )
