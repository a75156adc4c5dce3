"""tpu-inference's context-parallel fork of v3 without CP: v3's mapping on the fork's module, both outputs
against the oracle and the fork's own reference, and where its default block sizes part from v3's."""

import dataclasses

import numpy as np
import pytest

from rpa_harness import generations, targets
from rpa_harness.device import FAST_INTERPRET, INTERPRET, Backend
from rpa_harness.strategies.case import Case
from tests.cases import skip_without_tpu_inference

skip_without_tpu_inference(module_level=True)

from rpa_harness.targets import tpu_inference_rpa_v3_cp as cp  # noqa: E402  (needs tpu-inference)
from rpa_harness.targets import tpu_inference_v3 as v3  # noqa: E402
from rpa_harness.targets.tpu_inference import kernels  # noqa: E402
from rpa_harness.targets.tpu_inference_v3 import known_issues as v3_known_issues  # noqa: E402

TARGET = targets.load(targets.V3_CP_TARGET)
# A decode and a prefill across two KV blocks.
CASE = Case(
    max_num_batched_tokens=8, max_num_seqs=3, pages_per_seq=4, total_num_pages=11, page_size=4, num_q_heads=4,
    num_kv_heads=2, head_dim=128, q_lens=(1, 5), kv_lens=(6, 13), num_kv_pages_per_block=2,
    num_queries_per_block=4, mask_value_meaning="replaces", sm_scale=0.1,
)  # fmt: skip


@pytest.mark.parametrize("backend", [Backend(FAST_INTERPRET), Backend(INTERPRET)], ids=lambda b: b.label)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_fork_matches_the_oracle_and_writes_its_cache(backend, dtype):
    case = dataclasses.replace(CASE, q_dtype=dtype, kv_dtype=dtype)
    verdict = cp.judge(case.arrays(), case.options(), backend, precision=TARGET.precision)
    assert verdict.comparison.ok, str(verdict.comparison)
    assert verdict.cache_error is None, str(verdict.cache_error)


def test_the_fork_agrees_with_its_own_reference():
    arrays = dataclasses.replace(CASE, poison=False).arrays()
    inputs = cp.cp_inputs(**arrays, **CASE.options())
    tuning = ("d_block_sizes", "p_block_sizes", "m_block_sizes", "vmem_limit_bytes", "chunk_prefill_size")
    kwargs = {k: v for k, v in v3.validator_options(inputs.kwargs).items() if k not in tuning}
    expected, _ = cp.kernel().ref_ragged_paged_attention(*kernels.device_arrays(inputs.args), **kwargs)
    with Backend(FAST_INTERPRET).context():
        out, _ = cp.call_cp(inputs)
    rows = slice(0, CASE.num_tokens)
    np.testing.assert_allclose(np.asarray(out)[rows], np.asarray(expected)[rows], rtol=1e-5, atol=1e-5)


def test_the_forks_default_blocks_keep_v3s_rules_where_v3s_do_not():
    """v3's default mixed blocks on v6e for 48-key page tables are 48 keys in chunks of 32 (the finding
    default-blocks-break-v3s-own-rules); the fork rounds the block down to whole chunks."""
    case = dataclasses.replace(
        CASE, num_kv_pages_per_block=None, num_queries_per_block=None, page_size=16, pages_per_seq=3,
        total_num_pages=7, q_lens=(1, 5), kv_lens=(6, 40),
    )  # fmt: skip
    with generations.emulated("v6e"):
        arrays = case.arrays()
        v3_sizes = v3.v3_inputs(**arrays, **case.options()).mixed_block_sizes
        cp_sizes = cp.cp_inputs(**arrays, **case.options()).mixed_block_sizes
    assert v3_sizes[1] % v3_sizes[3] != 0
    assert cp_sizes[1] % cp_sizes[3] == 0


def test_v3s_findings_declared_by_the_fork_read_its_choices():
    """The fork's entries of v3's findings restate the fork's block sizes: v3's rule-breaking defaults for
    the case above match v3's finding, the fork's (which keep the rules) do not."""
    issue = next(i for i in v3.RPA_HARNESS_CATALOGUE if i.name == "default-blocks-break-v3s-own-rules")
    case = dataclasses.replace(
        CASE, num_kv_pages_per_block=None, num_queries_per_block=None, page_size=16, pages_per_seq=3,
        total_num_pages=7, q_lens=(1, 5), kv_lens=(6, 40),
    )  # fmt: skip
    with generations.emulated("v6e"):
        assert issue.matches(case)
        assert not v3_known_issues.for_module(issue, cp.kernel).matches(case)
    assert issue.name not in {i.name for i in TARGET.known_issues}


def test_bench_times_the_fork_against_v3_and_v3_on_the_kernel_call_it_maps_to(capsys):
    """The fork declares v3 its baseline; v3 is timed on its compiled call, whose inputs it donates (each
    timed call gets them back on the device)."""
    from rpa_harness import bench, cli

    command = ["bench", "--backend", "fast-interpret", "--batch", "small", "--calls", "2"]
    assert cli.main([*command, "--target", targets.V3_CP_TARGET]) == bench.PASSES
    out = capsys.readouterr().out
    assert f"{targets.V3_CP_TARGET}: timed on ragged_paged_attention, as users call it; x its baseline: over " \
        f"{targets.V3_TARGET}'s median" in out  # fmt: skip
    assert f"{targets.V3_TARGET}: timed on the kernel call it maps to" in out
    assert TARGET.baseline == targets.V3_TARGET
