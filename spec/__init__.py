"""The specification of ragged paged attention's interface (upstream's): options, defaults, input rules.

Kernel, references, oracle and strategies all read it from here (``rpa_harness.spec.interface``); it imports no kernel.
"""

from rpa_harness.spec.interface import (
    ARRAY_NAMES,
    DEFAULT_MASK_VALUE,
    OPTION_DEFAULTS,
    OPTION_NAMES,
    Options,
    dynamic_validate_inputs,
    static_validate_inputs,
    takes_options,
)

__all__ = [
    "ARRAY_NAMES",
    "DEFAULT_MASK_VALUE",
    "OPTION_DEFAULTS",
    "OPTION_NAMES",
    "Options",
    "dynamic_validate_inputs",
    "static_validate_inputs",
    "takes_options",
]
