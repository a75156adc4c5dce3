"""Targets: any importable module with upstream's ``ragged_paged_attention`` and ``dynamic_validate_inputs``.

A target may narrow what the strategies draw for it and opt into our stricter properties by defining
``RPA_HARNESS_CAPABILITIES`` (a dict of ``rpa_harness.strategies.valid.Capabilities`` fields). Known modules without
such a declaration (upstream's) get theirs from ``KNOWN_CAPABILITIES``; any other module is held to the
full specified space, on every backend, and upstream's own errors only.

A target declares the precision contract it is judged under with ``RPA_HARNESS_PRECISION`` (a tuple of
names from ``reference.CONTRACTS``, default float32 throughout); ``--rpa-precision`` overrides it.
"""

import dataclasses
import importlib
import importlib.util
import types

import jax
from rpa_harness import known_issues
from rpa_harness.reference.tolerance import DEFAULT_PRECISION, PrecisionError, parse_precision
from rpa_harness.strategies.valid import OUR_KERNEL, UPSTREAM_KERNEL, Capabilities

DEFAULT_TARGET = "rpa_harness.kernel"  # the bundled kernel
LEGACY_DEFAULT_TARGET = "kernel"  # its folder's name, which a checkout can still pass
UPSTREAM_TARGET = "jax.experimental.pallas.ops.tpu.ragged_paged_attention"
REQUIRED_FUNCTIONS = ("ragged_paged_attention", "dynamic_validate_inputs")
KNOWN_CAPABILITIES = {
    DEFAULT_TARGET: OUR_KERNEL,
    UPSTREAM_TARGET: UPSTREAM_KERNEL,
    f"{UPSTREAM_TARGET}.kernel": UPSTREAM_KERNEL,
}
# Known issues of modules without an RPA_HARNESS_KNOWN_ISSUES declaration (harness/known_issues.py).
KNOWN_ISSUES = {
    UPSTREAM_TARGET: known_issues.UPSTREAM_KNOWN_ISSUES,
    f"{UPSTREAM_TARGET}.kernel": known_issues.UPSTREAM_KNOWN_ISSUES,
}


class TargetError(Exception):
    """A target module that cannot be used; the message says why and what to pass instead."""


@dataclasses.dataclass(frozen=True)
class Target:
    name: str
    module: types.ModuleType
    capabilities: Capabilities
    precision: tuple[str, ...] = DEFAULT_PRECISION  # the precision contract its outputs are judged under
    known_issues: tuple = ()  # rpa_harness.known_issues.KnownIssue entries: their cases are not drawn

    def attention(self, arrays: dict, options: dict):
        """Calls the target's kernel on NumPy inputs (converted to jax arrays, as users call it)."""
        return self.module.ragged_paged_attention(**as_jax(arrays), **options)

    def validate(self, arrays: dict, options: dict) -> None:
        self.module.dynamic_validate_inputs(**as_jax(arrays), **options)


def as_jax(arrays: dict) -> dict:
    """The arrays as jax arrays: ``jax.device_put`` gives what ``jnp.asarray`` does (dtype, weak type,
    uncommitted placement) without compiling an identity per shape and dtype, as ``jnp.asarray`` does on
    jax 0.10."""
    return {name: jax.device_put(value) for name, value in arrays.items()}


def _bundled_kernel_under_its_folder_name(name: str) -> bool:
    """True for ``kernel`` when it would import this harness's own kernel folder (a checkout's ``kernel/``).

    The bundled kernel is ``rpa_harness.kernel``; importing its folder a second time as ``kernel`` would give a
    copy the harness does not know. A module of the user's own called ``kernel`` is theirs to test.
    """
    if name != LEGACY_DEFAULT_TARGET:
        return False
    try:
        found = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return False
    bundled = importlib.util.find_spec(DEFAULT_TARGET)
    return found is not None and bundled is not None and found.origin == bundled.origin


def load(name: str) -> Target:
    """Imports a target by module name; raises TargetError with a usable message."""
    if _bundled_kernel_under_its_folder_name(name):
        name = DEFAULT_TARGET
    try:
        module = importlib.import_module(name)
    except ImportError as error:
        bundled = (
            f" The bundled kernel is --rpa-target={DEFAULT_TARGET}." if name == LEGACY_DEFAULT_TARGET else ""
        )
        raise TargetError(
            f"--rpa-target={name}: cannot import it ({error}). Pass an importable module that defines "
            f"{' and '.join(REQUIRED_FUNCTIONS)}, e.g. --rpa-target={DEFAULT_TARGET}.{bundled}"
        ) from None
    missing = [fn for fn in REQUIRED_FUNCTIONS if not callable(getattr(module, fn, None))]
    if missing:
        raise TargetError(
            f"--rpa-target={name}: module {module.__name__} ({getattr(module, '__file__', '?')}) lacks "
            f"{', '.join(missing)}; a target must define {' and '.join(REQUIRED_FUNCTIONS)} with upstream's signatures."
        )
    declared = getattr(module, "RPA_HARNESS_CAPABILITIES", None)
    if declared is not None:
        try:
            capabilities = Capabilities(**declared)
        except (TypeError, ValueError) as error:
            raise TargetError(f"--rpa-target={name}: RPA_HARNESS_CAPABILITIES: {error}") from None
    else:
        capabilities = KNOWN_CAPABILITIES.get(name, Capabilities())
    try:
        precision = parse_precision(getattr(module, "RPA_HARNESS_PRECISION", DEFAULT_PRECISION))
    except PrecisionError as error:
        raise TargetError(f"--rpa-target={name}: RPA_HARNESS_PRECISION: {error}") from None
    declared_issues = getattr(module, "RPA_HARNESS_KNOWN_ISSUES", KNOWN_ISSUES.get(name, ()))
    try:
        issues = known_issues.resolve(declared_issues, f"{name}.RPA_HARNESS_KNOWN_ISSUES")
    except known_issues.KnownIssueError as error:
        raise TargetError(str(error)) from None
    return Target(name, module, capabilities, precision, issues)


def first_line_of_error(error: BaseException) -> str:
    """The real exception behind a JaxRuntimeError is on the last line of its embedded traceback."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[-1] if lines else ''}"[:300]
