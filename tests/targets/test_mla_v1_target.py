"""tpu-inference's MLA v1 target: latent attention in the specification (the value a prefix of the key),
the adapter's latent cache, the kernel against the oracle and its own reference, and its findings'
predicates (each checked against the kernel, not assumed)."""

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rpa_harness import reference, targets
from rpa_harness.checks import RaisedOnValidInput, check_differential
from rpa_harness.device import FAST_INTERPRET, INTERPRET, Backend
from rpa_harness.strategies.capabilities import Capabilities
from rpa_harness.strategies.case import Case
from rpa_harness.strategies.valid import valid_cases
from tests.cases import skip_without_tpu_inference
from tests.references import assert_matches_mla_v1_reference

skip_without_tpu_inference(module_level=True)

from rpa_harness.targets import tpu_inference_mla_v1 as mla  # noqa: E402  (needs tpu-inference)
from rpa_harness.targets.tpu_inference_mla_v1 import known_issues  # noqa: E402

TARGET = targets.load(targets.MLA_V1_TARGET)
# A decode, a prefill across two KV blocks, bfloat16 where the kernel can run it.
LATENT = Case(
    max_num_batched_tokens=8, max_num_seqs=3, pages_per_seq=4, total_num_pages=11, page_size=4, num_q_heads=4,
    num_kv_heads=1, head_dim=192, value_head_dim=128, q_lens=(1, 5), kv_lens=(6, 13), num_kv_pages_per_block=2,
    num_queries_per_block=4, mask_value_meaning="replaces", sm_scale=0.1,
)  # fmt: skip


def test_a_latent_cases_value_is_its_keys_prefix_in_every_slot():
    kv = LATENT.arrays()["kv_pages"]
    keys, values = kv[:, :, 0], kv[:, :, 1]
    np.testing.assert_array_equal(values[..., :128], keys[..., :128])
    assert not values[..., 128:].any()


def test_the_oracles_output_past_the_values_dims_is_zero():
    result = reference.oracle(**LATENT.arrays(), **LATENT.options())
    rows = slice(0, LATENT.num_tokens)
    assert not result.out[rows, :, 128:].any() and result.out[rows, :, :128].any()


def test_value_head_dims_are_checked_where_declared():
    with pytest.raises(ValueError, match=r"value_head_dims=\(\(192, 200\),\)"):
        Capabilities(head_dims=(192,), value_head_dims=((192, 200),))
    with pytest.raises(ValueError, match=r"head_dims=\(64, 192\).*\[64\] not in the specified space"):
        Capabilities(head_dims=(64, 192), value_head_dims=((192, 128),))
    assert Capabilities(head_dims=(192,), value_head_dims=((192, 128),)).value_head_dim_for(192) == 128


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16"])
def test_the_latent_cache_goes_there_and_back(kv_dtype):
    case = dataclasses.replace(LATENT, kv_dtype=kv_dtype, poison=False)
    kv = case.arrays()["kv_pages"]
    cache = mla.latent_cache(kv, 128)
    assert cache.shape == (11, 4 * kv.itemsize // 4, 4 // kv.itemsize, 256)
    np.testing.assert_array_equal(mla.upstream_cache(cache, 128, 192), kv)


@pytest.mark.parametrize("backend", [Backend(FAST_INTERPRET), Backend(INTERPRET)], ids=lambda b: b.label)
@pytest.mark.parametrize("q_dtype", ["float32", "bfloat16"])
def test_mla_v1_matches_the_oracle_and_writes_its_cache(backend, q_dtype):
    if q_dtype not in TARGET.capabilities.q_dtypes:
        pytest.skip(f"{q_dtype} queries need pltpu.reciprocal (jax 0.12)")
    case = dataclasses.replace(LATENT, q_dtype=q_dtype, kv_dtype=q_dtype)
    check_differential(TARGET, backend, case.arrays(), case.options())


def test_mla_v1_agrees_with_its_own_reference():
    """The kernel's reference on the adapter's inputs, against the target's output: the adapter maps the
    case as the kernel's authors mean it."""
    case = dataclasses.replace(LATENT, poison=False)
    arrays = case.arrays()
    with Backend(FAST_INTERPRET).context():
        out, _ = mla.ragged_paged_attention(**arrays, **case.options())
    assert_matches_mla_v1_reference(out, arrays, case.options(), case.num_tokens)


@pytest.mark.parametrize(
    "heads, bq, q_dtype, chunk_prefill_size, fails",
    [
        (4, 4, "float32", None, False),
        (4, 8, "float32", None, True),  # no decode in the batch: the decode path traces anyway
        (3, 2, "float32", None, True),
        (1, 2, "bfloat16", None, False),  # one head padded to bfloat16's two
        (4, 4, "float32", 2, False),  # the chunked prefill path: 2 tokens of 4 heads, whole blocks of 4
        (2, 4, "float32", 2, True),
    ],
)
def test_the_query_block_predicate_is_the_kernels_rule(heads, bq, q_dtype, chunk_prefill_size, fails):
    if q_dtype not in TARGET.capabilities.q_dtypes:
        pytest.skip(f"{q_dtype} queries need pltpu.reciprocal (jax 0.12)")
    case = dataclasses.replace(
        LATENT, num_q_heads=heads, num_queries_per_block=bq, q_dtype=q_dtype, q_lens=(2, 5),
        chunk_prefill_size=chunk_prefill_size,
    )  # fmt: skip
    predicted = known_issues.query_block_not_dividing_q_heads(case)
    try:
        check_differential(TARGET, Backend(FAST_INTERPRET), case.arrays(), case.options())
        raised = False
    except RaisedOnValidInput as failure:
        raised = "flash_attention" in str(failure)
    assert predicted == raised == fails
    moved = known_issues.with_query_block_dividing_q_heads(case)
    assert not known_issues.query_block_not_dividing_q_heads(moved)


@pytest.mark.parametrize("generation", ["none", "v5e", "v6e"])
def test_block_sizes_left_to_the_kernel_raise_on_every_generation(generation):
    """No generation has block sizes of its own: either one None raises, emulated chip or not, as the
    predicate says; given ones (the issue's nearest case) are taken."""
    backend = Backend(FAST_INTERPRET, generation=generation)
    for left in ("num_kv_pages_per_block", "num_queries_per_block"):
        case = dataclasses.replace(LATENT, **{left: None})
        assert known_issues.block_sizes_left_to_the_kernel(case)
        with pytest.raises(
            RaisedOnValidInput, match="num_kv_pages_per_block and num_queries_per_block must be"
        ):
            check_differential(TARGET, backend, case.arrays(), case.options())
        moved = known_issues.with_given_block_sizes(case)
        assert not known_issues.block_sizes_left_to_the_kernel(moved)
        assert getattr(moved, left) == {"num_kv_pages_per_block": 4, "num_queries_per_block": 8}[left]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_an_emulated_generation_draws_given_block_sizes(data):
    """Where the harness leaves block sizes to a kernel (a generation, emulated or the chip's), the known
    issue moves every case to given ones: the kernel would raise for want of them."""
    backend = Backend(FAST_INTERPRET, generation="v5e")
    capabilities = TARGET.capabilities_on(backend)
    assert not capabilities.needs_block_sizes
    case = data.draw(valid_cases(capabilities, excluding=TARGET.known_issues_on(backend)))
    assert case.num_kv_pages_per_block is not None and case.num_queries_per_block is not None


def test_given_block_sizes_run_on_an_emulated_v5e():
    """The nearest case outside the issue, then outside the query-block one (8 queries, 4 q heads), runs."""
    left = dataclasses.replace(LATENT, num_kv_pages_per_block=None, num_queries_per_block=None)
    case = known_issues.with_query_block_dividing_q_heads(known_issues.with_given_block_sizes(left))
    assert (case.num_kv_pages_per_block, case.num_queries_per_block) == (4, 4)
    check_differential(TARGET, Backend(FAST_INTERPRET, generation="v5e"), case.arrays(), case.options())
