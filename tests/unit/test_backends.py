"""The checking backend fails an example on what the TPU interpreter detects, and recovers afterwards."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from rpa_harness import backends
from rpa_harness.backends import INTERPRET, Backend, RaceDetected

from tests.processes import run_python

X = jnp.arange(16 * 128, dtype=jnp.float32).reshape(16, 128)


def copy_rows(read_before_wait: bool):
    """A kernel that DMAs 8 rows of HBM, from a row given at run time, into VMEM and reads them before
    or after waiting."""

    def kernel(row_ref, x_hbm, o_ref, buffer, semaphore):
        copy = pltpu.make_async_copy(x_hbm.at[pl.ds(row_ref[0], 8)], buffer, semaphore)
        copy.start()
        if read_before_wait:
            o_ref[...] = buffer[...]
        copy.wait()
        if not read_before_wait:
            o_ref[...] = buffer[...]

    def call(row, x):
        return pl.pallas_call(
            kernel,
            out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=1,
                grid=(1,),
                in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
                out_specs=pl.BlockSpec((8, 128), lambda i, row: (0, 0)),
                scratch_shapes=[pltpu.VMEM((8, 128), jnp.float32), pltpu.SemaphoreType.DMA(())],
            ),
        )(row, x)

    return jax.jit(call)


ROW_8 = jnp.array([8], jnp.int32)


def test_checking_backend_runs_a_correct_kernel():
    out = Backend(INTERPRET).run(copy_rows(read_before_wait=False), ROW_8, X)
    np.testing.assert_array_equal(out, np.asarray(X[8:]))


def test_checking_backend_fails_on_a_race_then_recovers():
    with pytest.raises(RaceDetected):
        Backend(INTERPRET).run(copy_rows(read_before_wait=True), ROW_8, X)
    out = Backend(INTERPRET).run(copy_rows(read_before_wait=False), ROW_8, X)
    np.testing.assert_array_equal(out, np.asarray(X[8:]))


def test_checking_backend_raises_on_an_out_of_bounds_dma_then_recovers():
    with pytest.raises(Exception, match="(?i)out of bounds|IndexError|out-of-bounds"):
        Backend(INTERPRET).run(copy_rows(read_before_wait=False), jnp.array([12], jnp.int32), X)
    out = Backend(INTERPRET).run(copy_rows(read_before_wait=False), ROW_8, X)
    np.testing.assert_array_equal(out, np.asarray(X[8:]))


def test_watchdog_kills_a_hung_call_with_a_message():
    """A call that never returns ends the process (signals cannot interrupt a stuck DMA wait)."""
    code = "import time\nfrom rpa_harness.backends import watchdog\nwith watchdog('a stuck call', 0.5):\n    time.sleep(30)\n"
    result = run_python("-c", code, cwd=".", timeout=60)
    assert result.returncode == 70
    assert (
        "a stuck call did not return within 0 s" in result.stderr or "did not return within" in result.stderr
    )


def test_faster_cpu_compilation_keeps_the_users_flags(monkeypatch):
    flags = {"xla_cpu_one": ("false", "true"), "xla_cpu_two": ("4", "1")}
    monkeypatch.setattr(backends, "faster_cpu_compilation_flags", lambda: flags)
    assert backends.faster_cpu_compilation({})["XLA_FLAGS"] == "--xla_cpu_one=false --xla_cpu_two=4"
    theirs = {"XLA_FLAGS": "--xla_dump_to=/tmp/d  --xla_cpu_one=true", "HOME": "/h"}
    assert backends.faster_cpu_compilation(theirs) == {
        "XLA_FLAGS": "--xla_dump_to=/tmp/d --xla_cpu_one=true --xla_cpu_two=4",
        "HOME": "/h",
    }
    chosen = {"XLA_FLAGS": "--xla_cpu_two=1 --xla_cpu_one=false"}
    assert backends.faster_cpu_compilation(chosen) == chosen
    monkeypatch.setattr(backends, "faster_cpu_compilation_flags", dict)  # a jaxlib where none was measured
    assert backends.faster_cpu_compilation(theirs) == theirs


def test_the_plugin_gave_this_process_the_faster_cpu_compilation():
    """Set in the environment at configuration, before the first computation (workers inherit it)."""
    assert backends.faster_cpu_compilation(os.environ) == dict(os.environ)
