"""The checking interpreter's exit check (gap tpu-exit-state): a kernel that ends with a DMA never waited or
a semaphore count left would halt a TPU, so on the ``interpret`` backend it fails, a failure of its own
kind; upstream's kernel does so wherever its known issue unwaited-kv-prefetch-halts-the-chip says."""

import dataclasses
import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from rpa_harness import checks, failures, generations, interpret_compat, targets
from rpa_harness import repro as repro_files
from rpa_harness.device import INTERPRET, Backend, WouldHaltTpu
from rpa_harness.interpret_compat import tpu as tpu_gaps
from rpa_harness.property_names import DIFFERENTIAL, PropertyName
from rpa_harness.recording import recorded
from rpa_harness.strategies.case import Case
from rpa_harness.strategies.valid import valid_cases
from rpa_harness.targets import upstream
from tests.cases import drawn_cases
from tests.compat_layer import layer_installed, layer_off

CHECKING = Backend(INTERPRET)
ISSUE = {issue.name: issue for issue in upstream.RPA_HARNESS_CATALOGUE}["unwaited-kv-prefetch-halts-the-chip"]
# Drawn upstream cases the predicate is held to the exit check on (about 0.1 s each, a compilation per
# configuration).
DRAWN = 40


@pytest.fixture(autouse=True, scope="module")
def compat_layer():
    with layer_installed():
        yield


# --- small kernels --------------------------------------------------------------------------------------


def start_a_copy_and_return(x_hbm, o_ref, buffer, semaphore):
    pltpu.make_async_copy(x_hbm, buffer, semaphore).start()
    o_ref[...] = jnp.zeros_like(o_ref)


def signal_and_return(x_ref, o_ref, semaphore):
    pl.semaphore_signal(semaphore, 1)
    o_ref[...] = x_ref[...]


def copy_and_wait(x_hbm, o_ref, buffer, semaphore):
    copy = pltpu.make_async_copy(x_hbm, buffer, semaphore)
    copy.start()
    copy.wait()
    o_ref[...] = buffer[...] + 1.0


def copy_rows_and_wait(rows_ref, x_hbm, o_ref, buffer, semaphore):
    """Copies ``rows_ref[0]`` rows (0 here: a copy of no elements, whose wait needs 0 bytes) and waits."""
    rows = rows_ref[0]
    copy = pltpu.make_async_copy(x_hbm.at[pl.ds(0, rows)], buffer.at[pl.ds(0, rows)], semaphore)
    copy.start()
    copy.wait()
    o_ref[...] = jnp.zeros_like(o_ref)


X = jnp.arange(8 * 128, dtype=jnp.float32).reshape(8, 128)
COPY = dict(in_specs=[pl.BlockSpec(memory_space=pl.ANY)], scratch_shapes=[pltpu.VMEM((8, 128), jnp.float32), pltpu.SemaphoreType.DMA])  # fmt: skip
SIGNAL = dict(scratch_shapes=[pltpu.SemaphoreType.REGULAR])


def call(kernel, spec: dict):
    """A jitted pallas_call of ``kernel`` built when traced (fresh: no call traced before the layer)."""
    return jax.jit(
        lambda x: pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32), **spec)(x)
    )


def test_a_dma_never_waited_would_halt_a_tpu_naming_where_it_started():
    with pytest.raises(
        WouldHaltTpu,
        match=r"would halt a TPU: it ends with a DMA started at test_exit_state\.py:\d+ "
        r"\(start_a_copy_and_return\) and never waited \(semaphore \d+\)",
    ):
        CHECKING.run(call(start_a_copy_and_return, COPY), X)


def test_a_semaphore_count_left_would_halt_a_tpu():
    with pytest.raises(WouldHaltTpu, match=r"it ends with semaphore \d+ at count 1, not 0"):
        CHECKING.run(call(signal_and_return, SIGNAL), X)


def test_a_kernel_that_waits_for_its_copies_passes_also_right_after_one_that_would_halt():
    """The failed call leaves no ordered-effect token behind: on jax 0.10.2 one holding its error made later
    calls fail with it, unrun (sometimes: seen with upstream's kernel)."""
    from jax._src import dispatch

    with pytest.raises(WouldHaltTpu):
        CHECKING.run(call(start_a_copy_and_return, COPY), X)
    assert not dispatch.runtime_tokens.current_tokens
    np.testing.assert_array_equal(CHECKING.run(call(copy_and_wait, COPY), X), np.asarray(X) + 1.0)


def test_a_copy_of_no_elements_is_left_out():
    """Its wait needs 0 bytes, which the semaphore has at once, so the interpreter never runs it: a task still
    queued at the end though it was waited for."""
    spec = dict(COPY, in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM), *COPY["in_specs"]])
    copy_no_rows = jax.jit(
        lambda rows, x: pl.pallas_call(
            copy_rows_and_wait, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32), **spec
        )(rows, x)
    )
    np.testing.assert_array_equal(
        CHECKING.run(copy_no_rows, jnp.array([0], jnp.int32), X), np.zeros((8, 128))
    )


def test_gap_exit_state_still_in_tpu_interpreter():
    """Without the layer jax ends such a kernel quietly (a count printed at most, a DMA never waited not even
    that), as the probe says; with the layer the probe's exit raises."""
    state = interpret_compat.gap_statuses()["tpu-exit-state"].state
    with layer_off():
        lacks_the_check = tpu_gaps._exit_state_probe()
        with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):
            ended_quietly = True
            try:
                call(start_a_copy_and_return, COPY)(X).block_until_ready()
            except Exception:  # noqa: BLE001 - jax raising here is what closing the gap means
                ended_quietly = False
                pltpu.reset_tpu_interpret_mode_state()
    assert lacks_the_check == (state != interpret_compat.CLOSED) == ended_quietly
    if not lacks_the_check:
        warnings.warn(
            f"jax {jax.__version__} now fails a kernel that ends with a DMA never waited: the tpu-exit-state "
            "patch can go once this jax is the lowest supported version.",
            stacklevel=1,
        )
    assert tpu_gaps._exit_state_probe() is False


# --- upstream's kernel ----------------------------------------------------------------------------------

UPSTREAM = targets.load(targets.UPSTREAM_TARGET)
# The configuration of the empty batch that halted a v5e alone in a fresh process, with block sizes given.
EMPTY_BATCH = repro_files.read(ISSUE.repro).case


def test_the_recorded_empty_batch_fails_as_would_halt_a_tpu():
    repro = repro_files.read(ISSUE.repro)
    assert repro.case.num_seqs == 0 and repro.backend == INTERPRET
    with pytest.raises(checks.WouldHaltATpu, match="prefetch_first_kv_blk") as failure:
        checks.recheck(UPSTREAM, CHECKING, repro)
    assert ISSUE.shows(str(failure.value))


def test_a_zero_query_sequence_fails_with_its_kind_and_a_decode_passes(tmp_path):
    """A recorded failure says its kind (what Hypothesis tells apart, and the report's ``failure kind``)."""
    zero = dataclasses.replace(EMPTY_BATCH, q_lens=(0,), kv_lens=(5,))
    name = PropertyName(DIFFERENTIAL, "checked", CHECKING.label)
    with pytest.raises(checks.WouldHaltATpu) as failure:
        with recorded(tmp_path, name, UPSTREAM, CHECKING, zero.arrays(), zero.options(), case=zero):
            checks.check_differential(UPSTREAM, CHECKING, zero.arrays(), zero.options())
    assert "\n  failure kind: would halt a TPU\n" in str(failure.value)
    assert failures.EXIT_STATE_CHECK.note() in str(failure.value)  # the release that made it a failure
    assert ISSUE.name in str(failure.value)  # the known issue the case matches
    decode = dataclasses.replace(EMPTY_BATCH, q_lens=(1,), kv_lens=(5,))
    assert checks.check_differential(UPSTREAM, CHECKING, decode.arrays(), decode.options()).ok


def exit_check_fires(case: Case, backend: Backend = CHECKING) -> bool:
    try:
        backend.run(UPSTREAM.attention, case.arrays(), case.options())
    except WouldHaltTpu:
        return True
    return False


# Where the kernel's loops leave a copy unwaited, and where they do not (q_len == 0 kept drawn there).
LAYOUTS = [
    ((), ()),  # an empty batch
    ((0,), (0,)),  # no query rows
    ((0, 0), (3, 0)),
    ((1, 0), (1, 0)),  # the last sequence has no keys
    ((1, 0, 1), (1, 0, 1)),  # a sequence without keys between two with rows
    ((8, 0), (8, 5)),  # rows end on a query-block boundary, then a sequence the loop never reaches
    ((5, 0), (5, 5)),  # rows end inside a query block: the loop reaches the q_len == 0 sequence
    ((0, 0, 1), (0, 3, 1)),
    ((30, 2, 0), (30, 97, 100)),  # halted a v5e (its block sizes not recorded)
    ((1, 1, 1), (2, 98, 97)),
]
# Both configurations: 32 query rows, 4 sequence slots, 8 query heads of 128.
SLOTS = dict(max_num_batched_tokens=32, max_num_seqs=4, num_q_heads=8, head_dim=128)
CONFIGS = {
    "one head block": dict(
        SLOTS,
        pages_per_seq=25,
        total_num_pages=103,
        page_size=4,
        num_kv_heads=4,
        q_dtype="bfloat16",
        kv_dtype="bfloat16",
    ),
    "two head blocks": dict(SLOTS, pages_per_seq=7, total_num_pages=29, page_size=16, num_kv_heads=8),
}


@pytest.mark.parametrize("config", CONFIGS, ids=list(CONFIGS))
@pytest.mark.parametrize("blocks", [(1, 8), (2, 3)], ids=["8 queries a block", "3 queries a block"])
def test_predicate_is_the_exit_check_on_chosen_layouts(config, blocks):
    for q_lens, kv_lens in LAYOUTS:
        case = Case(**CONFIGS[config], q_lens=q_lens, kv_lens=kv_lens, num_kv_pages_per_block=blocks[0],
                    num_queries_per_block=blocks[1])  # fmt: skip
        assert ISSUE.matches(case) == exit_check_fires(case), case.describe()


def test_predicate_is_the_exit_check_with_the_tuned_blocks_of_a_v5e():
    """Block sizes left to upstream's table, as on a chip: the predicate reads the table the kernel reads."""
    backend = Backend(INTERPRET, generation="v5e")
    for q_lens, kv_lens in LAYOUTS[-3:]:  # the chip's recorded layouts among them
        case = Case(**CONFIGS["one head block"], q_lens=q_lens, kv_lens=kv_lens)
        with generations.emulated("v5e"):
            predicted = ISSUE.matches(case)
        assert predicted == exit_check_fires(case, backend), case.describe()


def test_predicate_is_the_exit_check_on_drawn_cases():
    disagree = [
        case.describe()
        for case in drawn_cases(valid_cases(upstream.RPA_HARNESS_CAPABILITIES, pooled=True), DRAWN)
        if not upstream.one_kv_scale_with_mixed_dtypes(case)  # raises while traced
        and ISSUE.matches(case) != exit_check_fires(case)
    ]
    assert disagree == []


def test_predicate_on_the_chips_halts():
    """The (0, 0) call that halted a v5e alone matches; the decode batch that halted it only after such a
    call does not (its halt was its predecessor's copy), and its predecessor does."""
    halted_alone = repro_files.read(ISSUE.repro.parent / "differential_tpu.json")
    after_a_predecessor = repro_files.read(ISSUE.repro.parent / "differential-checked_tpu.json")
    with generations.emulated("v5e"):
        assert ISSUE.matches(halted_alone.case)
        assert not ISSUE.matches(after_a_predecessor.case)
        assert ISSUE.matches(Case.from_json(after_a_predecessor.preceded_by[-1]["case"]))


def test_v3s_own_property_reports_an_exit_that_would_halt_a_tpu_with_its_kind():
    """v3's both-outputs check (attention and cache) turns the checking interpreter's exit check into the
    failure kind, as the generic properties do, never a crash of the replay."""
    from rpa_harness.targets.tpu_inference.judging import checks_both_outputs

    def judge_outputs(arrays, options, backend, precision):
        raise WouldHaltTpu("WOULD HALT A TPU: a DMA started at kernel.py:1 and never waited")

    target = types.SimpleNamespace(name="v3", precision_on=lambda backend: ("float32",))
    with pytest.raises(checks.WouldHaltATpu, match="v3 on interpret: WOULD HALT A TPU"):
        checks_both_outputs(judge_outputs)(target, Backend(INTERPRET), {}, {})
