"""Promises float32 but multiplies float32 operands at DEFAULT precision: the bundled kernel as it was before
it asked for HIGHEST. On a TPU that is one bfloat16 pass (2.8e-3 relative error measured on a v5e, 1.6e3
times the float32 bound at q_len 1, kv_len 1, head_dim 64); on an interpreter emulating a generation too
(``rpa_harness.interpret_compat.products``), so CPU CI sees what only the chip showed.

It declares ``RPA_HARNESS_PRODUCT_PRECISION = "highest"``, which its source contradicts. The kernel is a
fresh copy of the bundled kernel's module with its products at DEFAULT, so the bundled kernel itself (and
its jit cache) stays as it is.
"""

import importlib.util

from rpa_harness.kernel import (
    dynamic_validate_inputs,  # noqa: F401  (part of the target interface)
    pallas_rpa,
)
from tests.broken import SMALL_SPACE


def _kernel_with_default_products():
    spec = importlib.util.spec_from_file_location(f"{__name__}._kernel", pallas_rpa.__file__)
    kernel = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kernel)
    kernel._product_precision = lambda operand_dtype: None  # DEFAULT whatever the operands
    return kernel


RPA_HARNESS_CAPABILITIES = dict(SMALL_SPACE, q_dtypes=("float32",), tpu_generations=("v5e",))
RPA_HARNESS_PRODUCT_PRECISION = "highest"
ragged_paged_attention = _kernel_with_default_products().ragged_paged_attention
