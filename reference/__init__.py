"""The references a kernel is judged against.

``ragged_paged_attention``: the plain-jnp reference (float32 path of the specification, jitted once per shape).
``oracle`` (in ``float64``): the float64 NumPy oracle, returning an ``OracleResult`` with the row map and
bound ingredients.
``error_bound`` / ``compare``: the tolerance model and the report (``Comparison``) built on it, under a
precision contract (``CONTRACTS``, ``parse_precision``; ``DEFAULT_PRECISION`` is float32 throughout).
"""

from rpa_harness.reference.float64 import OracleResult, oracle
from rpa_harness.reference.jnp_reference import ragged_paged_attention
from rpa_harness.reference.tolerance import (
    CONTRACTS,
    DEFAULT_PRECISION,
    Comparison,
    Mismatch,
    PrecisionError,
    compare,
    error_bound,
    parse_precision,
)

__all__ = [
    "CONTRACTS",
    "DEFAULT_PRECISION",
    "Comparison",
    "Mismatch",
    "OracleResult",
    "PrecisionError",
    "compare",
    "error_bound",
    "oracle",
    "parse_precision",
    "ragged_paged_attention",
]
