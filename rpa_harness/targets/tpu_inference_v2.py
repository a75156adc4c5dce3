"""tpu-inference's ragged paged attention v2 as a harness target: ``--rpa-target=rpa_harness.targets.tpu_inference_v2``.

RPA v2 (PyPI ``tpu-inference``, ``tpu_inference/kernels/ragged_paged_attention/v2/kernel.py``) has upstream
jax's API and, in 0.32.0, upstream's kernel: compared token by token with jax's
``ragged_paged_attention/kernel.py`` (0.10.2 and 0.12), it differs only in spelling (its own ``cdiv``,
``pltpu.MemorySpace``) and in one masked store (``ref[...] = jnp.where(mask, val, ref[...])`` for
``pltpu.store(ref, val, mask=mask)``). Its default block sizes come from jax's tuned table, which it imports
(the ``v2/tuned_block_sizes.py`` beside it is not read). So its profile is upstream's
(``rpa_harness.targets.upstream``): the same capabilities, the specification's rules and messages, and
upstream's findings, whose repros replay against v2 (``tests/properties/test_known_issues.py``).

The kernel is imported on first use (``RPA_HARNESS_KERNEL``), without ``tpu_inference/__init__.py``
(which imports vllm); install it as for v3: ``pip install --no-deps tpu-inference==0.32.0``.
"""

import functools
import types

from rpa_harness.targets import upstream
from rpa_harness.targets.tpu_inference.kernels import load_kernel_module
from rpa_harness.targets.tpu_inference.releases import installed_version

_KERNEL_MODULE = "tpu_inference.kernels.ragged_paged_attention.v2.kernel"


@functools.cache
def kernel() -> types.ModuleType:
    """v2's kernel module, imported on first use; raises ImportError saying how to install it."""
    return load_kernel_module(_KERNEL_MODULE)


def ragged_paged_attention(*args, **kwargs):
    return kernel().ragged_paged_attention(*args, **kwargs)


def dynamic_validate_inputs(*args, **kwargs):
    return kernel().dynamic_validate_inputs(*args, **kwargs)


def ref_ragged_paged_attention(*args, **kwargs):
    """v2's own reference, which ``rpa-harness report`` quotes beside the float64 oracle's value."""
    return kernel().ref_ragged_paged_attention(*args, **kwargs)


RPA_HARNESS_KERNEL = kernel
RPA_HARNESS_CAPABILITIES = upstream.RPA_HARNESS_CAPABILITIES
# v2/kernel.py: q @ K^T is a jnp.einsum and P @ V a jnp.dot, both without a precision: DEFAULT, one bfloat16
# pass for float32 operands on a TPU.
RPA_HARNESS_PRODUCT_PRECISION = "default"
RPA_HARNESS_KNOWN_ISSUES = upstream.RPA_HARNESS_KNOWN_ISSUES  # upstream's findings: the same kernel
RPA_HARNESS_VERSION = f"tpu-inference {installed_version()} (RPA v2)"
