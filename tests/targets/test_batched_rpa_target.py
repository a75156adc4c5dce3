"""tpu-inference's batched RPA (experimental): v3's mapping with batched RPA's block sizes, both outputs
against the oracle and against v3's own reference, and what the target keeps off the CPU."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from rpa_harness import generations, reference, targets
from rpa_harness import repro as repro_files
from rpa_harness.checks import RaisedOnValidInput, check_differential
from rpa_harness.device import FAST_INTERPRET, INTERPRET, TPU, Backend
from rpa_harness.strategies.case import Case
from tests.cases import skip_without_tpu_inference

skip_without_tpu_inference(module_level=True)

from rpa_harness.targets import tpu_inference_batched_rpa as batched  # noqa: E402  (needs tpu-inference)
from rpa_harness.targets.tpu_inference import kernels  # noqa: E402
from rpa_harness.targets.tpu_inference_v3 import adapter as v3  # noqa: E402

TARGET = targets.load(targets.BATCHED_RPA_TARGET)
# Three decodes (a whole batch of two and one alone) and a prefill across two KV blocks; v6e's int16
# positions for bfloat16 queries.
CASE = Case(
    max_num_batched_tokens=12, max_num_seqs=5, pages_per_seq=4, total_num_pages=19, page_size=4, num_q_heads=4,
    num_kv_heads=2, head_dim=128, q_lens=(1, 1, 1, 5), kv_lens=(6, 3, 9, 13), num_kv_pages_per_block=2,
    num_queries_per_block=4, mask_value_meaning="replaces", sm_scale=0.1,
)  # fmt: skip


def write_ones_into_aliased_input(x_hbm, o_hbm, ones, semaphore):
    ones[...] = jnp.ones(ones.shape, ones.dtype)
    copy = pltpu.make_async_copy(ones, x_hbm, semaphore)
    copy.start()
    copy.wait()


def generic_interpreter_keeps_aliased_input_writes() -> bool:
    """Whether the generic interpreter keeps what a kernel writes into an input aliased to an output (jax
    0.10.2's returns the input unchanged; batched RPA writes its cache so: docs/experimental-kernels.md)."""
    x = jnp.zeros((8, 128), jnp.float32)

    def call(x):  # built while traced, under the interpreter's setting
        return pl.pallas_call(
            write_ones_into_aliased_input,
            out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
            in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=pl.BlockSpec(memory_space=pl.ANY),
            scratch_shapes=[pltpu.VMEM(x.shape, x.dtype), pltpu.SemaphoreType.DMA(())],
            input_output_aliases={0: 0},
        )(x)

    with pltpu.force_tpu_interpret_mode(True):
        return bool(np.asarray(jax.jit(call)(x))[0, 0] == 1.0)


@pytest.mark.parametrize(
    "backend",
    [Backend(FAST_INTERPRET, generation="v6e"), Backend(INTERPRET, generation="v6e")],
    ids=lambda b: b.label,
)
@pytest.mark.parametrize("dtypes", [("float32", "float32"), ("bfloat16", "float32")], ids="/".join)
def test_batched_rpa_matches_the_oracle_and_writes_its_cache(backend, dtypes):
    q_dtype, kv_dtype = dtypes
    case = dataclasses.replace(CASE, q_dtype=q_dtype, kv_dtype=kv_dtype)
    verdict = batched.judge(case.arrays(), case.options(), backend, precision=TARGET.precision_on(backend))
    assert verdict.comparison.ok, str(verdict.comparison)
    if backend.name == FAST_INTERPRET and not generic_interpreter_keeps_aliased_input_writes():
        assert verdict.cache_error is not None and verdict.cache_error.stale.any()  # the input, unchanged
        return
    assert verdict.cache_error is None, str(verdict.cache_error)


def test_a_query_block_of_no_tokens_races_with_nothing():
    """One 17-token prefill over 8-row query blocks: the kernel fetches an empty query block while the
    previous step's output is written back, which the TPU interpreter took for a race (tpu-empty-access-race)."""
    case = dataclasses.replace(
        CASE, q_lens=(17,), kv_lens=(17,), num_q_heads=8, num_kv_heads=4, head_dim=64, kv_dtype="bfloat16",
        max_num_batched_tokens=32, pages_per_seq=8, total_num_pages=9,
    )  # fmt: skip
    on_v6e = Backend(INTERPRET, generation="v6e")
    verdict = batched.judge(case.arrays(), case.options(), on_v6e, precision=TARGET.precision_on(on_v6e))
    assert verdict.comparison.ok and verdict.cache_error is None, str(verdict.comparison)


def test_batched_rpa_agrees_with_v3s_reference():
    """It has no reference of its own; v3's, on the same arguments, is a second oracle. They agree through
    the float64 oracle: v3's reference within the float32 bound, the kernel within its contract on v6e,
    where its float32 products are the chip's one bfloat16 pass (so not to v3's float32 last bits)."""
    arrays = dataclasses.replace(CASE, poison=False).arrays()
    inputs = batched.batched_inputs(**arrays, **CASE.options())
    on_v6e = Backend(FAST_INTERPRET, generation="v6e")
    with on_v6e.context():
        out, _ = batched.call_batched(inputs)
    options = {k: inputs.kwargs[k] for k in ("sm_scale", "sliding_window", "soft_cap", "mask_value")}
    expected, _ = v3.kernel().ref_ragged_paged_attention(*kernels.device_arrays(inputs.args), **options)
    result = reference.oracle(**arrays, **CASE.options())
    padded = np.zeros(result.out.shape, np.float32)  # rows past the live tokens are not judged
    padded[: len(expected)] = np.asarray(expected)
    assert reference.compare(padded, result, label="v3's reference").ok
    judged = reference.compare(np.asarray(out), result, precision=TARGET.precision_on(on_v6e))
    assert judged.ok, str(judged)


def test_the_case_gives_the_blocks_and_the_target_the_batching():
    inputs = batched.batched_inputs(**CASE.arrays(), **CASE.options())
    decode, mixed = inputs.decode_block_sizes, inputs.mixed_block_sizes
    assert (decode.bq_sz, decode.bkv_sz, decode.batch_size, decode.n_buffer) == (1, 8, 2, 3)
    assert (mixed.bq_sz, mixed.bq_c_sz, mixed.bkv_sz, mixed.batch_size, mixed.n_buffer) == (4, 2, 8, 2, 3)
    assert inputs.kwargs["kv_layout"] == batched.adapter.configs().KVLayout.HEAD_ALONG_SUBLANE
    none_given = dataclasses.replace(CASE, num_kv_pages_per_block=None, num_queries_per_block=None)
    assert batched.batched_inputs(**none_given.arrays(), **none_given.options()).decode_block_sizes is None


def test_the_interpreters_give_the_blocks_a_tpu_leaves_them_to_the_kernel():
    for name in (FAST_INTERPRET, INTERPRET):
        assert TARGET.capabilities_on(Backend(name, generation="v6e")).needs_block_sizes
    tpu = Backend(TPU)  # where it is a chip, the kernel's own blocks are drawn too
    assert TARGET.capabilities_on(tpu).needs_block_sizes == (not tpu.has_tpu_generation)


def test_bfloat16_queries_with_a_bfloat16_cache_are_drawn_only_off_the_cpu():
    excluded = TARGET.capabilities.excluded_dtype_pairs
    assert excluded == ((("bfloat16", "bfloat16"),) if jax.default_backend() == "cpu" else ())


def test_the_schedule_overrun_is_seen_where_bounds_are_checked_and_predicted():
    """A page table of 240,000 entries leaves the schedule kernel SMEM for 384 steps: its write-back of
    1,024 entries reads past a 768-entry array (the checking interpreter); the generic interpreter checks
    no bounds and gets the attention right. The predicate restates the kernel's sizes: it matches the repro
    and not the case it moves to."""
    issue = next(i for i in batched.RPA_HARNESS_CATALOGUE if "schedule-write-back" in i.name)
    case = repro_files.read(issue.repro).case
    with generations.emulated("v6e"):
        assert issue.matches(case)
        assert not issue.matches(issue.nearest_outside(case))
    arrays, options = case.arrays(), case.options()
    with pytest.raises(RaisedOnValidInput, match="Out-of-bounds read of .* smem"):
        check_differential(TARGET, Backend(INTERPRET, generation="v6e"), arrays, options)
    check_differential(TARGET, Backend(FAST_INTERPRET, generation="v6e"), arrays, options)
