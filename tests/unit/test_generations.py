"""TPU generation emulation: a kernel traced under a generation sees that chip wherever the shipped kernels
ask, traces are not shared between generations, everything is restored afterwards, and runs, repros and
replays carry the generation."""

import contextlib
import dataclasses
import importlib
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic import tpu_info
from jax.experimental.pallas import tpu as pltpu

from rpa_harness import generations, repro, targets
from rpa_harness.checks import CannotRun, check_differential, run_valid
from rpa_harness.device import FAST_INTERPRET, TPU, Backend
from rpa_harness.strategies.buckets import BUCKETS
from rpa_harness.strategies.case import Case
from rpa_harness.strategies.options import TUNED_KV_PAGES_PER_BLOCK, TUNED_QUERIES_PER_BLOCK
from tests.cases import skip_without_tpu_inference
from tests.processes import run_python

UPSTREAM_TUNING = "jax.experimental.pallas.ops.tpu.ragged_paged_attention.tuned_block_sizes"


@pytest.mark.parametrize("generation", generations.DEVICE_KINDS)
def test_the_kernel_sees_the_chip_and_then_the_cpu_again(generation):
    registered = dict(tpu_info.registry)
    with generations.emulated(generation):
        kind = jax.devices()[0].device_kind
        assert tpu_info.chip_version_from_device_kind(kind) == tpu_info.ChipVersion(generation), kind
        assert pltpu.get_tpu_info().chip_version == tpu_info.ChipVersion(generation)
        assert generations.current() == generation and generations.on_a_tpu_generation()
        assert jax.devices()[0].platform == "cpu"  # every other attribute is the CPU device's
        assert jax.devices("cpu")[0].device_kind == kind
    assert jax.devices()[0].device_kind == "cpu" and generations.current() == generations.NONE
    assert dict(tpu_info.registry) == registered


# What the shipped kernels compute from the chip (their installed sources' get_tpu_version/get_device_name).
UPSTREAM_SEES = {"v4": (4, "TPU v4"), "v5e": (5, "TPU v5"), "v5p": (5, "TPU v5"), "v6e": (6, "TPU v6")}


@pytest.mark.parametrize("generation", UPSTREAM_SEES)
def test_upstreams_chip_lookup_answers_as_on_the_chip(generation):
    tuning = importlib.import_module(UPSTREAM_TUNING)
    with pytest.raises(NotImplementedError, match="TPU version must be 4 or higher"):
        tuning.get_tuned_block_sizes(jnp.float32, jnp.float32, 8, 1, 128, 16, 512, 64)
    with generations.emulated(generation):
        assert (tuning.get_tpu_version(), tuning.get_device_name()) == UPSTREAM_SEES[generation]
        assert tuning.get_tuned_block_sizes(jnp.bfloat16, jnp.bfloat16, 8, 1, 128, 16, 512, 64)


def test_the_tuned_block_sizes_drawn_are_upstreams():
    """The block sizes the strategies draw as tuned are those of this jax's table for the generations the
    harness emulates (v5e, v6e) plus its untuned default (128, 32), and the production bucket's page sizes
    are the table's."""
    table = importlib.import_module(UPSTREAM_TUNING).TUNED_BLOCK_SIZES
    values = {value for device in ("TPU v5", "TPU v6") for value in table[device].values()}
    assert {kv for kv, _ in values} | {128} == set(TUNED_KV_PAGES_PER_BLOCK)
    assert {q for _, q in values} | {32} == set(TUNED_QUERIES_PER_BLOCK)
    assert {key[5] for device in table.values() for key in device} == set(BUCKETS["production"].page_sizes)


def test_v3s_chip_lookup_answers_as_on_the_chip():
    # The adapter imports v3's modules without tpu_inference/__init__.py (which imports vllm).
    skip_without_tpu_inference()
    from tpu_inference.kernels.ragged_paged_attention.v3 import util

    assert util.get_tpu_version() == -1
    for generation, version in (("v5e", 5), ("v5p", 5), ("v6e", 6), ("7x", 7)):
        with generations.emulated(generation):
            assert util.get_tpu_version() == version, generation


def test_a_trace_is_made_per_generation():
    seen = []

    @jax.jit
    def kind_while_traced(x):
        seen.append(jax.devices()[0].device_kind)
        return x

    for generation in ("v5e", "v6e", "v5e", generations.NONE):
        with generations.emulated(generation):
            kind_while_traced(jnp.zeros(2))
    assert seen == ["TPU v5 lite", "TPU v6 lite", "cpu"]  # the second v5e call reuses the first's trace


def test_unknown_names_and_a_real_tpu_are_refused():
    with pytest.raises(generations.GenerationError, match="unknown TPU generation.*v9.*known to jax"):
        generations.parse("v5e,v9")
    with pytest.raises(generations.GenerationError, match="a real TPU is the chip it is"):
        Backend(TPU, generation="v5e")
    with pytest.raises(generations.GenerationError, match="unknown TPU generation.*v9"):
        Backend(FAST_INTERPRET, generation="v9")
    with pytest.raises(generations.GenerationError, match="one generation is expected"):
        Backend(FAST_INTERPRET, generation="v5e,v6e")
    assert generations.parse("") == generations.parse("none") == (generations.NONE,)


def test_auto_picks_among_the_declared_generations_per_profile():
    declared = ("v4", "v5e", "v5p", "v6e", "7x")
    assert generations.select("auto", declared, profile="ci") == ("v5e", "v6e")
    assert generations.select("", declared, profile="nightly") == declared
    assert generations.select("auto", (), profile="ci") == (generations.NONE,)
    assert generations.select("7x", declared, profile="ci") == ("7x",)


UPSTREAM_CASE = Case(
    max_num_batched_tokens=8, max_num_seqs=2, pages_per_seq=8, total_num_pages=17,
    page_size=4, num_kv_heads=1, num_q_heads=2, head_dim=128, q_dtype="bfloat16", kv_dtype="bfloat16",
    q_lens=(3, 1), kv_lens=(9, 30), seed=7,
)  # fmt: skip


def test_upstream_runs_on_its_tuned_defaults_only_on_a_generation():
    """Without block sizes upstream's kernel looks them up per chip: not a TPU on a CPU device, the
    chip's tuned table under emulation, where it must then match the oracle."""
    upstream = targets.load(targets.UPSTREAM_TARGET)
    arrays, options = UPSTREAM_CASE.arrays(), UPSTREAM_CASE.options()
    assert options.get("num_kv_pages_per_block") is None and options.get("num_queries_per_block") is None
    with pytest.raises(CannotRun, match="TPU-tuned parameters"):
        run_valid(upstream, Backend(FAST_INTERPRET), arrays, options)
    for generation in ("v5e", "v6e"):
        assert check_differential(
            upstream, Backend(FAST_INTERPRET, generation=generation), arrays, options
        ).ok
    assert upstream.capabilities.needs_block_sizes
    assert not upstream.capabilities_on(Backend(FAST_INTERPRET, generation="v6e")).needs_block_sizes


V3_CASE = Case(
    max_num_batched_tokens=16, max_num_seqs=3, pages_per_seq=8, total_num_pages=30, page_size=16,
    num_q_heads=4, num_kv_heads=2, head_dim=128, q_dtype="bfloat16", kv_dtype="bfloat16",
    q_lens=(1, 3, 9), kv_lens=(50, 9, 100), mask_value_meaning="replaces", seed=3,
)  # fmt: skip


def test_v3_runs_on_its_own_defaults_on_a_generation():
    """Without block sizes or a VMEM limit v3 chooses them for the chip: the target passes None on a
    generation (its own defaults elsewhere), records the sizes v3 chooses (which differ between v6e and
    7x), and v3 then matches the oracle."""
    skip_without_tpu_inference()
    from rpa_harness.targets import tpu_inference_v3 as v3target
    from rpa_harness.targets.tpu_inference import arguments

    v3 = targets.load(targets.V3_TARGET)
    arrays, options = V3_CASE.arrays(), V3_CASE.options()
    off_chip = v3target.v3_inputs(**arrays, **options)
    assert off_chip.kwargs["d_block_sizes"] == off_chip.mixed_block_sizes  # the target's own defaults
    assert off_chip.kwargs["vmem_limit_bytes"] == arguments.DEFAULT_VMEM_LIMIT_BYTES
    chosen = {}
    for generation in ("v6e", "7x"):
        with generations.emulated(generation):
            inputs = v3target.v3_inputs(**arrays, **options)
        assert inputs.kwargs["d_block_sizes"] is inputs.kwargs["m_block_sizes"] is None
        assert inputs.kwargs["vmem_limit_bytes"] is None
        assert inputs.decode_block_sizes[0] == 1  # v3's decode kernel: one query row per block
        chosen[generation] = inputs.mixed_block_sizes
        assert check_differential(v3, Backend(FAST_INTERPRET, generation=generation), arrays, options).ok
    assert chosen["v6e"] != chosen["7x"], chosen


def test_known_issue_predicates_see_the_generation():
    """A predicate that reads the block sizes v3 chooses runs under the backend's generation (at draw time
    there is no kernel call to emulate it)."""
    skip_without_tpu_inference()
    v3 = targets.load(targets.V3_TARGET)
    seen = []
    probe = dataclasses.replace(
        v3.catalogue[0], matches=lambda case: seen.append(jax.devices()[0].device_kind) or False
    )
    v3 = dataclasses.replace(v3, known_issues=(probe,))
    for generation in (generations.NONE, "v6e"):
        (issue,) = v3.known_issues_on(Backend(FAST_INTERPRET, generation=generation))
        assert not issue.matches(V3_CASE)
    assert seen == ["cpu", "TPU v6 lite"]


def test_a_targets_hook_is_told_the_generation(monkeypatch):
    told = []

    @contextlib.contextmanager
    def hook(generation):
        told.append(generation)
        yield

    module = types.ModuleType("hooked_target")
    module.ragged_paged_attention = lambda **arrays_and_options: jnp.zeros(1)
    module.dynamic_validate_inputs = lambda **arrays_and_options: None
    module.RPA_HARNESS_GENERATION_HOOK = hook
    monkeypatch.setitem(sys.modules, "hooked_target", module)
    target = targets.load("hooked_target")
    Backend(FAST_INTERPRET).run(target.attention, {}, {})
    Backend(FAST_INTERPRET, generation="v6e").run(target.attention, {}, {})
    assert told == ["v6e"]
    module.RPA_HARNESS_GENERATION_HOOK = "v6e"
    with pytest.raises(targets.TargetError, match="RPA_HARNESS_GENERATION_HOOK is 'v6e'"):
        targets.load("hooked_target")


def test_a_repro_keeps_its_generation(tmp_path):
    arrays = {"q": np.zeros((1, 1, 1), np.float32)}
    path = repro.write(repro.Repro("p[x]", "t", FAST_INTERPRET, arrays, {}, tpu_generation="v6e"), tmp_path)
    assert repro.read(path).tpu_generation == "v6e"


def test_the_option_parametrises_the_numeric_properties_and_refuses_unknown_names(pytestconfig):
    common = ("-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "tests/properties/test_padding.py",
              f"--rpa-target={targets.UPSTREAM_TARGET}", "--rpa-backend=fast-interpret")  # fmt: skip
    collected = run_python(*common, "--rpa-tpu-generation=v5e,v6e", cwd=pytestconfig.rootpath)
    assert collected.returncode == 0, collected.stdout[-2000:] + collected.stderr[-2000:]
    assert "[fast-interpret-v5e]" in collected.stdout and "[fast-interpret-v6e]" in collected.stdout
    unknown = run_python(*common, "--rpa-tpu-generation=v9", cwd=pytestconfig.rootpath)
    assert unknown.returncode == 4 and "unknown TPU generation(s) v9" in unknown.stderr
    assert "Traceback" not in unknown.stderr
