"""Upstream's references (jax's ``ref_ragged_paged_attention``, tpu-inference v3's), run as one program.

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
