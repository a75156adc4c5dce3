"""tpu-inference's DeepSeek-V4 sliding-window latent attention (experimental): a value that is the whole key
in the specification, the adapter's byte cache against the kernel's own byte layout, the kernel against the
oracle (attention, cache and its softmax statistics), wrong outputs caught, and the jax it needs."""

import dataclasses
import math
import types
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from jax.experimental.pallas import tpu as pltpu

from rpa_harness import targets
from rpa_harness.checks import CacheMismatch, PropertyFailure, RaisedOnValidInput, check_differential
from rpa_harness.device import FAST_INTERPRET, INTERPRET, Backend
from rpa_harness.spec.interface import DEFAULT_MASK_VALUE
from rpa_harness.strategies.capabilities import Capabilities
from rpa_harness.strategies.case import Case
from rpa_harness.strategies.valid import valid_cases
from rpa_harness.targets import layouts
from tests.cases import skip_without_tpu_inference
from tests.processes import run_python

skip_without_tpu_inference(module_level=True)

from rpa_harness.targets import tpu_inference_mla_swa as swa  # noqa: E402  (needs tpu-inference)
from rpa_harness.targets.tpu_inference.kernels import load_kernel_module  # noqa: E402

NAME = "rpa_harness.targets.tpu_inference_mla_swa"
REPO_ROOT = Path(__file__).resolve().parents[2]
CAPABILITIES = Capabilities(**swa.RPA_HARNESS_CAPABILITIES)
HAS_TPU_RECIPROCAL = hasattr(pltpu, "reciprocal")
needs_reciprocal = pytest.mark.skipif(
    not HAS_TPU_RECIPROCAL,
    reason="this jax lacks pltpu.reciprocal, which the kernel calls for bfloat16 outputs: the target does not load "
    "(jax >= 0.12)",
)
# A decode and a prefill across KV blocks and pages, a window shorter than the prefill's context, sinks from
# none (-inf) to one among the largest logits, an odd head count padded to bfloat16's two.
CASE = Case(
    max_num_batched_tokens=8, max_num_seqs=3, pages_per_seq=4, total_num_pages=11, page_size=4, num_q_heads=3,
    num_kv_heads=1, head_dim=256, value_head_dim=256, q_dtype="bfloat16", kv_dtype="bfloat16", q_lens=(1, 5),
    kv_lens=(6, 13), num_kv_pages_per_block=2, num_queries_per_block=4, sm_scale=0.1, sliding_window=5,
    attention_sink=(-math.inf, -1.0, 2.0),
)  # fmt: skip


def test_a_value_may_be_the_whole_key():
    assert Capabilities(head_dims=(256,), value_head_dims=((256, 256),)).value_head_dim_for(256) == 256
    kv = CASE.arrays()["kv_pages"]
    np.testing.assert_array_equal(kv[:, :, 1].view(np.uint16), kv[:, :, 0].view(np.uint16))
    with pytest.raises(ValueError, match=r"value_head_dim=257 must be in \(0, head_dim=256\]"):
        dataclasses.replace(CASE, value_head_dim=257)


@pytest.mark.parametrize("pooled", [False, True])
def test_the_options_the_kernel_does_not_take_are_drawn_at_their_defaults(pooled):
    @settings(max_examples=40, database=None, deadline=None)
    @given(valid_cases(CAPABILITIES, pooled=pooled))
    def drawn(case):
        assert (case.soft_cap, case.k_scale, case.v_scale) == (None, None, None), case
        assert case.mask_value in (None, DEFAULT_MASK_VALUE), case

    drawn()
    with pytest.raises(ValueError, match=r"options_not_taken=\('sm_scale',\).*not in the specified space"):
        Capabilities(options_not_taken=("sm_scale",))


def test_the_byte_layout_is_the_kernels_own():
    """The adapter's bytes of a token are what the kernel's wrapper makes of its new tokens
    (``prepare_kv_inputs``), and read back to the same bits, NaN and infinities included."""
    rng = np.random.default_rng(0)
    vectors = rng.normal(size=(5, 512)).astype(swa.adapter.BFLOAT16)
    vectors[1, 3], vectors[2, 200], vectors[4, 511] = np.nan, np.inf, -0.0
    module = load_kernel_module(swa.adapter.KERNEL_MODULE)
    expected = np.asarray(module.prepare_kv_inputs(jnp.asarray(vectors)))
    np.testing.assert_array_equal(swa.token_bytes(vectors), expected)
    np.testing.assert_array_equal(swa.token_vectors(expected).view(np.uint16), vectors.view(np.uint16))


@pytest.mark.parametrize("head_dim", [256, 512])
def test_the_byte_cache_goes_there_and_back(head_dim):
    case = dataclasses.replace(CASE, head_dim=head_dim, value_head_dim=head_dim)  # NaN in the page tails
    kv = case.arrays()["kv_pages"]
    cache = swa.byte_cache(kv)
    assert cache.shape == (11, 4 * head_dim // 256, 4, 128) and cache.dtype == np.uint8
    np.testing.assert_array_equal(swa.upstream_cache(cache, head_dim).view(np.uint16), kv.view(np.uint16))
    token = kv[3, 1, 0]  # page 3, slot 1: its bytes are the cache's second token row of that page
    rows = head_dim // 256
    np.testing.assert_array_equal(cache[3, rows : 2 * rows].reshape(-1), swa.token_bytes(token))


@needs_reciprocal
@pytest.mark.parametrize(
    "backend, window, sinks",
    [(Backend(FAST_INTERPRET), 5, CASE.attention_sink), (Backend(INTERPRET), None, None)],
    ids=["fast-interpret-window-sinks", "interpret-no-window-no-sinks"],
)
def test_the_kernel_matches_the_oracle_and_writes_its_cache(backend, window, sinks):
    case = dataclasses.replace(CASE, sliding_window=window, attention_sink=sinks)
    check_differential(targets.load(NAME), backend, case.arrays(), case.options())


def changed_kernel(*, out_delta=0.0, cache_slot=None) -> types.SimpleNamespace:
    """The target's kernel with one attention element moved or one cache byte changed: what a kernel that
    gets one of them wrong returns."""

    def ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options):
        arrays = (q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs)
        out, cache = swa.ragged_paged_attention(*arrays, **options)
        out, cache = out.copy(), cache.copy()
        out[5, 2, 255] += out_delta  # the prefill's last row, last head, last dim
        if cache_slot is not None:
            cache[cache_slot] = cache[cache_slot] + 1
        return out, cache

    return types.SimpleNamespace(ragged_paged_attention=ragged_paged_attention)


def last_new_token_slot(arrays) -> tuple[int, int]:
    """(page, slot) where the kernel must write the batch's last new token."""
    tokens = layouts.split_new_tokens(**arrays)
    page, slot = np.argwhere(tokens.new_slots)[-1]
    return int(page), int(slot)


@needs_reciprocal
@pytest.mark.parametrize(
    "changes, failure",
    [
        (dict(out_delta=0.05), PropertyFailure),
        (dict(cache_slot=(*last_new_token_slot(CASE.arrays()), 0, 7)), CacheMismatch),
    ],
    ids=["attention", "cache"],
)
def test_a_wrong_output_is_caught(changes, failure):
    """One attention element 0.05 off (a few bfloat16 ulps of it), or one new token's written key changed
    in one dim: the judges fail them."""
    target = targets.load(NAME)
    arrays, options = CASE.arrays(), CASE.options()
    check_differential(target, Backend(FAST_INTERPRET), arrays, options)  # as it is, it holds
    changed = dataclasses.replace(target, module=changed_kernel(**changes))
    with pytest.raises(failure):
        check_differential(changed, Backend(FAST_INTERPRET), arrays, options)


@needs_reciprocal
def test_float32_queries_fail_to_trace_as_the_finding_says():
    """The finding's predicate is the kernel's rule: float32 queries fail with its symptom, the nearest case
    outside it (bfloat16 queries) runs."""
    target = targets.load(NAME)
    (issue,) = [i for i in target.known_issues if i.name == "mla-swa-float32-queries-fail-to-trace"]
    case = dataclasses.replace(CASE, q_dtype="float32")
    assert issue.matches(case) and not issue.matches(issue.nearest_outside(case))
    with pytest.raises(RaisedOnValidInput) as failure:
        check_differential(target, Backend(FAST_INTERPRET), case.arrays(), case.options())
    assert issue.shows(str(failure.value)), failure.value
    moved = issue.nearest_outside(case)
    check_differential(target, Backend(FAST_INTERPRET), moved.arrays(), moved.options())


def softmax_statistics(case: Case) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per live row and q head, in float64 from the case's bfloat16 inputs: the largest scaled logit of the
    keys in the window (the kernel's ``m``), the sum of exp(logit - that) over them (its ``l``, no sink),
    and the largest sum of |scaled q_d k_d| over dims (what bounds a float32 logit's rounding)."""
    arrays = case.arrays()
    q, kv = arrays["q"].astype(np.float64), arrays["kv_pages"][:, :, 0].astype(np.float64)
    rows = case.num_tokens
    row_max, row_sum, magnitude = (np.zeros((rows, case.num_q_heads)) for _ in range(3))
    for seq, (q_len, kv_len) in enumerate(zip(case.q_lens, case.kv_lens, strict=True)):
        keys = kv[arrays["page_indices"][seq]].reshape(-1, case.head_dim)[:kv_len]
        for j in range(q_len):
            row, position = int(arrays["cu_q_lens"][seq]) + j, kv_len - q_len + j
            window = keys[max(0, position - (case.sliding_window or kv_len) + 1) : position + 1]
            logits = q[row] @ window.T * case.sm_scale
            row_max[row] = logits.max(axis=1)
            row_sum[row] = np.exp(logits - row_max[row][:, None]).sum(axis=1)
            magnitude[row] = (np.abs(q[row]) @ np.abs(window).T).max(axis=1) * case.sm_scale
    return row_max, row_sum, magnitude


@needs_reciprocal
def test_l_and_m_are_the_rows_softmax_statistics():
    """The kernel's third and fourth outputs, which the harness's properties do not judge (the
    specification has no such outputs), against float64: a logit is a float32 sum of exact bfloat16
    products, within head_dim * 2^-24 of the largest |q_d k_d| sum; l's terms move by e^(twice that), and
    its float32 sum of at most a page table's keys by 2^-23 per term."""
    arrays, options = CASE.arrays(), CASE.options()
    with Backend(FAST_INTERPRET).context():
        _, _, row_sum, row_max = swa.call_swa(swa.swa_inputs(**arrays, **options))
    expected_max, expected_sum, magnitude = softmax_statistics(CASE)
    rows = CASE.num_tokens
    logit_error = CASE.head_dim * 2.0**-24 * magnitude
    assert np.all(np.abs(np.asarray(row_max)[:rows] - expected_max) <= logit_error)
    relative = np.abs(np.asarray(row_sum)[:rows] / expected_sum - 1)
    assert np.all(relative <= np.expm1(2 * logit_error) + CASE.page_size * CASE.pages_per_seq * 2.0**-23)


@pytest.mark.skipif(not HAS_TPU_RECIPROCAL, reason="this jax lacks pltpu.reciprocal: loading it is refused")
def test_the_target_loads_where_jax_has_pltpu_reciprocal():
    target = targets.load(NAME)
    assert target.updates_cache and target.precision == ("float32", "approx-reciprocal-for-narrow-output")


@pytest.mark.skipif(HAS_TPU_RECIPROCAL, reason="this jax has pltpu.reciprocal: the target loads")
def test_without_pltpu_reciprocal_the_target_is_one_usage_error(tmp_path):
    """jax 0.10.2: every call would fail while traced, so loading the target is refused, in one line that
    says why and what jax to use (exit 4, no run)."""
    run = run_python(
        "-m", "rpa_harness.cli", "run", "--profile", "ci", "--target", NAME, "--repro-dir", str(tmp_path),
        cwd=REPO_ROOT,
    )  # fmt: skip
    assert run.returncode == 4, run.stdout + run.stderr
    errors = [line for line in run.stderr.splitlines() if line.strip()]
    assert len(errors) == 1, run.stderr
    assert "pltpu.reciprocal (mla_swa.py:" in errors[0], errors
    assert "jax >= 0.12 (Python >= 3.12)" in errors[0], errors
