"""The v3 target on tpu-inference 0.11.1 to 0.13.x (``rpa_harness.targets.tpu_inference_v3.early_api``): the
mask value's meaning read from the kernel, the options mapped onto the early API, the block options and the
tuned table, the loader's fixes, the rule table and the profile a release gets.

None of these needs an early release: each reads stand-in kernel files and modules. A test that also reads
a release's own files uses its folder (``RELEASES``) where it is present and is skipped where it is not.
"""

import dataclasses
import json
import os
import textwrap
import types
from pathlib import Path

import numpy as np
import pytest
from jax._src import dtypes as jax_dtypes

from rpa_harness import generations
from rpa_harness.spec.interface import MASK_ADDED, MASK_REPLACES, Options
from rpa_harness.strategies.case import Case
from rpa_harness.targets.tpu_inference import arguments, kernels, releases
from rpa_harness.targets.tpu_inference_v3 import adapter, early_api, early_known_issues, early_rules
from tests.processes import run_python

RELEASES = Path.home() / ".cache" / "rpa-harness" / "tpu-inference"
DEFAULT_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
EARLY_SIGNATURE = """
def ragged_paged_attention(queries, keys, values, kv_cache, kv_lens, page_indices, cu_q_lens, distribution,
                           *, sm_scale=1.0, sliding_window=None, soft_cap=None, mask_value=None, q_scale=None,
                           k_scale=None, v_scale=None, chunk_prefill_size=None, num_kv_pages_per_block=None,
                           num_queries_per_block=None, vmem_limit_bytes=None, debug_mode=False):
    pass
"""
ADDED = """
def _ragged_paged_attention_kernel(s, mask, mask_value):
    s += jnp.where(mask, mask_value, 0.0)
"""
REPLACED = """
def _ragged_paged_attention_kernel(s, mask, mask_value):
    s = jnp.where(mask, s, mask_value)
"""


def kernel_file(tmp_path, body: str) -> Path:
    path = tmp_path / "kernel.py"
    path.write_text(textwrap.dedent(EARLY_SIGNATURE + body))
    return path


@pytest.mark.parametrize("body, meaning", [(ADDED, MASK_ADDED), (REPLACED, MASK_REPLACES)])
def test_the_mask_values_meaning_is_read_from_the_kernel(tmp_path, body, meaning):
    assert early_api.kernel_mask_value_meaning(kernel_file(tmp_path, body)) == meaning


def test_a_kernel_that_applies_no_mask_value_is_named(tmp_path):
    path = kernel_file(tmp_path, "def _ragged_paged_attention_kernel(s):\n    return s\n")
    with pytest.raises(LookupError, match="applies mask_value in no jnp.where"):
        early_api.kernel_mask_value_meaning(path)


@pytest.mark.parametrize(
    "release, meaning",
    [("0.11.1", MASK_ADDED), ("0.12.0", MASK_ADDED), ("0.13.3", MASK_REPLACES), ("0.32.0", MASK_REPLACES)],
)
def test_each_releases_kernel_has_its_meaning(release, meaning):
    path = RELEASES / release / "tpu_inference/kernels/ragged_paged_attention/v3/kernel.py"
    if not path.is_file():
        pytest.skip(f"tpu-inference {release} is not unpacked under {RELEASES}")
    assert early_api.kernel_mask_value_meaning(path) == meaning


@pytest.mark.parametrize(
    "mask_value, meaning, kernel_meaning, passed",
    [
        (None, MASK_ADDED, MASK_ADDED, DEFAULT_MASK_VALUE),  # the kernel takes no None: its default
        (None, MASK_REPLACES, MASK_ADDED, DEFAULT_MASK_VALUE),  # both defaults mask fully
        (
            arguments.UPSTREAM_DEFAULT_MASK_VALUE,
            MASK_ADDED,
            MASK_REPLACES,
            arguments.UPSTREAM_DEFAULT_MASK_VALUE,
        ),
        (-2.0, MASK_ADDED, MASK_ADDED, -2.0),
        (-2.0, MASK_REPLACES, MASK_REPLACES, -2.0),
    ],
)
def test_the_mask_value_passed(mask_value, meaning, kernel_meaning, passed):
    options = Options(mask_value=mask_value, mask_value_meaning=meaning)
    assert early_api.early_mask_value(options, kernel_meaning, DEFAULT_MASK_VALUE) == passed


def test_a_finite_mask_value_of_the_other_meaning_has_no_counterpart(monkeypatch):
    monkeypatch.setattr(releases, "installed_version", lambda: "0.12.0")
    options = Options(mask_value=-2.0, mask_value_meaning=MASK_REPLACES)
    with pytest.raises(ValueError, match=r"tpu-inference 0\.12\.0 added it .* mask_value_meaning='added'"):
        early_api.early_mask_value(options, MASK_ADDED, DEFAULT_MASK_VALUE)


@pytest.mark.parametrize(
    "name, value",
    [
        ("use_causal_mask", False),
        ("skip_kv_mask", True),
        ("out_dtype", "float32"),
        ("update_kv_cache", False),
    ],
)
def test_an_option_the_early_api_lacks_is_refused_off_its_default(monkeypatch, name, value):
    monkeypatch.setattr(releases, "installed_version", lambda: "0.13.3")
    api = releases.V3Api(("queries", "sm_scale", "num_kv_pages_per_block"))
    early_api.check_options_taken(Options(), api)
    with pytest.raises(ValueError, match=rf"{name}={value!r}: the installed tpu-inference 0\.13\.3 has no"):
        early_api.check_options_taken(Options(**{name: value}), api)


def test_the_old_name_of_bit_width_is_provided_where_jax_lacks_it(monkeypatch):
    monkeypatch.delattr(jax_dtypes, "bit_width", raising=False)
    kernels.provide_dtypes_bit_width()
    assert jax_dtypes.bit_width(np.dtype(np.float32)) == 32
    assert jax_dtypes.bit_width(jax_dtypes.bfloat16) == jax_dtypes.itemsize_bits(jax_dtypes.bfloat16) == 16


class StandInKernel(types.ModuleType):
    """An early kernel module: its signature, a validator and a tuned table that record their calls."""

    def __init__(self, tmp_path, *, table_takes_window: bool, body: str = REPLACED):
        super().__init__("stand_in_early_kernel")
        self.__file__ = str(kernel_file(tmp_path, body))
        namespace: dict = {}
        exec(textwrap.dedent(EARLY_SIGNATURE), namespace)
        self.ragged_paged_attention = namespace["ragged_paged_attention"]
        self.DEFAULT_MASK_VALUE = DEFAULT_MASK_VALUE
        self.calls: list = []

        def table(head_dim, max_num_tokens, pages_per_seq, window):
            self.calls.append(("table", head_dim, max_num_tokens, pages_per_seq, window))
            return 3, 4  # (num_kv_pages_per_block, num_queries_per_block)

        def windowed_table(q_dtype, kv_dtype, num_q_heads, num_kv_heads, head_dim, page_size,
                           max_num_tokens, pages_per_seq, sliding_window=None):  # fmt: skip
            return table(head_dim, max_num_tokens, pages_per_seq, dict(sliding_window=sliding_window))

        def windowless_table(
            q_dtype, kv_dtype, num_q_heads, num_kv_heads, head_dim, page_size, max_num_tokens, pages_per_seq
        ):  # 0.11.1 and 0.12.0: no window
            return table(head_dim, max_num_tokens, pages_per_seq, {})

        self.get_tuned_block_sizes = windowed_table if table_takes_window else windowless_table

    def static_validate_inputs(self, *args, **kwargs):
        self.calls.append(("validate", tuple(kwargs)))


CASE = Case(
    max_num_batched_tokens=8, max_num_seqs=2, pages_per_seq=4, total_num_pages=9, page_size=4,
    num_q_heads=2, num_kv_heads=1, head_dim=64, q_lens=(1, 3), kv_lens=(5, 9),
    mask_value_meaning=MASK_REPLACES,
)  # fmt: skip


def early_inputs(module, case: Case = CASE) -> adapter.V3Inputs:
    return adapter.v3_inputs(**case.arrays(), **case.options(), module=module)


def test_the_adapter_maps_a_call_onto_the_early_api(tmp_path):
    module = StandInKernel(tmp_path, table_takes_window=True)
    inputs = early_inputs(module, dataclasses.replace(CASE, mask_value=-3.0, sliding_window=5))
    assert set(inputs.kwargs) <= set(adapter.api_of(module).parameters)
    assert inputs.kwargs["mask_value"] == -3.0 and inputs.kwargs["sliding_window"] == 5
    assert inputs.kwargs["vmem_limit_bytes"] is None  # the early kernels' default is a constant
    # Off a TPU generation: the target's defaults, 8 query rows and 2 pages; whole blocks, no chunks.
    assert (inputs.kwargs["num_queries_per_block"], inputs.kwargs["num_kv_pages_per_block"]) == (8, 2)
    assert inputs.decode_block_sizes == inputs.mixed_block_sizes == (8, 8, 8, 8)
    assert module.calls == []
    # The same new tokens, cache and metadata as the later API's mapping.
    assert len(inputs.args) == 8 and inputs.expected_cache.shape[1] == CASE.page_size


@pytest.mark.parametrize("table_takes_window", [True, False], ids=["0.13.x", "0.11.1-0.12.0"])
def test_on_a_tpu_generation_the_tuned_table_chooses_as_the_kernel_calls_it(tmp_path, table_takes_window):
    module = StandInKernel(tmp_path, table_takes_window=table_takes_window)
    with generations.emulated("v6e"):
        inputs = early_inputs(module, dataclasses.replace(CASE, sliding_window=5))
    window = {"sliding_window": 5} if table_takes_window else {}
    assert [call[0] for call in module.calls] == ["validate", "table"]  # validated before the table asks
    # head_dim aligned to 128 lanes, the token budget and the page table, as the kernel passes them.
    assert module.calls[1][1:] == (128, CASE.max_num_batched_tokens, CASE.pages_per_seq, window)
    assert inputs.kwargs["num_queries_per_block"] is inputs.kwargs["num_kv_pages_per_block"] is None
    assert inputs.mixed_block_sizes == inputs.decode_block_sizes == (4, 12, 4, 12)


def test_the_adapter_keeps_the_later_api_for_a_kernel_with_block_tuples(tmp_path):
    module = StandInKernel(tmp_path, table_takes_window=True)
    module.ragged_paged_attention = lambda q, *, d_block_sizes=None, update_kv_cache=True: None
    inputs = early_inputs(module)
    assert "m_block_sizes" in inputs.kwargs and "num_kv_pages_per_block" not in inputs.kwargs


def test_the_early_rule_table_names_the_block_options_and_has_no_skip_kv_mask_rule():
    assert "skip_kv_mask with the causal mask" not in early_rules.RULES
    messages = {name: rule.message for name, rule in early_rules.RULES.items()}
    assert (
        messages["num_kv_pages_per_block not positive"](-1) == "num_kv_pages_per_block=-1 must be positive."
    )
    assert messages["num_queries_per_block not positive"](0) == "num_queries_per_block=0 must be positive."
    names = list(early_rules.RULES)  # the early validator checks the KV block before the query block
    assert names.index("num_kv_pages_per_block not positive") < names.index(
        "num_queries_per_block not positive"
    )


@pytest.mark.parametrize(
    "changes, not_whole",
    [
        (dict(kv_dtype="bfloat16", q_dtype="bfloat16", num_kv_pages_per_block=1), True),  # 4 keys of 1 row
        (dict(kv_dtype="bfloat16", q_dtype="bfloat16", num_kv_pages_per_block=2), False),  # 8 rows
        (dict(num_kv_pages_per_block=1), False),  # float32: 2 rows a key (K and V), 8 rows
        (dict(num_kv_pages_per_block=1, page_size=2, pages_per_seq=8, total_num_pages=17), True),
    ],
)
def test_the_tile_finding_counts_the_kv_blocks_rows(tmp_path, changes, not_whole):
    module = StandInKernel(tmp_path, table_takes_window=True)
    case = dataclasses.replace(CASE, head_dim=128, num_queries_per_block=8, **changes)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(adapter, "kernel", lambda: module)
        early_known_issues._inputs_on.cache_clear()
        assert early_known_issues.early_kv_block_not_whole_tiles(case) is not_whole
        moved = early_known_issues.with_whole_tile_kv_blocks(case)
        assert not early_known_issues.early_kv_block_not_whole_tiles(moved)
        early_known_issues._inputs_on.cache_clear()


def test_the_window_finding_needs_a_window_starting_past_the_first_kv_block(tmp_path):
    module = StandInKernel(tmp_path, table_takes_window=True)
    case = dataclasses.replace(CASE, num_kv_pages_per_block=1, num_queries_per_block=8)  # 4-key blocks
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(adapter, "kernel", lambda: module)
        early_known_issues._inputs_on.cache_clear()
        past = dataclasses.replace(case, sliding_window=2)  # sequence 1: (9 - 3 - 2) // 4 = block 1
        within = dataclasses.replace(case, sliding_window=3)  # (9 - 3 - 3) // 4 = block 0 for both
        assert early_known_issues.early_window_past_block_0(past)
        assert not early_known_issues.early_window_past_block_0(within)
        assert not early_known_issues.early_window_past_block_0(case)
        moved = early_known_issues.with_window_from_block_0(past)
        assert moved.sliding_window == 6 and not early_known_issues.early_window_past_block_0(moved)
        early_known_issues._inputs_on.cache_clear()


@pytest.mark.parametrize("meaning", [MASK_ADDED, MASK_REPLACES])
def test_the_mask_findings_need_a_finite_mask_value_and_slots_past_kv_len(tmp_path, meaning):
    module = StandInKernel(
        tmp_path, table_takes_window=True, body=ADDED if meaning == MASK_ADDED else REPLACED
    )
    finding = {
        MASK_ADDED: early_known_issues.added_finite_mask_value_weights_slots_past_kv_len,
        MASK_REPLACES: early_known_issues.replacing_finite_mask_value_weights_slots_past_kv_len,
    }[meaning]
    case = dataclasses.replace(
        CASE, mask_value=-2.0, mask_value_meaning=meaning, num_kv_pages_per_block=1, num_queries_per_block=8
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(adapter, "kernel", lambda: module)
        early_known_issues._inputs_on.cache_clear()
        assert finding(case)  # kv_lens 5 and 9 in 4-key blocks
        assert not finding(dataclasses.replace(case, kv_lens=(4, 8)))  # whole blocks: no slot past kv_len
        assert not finding(dataclasses.replace(case, mask_value=-1e6))  # its weight underflows
        assert not finding(early_known_issues.with_default_mask_value(case))
        other = MASK_REPLACES if meaning == MASK_ADDED else MASK_ADDED  # the other finding's
        assert not finding(dataclasses.replace(case, mask_value_meaning=other))
        early_known_issues._inputs_on.cache_clear()


STAND_IN_RELEASE_PROGRAM = """
import json
from rpa_harness.strategies.capabilities import Capabilities
from rpa_harness.targets import tpu_inference_v3 as v3
from rpa_harness.targets.tpu_inference_v3 import early_rules
caps = Capabilities(**v3.RPA_HARNESS_CAPABILITIES)
print(json.dumps(dict(
    version=v3.RPA_HARNESS_VERSION, meaning=caps.mask_value_meaning, non_causal=caps.non_causal,
    out_dtype=caps.out_dtype, skip_kv_mask=caps.skip_kv_mask, update_kv_cache=caps.update_kv_cache,
    precision=list(v3.RPA_HARNESS_PRECISION), early_rules=v3.RPA_HARNESS_RULES is early_rules.RULES,
    known_issues=list(v3.RPA_HARNESS_KNOWN_ISSUES),
)))
"""


def stand_in_release(tmp_path, version: str, body: str) -> Path:
    """A folder with a tpu-inference ``version`` whose v3 package holds only a stand-in kernel file."""
    v3 = tmp_path / version / "tpu_inference/kernels/ragged_paged_attention/v3"
    v3.mkdir(parents=True)
    (tmp_path / version / "tpu_inference/__init__.py").write_text("raise ImportError('imports vllm')\n")
    kernel_file(v3, body)
    info = tmp_path / version / f"tpu_inference-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: tpu-inference\nVersion: {version}\n")
    return tmp_path / version


@pytest.mark.parametrize(
    "version, body, meaning", [("0.12.0", ADDED, MASK_ADDED), ("0.13.3", REPLACED, MASK_REPLACES)]
)
def test_an_early_release_gets_its_own_profile(tmp_path, version, body, meaning):
    folder = stand_in_release(tmp_path, version, body)
    env = dict(os.environ, PYTHONPATH=str(folder))
    child = run_python("-c", STAND_IN_RELEASE_PROGRAM, cwd=tmp_path, env=env)
    assert child.returncode == 0, child.stderr
    profile = json.loads(child.stdout.splitlines()[-1])
    assert profile["version"].startswith(f"tpu-inference {version} (v3/kernel.py ")
    assert profile["meaning"] == meaning
    assert not (profile["non_causal"] or profile["out_dtype"] or profile["skip_kv_mask"])
    assert not profile["update_kv_cache"]
    assert profile["precision"] == ["approx-reciprocal-for-narrow-output"]
    assert profile["early_rules"]
    early = {issue.name: issue for issue in early_known_issues.RPA_HARNESS_CATALOGUE}
    declared_early = [name for name in profile["known_issues"] if name in early]
    assert declared_early == [name for name, issue in early.items() if issue.affects(version)]
    assert declared_early  # each early release has at least one of them


MATCHES_ITS_REPRO_PROGRAM = """
import sys
from rpa_harness import repro
from rpa_harness.targets import tpu_inference_v3 as v3
issue = {issue.name: issue for issue in v3.RPA_HARNESS_CATALOGUE}[sys.argv[1]]
print(issue.name in v3.RPA_HARNESS_KNOWN_ISSUES, issue.matches(repro.read(issue.repro).case))
"""
REPRO_RELEASES = {  # each early finding's repro, the release it was made on
    "early-kv-block-not-whole-tiles-fails-to-trace": "0.13.3",
    "early-window-past-block-0-desyncs-kv-prefetch": "0.13.3",
    "early-finite-mask-value-weights-slots-past-kv-len": "0.11.1",
    "early-finite-mask-value-weights-stale-slots-past-kv-len": "0.13.3",
}


@pytest.mark.parametrize("name", list(REPRO_RELEASES))
def test_each_early_finding_is_declared_for_its_release_and_matches_its_repro(tmp_path, name):
    folder = RELEASES / REPRO_RELEASES[name]
    if not folder.is_dir():
        pytest.skip(f"tpu-inference {REPRO_RELEASES[name]} is not unpacked under {RELEASES}")
    env = dict(os.environ, PYTHONPATH=str(folder))
    child = run_python("-c", MATCHES_ITS_REPRO_PROGRAM, name, cwd=tmp_path, env=env)
    assert child.returncode == 0, child.stderr
    assert child.stdout.split() == ["True", "True"]
