"""Our Pallas TPU ragged paged attention kernel, with upstream's API (validators from ``spec``)."""

from rpa_harness.kernel.pallas_rpa import ragged_paged_attention
from rpa_harness.spec.interface import (
    DEFAULT_MASK_VALUE,
    dynamic_validate_inputs,
    static_validate_inputs,
)

__all__ = [
    "DEFAULT_MASK_VALUE",
    "dynamic_validate_inputs",
    "ragged_paged_attention",
    "static_validate_inputs",
]
