"""Targets: any importable module with upstream's ``ragged_paged_attention`` and ``dynamic_validate_inputs``.

A target may narrow what the strategies draw for it and opt into our stricter properties by defining
``RPA_HARNESS_CAPABILITIES`` (a dict of ``strategies.valid.Capabilities`` fields). Known modules without
such a declaration (upstream's) get theirs from ``KNOWN_CAPABILITIES``; any other module is held to the
full specified space and upstream's own errors only.
"""

import dataclasses
import importlib
import types

import jax.numpy as jnp
import numpy as np

from harness import known_issues
from strategies.valid import OUR_KERNEL, UPSTREAM_KERNEL, Capabilities

DEFAULT_TARGET = "kernel"
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
    known_issues: tuple = ()  # harness.known_issues.KnownIssue entries: their cases are not drawn

    def attention(self, arrays: dict, options: dict):
        """Calls the target's kernel on NumPy inputs (converted to jax arrays, as users call it)."""
        return self.module.ragged_paged_attention(**as_jax(arrays), **options)

    def validate(self, arrays: dict, options: dict) -> None:
        self.module.dynamic_validate_inputs(**as_jax(arrays), **options)


def as_jax(arrays: dict) -> dict:
    return {name: jnp.asarray(value) for name, value in arrays.items()}


def load(name: str) -> Target:
    """Imports a target by module name; raises TargetError with a usable message."""
    try:
        module = importlib.import_module(name)
    except ImportError as error:
        raise TargetError(
            f"--rpa-target={name}: cannot import it ({error}). Pass an importable module that defines "
            f"{' and '.join(REQUIRED_FUNCTIONS)}, e.g. --rpa-target={DEFAULT_TARGET}."
        ) from None
    missing = [fn for fn in REQUIRED_FUNCTIONS if not callable(getattr(module, fn, None))]
    if missing:
        raise TargetError(
            f"--rpa-target={name}: module {module.__name__} ({getattr(module, '__file__', '?')}) lacks "
            f"{', '.join(missing)}; a target must define {' and '.join(REQUIRED_FUNCTIONS)} with upstream's signatures."
        )
    declared = getattr(module, "RPA_HARNESS_CAPABILITIES", None)
    if declared is not None:
        capabilities = Capabilities(**declared)
    else:
        capabilities = KNOWN_CAPABILITIES.get(name, Capabilities())
    declared_issues = getattr(module, "RPA_HARNESS_KNOWN_ISSUES", KNOWN_ISSUES.get(name, ()))
    try:
        issues = known_issues.resolve(declared_issues, f"{name}.RPA_HARNESS_KNOWN_ISSUES")
    except known_issues.KnownIssueError as error:
        raise TargetError(str(error)) from None
    return Target(name, module, capabilities, issues)


def first_line_of_error(error: BaseException) -> str:
    """The real exception behind a JaxRuntimeError is on the last line of its embedded traceback."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[-1] if lines else ''}"[:300]


def smallest_output(target: Target, backend) -> np.ndarray:
    """Runs the target once on a tiny case it supports (used to tell whether it can run at all)."""
    from strategies.case import Case
    from strategies.valid import required_block_sizes

    caps = target.capabilities
    case = Case(
        max_num_batched_tokens=8,
        max_num_seqs=2,
        pages_per_seq=2,
        total_num_pages=4,
        page_size=caps.page_sizes[-1] if 16 not in caps.page_sizes else 16,
        num_q_heads=caps.num_kv_heads[0] * 2,
        num_kv_heads=caps.num_kv_heads[0],
        head_dim=caps.head_dims[0],
        q_lens=(3, 1),
        kv_lens=(5, 9),
    )
    if caps.needs_block_sizes:
        case = dataclasses.replace(case, **required_block_sizes({"pages_per_seq": case.pages_per_seq}))
    return backend.run(target.attention, case.arrays(), case.options())
