"""tpu-inference's RPA v3 (``rpa_harness.targets.tpu_inference_v3``): both of its outputs, its validators, its hang,
its semantics against its own reference, its known issues.

v3 returns the attention and the cache with the new tokens written into it. Each example runs v3 once on
the TPU interpreter (with the compat layer, races checked; the generic properties also run v3 on the
generic interpreter, whose data-dependent copy sizes the compat layer runs as masked copies) and judges both: the attention against the float64 oracle under v3's declared
precision contract (``RPA_HARNESS_PRECISION``), the updated cache bit for bit against the expected one
(every new token in its slot, nothing else changed). Cases carry v3's semantics as the specification's
extension options (``mask_value_meaning="replaces"``, ``q_scale``), which the oracle computes.

A cache that differs exactly where the documented finding ``sliding-window-skips-cache-writes`` predicts
(and holds the input there) is counted as that finding (a Hypothesis event), not as a new failure; any
other difference fails.

Skipped when tpu-inference is not installed (``pip install --no-deps tpu-inference==0.32.0``).
"""

import dataclasses
import textwrap
from pathlib import Path

import numpy as np
import pytest
from hypothesis import assume, event, given, settings
from hypothesis import strategies as st

from rpa_harness import ahead_of_time, generations, known_issues, targets
from rpa_harness import repro as repro_files
from rpa_harness.checks import check_compiles, numeric_failure
from rpa_harness.device import FAST_INTERPRET, INTERPRET, TPU_COMPILER, Backend
from rpa_harness.failures import CacheMismatch
from rpa_harness.interpret_compat.limitations import recognise
from rpa_harness.property_names import PropertyName
from rpa_harness.recording import closeness_notes, recorded
from rpa_harness.reference import compare, oracle
from rpa_harness.reference.variants import contract_attention
from rpa_harness.strategies.capabilities import Capabilities
from rpa_harness.strategies.case import Case
from rpa_harness.strategies.valid import valid_cases
from rpa_harness.targets import tpu_inference_v3 as v3target
from rpa_harness.targets.tpu_inference import judging, kernels, releases
from tests.cases import drawn_cases, sized_case, skip_without_tpu_inference
from tests.processes import run_python
from tests.references import as_one_program

skip_without_tpu_inference(module_level=True)
CAPABILITIES = Capabilities(**v3target.RPA_HARNESS_CAPABILITIES)
TARGET = targets.load(targets.V3_TARGET)
BACKEND = judging.CHECKING
CATALOGUE = {issue.name: issue for issue in v3target.RPA_HARNESS_CATALOGUE}
# The entries of the installed release: a predicate restates the kernel of the releases it names
# (tests/targets/test_v3_early_api.py tests the early releases' entries).
INSTALLED_RELEASES = tuple(
    i for i in v3target.RPA_HARNESS_CATALOGUE if i.affects(releases.installed_version())
)
# Few examples: each new configuration compiles for seconds on the TPU interpreter (docs/measurements.md);
# the generation matrix adds v3 on the fast interpreter.
POOLED_EXAMPLES = max(5, settings.default.max_examples // 8)
ANY_CONFIG_EXAMPLES = max(3, settings.default.max_examples // 16)
PROPERTY = judging.ATTENTION_AND_CACHE
# v3's declared known issues are not drawn, except the sliding-window one: this property checks the cache,
# and counts a mismatch that is exactly that finding's as the finding.
EXCLUDED = tuple(i for i in TARGET.known_issues if i.name != v3target.SLIDING_WINDOW_FINDING)


@pytest.fixture(scope="module")
def v3_runs():
    """Skips, with the reason, where v3 cannot run at all: a recognised interpreter limitation (e.g. a gap
    the compat layer cannot patch on this jax). Any other error is a failure, never a skip."""
    try:
        v3target.judge(BASE.arrays(), BASE.options(), precision=TARGET.precision)
    except Exception as error:
        reason = recognise(error)
        if reason is None:
            raise
        pytest.skip(f"tpu-inference v3 cannot run on the TPU interpreter here: {reason}")


def draw_and_check(data, repro_dir, *, pooled: bool, variant: str = ""):
    case = data.draw(valid_cases(CAPABILITIES, pooled=pooled, excluding=EXCLUDED), label="case")
    arrays, options = case.arrays(), case.options()
    name = PropertyName(PROPERTY, variant, INTERPRET)
    with recorded(repro_dir, name, TARGET, BACKEND, arrays, options, case=case) as notes:
        verdict = v3target.judge(arrays, options, precision=TARGET.precision)
        notes.update(closeness_notes(verdict.comparison, case))
        if verdict.known_finding:
            event(f"known finding: {verdict.known_finding}")
            notes.update(known_finding=verdict.known_finding)
        elif verdict.cache_error is not None:
            raise verdict.cache_error
        if not verdict.comparison.ok:  # judged under v3's declared precision contract
            raise numeric_failure(verdict.comparison, arrays)


@settings(max_examples=POOLED_EXAMPLES)
@given(data=st.data())
def test_v3_attention_and_updated_cache(v3_runs, repro_dir, data):
    draw_and_check(data, repro_dir, pooled=True)


@settings(max_examples=ANY_CONFIG_EXAMPLES)
@given(data=st.data())
def test_v3_attention_and_updated_cache_any_config(v3_runs, repro_dir, data):
    draw_and_check(data, repro_dir, pooled=False, variant="any-config")


# ---- v3's own validators: its rules and messages (from its static_validate_inputs and
# dynamic_validate_inputs), reached through the upstream-style wrapper ----

BASE = sized_case(
    (1, 3), (5, 9), spare_seqs=0, spare_rows=4, spare_pages=0, spare_cache_pages=3, num_q_heads=2,
    num_kv_heads=1, head_dim=128,
)  # fmt: skip


def _with(arrays: dict, **changes) -> dict:
    arrays = {name: value.copy() for name, value in arrays.items()}
    for name, (index, value) in changes.items():
        arrays[name][index] = value
    return arrays


def _static_cases():
    arrays = BASE.arrays()
    yield "sliding_window <= 0", arrays, dict(sliding_window=0), "sliding_window=0 must be positive."
    yield "soft_cap == 0", arrays, dict(soft_cap=0.0), "soft_cap=0.0 must not be 0.0."
    yield "vmem_limit_bytes <= 0", arrays, dict(vmem_limit_bytes=-1), "vmem_limit_bytes=-1 must be positive."
    yield (
        "query block of 0 (v3's decode block sizes)",
        arrays,
        dict(num_queries_per_block=0),
        "decode bq_csz=0 and bq_sz=0 must satisfy (0 < bq_csz and bq_sz % bq_csz == 0).",
    )
    odd_heads = dict(
        arrays,
        q=np.concatenate([arrays["q"]] * 3, axis=1)[:, :3],
        kv_pages=np.concatenate([arrays["kv_pages"]] * 2, axis=2),
    )
    yield (
        "num_q_heads not a multiple of num_kv_heads",
        odd_heads,
        {},
        "Expected actual_num_q_heads=3 to be divisible by actual_num_kv_heads=2.",
    )
    fp8 = dataclasses.replace(
        BASE, page_size=2, pages_per_seq=5, total_num_pages=12, kv_dtype="float8_e4m3fn"
    )
    yield (
        "page_size not a multiple of the fp8 packing",
        fp8.arrays(),
        {},
        "page_size=2 must be divisible by kv_packing=4.",
    )


def _dynamic_cases():
    arrays = BASE.arrays()
    yield (
        "q_len == 0",
        dataclasses.replace(BASE, q_lens=(1, 0)).arrays(),
        "Require 0 < q_len=Array(0, dtype=int32) <= kv_len=Array(9, dtype=int32) at sequence 1.",
    )
    yield (
        "q_len > kv_len",
        _with(arrays, kv_lens=(1, 2)),
        "Require 0 < q_len=Array(3, dtype=int32) <= kv_len=Array(2, dtype=int32) at sequence 1.",
    )
    yield "num_seqs > max_num_seqs", _with(arrays, num_seqs=(0, 3)), "num_seqs=3 must be <= max_num_seqs=2"
    yield (
        "more query rows than max_num_tokens",
        _with(arrays, cu_q_lens=(2, 9)),
        "Total q tokens 9 must be <= max_num_tokens=8.",
    )
    yield (
        "kv_len past the page table",
        _with(arrays, kv_lens=(1, 13)),
        "Require page_cnt=Array(4, dtype=int32) <= pages_per_seq=3 at sequence 1 where "
        "kv_len=Array(13, dtype=int32) and page_size=4.",
    )
    yield (
        "page index out of range",
        _with(arrays, page_indices=((1, 0), 8)),
        "Require 0 <= page_idx=Array(8, dtype=int32) < total_num_pages=8 at sequence 1 where "
        "kv_len=Array(9, dtype=int32) and page_size=4.",
    )


STATIC = {name: rest for name, *rest in _static_cases()}
DYNAMIC = {name: rest for name, *rest in _dynamic_cases()}


@pytest.mark.parametrize("rule", STATIC)
def test_static_rule_raises_v3_message(rule):
    arrays, options, message = STATIC[rule]
    with pytest.raises(ValueError) as raised:
        judging.CHECKING.run(TARGET.attention, arrays, {**BASE.options(), **options})
    assert str(raised.value) == message


@pytest.mark.parametrize("rule", DYNAMIC)
def test_dynamic_rule_raises_v3_message(rule):
    arrays, message = DYNAMIC[rule]
    with pytest.raises(ValueError) as raised:
        TARGET.validate(arrays, BASE.options())
    assert str(raised.value) == message


def test_valid_case_passes_v3_validation():
    TARGET.validate(BASE.arrays(), BASE.options())


@settings(max_examples=max(20, settings.default.max_examples))
@given(case=valid_cases(CAPABILITIES))
def test_drawn_cases_pass_v3_validation(case):
    """The declared capabilities draw only what v3's own validators accept (no kernel call: cheap)."""
    TARGET.validate(case.arrays(), case.options())


# ---- A q_len == 0 sequence before a live one (v3's validator forbids q_len == 0) ----

ROOT = Path(__file__).resolve().parents[2]
HANG_REPRO = (
    ROOT / "docs/tpu-inference-v3-findings/q-len-zero-before-a-live-sequence-hangs/v3-hang_interpret.json"
)
HANG_TIMEOUT_SECONDS = 60  # the watchdog, should the deadlock check be unpatched (a cold call: 3-30 s here)


def test_q_len_zero_before_live_sequence_deadlocks_at_the_wait_for_its_query_block(v3_runs):
    """The replay on the TPU interpreter stops at sequence 1's wait for its query block: one token, 512
    bytes, on a semaphore only sequence 0's copy of no tokens signalled (the finding; what a TPU does is
    not settled: `rpa-harness chip q-len-zero`)."""
    replay = run_python(
        "-m", "rpa_harness.cli", "replay", str(HANG_REPRO), "--timeout", str(HANG_TIMEOUT_SECONDS),
        cwd=ROOT, timeout=HANG_TIMEOUT_SECONDS + 120,
    )  # fmt: skip
    output = replay.stdout + replay.stderr
    assert replay.returncode == 1, textwrap.shorten(output, 600)
    assert (
        "a DMA wait at kernel.py:545" in output and "needs 512 (bytes), its semaphore's count is 0" in output
    )


def test_q_len_zero_before_live_sequence_takes_sequence_0s_copies_where_waits_do_not_block(v3_runs):
    """On the generic interpreter, whose waits do not block, the repro shows what v3's copies hold for
    sequence 1: its query buffer nothing wrote (NaN attention) and the KV row copied for sequence 0 (its
    key and value written into sequence 1's cache slot)."""
    repro = repro_files.read(HANG_REPRO)
    inputs = v3target.v3_inputs(**repro.arrays, **repro.options)
    out, cache = Backend(FAST_INTERPRET).run(v3target.call_v3, inputs)
    (sequence_0_page, _), (sequence_1_page, _) = repro.arrays["page_indices"]
    assert np.isnan(out[0]).all()
    np.testing.assert_array_equal(
        cache[sequence_1_page, 0].view(np.uint32), inputs.expected_cache[sequence_0_page, 0].view(np.uint32)
    )


RESCALE_REPRO = (
    v3target.known_issues.FINDINGS / "rescale-in-output-dtype" / "differential_fast-interpret.json"
)


def test_the_accumulator_contract_makes_v3s_roundings(v3_runs):
    """The calibration variant of accumulators-in-output-dtype is v3's arithmetic: on the case where v3 once
    exceeded that contract (its rescale factor is computed in bfloat16), v3's decode rows (one KV page per
    compute chunk, as the variant's blocks) equal the variant's bit for bit, and the contract accepts v3."""
    recorded_case = repro_files.read(RESCALE_REPRO)
    arrays, options = recorded_case.arrays, recorded_case.options
    actual = np.asarray(Backend(FAST_INTERPRET).run(TARGET.attention, arrays, options))
    variant = contract_attention(**arrays, **options, precision=TARGET.precision, kv_pages_per_block=1)
    cu_q_lens = arrays["cu_q_lens"]
    decodes = [i for i in range(int(arrays["num_seqs"][0])) if cu_q_lens[i + 1] - cu_q_lens[i] == 1]
    assert decodes, "the repro has decode rows"
    for i in decodes:
        np.testing.assert_array_equal(actual[cu_q_lens[i]], variant[cu_q_lens[i]], err_msg=f"sequence {i}")
    judged = compare(actual, oracle(**arrays, **options), precision=TARGET.precision)
    assert judged.ok, str(judged)


# ---- The mapping and the cache check themselves (no kernel call) ----


def test_new_tokens_are_the_last_q_len_keys_of_each_sequence():
    case = dataclasses.replace(BASE, q_lens=(1, 3), kv_lens=(5, 9), poison=True)
    arrays = case.arrays()
    inputs = v3target.v3_inputs(**arrays, **case.options())
    keys, values, cache = inputs.args[1], inputs.args[2], inputs.args[3]
    for i, (start, q_len, kv_len) in enumerate(((0, 1, 5), (1, 3, 9))):
        for j in range(q_len):
            position = kv_len - q_len + j
            page = arrays["page_indices"][i, position // case.page_size]
            slot = arrays["kv_pages"][page, position % case.page_size]
            np.testing.assert_array_equal(keys[start + j], slot[0::2])
            np.testing.assert_array_equal(values[start + j], slot[1::2])
            assert np.isnan(cache[page, position % case.page_size]).all()  # v3 must not read it
    assert np.isnan(keys[4:]).all()  # poisoned padding rows
    assert inputs.new_slots.sum() == 4
    np.testing.assert_array_equal(inputs.args[-1], [1, 1, 2])  # one leading decode


def test_cache_check_reports_a_changed_slot_outside_the_new_tokens():
    inputs = v3target.v3_inputs(**BASE.arrays(), **BASE.options())
    judging.check_updated_cache(inputs, inputs.expected_cache)
    changed = inputs.expected_cache.copy()
    page = int(BASE.arrays()["page_indices"][1, 0])
    changed[page, 0, 0, 0, 5] += 1  # sequence 1, key position 0: not a new token
    with pytest.raises(CacheMismatch) as raised:
        judging.check_updated_cache(inputs, changed)
    assert "1 slot (0 of 4 new-token slots, 1 slot it must leave unchanged)" in str(raised.value)
    assert f"page {page}, slot 0 (a slot v3 must leave unchanged; sequence 1, key position 0)" in str(
        raised.value
    )


# ---- v3's semantics against v3's own reference (a second oracle): the mask value replaces a masked logit,
# q_scale divides q (and the cast to the KV dtype is exact for a float32 cache); float32 queries and cache,
# where its reference's roundings (logits to the output dtype, P to V's dtype, P @ V in V's dtype) are
# exact. With a narrower cache its reference computes P @ V in the cache's dtype (fp8 for an fp8 cache),
# which no precision contract covers; the kernel's properties judge those dtypes against our oracle. ----

# out_dtype is left out: other than q's it fails to trace in the kernel (a finding), and the reference
# computes its logits in it.
F32_QUERIES = dataclasses.replace(
    CAPABILITIES, q_dtypes=("float32",), kv_dtypes=("float32",), out_dtype=False
)


@settings(max_examples=max(10, settings.default.max_examples // 2))
@given(case=valid_cases(F32_QUERIES))
def test_oracle_agrees_with_v3_reference(case):
    """Our oracle, given v3's declared semantics (mask_value_meaning, q_scale, use_causal_mask), computes
    what v3's own ``ref_ragged_paged_attention`` computes, within the float32 contract.

    The reference always writes the new tokens (it has no ``update_kv_cache``), so it gets them; and it
    applies a sliding window only with the causal mask, where the kernel and the specification apply it
    either way (docs/tpu-inference-v3.md), so a non-causal case is given no window here."""
    from rpa_harness import reference
    from rpa_harness.targets.tpu_inference_v3.report import V3

    assume(case.num_seqs > 0)  # v3's reference concatenates the sequences' outputs: it needs one
    if not case.use_causal_mask:
        case = dataclasses.replace(case, sliding_window=None)
    arrays, options = case.arrays(), case.options()
    inputs = v3target.v3_inputs(**arrays, **{**options, "update_kv_cache": True})
    semantic = {k: v for k, v in inputs.kwargs.items() if k not in V3.tuning_options}
    tensors, metadata = inputs.args[:4], inputs.args[4:]  # q, k, v, cache; kv_lens ... distribution
    ref_out, _ = as_one_program(v3target.kernel().ref_ragged_paged_attention, tensors, metadata, **semantic)
    rows = case.num_tokens
    padded = np.zeros(arrays["q"].shape, arrays["q"].dtype)
    padded[:rows] = np.asarray(ref_out)[:rows]
    comparison = reference.compare(
        padded,
        reference.oracle(**arrays, **options),
        label="v3's reference",
    )
    assert comparison.ok, f"{case.describe()}\n{comparison}"


# ---- The known issues v3 declares (known_issues.py of its target) ----


def test_the_finite_mask_value_finding_covers_values_zeroed_past_a_query_blocks_positions():
    """Found by the ci campaign while the predicate looked only at the keys a query block visits: one
    prefill (32, 32) in one 32-key KV block, query blocks of 16 rows. The first query block visits [0, 32) =
    [0, kv_len) but zeroes the values of keys 16-31 (past its last position), which the finite mask value
    still weights: v3 returned 0.027 for 0.168 where keys with 0 values weigh in predicts v3 to 2e-10."""
    case = Case(max_num_batched_tokens=32, max_num_seqs=4, pages_per_seq=4, total_num_pages=19, page_size=32,
                num_q_heads=2, num_kv_heads=2, head_dim=256, q_dtype="float32", kv_dtype="float8_e5m2",
                q_lens=(32,), kv_lens=(32,), mask_value=-2.0, num_kv_pages_per_block=1, num_queries_per_block=16,
                mask_value_meaning="replaces")  # fmt: skip
    finding = CATALOGUE["finite-mask-value-counts-keys-by-block"]
    assert finding.matches(case)
    assert not finding.matches(dataclasses.replace(case, num_queries_per_block=32))  # one block, values kept


ROW_SUM = CATALOGUE["row-sum-accumulated-in-bfloat16"]


def test_v3_sums_a_chunks_weights_in_bfloat16(v3_runs):
    """The finding's hand-made case: every value 1, so the output is exactly 1 whatever the weights; one
    key of weight 1 and 63 of weight 0.0035 (below half a bfloat16 ulp of 1) in one compute chunk. v3's
    denominator drops the small weights; the same case with float32 queries (float32 accumulators) is
    right, to what the chip's one bfloat16 pass of P @ V allows (its products are at DEFAULT)."""
    recorded = repro_files.read(ROW_SUM.repro.with_name("dominant-key_fast-interpret-v6e.json"))
    backend = Backend(FAST_INTERPRET, generation=recorded.tpu_generation)
    out = np.asarray(backend.run(TARGET.attention, recorded.arrays, {}), np.float64)[0]
    assert np.all(out > 1.05), out.min()
    arrays = dict(recorded.arrays, q=recorded.arrays["q"].astype(np.float32))
    out32 = backend.run(TARGET.attention, arrays, {})
    judged = compare(out32, oracle(**arrays), precision=TARGET.precision_on(backend))
    assert judged.ok, str(judged)


def test_the_row_sum_finding_matches_bfloat16_accumulators_with_weights_a_bfloat16_sum_drops():
    """The repro's case matches on v6e: its masked keys' weights (a finite mask value 5.6 below logits near
    0) are each below half a bfloat16 ulp of 1. Float32 queries, the default mask value (masked keys weigh
    nothing and the rest are equal), or the one key a decode of one key sums do not; with a finite mask
    value a nearly uniform softmax still drops the masked weights, so the case moves to float32 queries."""
    case = repro_files.read(ROW_SUM.repro).case
    (issue,) = known_issues.on_generation((ROW_SUM,), "v6e")
    assert issue.matches(case)
    assert not issue.matches(dataclasses.replace(case, q_dtype="float32"))
    assert not issue.matches(dataclasses.replace(case, mask_value=None))
    assert not issue.matches(dataclasses.replace(case, q_lens=(1,), kv_lens=(1,)))
    assert issue.matches(dataclasses.replace(case, values="tiny"))
    assert issue.nearest_outside(case) == dataclasses.replace(case, q_dtype="float32")


@pytest.mark.parametrize("issue", INSTALLED_RELEASES, ids=lambda issue: issue.name)
def test_v3_issue_matches_its_own_repro(issue):
    """On the chip the repro was recorded for (its predicate may read the block sizes v3 chooses there)."""
    recorded = repro_files.read(issue.repro)
    (issue,) = known_issues.on_generation((issue,), recorded.tpu_generation)
    case = recorded.case
    assert issue.matches(case), f"{issue.name} does not match its own repro's case: {case.describe()}"
    moved = issue.nearest_outside(case)
    assert not issue.matches(moved), moved.describe()
    assert TARGET.known_issues == tuple(CATALOGUE[n] for n in v3target.RPA_HARNESS_KNOWN_ISSUES)


DEFAULT_BLOCKS = CATALOGUE["default-blocks-break-v3s-own-rules"]
# Issues of code v3 runs on some TPU generations only (its own block sizes, its int16 positions).
ON_A_GENERATION_ONLY = (
    "default-blocks-break-v3s-own-rules",
    "sliding-window-wraps-int16-positions",
    "int16-positions-wrap-past-32767-keys",
)


@settings(max_examples=60, deadline=None)
@given(case=valid_cases(CAPABILITIES), generation=st.sampled_from(["v5e", "v6e", "7x"]))
def test_the_default_blocks_finding_holds_only_where_v3s_validator_rejects_v3s_defaults(case, generation):
    """Where the predicate holds, v3's own validator rejects the block sizes v3 chose for the chip, had they
    been given (the finding is about sizes v3 does not validate); given block sizes never match."""
    (issue,) = known_issues.on_generation((DEFAULT_BLOCKS,), generation)
    with generations.emulated(generation):
        inputs = v3target.v3_inputs(**case.arrays(), **case.options())
    if inputs.kwargs["m_block_sizes"] is not None:
        assert not issue.matches(case)
        return
    given_defaults = dict(
        inputs.kwargs, d_block_sizes=inputs.decode_block_sizes, m_block_sizes=inputs.mixed_block_sizes
    )
    try:
        v3target.kernel().static_validate_inputs(*inputs.args, **v3target.validator_options(given_defaults))
        rejected = False
    except ValueError:
        rejected = True
    matches = issue.matches(case)
    event(f"{generation}: v3 rejects its own defaults: {rejected}; the finding's predicate: {matches}")
    assert rejected or not matches


def test_v3s_rejected_defaults_are_right_where_no_chunk_runs_past_its_block():
    """On v5e v3 chooses ``(16, 104, 32, 56)`` for its mixed kernel here, sizes its validator rejects (a
    KV chunk that does not divide the block, a query chunk twice the block). The mixed kernel runs only the
    last sequence, whose 30 keys lie within the block's whole KV chunk (the decodes run in the decode
    kernel): both outputs are right, and the finding's predicate does not hold. It moves out only the
    cases that read past the KV buffer (its repro, a sequence of 61 keys in the mixed kernel, is replayed by
    the known-issue property)."""
    case = Case(max_num_batched_tokens=32, max_num_seqs=4, pages_per_seq=13, total_num_pages=60,
                page_size=8, num_q_heads=8, num_kv_heads=2, head_dim=128, q_dtype="bfloat16",
                kv_dtype="bfloat16", q_lens=(1, 1, 7), kv_lens=(17, 100, 30), mask_value_meaning="replaces",
                seed=3)  # fmt: skip
    (issue,) = known_issues.on_generation((DEFAULT_BLOCKS,), "v5e")
    assert not issue.matches(case)  # the issue emulates its generation itself
    with generations.emulated("v5e"):
        inputs = v3target.v3_inputs(**case.arrays(), **case.options())
        assert inputs.mixed_block_sizes == (16, 104, 32, 56)
        verdict = v3target.judge(case.arrays(), case.options(), precision=TARGET.precision)
    assert verdict.comparison.ok and verdict.cache_error is None, verdict.comparison


def test_v3_issues_are_narrow():
    """Each drawable v3 issue matches some but at most a quarter of the cases drawn for v3."""
    cases = drawn_cases(valid_cases(CAPABILITIES), 200)
    for issue in INSTALLED_RELEASES:
        share = sum(issue.matches(case) for case in cases) / len(cases)
        if issue.name == "q-len-zero-before-a-live-sequence-hangs":  # empty_sequences=False: never drawn
            assert share == 0, issue.name
        elif issue.name in ON_A_GENERATION_ONLY:  # drawn here as on a CPU device
            assert share == 0, issue.name
        else:
            assert 0 < share <= 0.25, (issue.name, share)


@settings(max_examples=50, deadline=None)
@given(data=st.data())
def test_v3_issues_are_never_drawn(data):
    case = data.draw(valid_cases(CAPABILITIES, excluding=TARGET.known_issues))
    assert [issue.name for issue in TARGET.known_issues if issue.matches(case)] == []
    TARGET.validate(case.arrays(), case.options())


def test_the_int16_window_finding_needs_v6_packed_queries_and_a_window_that_wraps():
    case = repro_files.read(CATALOGUE["sliding-window-wraps-int16-positions"].repro).case
    matches = {
        generation: issue.matches(case)
        for generation in ("v5e", "v6e", "7x")
        for (issue,) in [
            known_issues.on_generation((CATALOGUE["sliding-window-wraps-int16-positions"],), generation)
        ]
    }
    assert matches == {"v5e": False, "v6e": True, "7x": True}
    (on_v6e,) = known_issues.on_generation((CATALOGUE["sliding-window-wraps-int16-positions"],), "v6e")
    assert not on_v6e.matches(dataclasses.replace(case, q_dtype="float32"))
    assert not on_v6e.matches(dataclasses.replace(case, sliding_window=32767 - case.kv_capacity))
    assert on_v6e.matches(dataclasses.replace(case, sliding_window=32768 - case.kv_capacity))


@pytest.mark.skipif(
    ahead_of_time.unavailable_reason() is not None, reason=str(ahead_of_time.unavailable_reason())
)
@pytest.mark.parametrize("generation", ["v5e", "v6e"])
def test_v3_compiles_ahead_of_time_through_its_host_mapping(generation):
    """v3's adapter maps a call with NumPy, so it cannot be traced on shapes alone; its compiled call maps
    the case's stand-in arrays on the host and the compiler compiles v3's kernel function on the mapped
    arguments' shapes. A decode and a prefill sequence, bfloat16, 8 query heads over 2 KV heads."""
    case = Case(
        max_num_batched_tokens=32, max_num_seqs=2, pages_per_seq=8, total_num_pages=17, page_size=16,
        num_q_heads=8, num_kv_heads=2, head_dim=128, q_dtype="bfloat16", kv_dtype="bfloat16",
        q_lens=(1, 20), kv_lens=(40, 100),
    )  # fmt: skip
    compiler = Backend(TPU_COMPILER, True, generation)
    check_compiles(TARGET, compiler, repro_files.stand_ins(case.array_shapes()), case.options())
    function, arguments = TARGET.compiled_call(case.arrays(), case.options())
    # The jitted call v3's adapter runs (``kernels.jitted``): compiled ahead, it serves the call that follows.
    assert function in kernels._JITTED.values() and len(arguments) == 8
