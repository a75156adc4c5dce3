"""Upstream's references (jax's ``ref_ragged_paged_attention``, tpu-inference v3's), run as one program;
tpu-inference MLA v1's, held against a kernel's output.

Both loop in Python over the sequences their metadata name and slice by those lengths, so run op by op
each call dispatches a few hundred single operations, each compiled for its own shape (a jax 0.10 cache
lookup or an XLA compilation each). Jitted with the metadata as constants, the loop unrolls at trace time
and the whole reference compiles once per case: the same operations on the same values, with XLA free to
fuse them (the last bit of a float32 result may differ from op-by-op evaluation, well inside every
contract these references are compared under).
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu.ragged_paged_attention.kernel import ref_ragged_paged_attention

from rpa_harness.spec.interface import ARRAY_NAMES

METADATA_NAMES = ARRAY_NAMES[2:]  # after q and kv_pages: the integer arrays the references slice by


def as_one_program(reference, tensors, metadata, **options):
    """``reference(*tensors, *metadata, **options)`` compiled as one program: ``tensors`` traced, each of
    ``metadata`` (the integer arrays the reference slices by) a constant."""
    constants = [np.asarray(m) for m in metadata]
    program = jax.jit(lambda *traced: reference(*traced, *constants, **options))
    return program(*(jnp.asarray(t) for t in tensors))


def upstream_in_one_program(arrays: dict, q, kv_pages, **options):
    """jax's upstream ``ref_ragged_paged_attention`` as one program, on ``q`` and ``kv_pages`` (the values a
    test wants it to see) and the metadata of ``arrays``."""
    metadata = [arrays[name] for name in METADATA_NAMES]
    return as_one_program(ref_ragged_paged_attention, (q, kv_pages), metadata, **options)


def assert_matches_mla_v1_reference(out, arrays: dict, options: dict, num_tokens: int) -> None:
    """A latent attention kernel's output ``out`` against tpu-inference MLA v1's reference on v1's inputs for
    the same case: the rows of its ``num_tokens`` tokens, the 128 value dims of each head. The reference
    takes none of the kernel's tuning arguments."""
    from rpa_harness.targets import tpu_inference_mla_v1 as mla_v1

    inputs = mla_v1.mla_inputs(**arrays, **options)
    tuning = ("chunk_prefill_size", "num_kv_pages_per_block", "num_queries_per_block", "vmem_limit_bytes")
    kwargs = {k: v for k, v in inputs.kwargs.items() if k not in tuning}
    expected, _ = mla_v1.kernel().ref_mla_ragged_paged_attention(*inputs.args, **kwargs)
    rows = slice(0, num_tokens)
    np.testing.assert_allclose(out[rows, :, :128], np.asarray(expected)[rows, :, :128], rtol=1e-5, atol=1e-5)
