"""tpu-inference's stacked RPA (experimental): its cache layout converted both ways, both outputs judged on
the interpreters of jax 0.10 and 0.11, and on jax 0.12, where it does not trace, a usage error that says so."""

import dataclasses
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

from rpa_harness import reference, targets
from rpa_harness import repro as repro_files
from rpa_harness.checks import CacheMismatch
from rpa_harness.device import FAST_INTERPRET, INTERPRET, Backend
from rpa_harness.strategies.case import Case
from rpa_harness.targets.layouts import LayoutError
from tests.cases import skip_without_tpu_inference

skip_without_tpu_inference(module_level=True)

from rpa_harness.targets import tpu_inference_stacked_rpa as stacked  # noqa: E402  (needs tpu-inference)
from rpa_harness.targets.tpu_inference_stacked_rpa import adapter, layout  # noqa: E402

NAME = "rpa_harness.targets.tpu_inference_stacked_rpa"
CATALOGUE = {issue.name: issue for issue in stacked.RPA_HARNESS_CATALOGUE}
WINDOW_WRITE_BACK = CATALOGUE[stacked.both_outputs.WINDOW_WRITE_BACK_FINDING]
ON_V6E = Backend(INTERPRET, generation="v6e")
FAST_ON_V6E = Backend(FAST_INTERPRET, generation="v6e")


def precision_on(backend):
    """The contract it is judged under there (on v6e its float32 products are the chip's bfloat16 pass)."""
    return targets.load(NAME).precision_on(backend)


TRACES_HERE = adapter.jax_version() < adapter.FIRST_JAX_IT_DOES_NOT_TRACE_ON
needs_the_kernel = pytest.mark.skipif(
    not TRACES_HERE, reason="stacked RPA does not trace on jax >= 0.12 (its emit_pipeline use; adapter.py)"
)
# A decode (its one new token at slot 99 of its first page) and a mixed sequence of five new tokens
# across its second page; one KV head of two q heads, 128-key pages, the KV blocks one page each.
CASE = Case(
    max_num_batched_tokens=8, max_num_seqs=2, pages_per_seq=2, total_num_pages=5, page_size=128, num_q_heads=2,
    num_kv_heads=1, head_dim=128, q_lens=(1, 5), kv_lens=(100, 200), num_kv_pages_per_block=1,
    num_queries_per_block=8, mask_value_meaning="replaces",
)  # fmt: skip


def upstream_cache(dtype, head_dim: int) -> np.ndarray:
    """A cache of 3 pages of 128 slots, 2 KV heads, every element distinct."""
    return (np.arange(3 * 128 * 4 * head_dim) % 251 - 125).reshape(3, 128, 4, head_dim).astype(dtype)


@pytest.mark.parametrize(
    "dtype, head_dim, padded",
    [(np.float32, 64, 64), (ml_dtypes.bfloat16, 72, 80), (ml_dtypes.float8_e4m3fn, 72, 96)],
    ids=["float32", "bfloat16", "fp8"],
)
def test_the_converter_pads_head_dim_to_sublane_tiles_and_round_trips(dtype, head_dim, padded):
    kv_pages = upstream_cache(dtype, head_dim)
    stacked_cache = layout.stack_cache(kv_pages)
    assert stacked_cache.shape == (3, 4, padded, 128) and stacked_cache.dtype == kv_pages.dtype
    # Slot 5 of page 1, V of KV head 1 (combined head 3), dim 7: the same element in both layouts.
    assert stacked_cache[1, 3, 7, 5] == kv_pages[1, 5, 3, 7]
    assert not stacked_cache[:, :, head_dim:, :].astype(np.float32).any()
    np.testing.assert_array_equal(layout.unstack_cache(stacked_cache, head_dim=head_dim), kv_pages)
    assert layout.slots_first(stacked_cache)[1, 5, 3, 7] == kv_pages[1, 5, 3, 7]


def test_the_converter_refuses_a_cache_of_another_rank_or_width():
    with pytest.raises(LayoutError, match=r"stack_cache: kv_pages has shape \(3, 128, 4\)"):
        layout.stack_cache(np.zeros((3, 128, 4), np.float32))
    with pytest.raises(LayoutError, match="cannot hold head_dim=72"):
        layout.unstack_cache(np.zeros((3, 4, 64, 128), np.float32), head_dim=72)


@pytest.mark.skipif(TRACES_HERE, reason="jax < 0.12 traces the kernel: the target loads")
def test_on_jax_0_12_the_target_is_one_usage_error_naming_the_jax_to_use(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "rpa_harness.cli", "run", "--target", NAME, "-n", "0"],
        capture_output=True, text=True, cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert result.returncode == 4, result.stdout + result.stderr
    error = result.stderr.strip().splitlines()
    assert len(error) == 1 and result.stdout.strip() == "", result.stdout + result.stderr
    assert "does not trace on jax" in error[0] and "pipeline.py:868" in error[0], error[0]
    assert "run this target on jax 0.11.2" in error[0], error[0]


@needs_the_kernel
def test_the_case_gives_the_blocks_a_window_widens_the_decode_block():
    inputs = stacked.stacked_inputs(**CASE.arrays(), **CASE.options())
    decode, mixed = inputs.decode_block_sizes, inputs.mixed_block_sizes
    assert (decode.bq_sz, decode.bkv_sz, decode.batch_size, decode.n_buffer) == (1, 128, 2, 2)
    assert (mixed.bq_sz, mixed.bq_c_sz, mixed.bkv_sz, mixed.batch_size, mixed.n_buffer) == (8, 4, 128, 2, 2)
    assert inputs.args[3].shape == (5, 2, 128, 128)
    windowed = dataclasses.replace(CASE, sliding_window=200)
    # The window and the query from the page boundary below: 200 + 1 keys span three pages; the sequence
    # holds two.
    assert stacked.stacked_inputs(**windowed.arrays(), **windowed.options()).decode_block_sizes.bkv_sz == 256


@needs_the_kernel
def test_a_wrong_cache_is_caught_slot_by_slot():
    inputs = stacked.stacked_inputs(**CASE.arrays(), **CASE.options())
    written = np.ascontiguousarray(inputs.expected_cache.transpose(0, 2, 3, 1))  # the kernel's layout
    stacked.check_updated_cache(inputs, written)
    page = int(np.asarray(CASE.arrays()["page_indices"])[1, 1])  # the mixed sequence's second page
    unwritten = written.copy()
    unwritten[page, :, :, 67] = inputs.args[3][page, :, :, 67]  # its first new token (position 195), as given
    with pytest.raises(
        CacheMismatch,
        match=rf"page {page}, slot 67 \(a new token's slot; sequence 1, key position 195, left as it was\)",
    ):
        stacked.check_updated_cache(inputs, unwritten)
    changed = written.copy()
    changed[0, 1, 127, 0] = 1.0  # page 0, slot 0: V head 0, dim 127
    with pytest.raises(CacheMismatch, match=r"page 0, slot 0 .* first at V head 0, dim 127"):
        stacked.check_updated_cache(inputs, changed)


@needs_the_kernel
def test_the_generic_interpreter_gets_the_attention_right_and_the_cache_where_jax_keeps_aliased_writes():
    """jax 0.10's generic interpreter drops writes into an aliased input: the cache comes back as given.
    From jax 0.11 (0.11.2 is what tpu-inference 0.32.0 pins) it keeps them: both outputs are right."""
    verdict = stacked.judge(CASE.arrays(), CASE.options(), FAST_ON_V6E, precision=precision_on(FAST_ON_V6E))
    assert verdict.comparison.ok, str(verdict.comparison)
    error = verdict.cache_error
    if stacked.adapter.jax_version() >= (0, 11):
        assert error is None, str(error)
        return
    assert error is not None and error.slots is not None and error.stale is not None
    new_slots = stacked.stacked_inputs(**CASE.arrays(), **CASE.options()).new_slots
    assert np.array_equal(error.slots, new_slots) and error.stale[new_slots].all(), str(error)


@needs_the_kernel
def test_the_tpu_interpreter_writes_every_new_token_and_keeps_every_live_key():
    """On the TPU interpreter both outputs are right. The slots past kv_len, which the cache judge leaves
    out, do change: the write-back's tile past each sequence's last new token takes the new-token rows
    after it."""
    inputs = stacked.stacked_inputs(**CASE.arrays(), **CASE.options())
    out, cache = ON_V6E.run(stacked.call_stacked, inputs)
    comparison = reference.compare(
        out,
        reference.oracle(**CASE.arrays(), **CASE.options()),
        label="stacked RPA",
        precision=precision_on(ON_V6E),
    )
    assert comparison.ok, str(comparison)
    stacked.check_updated_cache(inputs, cache)
    past_kv_len = stacked.both_outputs.slots_past_kv_len(inputs)
    returned = layout.slots_first(np.asarray(cache)).view(np.uint32)
    assert (returned != inputs.given_cache.view(np.uint32))[past_kv_len].any()


def test_the_finite_mask_value_finding_matches_its_repro_and_not_the_case_moved_out():
    """Its predicate reads the case only (it runs on jax 0.12 too); the repro's replay is the known-issue
    property's."""
    issue = CATALOGUE["stacked-rpa-finite-mask-value-weights-keys-by-block"]
    case = repro_files.read(issue.repro).case
    assert issue.matches(case) and case.mask_value == -2.0
    assert not issue.matches(issue.nearest_outside(case))
    whole_blocks = dataclasses.replace(case, mask_value=-2.0, kv_lens=(128,), q_lens=(1,), total_num_pages=3)
    assert not issue.matches(whole_blocks)  # one decode, every slot of its block a key: nothing masked


@pytest.mark.parametrize(
    "q_len, kv_len, window, unwritten",
    [
        (2, 130, 32, [128, 129]),  # rows 0-1 never meet the second page's key positions 128-255
        (3, 129, 64, [128]),  # rows 0-2 meet page 0 (positions 126-127, written), not page 1
        (5, 200, 32, [195, 196, 197, 198, 199]),
        (2, 2, 32, []),  # rows and key positions agree
    ],
)
def test_the_window_write_back_restatement_gives_the_slots_the_kernel_left(q_len, kv_len, window, unwritten):
    """The slots the TPU interpreter left unwritten for these sequences (each alone in its batch, query
    blocks of 8 rows, 128-key pages): the restated schedule's own prediction."""
    missed = stacked.both_outputs.window_unwritten_positions(
        (q_len,), (kv_len,), range(1), window=window, bq=8, total_q_tokens=8, page_size=128, pages_per_seq=2
    )
    assert missed == ({0: unwritten} if unwritten else {})


def test_the_window_write_back_finding_matches_its_repro_and_not_the_case_moved_out():
    case = repro_files.read(WINDOW_WRITE_BACK.repro).case
    assert WINDOW_WRITE_BACK.matches(case) and case.sliding_window is not None
    assert not WINDOW_WRITE_BACK.matches(WINDOW_WRITE_BACK.nearest_outside(case))
    assert not WINDOW_WRITE_BACK.matches(dataclasses.replace(case, sliding_window=None))
    assert not WINDOW_WRITE_BACK.matches(dataclasses.replace(case, kv_lens=(2,)))  # rows are the positions
    decode = dataclasses.replace(case, q_lens=(1,), kv_lens=(130,))  # the decode kernel writes its token
    assert not WINDOW_WRITE_BACK.matches(decode)
    assert not WINDOW_WRITE_BACK.matches(dataclasses.replace(case, q_lens=(), kv_lens=()))  # no sequence


@needs_the_kernel
def test_the_tpu_interpreter_leaves_the_predicted_window_slots_and_the_judge_names_the_finding():
    """A decode, then a mixed sequence whose rows (1-3) meet its first page's new key positions (126-127)
    but not its second's (128): that one slot stays as given, and the judge attributes exactly it."""
    case = dataclasses.replace(
        CASE, q_lens=(1, 3), kv_lens=(100, 129), sliding_window=64, num_q_heads=1, head_dim=64
    )
    assert WINDOW_WRITE_BACK.matches(case)
    verdict = stacked.judge(case.arrays(), case.options(), ON_V6E, precision=precision_on(ON_V6E))
    assert verdict.comparison.ok, str(verdict.comparison)
    error = verdict.cache_error
    assert error is not None and error.slots is not None and int(error.slots.sum()) == 1, str(error)
    assert "key position 128, left as it was" in str(error)
    assert verdict.known_finding == f"docs/tpu-inference-stacked-rpa-findings/{WINDOW_WRITE_BACK.name}"
