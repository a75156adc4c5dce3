"""Fewer compilations: our kernel compiles once for all values of its run-time options, a whole-space group
of cases shares one static configuration (its cases no costlier than asked), and jax's persistent cache
serves a later process."""

import dataclasses
import json

import pytest
from hypothesis import given

from rpa_harness import device
from rpa_harness.checks import check_differential
from rpa_harness.device import FAST_INTERPRET, Backend
from rpa_harness.kernel import pallas_rpa
from rpa_harness.spec.interface import OPTION_NAMES
from rpa_harness.strategies.capabilities import RUNTIME_OPTIONS
from rpa_harness.strategies.case import Case
from rpa_harness.strategies.pooled import pool
from rpa_harness.strategies.valid import valid_case_groups
from rpa_harness.targets import load
from rpa_harness.targets.bundled import RPA_HARNESS_CAPABILITIES as OUR_KERNEL
from rpa_harness.targets.upstream import RPA_HARNESS_CAPABILITIES as UPSTREAM_KERNEL
from tests.cases import SMALL
from tests.processes import run_python

OTHER_VALUES = dict(
    sm_scale=1.0, sliding_window=16, soft_cap=5.0, mask_value=-2.0, k_scale=2.0, v_scale=0.0625
)


def test_run_time_option_values_share_one_compilation_and_are_honoured():
    target, backend = load("rpa_harness.kernel"), Backend(FAST_INTERPRET)
    compiled = pallas_rpa._ragged_paged_attention._cache_size
    before = compiled()
    for case in (SMALL, dataclasses.replace(SMALL, **OTHER_VALUES)):
        check_differential(target, backend, case.arrays(), case.options())  # each value is the one used
    assert compiled() == before + 1
    check_differential(target, backend, SMALL.arrays(), dataclasses.replace(SMALL, soft_cap=None).options())
    assert compiled() == before + 2, "whether an option is None is static: it changes the computation"


@given(cases=valid_case_groups(OUR_KERNEL, max_cases=6))
def test_a_group_shares_its_static_configuration(cases):
    first = cases[0]
    varying = {"q_lens", "kv_lens", "seed", "values", "poison", "garbage", *RUNTIME_OPTIONS}
    for case in cases[1:]:
        for field in dataclasses.fields(Case):
            if field.name not in varying:
                assert getattr(case, field.name) == getattr(first, field.name), field.name
        for name in RUNTIME_OPTIONS:
            if name != "mask_value":  # None is the default mask, a value
                assert (getattr(case, name) is None) == (getattr(first, name) is None), name


@given(cases=valid_case_groups(OUR_KERNEL, max_cases=6, pooled=True))
def test_a_pooled_group_shares_one_of_the_pooled_configurations(cases):
    """What the pooled property draws on a chip: several layouts on one pooled configuration."""
    shapes = ("page_size", "num_kv_heads", "head_dim", "q_dtype", "kv_dtype")
    pooled = {tuple(layout[name] for name in shapes) for layout, _ in pool(OUR_KERNEL)}
    assert len({tuple(getattr(case, name) for name in shapes) for case in cases}) == 1
    assert tuple(getattr(cases[0], name) for name in shapes) in pooled


@given(cases=valid_case_groups(UPSTREAM_KERNEL, max_cases=6))
def test_a_target_with_static_options_gets_one_set_of_options_per_group(cases):
    assert len({tuple(getattr(case, name) for name in OPTION_NAMES) for case in cases}) == 1


def test_group_size_is_checked_before_drawing():
    with pytest.raises(ValueError, match="max_cases=0 must be an int of at least 1"):
        valid_case_groups(max_cases=0)


def test_the_compilation_cache_setting():
    assert device.compilation_cache_setting("off") is None
    assert device.compilation_cache_setting("") is None
    assert str(device.compilation_cache_setting("some/folder")) == "some/folder"


_ONE_CALL = """
import json, sys
from rpa_harness import device
device.count_compilations()
device.enable_compilation_cache(sys.argv[1])
from rpa_harness.device import Backend
from rpa_harness.targets import load
from tests.cases import SMALL
Backend("fast-interpret").run(load("rpa_harness.kernel").attention, SMALL.arrays(), SMALL.options())
print("STATS", json.dumps(device.compilation_stats()))
"""


def test_a_later_process_reads_the_fast_interpreters_kernel_from_the_cache(tmp_path, pytestconfig):
    def one_call():
        out = run_python("-c", _ONE_CALL, str(tmp_path / "cache"), cwd=pytestconfig.rootpath)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
        return json.loads(out.stdout.split("STATS ", 1)[1])

    cold = one_call()
    assert cold["cache_writes"] >= 1 and cold["cache_hits"] == 0, cold
    warm = one_call()
    # Every entry the first process wrote is read (the kernel's among them); an executable that compiled
    # just under the threshold there may be written here.
    assert warm["cache_hits"] >= cold["cache_writes"], (cold, warm)


def test_block_steps_count_query_and_kv_block_pairs():
    given_blocks = dataclasses.replace(SMALL, num_queries_per_block=2, num_kv_pages_per_block=2)
    assert (
        given_blocks.block_steps == 2 * 2 + 1 * 1
    )  # (3 rows, 20 keys) and (1, 9) in blocks of 2 rows, 16 keys
    assert SMALL.block_steps == 3 * 3 + 1 * 2  # blocks left to the kernel: one row, one 8-key page


@given(cases=valid_case_groups(OUR_KERNEL, max_cases=6, max_block_steps=8))
def test_no_drawn_case_has_more_block_steps_than_asked(cases):
    assert all(case.block_steps <= 8 for case in cases)


def test_the_block_step_bound_is_checked_before_drawing():
    with pytest.raises(ValueError, match=r"valid_case_groups\(max_block_steps=0\): pass a positive int"):
        valid_case_groups(max_block_steps=0)
