"""tpu-inference's MLA v2 behind upstream's API: MLA v1's mapping (``tpu_inference_mla_v1.adapter``) with
what v2 changes.

v2 takes the latent query head-major (``ql_nope [H, T, lkv]``, ``q_pe`` stays ``[T, H, r]``) and returns the
attention head-major (``[H, T, lkv]``); it has no dynamic validator; and it takes precision options of its
own. The adapter passes ``s_dtype=float32``: with its default (bfloat16) v2 rounds the logits to bfloat16 and
takes the running max and the softmax weights in bfloat16, a precision choice no contract of the harness
states yet, so the default is not what this target judges. ``p_same_dtype_as_v`` keeps its default (P
rounded to the cache's dtype before P @ V, v_scale applied after: the ``probabilities-in-cache-dtype``
contract).

Its modules import ``sympy`` (``transpose.py``: ``divisors``) and, through ``tpu_inference.logger``, vllm; where
those are not installed (``pip install --no-deps``), ``kernel()`` stands in for the two names it uses.
"""

import functools
import importlib.util
import sys
import types

import jax.numpy as jnp
import numpy as np

from rpa_harness.targets.tpu_inference import arguments, kernels
from rpa_harness.targets.tpu_inference_mla_v1 import adapter as v1

_KERNEL_MODULE = "tpu_inference.kernels.mla.v2.kernel"
# The precision options the adapter passes (see the module's docstring).
PRECISION_OPTIONS = {"s_dtype": jnp.dtype(jnp.float32)}
# v2's only chip-dependent code is its default VMEM limit (vmem_limit_bytes=None reads the chip's VMEM
# capacity), as v3's: off a TPU the adapter passes v3's default (``arguments.vmem_limit``).


def _divisors(n: int) -> list[int]:
    """``sympy.divisors``, the one name v2's transpose imports from sympy."""
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})


def _stand_in_for_missing_imports() -> None:
    if importlib.util.find_spec("sympy") is None and "sympy" not in sys.modules:
        sympy = types.ModuleType("sympy")
        sympy.divisors = _divisors  # type: ignore[attr-defined]
        sys.modules["sympy"] = sympy
    kernels.stand_in_for_tpu_inference_logger()


@functools.cache
def kernel() -> types.ModuleType:
    """MLA v2's kernel module, imported on first use (ImportError says how to install it)."""
    kernels.load_kernel_module("tpu_inference.kernels.ragged_paged_attention.v3.util")  # the package stubs
    _stand_in_for_missing_imports()
    return kernels.load_kernel_module(_KERNEL_MODULE)


def mla_inputs(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options) -> v1.MlaInputs:
    """v1's mapping, the latent query head-major and v2's precision options added."""
    inputs = v1.mla_inputs(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options)
    ql_nope, *rest = inputs.args
    kwargs = {**inputs.kwargs, **PRECISION_OPTIONS}
    kwargs["vmem_limit_bytes"] = arguments.vmem_limit(kwargs["vmem_limit_bytes"])
    return v1.MlaInputs(
        (np.ascontiguousarray(ql_nope.transpose(1, 0, 2)), *rest),
        kwargs,
        inputs.lkv,
        inputs.head_dim,
    )


def call_mla(inputs: v1.MlaInputs):
    """Runs MLA v2 (on whatever backend the caller's context selects): ``(attention [H, T, lkv], cache)``."""
    return kernels.run_jitted(kernel().mla_ragged_paged_attention, inputs)


def ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options):
    """Upstream's call on MLA v2: ``(attention zero-padded to head_dim, updated cache in upstream's layout)``."""
    inputs = mla_inputs(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options)
    out, cache = call_mla(inputs)
    out = np.asarray(out).transpose(1, 0, 2)
    padded = np.zeros((*out.shape[:-1], inputs.head_dim), out.dtype)
    padded[..., : out.shape[-1]] = out
    return padded, v1.upstream_cache(cache, inputs.lkv, inputs.head_dim)
