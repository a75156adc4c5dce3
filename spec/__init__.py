"""The specification of ragged paged attention's interface (upstream's): options, defaults, input rules.

Kernel, references, oracle and strategies all read it from here (``rpa_harness.spec.interface``); it imports no kernel.
"""

from rpa_harness.spec.interface import (
    ALL_OPTION_NAMES,
    ARRAY_NAMES,
    DEFAULT_MASK_VALUE,
    EXTENSION_NAMES,
    MASK_ADDED,
    MASK_REPLACES,
    OPTION_DEFAULTS,
    OPTION_NAMES,
    Options,
    dynamic_validate_inputs,
    static_validate_inputs,
    takes_extended_options,
    takes_options,
)

__all__ = [
    "ALL_OPTION_NAMES",
    "ARRAY_NAMES",
    "DEFAULT_MASK_VALUE",
    "EXTENSION_NAMES",
    "MASK_ADDED",
    "MASK_REPLACES",
    "OPTION_DEFAULTS",
    "OPTION_NAMES",
    "Options",
    "dynamic_validate_inputs",
    "static_validate_inputs",
    "takes_extended_options",
    "takes_options",
]
