"""Compiling for a TPU generation on this host (``rpa_harness.ahead_of_time``): the chip's verdicts without
a chip, as the compile property (tests/properties/test_compilation.py) and ``rpa-harness replay`` use them.

The compiler's verdicts here are those a v5e gave on the same configurations: the bundled kernel's fp8
cache with one KV head did not compile ("Offsets along tiled dimensions must be aligned to tiles"), and
upstream's kernel at a Llama-3-8B-like batch with its tuned block sizes ran out of v5e's scoped VMEM.
"""

import functools
import importlib.util
import json
import os
from pathlib import Path

import numpy as np
import pytest

from rpa_harness import ahead_of_time, bench, device, generations, property_names, repro, targets
from rpa_harness.checks import DoesNotCompile, NeedsMoreSmem, NeedsMoreVmem, check_compiles
from rpa_harness.kernel import pallas_rpa
from rpa_harness.run_settings import compile_generations
from rpa_harness.strategies.case import Case
from tests.processes import run_python

NEEDS_COMPILER = pytest.mark.skipif(
    ahead_of_time.unavailable_reason() is not None, reason=str(ahead_of_time.unavailable_reason())
)
DOES_NOT_COMPILE = "tests.broken.does_not_compile"
REPO = Path(__file__).resolve().parents[2]  # where the broken target imports


def compiler(generation: str) -> device.Backend:
    return device.Backend(device.TPU_COMPILER, True, generation)


def compile_case(target_name: str, case: Case, generation: str) -> None:
    arrays = repro.stand_ins(case.array_shapes())
    check_compiles(targets.load(target_name), compiler(generation), arrays, case.options())


def small_case(**fields) -> Case:
    layout = dict(
        max_num_batched_tokens=32, max_num_seqs=4, pages_per_seq=8, total_num_pages=32, page_size=16,
        num_q_heads=4, num_kv_heads=2, head_dim=128, q_lens=(3,), kv_lens=(20,),
    )  # fmt: skip
    return Case(**{**layout, **fields})


# A Llama-3-8B-like serving batch: 512 tokens, 32 query and 8 KV heads of 128, bfloat16, pages of 16.
LLAMA_BATCH = dict(
    max_num_batched_tokens=512, max_num_seqs=64, pages_per_seq=128, total_num_pages=2048, page_size=16,
    num_q_heads=32, num_kv_heads=8, head_dim=128, q_dtype="bfloat16", kv_dtype="bfloat16",
    q_lens=(1,), kv_lens=(1,),
)  # fmt: skip


@NEEDS_COMPILER
@pytest.mark.parametrize("generation", ["v5e", "v6e"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_bundled_kernel_compiles_an_fp8_cache_with_one_kv_head(generation, page_size):
    case = small_case(
        num_kv_heads=1, head_dim=64, kv_dtype="float8_e4m3fn", page_size=page_size, pages_per_seq=64,
        total_num_pages=256, kv_lens=(20,),
    )  # fmt: skip
    compile_case(targets.DEFAULT_TARGET, case, generation)


@NEEDS_COMPILER
def test_bundled_kernel_given_large_kv_blocks_fits_them_to_its_vmem_limit():
    # 128 pages of 32 float32 keys at head_dim 256: 16 MiB of KV buffers, v5e's default scoped limit.
    case = Case(
        max_num_batched_tokens=16, max_num_seqs=2, pages_per_seq=4096, total_num_pages=4096, page_size=32,
        num_q_heads=1, num_kv_heads=1, head_dim=256, q_lens=(1,), kv_lens=(1,), num_kv_pages_per_block=128,
        num_queries_per_block=16,
    )  # fmt: skip
    compile_case(targets.DEFAULT_TARGET, case, "v5e")
    # Under a caller's limit of 16 MiB the given blocks are halved until they fit it (the same attention).
    compile_case(targets.DEFAULT_TARGET, Case(**{**vars_of(case), "vmem_limit_bytes": 16 * 2**20}), "v5e")
    shapes = dict(q_heads_per_block=1, page_size=32, kv_heads_per_block=1, head_dim=256)
    block_q, kv_pages = pallas_rpa.blocks_within_vmem(
        16, 128, 16 * 2**20, q_dtype="float32", kv_dtype="float32", **shapes
    )
    assert (block_q, kv_pages) == (16, 32) and pallas_rpa.blocks_within_vmem(16, 128, None, **shapes) == (
        16,
        128,
    )


def vars_of(case: Case) -> dict:
    return json.loads(case.to_json()) | {"q_lens": case.q_lens, "kv_lens": case.kv_lens}


@NEEDS_COMPILER
def test_upstream_tuned_blocks_overflow_v5e_vmem_at_a_llama_batch():
    case = Case(**LLAMA_BATCH)
    with pytest.raises(
        NeedsMoreVmem, match=r"v5e \(TPU v5 lite\)'s scoped limit \(vmem_limit_bytes not given\)"
    ):
        compile_case(targets.UPSTREAM_TARGET, case, "v5e")
    compile_case(targets.UPSTREAM_TARGET, case, "v6e")  # its tuned table's v6e entry fits


@NEEDS_COMPILER
def test_the_benchs_decode_batch_compiles_for_a_v5e_under_its_vmem_limit():
    """``rpa-harness bench`` on a v5e: upstream's kernel, the default baseline, compiles at the serving
    decode batch under the limit the batches give (at the default limit it overflows, above)."""
    for target in (targets.UPSTREAM_TARGET, targets.DEFAULT_TARGET):
        compile_case(target, bench.BATCHES["decode"].case, "v5e")


@NEEDS_COMPILER
def test_a_page_table_prefetched_whole_needs_more_smem_than_a_chip_has():
    case = Case(**{**LLAMA_BATCH, "max_num_seqs": 256, "pages_per_seq": 2048, "total_num_pages": 8192})
    with pytest.raises(NeedsMoreSmem, match=r"needs more SMEM than v6e .*space=smem"):
        compile_case(targets.UPSTREAM_TARGET, case, "v6e")


@NEEDS_COMPILER
def test_what_pallas_cannot_lower_for_a_tpu_does_not_compile():
    with pytest.raises(DoesNotCompile, match=r"does not compile for v5e \(TPU v5 lite\): .*cumsum"):
        compile_case(
            DOES_NOT_COMPILE, small_case(head_dim=64, page_size=8, num_kv_heads=1, num_q_heads=2), "v5e"
        )


@NEEDS_COMPILER
def test_a_compile_repro_replays_and_its_script_compiles(tmp_path):
    case = small_case(head_dim=64, page_size=8, num_kv_heads=1, num_q_heads=2)
    written = repro.Repro(
        "compiles[tpu-compiler-v5e]", DOES_NOT_COMPILE, device.TPU_COMPILER,
        repro.stand_ins(case.array_shapes()), case.options(), case=case, kind="compiles",
        tpu_generation="v5e", shapes_only=True,
    )  # fmt: skip
    path = repro.write(written, tmp_path)
    script = tmp_path / "repro.py"
    replayed = run_python("-m", "rpa_harness.cli", "replay", str(path), "--script", str(script), cwd=REPO)
    assert replayed.returncode == 1, replayed.stdout + replayed.stderr
    assert "does not compile for v5e" in replayed.stdout and "cumsum" in replayed.stdout
    standalone = run_python("-c", script.read_text(), cwd=REPO)  # -c: the folder it runs in imports
    assert standalone.returncode != 0 and "cumsum" in standalone.stderr, standalone.stderr[-2000:]
    # The same program for a target that compiles says so.
    script.write_text(script.read_text().replace(DOES_NOT_COMPILE, targets.DEFAULT_TARGET))
    compiles = run_python("-c", script.read_text(), cwd=REPO)
    assert compiles.returncode == 0 and "compiles for v5e" in compiles.stdout, compiles.stderr[-2000:]


def test_a_shapes_only_repro_stores_the_shapes_and_reads_back_stand_ins(tmp_path):
    case = Case(**LLAMA_BATCH)
    arrays = repro.stand_ins(case.array_shapes())
    assert sum(value.nbytes for value in arrays.values()) > 2**20  # what a stored pair would hold
    written = repro.Repro(
        "compiles[tpu-compiler-v5e]", targets.DEFAULT_TARGET, device.TPU_COMPILER, arrays, case.options(),
        case=case, kind="compiles", tpu_generation="v5e", shapes_only=True,
    )  # fmt: skip
    path = repro.write(written, tmp_path)
    assert not path.with_suffix(".npz").exists() and path.stat().st_size < 16 * 2**10
    pending = repro.write_pending(written, tmp_path)
    read = repro.read(path)
    assert read.shapes_only and not read.in_flight and repro.read(pending).shapes_only
    assert {name: (value.shape, value.dtype) for name, value in read.arrays.items()} == {
        name: (shape, dtype) for name, (shape, dtype) in case.array_shapes().items()
    }


def test_array_shapes_are_those_of_the_arrays():
    case = small_case(q_dtype="bfloat16", kv_dtype="float8_e5m2", garbage=True)
    assert {name: (value.shape, value.dtype) for name, value in case.arrays().items()} == case.array_shapes()


def test_without_libtpu_the_compiler_backend_says_what_to_install(monkeypatch):
    found = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *rest: None if name == "libtpu" else found(name, *rest)
    )
    assert ahead_of_time.INSTALL_COMMAND in compiler("v5e").skip_reason


def test_the_compiler_backend_needs_a_generation():
    with pytest.raises(generations.GenerationError, match="compiles for a TPU generation"):
        device.Backend(device.TPU_COMPILER, True, generations.NONE)


@pytest.mark.parametrize(
    "chosen, option, emulated, profile, expected",
    [
        ((device.FAST_INTERPRET,), "auto", ("v5e", "v6e", "7x"), "ci", ("v5e", "v6e", "7x")),
        ((device.FAST_INTERPRET,), "auto", (generations.NONE,), "ci", ("v5e", "v6e")),
        (
            (device.FAST_INTERPRET,),
            "auto",
            (generations.NONE,),
            "nightly",
            ("v4", "v5e", "v5p", "v6e", "7x"),
        ),
        ((device.FAST_INTERPRET,), "v6e", ("v6e",), "ci", ("v6e",)),
        ((device.FAST_INTERPRET,), "none", (generations.NONE,), "ci", ()),
        ((device.TPU,), "auto", (generations.NONE,), "ci", ()),
    ],
    ids=["emulated", "none-emulated", "nightly", "named", "named-none", "a-real-tpu"],
)
def test_compile_generations(chosen, option, emulated, profile, expected):
    known = tuple(name for name in expected if name in generations.DEVICE_KINDS)
    assert compile_generations(chosen, option, emulated, profile) == known


@functools.cache
def upstream_chip_cases() -> tuple[Case, ...]:
    """Small configurations as the compile property draws them for upstream (block sizes may be left to its
    table), the same on every run."""
    import dataclasses as dc

    from hypothesis import HealthCheck, Phase, given, settings

    from rpa_harness.strategies.valid import valid_cases
    from rpa_harness.targets import upstream

    capabilities = dc.replace(upstream.RPA_HARNESS_CAPABILITIES, needs_block_sizes=False)
    cases: list[Case] = []

    @settings(
        max_examples=400, derandomize=True, database=None, phases=[Phase.generate], deadline=None,
        suppress_health_check=list(HealthCheck),
    )  # fmt: skip
    @given(valid_cases(capabilities))
    def collect(case):
        cases.append(dc.replace(case, vmem_limit_bytes=None))

    collect()
    return tuple(cases)


@NEEDS_COMPILER
def test_upstreams_compile_predicates_agree_with_the_compiler():
    """Each compile finding's predicate against the compiler's verdict for v5e: up to 3 drawn cases it
    matches (and no other finding does) are refused with its symptom, and 3 it does not match are not."""
    from rpa_harness.checks import PropertyFailure
    from rpa_harness.known_issues import on_generation
    from rpa_harness.targets import upstream

    catalogue = on_generation(upstream.RPA_HARNESS_CATALOGUE, "v5e")
    compile_findings = [
        issue for issue in catalogue if repro.read(issue.repro).kind == property_names.COMPILATION
    ]
    for issue in compile_findings:
        # Cases no other finding is about: the compiler shows this one's symptom or none.
        others = [other for other in catalogue if other.name != issue.name]
        cases = [case for case in upstream_chip_cases() if not any(other.matches(case) for other in others)]
        recorded = repro.read(issue.repro).case  # where few drawn cases are inside, its own repro's
        inside = ([case for case in cases if issue.matches(case)] + [recorded])[:3]
        outside = [case for case in cases if not issue.matches(case)][:3]
        for case, expected in [(case, True) for case in inside] + [(case, False) for case in outside]:
            try:
                compile_case(targets.UPSTREAM_TARGET, case, "v5e")
                shown = False
            except PropertyFailure as failure:
                shown = issue.shows(str(failure))
            assert shown == expected, (issue.name, expected, case.describe())


# What compiling a configuration reads: its arrays' shapes and dtypes, and the options that are not run-time
# ones (``Capabilities.runtime_options`` vary within a group, ``valid_case_groups``).
SHAPE_FIELDS = (
    "page_size", "pages_per_seq", "max_num_seqs", "max_num_batched_tokens", "total_num_pages", "num_q_heads",
    "num_kv_heads", "head_dim", "q_dtype", "kv_dtype",
)  # fmt: skip


@NEEDS_COMPILER
def test_the_agreement_step_draws_its_count_in_groups_that_share_a_compilation():
    """``--predict`` compiles a group once: its configurations share every static field, the count is
    exact, some group holds more than one (fewer compilations than configurations), and the draw is the
    same on every call (the chip checks what the host predicted)."""
    from rpa_harness.chip import agreement

    target = targets.load(targets.DEFAULT_TARGET)
    groups = agreement.draw_groups(target, compiler("v5e"), 12)
    assert sum(map(len, groups)) == 12
    assert len(groups) < 12, [len(group) for group in groups]
    runtime = target.capabilities.runtime_options
    for group in groups:
        statics = {
            (
                tuple(getattr(case, name) for name in SHAPE_FIELDS),
                tuple(sorted((n, repr(v)) for n, v in case.options().items() if n not in runtime)),
            )
            for case in group
        }
        assert len(statics) == 1, [case.describe() for case in group]
    assert agreement.draw_groups(target, compiler("v5e"), 12) == groups


def test_the_agreement_step_interprets_no_long_context():
    """A configuration reading more keys than ``MOST_INTERPRETED_KEYS`` (a long context: minutes to hours
    on the interpreters) or writing more output than ``LARGEST_RUN`` is compiled only."""
    from rpa_harness.chip.agreement import LARGEST_RUN, MOST_INTERPRETED_KEYS, interpreted

    pages = -(-MOST_INTERPRETED_KEYS // 16) + 1
    long_layout = dict(pages_per_seq=pages, total_num_pages=pages, max_num_seqs=1)
    assert interpreted(small_case())
    assert interpreted(small_case(**long_layout, q_lens=(1,), kv_lens=(MOST_INTERPRETED_KEYS,)))
    assert not interpreted(small_case(**long_layout, q_lens=(1,), kv_lens=(MOST_INTERPRETED_KEYS + 1,)))
    tokens = LARGEST_RUN // (4 * 128) + 1
    assert not interpreted(small_case(max_num_batched_tokens=tokens, q_lens=(3,), kv_lens=(20,)))


@NEEDS_COMPILER
def test_the_chip_agreement_step_rehearses_on_an_interpreter(tmp_path):
    """`rpa-harness chip agreement`'s two steps, the chip's stood in for by the interpreter that predicted it:
    the predictions are the same with two workers and in one process, every verdict agrees and the outputs
    are the same (0 of the bound apart); without a TPU, the check says so in one line, exit 4."""
    folder = str(tmp_path / "agreement")
    env = {**os.environ, device.TPU_PROBE_ENV: "none"}

    def agreement(*args):
        return run_python(
            "-m", "rpa_harness.cli", "chip", "agreement", "--folder", folder, *args, env=env, cwd=tmp_path
        )

    predicted = agreement(
        "--predict", "--count", "3", "--target", targets.DEFAULT_TARGET, "--tpu-generation", "v5e",
        "--workers", "2",
    )  # fmt: skip
    assert predicted.returncode == 0 and "3 configurations predicted" in predicted.stdout, predicted.stderr[
        -2000:
    ]
    assert "with 2 worker(s)" in predicted.stdout, predicted.stdout
    assert f"| {targets.DEFAULT_TARGET} | " in predicted.stdout.split("seconds per target and phase:")[1]
    alone = tmp_path / "in-one-process"
    in_one_process = run_python(
        "-m", "rpa_harness.cli", "chip", "agreement", "--predict", "--folder", str(alone), "--count", "3",
        "--target", targets.DEFAULT_TARGET, "--tpu-generation", "v5e", "--workers", "1", env=env, cwd=tmp_path,
    )  # fmt: skip
    assert in_one_process.returncode == 0, in_one_process.stderr[-2000:]
    in_workers = Path(folder)
    assert (alone / "predictions.json").read_text() == (in_workers / "predictions.json").read_text()
    one, two = np.load(alone / "outputs.npz"), np.load(in_workers / "outputs.npz")
    assert sorted(one) == sorted(two) and all(np.array_equal(one[k], two[k], equal_nan=True) for k in one)
    rehearsed = agreement("--backend", "fast-interpret")
    assert rehearsed.returncode == 0, rehearsed.stdout + rehearsed.stderr[-2000:]
    rows = [
        line for line in rehearsed.stdout.splitlines() if line.startswith(f"| {targets.DEFAULT_TARGET} |")
    ]
    cells = [[cell.strip() for cell in line.split("|")] for line in rows]
    assert all(row[5] == "0 / 0" and row[6] in ("0, 0", "-") and row[7] == row[8] == "0" for row in cells), (
        rehearsed.stdout
    )  # -: too large to run
    assert any(row[6] == "0, 0" for row in cells), rehearsed.stdout
    refused = agreement()
    assert refused.returncode == 4 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr[-2000:]
    assert refused.stderr.startswith("rpa-harness chip agreement: jax sees no TPU here"), refused.stderr
