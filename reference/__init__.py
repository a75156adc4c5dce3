"""The references a kernel is judged against.

``ragged_paged_attention``: the plain-jnp reference (float32 path of the specification, jitted once per shape).
``oracle``: the float64 NumPy oracle, returning an ``OracleResult`` with the row map and bound ingredients.
``error_bound`` / ``compare``: the tolerance model and the report (``Comparison``) built on it.
"""

from reference.jnp_reference import ragged_paged_attention
from reference.oracle import OracleResult, oracle
from reference.tolerance import Comparison, Mismatch, compare, error_bound

__all__ = [
    "Comparison",
    "Mismatch",
    "OracleResult",
    "compare",
    "error_bound",
    "oracle",
    "ragged_paged_attention",
]
