"""The checking backend fails an example on what the TPU interpreter detects, and recovers afterwards."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from rpa_harness import device
from rpa_harness.device import INTERPRET, Backend, RaceDetected
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
    code = "import time\nfrom rpa_harness.device import watchdog\nwith watchdog('a stuck call', 0.5):\n    time.sleep(30)\n"
    result = run_python("-c", code, cwd=".", timeout=60)
    assert result.returncode == 70
    assert (
        "a stuck call did not return within 0 s" in result.stderr or "did not return within" in result.stderr
    )


# A kernel that adds 1 to its output n times (n from SMEM): on the TPU interpreter each step is a few
# callbacks, so a large n is a call that runs for seconds while the interpreter keeps stepping. The script
# compiles it with n = 1 first, so that the watched call only runs.
STEPPING_CALL = """
import sys, time
import jax, jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from rpa_harness.device import INTERPRET, Backend, watchdog

def kernel(n_ref, x_ref, o_ref):
    o_ref[...] = x_ref[...]

    def add_one(i, carry):
        o_ref[...] = o_ref[...] + 1.0
        return carry

    jax.lax.fori_loop(0, n_ref[0], add_one, 0)

@jax.jit
def call(n):
    x = jnp.zeros((8, 128), jnp.float32)
    smem, vmem = pl.BlockSpec(memory_space=pltpu.SMEM), pl.BlockSpec(memory_space=pltpu.VMEM)
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), in_specs=[smem, vmem],
                          out_specs=vmem)(n, x)

backend = Backend(INTERPRET)
with backend.context():
    call(jnp.array([1], jnp.int32)).block_until_ready()
seconds, slow_timeouts, n = float(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
started = time.monotonic()
with backend.context(), watchdog("a stepping call", seconds, slow_timeouts=slow_timeouts):
    out = jax.block_until_ready(call(jnp.array([n], jnp.int32)))
print(f"returned {float(out[0, 0]):g} after {time.monotonic() - started:.1f} s")
"""


def test_watchdog_lets_a_call_that_keeps_stepping_run_past_its_timeout():
    """A long call on the TPU interpreter whose steps keep returning is slow, not stuck: it is not ended
    at its timeout (a loaded machine made such calls look like hangs)."""
    # A timeout short against the call however loaded the machine (3,000 steps took 0.6 s on a quiet one,
    # 6 s on a loaded one), so that the call outlives several timeouts either way.
    result = run_python("-c", STEPPING_CALL, "0.05", "1000000", "10000", cwd=".", timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    value, seconds = result.stdout.split()[1], float(result.stdout.split()[3])
    assert value == "10000" and seconds > 3 * 0.05, f"the call did not outlive its timeout: {result.stdout}"


def test_watchdog_ends_a_call_still_stepping_after_its_longest_watch_as_too_slow_not_a_hang():
    result = run_python("-c", STEPPING_CALL, "0.3", "2", "10000000", cwd=".", timeout=300)
    assert result.returncode == device.SLOW_EXIT_CODE, result.stdout[-1000:] + result.stderr[-2000:]
    assert "TOO SLOW: a stepping call was still running after 0.6 s" in result.stderr, result.stderr[-2000:]
    assert "not a hang" in result.stderr and "HANG" not in result.stderr


def test_faster_cpu_compilation_keeps_the_users_flags(monkeypatch):
    flags = {"xla_cpu_one": ("false", "true"), "xla_cpu_two": ("4", "1")}
    monkeypatch.setattr(device.compilation, "faster_cpu_compilation_flags", lambda: flags)
    assert device.faster_cpu_compilation({})["XLA_FLAGS"] == "--xla_cpu_one=false --xla_cpu_two=4"
    theirs = {"XLA_FLAGS": "--xla_dump_to=/tmp/d  --xla_cpu_one=true", "HOME": "/h"}
    assert device.faster_cpu_compilation(theirs) == {
        "XLA_FLAGS": "--xla_dump_to=/tmp/d --xla_cpu_one=true --xla_cpu_two=4",
        "HOME": "/h",
    }
    chosen = {"XLA_FLAGS": "--xla_cpu_two=1 --xla_cpu_one=false"}
    assert device.faster_cpu_compilation(chosen) == chosen
    monkeypatch.setattr(
        device.compilation, "faster_cpu_compilation_flags", dict
    )  # a jaxlib where none was measured
    assert device.faster_cpu_compilation(theirs) == theirs


def test_the_plugin_gave_this_process_the_faster_cpu_compilation():
    """Set in the environment at configuration, before the first computation (workers inherit it)."""
    assert device.faster_cpu_compilation(os.environ) == dict(os.environ)


def test_a_route_the_run_installs_makes_every_kernel_call():
    """Where a chip owner makes this process's calls, ``Backend.run`` sends each along the route (its
    backend, function and arguments) and returns its answer."""
    sent = []
    device.backends.route_calls(lambda backend, fn, args, kwargs: sent.append((backend.name, fn, args)) or 7)
    try:
        answer = Backend(INTERPRET).run(abs, -3)
    finally:
        device.backends.route_calls(None)
    assert answer == 7 and sent == [(INTERPRET, abs, (-3,))]
    assert Backend(INTERPRET).run(abs, -3) == 3
