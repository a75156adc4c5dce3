"""tpu-inference's context-parallel fork of v3 behind upstream's API: v3's adapter
(``rpa_harness.targets.tpu_inference_v3.adapter``) pointed at ``experimental/rpa_v3_cp/kernel.py``.

Without context parallelism (``cp_group_size`` and the PCP arrays left None) the fork takes v3's arguments
and computes v3's attention; its own validators and default block sizes decide what it runs. The call
maps exactly as v3's does, with the fork's module where v3's adapter reads the kernel's.
"""

import functools
import types

from rpa_harness.targets.tpu_inference import kernels
from rpa_harness.targets.tpu_inference_v3 import adapter as v3

_KERNEL_MODULE = "tpu_inference.kernels.experimental.rpa_v3_cp.kernel"


@functools.cache
def kernel() -> types.ModuleType:
    """The fork's kernel module, imported on first use (ImportError says how to install tpu-inference)."""
    return kernels.load_kernel_module(_KERNEL_MODULE)


def cp_inputs(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options) -> v3.V3Inputs:
    """v3's mapping, the fork validating the call and choosing the block sizes left to it."""
    return v3.v3_inputs(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, module=kernel(), **options)


def call_cp(inputs: v3.V3Inputs):
    """Runs the fork (on whatever backend the caller's context selects): ``(attention, updated cache)``."""
    return kernels.run_jitted(kernel().ragged_paged_attention, inputs)


def ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options):
    """Upstream's call on the fork: the attention (it raises its static validators' errors while tracing)."""
    out, _ = call_cp(cp_inputs(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options))
    return out


def dynamic_validate_inputs(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options):
    """The fork's own ``dynamic_validate_inputs`` (v3's rules and messages) on the mapped inputs."""
    inputs = cp_inputs(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options)
    kernel().dynamic_validate_inputs(
        *kernels.device_arrays(inputs.args), **v3.validator_options(inputs.kwargs)
    )
