"""tpu-inference's MLA v2 target: the adapter's head-major query against the oracle and MLA v1's reference,
and its findings' predicates (each checked against the kernel, not assumed)."""

import dataclasses
import sys

import pytest

from rpa_harness import targets
from rpa_harness.checks import CacheMismatch, RaisedOnValidInput, check_differential
from rpa_harness.device import FAST_INTERPRET, INTERPRET, Backend
from rpa_harness.strategies.case import Case
from tests.cases import skip_without_tpu_inference
from tests.references import assert_matches_mla_v1_reference

skip_without_tpu_inference(module_level=True)

from rpa_harness.targets import tpu_inference_mla_v2 as mla_v2  # noqa: E402  (needs tpu-inference)
from rpa_harness.targets.tpu_inference_mla_v2 import known_issues  # noqa: E402

TARGET = targets.load(targets.MLA_V2_TARGET)
# A decode, a prefill across two KV blocks; every kv_len and every cached part ends a 32-bit row, so its
# bfloat16 cache stays outside MLA v2's findings.
LATENT = Case(
    max_num_batched_tokens=8, max_num_seqs=3, pages_per_seq=4, total_num_pages=11, page_size=4, num_q_heads=4,
    num_kv_heads=1, head_dim=192, value_head_dim=128, q_lens=(1, 5), kv_lens=(8, 14), num_kv_pages_per_block=2,
    num_queries_per_block=4, mask_value_meaning="replaces", sm_scale=0.1, poison=False,
)  # fmt: skip


@pytest.mark.parametrize("backend", [Backend(FAST_INTERPRET), Backend(INTERPRET)], ids=lambda b: b.label)
@pytest.mark.parametrize(
    "q_dtype, kv_dtype", [("float32", "float32"), ("float32", "bfloat16"), ("bfloat16", "bfloat16")]
)
def test_mla_v2_matches_the_oracle_and_writes_its_cache(backend, q_dtype, kv_dtype):
    if q_dtype not in TARGET.capabilities.q_dtypes:
        pytest.skip(f"{q_dtype} queries need pltpu.reciprocal (jax 0.12)")
    case = dataclasses.replace(LATENT, q_dtype=q_dtype, kv_dtype=kv_dtype)
    assert not any(issue.matches(case) for issue in TARGET.known_issues)
    check_differential(TARGET, backend, case.arrays(), case.options())


def test_mla_v2_agrees_with_mla_v1s_reference():
    """v2 has no reference of its own; v1's, on v1's inputs for the same case, against v2's output: the
    head-major query and the precision options mean what the adapter says."""
    arrays = LATENT.arrays()
    with Backend(FAST_INTERPRET).context():
        out, _ = mla_v2.ragged_paged_attention(**arrays, **LATENT.options())
    assert_matches_mla_v1_reference(out, arrays, LATENT.options(), LATENT.num_tokens)


# (page_size, pages per KV block, q_lens, kv_lens) of a bfloat16 cache; whether the merge reads past its
# buffer, as measured on the TPU interpreter.
MERGES = [
    (2, 1, (1, 1), (2, 4), True),
    (2, 1, (1, 2), (2, 3), True),
    (2, 1, (1, 3), (3, 4), True),
    (2, 1, (2, 1), (2, 4), False),
    (2, 1, (1, 1), (2, 3), False),
    (4, 2, (3, 2), (5, 6), False),
]


@pytest.mark.parametrize("page_size, pages_per_block, q_lens, kv_lens, reads_past", MERGES)
def test_the_merge_predicate_is_the_kernels_rule(page_size, pages_per_block, q_lens, kv_lens, reads_past):
    case = dataclasses.replace(
        LATENT, page_size=page_size, num_kv_pages_per_block=pages_per_block, q_lens=q_lens, kv_lens=kv_lens,
        head_dim=96, value_head_dim=32, num_q_heads=1, num_queries_per_block=1, kv_dtype="bfloat16",
    )  # fmt: skip
    assert known_issues.merge_reads_a_row_past_its_buffer(case) == reads_past
    try:
        check_differential(TARGET, Backend(INTERPRET), case.arrays(), case.options())
        raised = False
    except RaisedOnValidInput as failure:
        raised = "Out-of-bounds read" in str(failure)
    except CacheMismatch:  # the packed-cache row partner, another finding
        raised = False
    assert raised == reads_past
    moved = known_issues.with_cached_tokens_ending_rows(case)
    assert not known_issues.merge_reads_a_row_past_its_buffer(moved)


def test_the_merge_issue_shows_only_where_bounds_are_checked():
    """Its cases are drawn on the generic interpreter (whose output is right) and kept out on the TPU one."""
    issue = next(i for i in TARGET.known_issues if i.name == "mla-v2-merge-reads-a-row-past-its-vmem-buffer")
    assert issue in TARGET.known_issues_on(Backend(INTERPRET))
    assert issue not in TARGET.known_issues_on(Backend(FAST_INTERPRET))


@pytest.mark.parametrize("kv_lens, overwrites", [((8, 13), True), ((8, 14), False)])
def test_the_row_partner_predicate_is_the_kernels_rule(kv_lens, overwrites):
    case = dataclasses.replace(LATENT, kv_dtype="bfloat16", kv_lens=kv_lens)
    assert known_issues.packed_cache_row_past_kv_len(case) == overwrites
    try:
        check_differential(TARGET, Backend(FAST_INTERPRET), case.arrays(), case.options())
        mismatch = False
    except CacheMismatch:
        mismatch = True
    assert mismatch == overwrites
    assert not known_issues.packed_cache_row_past_kv_len(known_issues.with_kv_lens_ending_rows(case))


def test_one_logger_stand_in_serves_every_kernel_module():
    """MLA v2 and the head_dim-64 kernel's tuned table import vllm's logger (through tpu_inference.logger);
    without vllm one stand-in serves both, whichever loads first: warning and warning_once alike."""
    mla_v2.kernel()
    from rpa_harness.targets.tpu_inference_v3_hd64 import kernel as hd64_kernel

    hd64_kernel()
    logger = sys.modules["tpu_inference.logger"].init_logger("a kernel module")
    assert all(callable(getattr(logger, name)) for name in ("warning", "info", "warning_once", "info_once"))


@pytest.mark.parametrize("generation", ["none", "v5e"])
def test_block_sizes_left_to_the_kernel_raise_as_in_v1(generation):
    """v2's tuned_params.py is its caller's: the kernel takes no block sizes of its own on any generation."""
    backend = Backend(FAST_INTERPRET, generation=generation)
    case = dataclasses.replace(LATENT, num_queries_per_block=None)
    assert known_issues.block_sizes_left_to_the_kernel(case)
    with pytest.raises(RaisedOnValidInput, match="num_kv_pages_per_block and num_queries_per_block must be"):
        check_differential(TARGET, backend, case.arrays(), case.options())
    moved = known_issues.with_given_block_sizes(case)
    assert moved.num_queries_per_block == 8 and not any(issue.matches(moved) for issue in TARGET.known_issues)
    check_differential(TARGET, backend, moved.arrays(), moved.options())
