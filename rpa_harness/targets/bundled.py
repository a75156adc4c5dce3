"""The bundled kernel (``rpa_harness.kernel``): its profile.

The kernel stays free of the harness (the judged imports nothing of the judges), so its declaration is
kept here. It is held to the specification's rules with our stricter ValueErrors (``strict_validation``),
lowers to Mosaic on CPU, runs every bucket, and takes the runtime options as traced values.
"""

from rpa_harness import __version__
from rpa_harness.strategies.capabilities import RUNTIME_OPTIONS, Capabilities

RPA_HARNESS_CAPABILITIES = Capabilities(
    strict_validation=True,
    lowers_for_tpu=True,
    buckets=("tiny", "small", "medium", "long", "production"),
    runtime_options=RUNTIME_OPTIONS,
)
# pallas_rpa._product_precision: q @ K^T and P @ V pass HIGHEST for float32 operands, keeping the float32
# promise on a TPU.
RPA_HARNESS_PRODUCT_PRECISION = "highest"
# The harness's own release: the kernel ships with it (an editable install's metadata can be older).
RPA_HARNESS_VERSION = f"rpa-harness {__version__}"
