"""`rpa-harness report` of the repros of tpu-inference's v3 kernels: every finding of v3's and of the
head_dim-64 kernel's gets a report whose script runs the kernel against its own reference; a repro that
does not reproduce gets none.

The cache finding's report is rendered and its script run (on the TPU interpreter: the slot by slot
comparison), the hang finding's script is run (the deadlock check standing for the watchdog), an hd64
finding's report is rendered and its script run (its loader without vllm, its sinks and cache layout), and
every finding's script is built from its repro and checked to be standalone. ~50 s of one worker in all: the
other findings' reports (docs/tpu-inference-v3-findings/*/report.md, each with its script's output) take
40-95 s each on the fast interpreter.
"""

import ast
import importlib

import jax.numpy as jnp
import numpy as np
import pytest

v3_report = pytest.importorskip("rpa_harness.targets.tpu_inference_v3.report", exc_type=ImportError)

from rpa_harness import bug_report, generations  # noqa: E402
from rpa_harness import repro as repro_files  # noqa: E402
from rpa_harness.device import INTERPRET, Backend  # noqa: E402
from rpa_harness.report_sections import NothingToReport  # noqa: E402
from rpa_harness.strategies.case import Case  # noqa: E402
from rpa_harness.targets import tpu_inference_batched_rpa as batched  # noqa: E402
from rpa_harness.targets import tpu_inference_v3 as v3  # noqa: E402
from rpa_harness.targets import tpu_inference_v3_hd64 as hd64  # noqa: E402
from rpa_harness.targets.tpu_inference import report as family_report  # noqa: E402
from rpa_harness.targets.tpu_inference_batched_rpa.report import BATCHED  # noqa: E402
from rpa_harness.targets.tpu_inference_v3_hd64.report import HD64  # noqa: E402

# The installed release's: a report's script makes the call of the release it names (the early releases'
# scripts: tests/targets/test_v3_early_api.py).
FINDINGS = {issue.name: issue for issue in v3.RPA_HARNESS_CATALOGUE if issue.affects(v3.installed_version())}
HD64_FINDINGS = {issue.name: issue for issue in hd64.RPA_HARNESS_CATALOGUE}
BATCHED_FINDINGS = {issue.name: issue for issue in batched.RPA_HARNESS_CATALOGUE}
ISSUES = {**FINDINGS, **HD64_FINDINGS, **BATCHED_FINDINGS}
KERNELS = {
    **dict.fromkeys(FINDINGS, v3_report.V3),
    **dict.fromkeys(HD64_FINDINGS, HD64),
    **dict.fromkeys(BATCHED_FINDINGS, BATCHED),
}
STANDALONE_IMPORTS = {"base64", "importlib", "io", "os", "sys", "threading", "types", "warnings"} | {
    "jax",
    "numpy",
}


def script_of(issue, kernel=v3_report.V3) -> tuple[str, object]:
    repro = repro_files.read(issue.repro)
    with generations.emulated(repro.tpu_generation):  # the block sizes are chosen for the chip
        inputs = kernel.inputs(**repro.arrays, **repro.options)
    return family_report.script(kernel, inputs, issue.description, repro.tpu_generation), inputs


def options_of(program: str) -> dict:
    """The keyword options a script passes, evaluated as the script evaluates them."""
    line = next(line for line in program.splitlines() if line.startswith("options = "))
    return eval(line.removeprefix("options = "), {"jnp": jnp, "np": np, "importlib": importlib})


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_every_findings_script_is_standalone_and_makes_the_repros_call(name):
    """Only jax, numpy and tpu-inference (loaded from the installed folder), with the block sizes and
    options of the repro: what a maintainer runs on the chip."""
    kernel, issue = KERNELS[name], ISSUES[name]
    program, inputs = script_of(issue, kernel)
    tree = ast.parse(program)
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}  # fmt: skip
    assert imported <= STANDALONE_IMPORTS and not any(isinstance(n, ast.ImportFrom) for n in ast.walk(tree))
    assert f'importlib.import_module("{kernel.module.__name__}")' in program
    assert f'reference = importlib.import_module("{kernel.reference_functions.__name__}")' in program
    assert f"reference.{kernel.reference}(" in program and f"kernel.{kernel.function}(" in program
    assert options_of(program) == kernel.script_options(inputs)
    sinks = inputs.args[8] if len(inputs.args) > 8 else None
    assert ("attention_sink = np.array(" in program) == (sinks is not None)
    assert issue.explanation, f"{name}: the report's Why section is empty"


def test_a_small_repros_script_carries_its_own_inputs():
    """A case whose inputs compress to a few KiB is run on its own data (a finding of the values, such as
    the bfloat16 row sum's, shows on no random data); a larger one on random data of its shapes."""
    issue = FINDINGS["row-sum-accumulated-in-bfloat16"]
    dominant = issue.repro.with_name("dominant-key_fast-interpret-v6e.json")
    program, inputs = script_of(type("Issue", (), {"repro": dominant, "description": issue.description}))
    namespace = {"jnp": jnp, "np": np, "q_dtype": inputs.args[0].dtype, "kv_dtype": inputs.args[3].dtype}
    data = program[program.index("# The failing case's own inputs") : program.index("arrays = (")]
    exec("import base64, io\n" + data, namespace)
    for name, expected in zip(("queries", "keys", "values", "kv_cache"), inputs.args[:4], strict=True):
        np.testing.assert_array_equal(
            namespace[name].view(np.uint8), np.asarray(expected).view(np.uint8), name
        )
    large = Case(max_num_batched_tokens=8, max_num_seqs=1, pages_per_seq=63, total_num_pages=64, page_size=16,
                 num_q_heads=1, num_kv_heads=1, head_dim=128, q_dtype="float32", kv_dtype="float32",
                 q_lens=(1,), kv_lens=(1000,))  # fmt: skip
    inputs = v3.v3_inputs(**large.arrays(), **large.options())
    assert "rng = np.random.default_rng(0)" in family_report.script(
        v3_report.V3, inputs, "d", generations.NONE
    )


def test_an_hd64_findings_report_runs_its_script_without_vllm():
    """The hd64 kernel's report: its function and reference, its cache layout, the block sizes given to
    the script, and the script (its loader stubbing what the tuned table imports from vllm) reproducing."""
    issue = HD64_FINDINGS["hd64-finite-mask-value-weights-keys-by-block"]
    report = bug_report.render(issue.repro, with_script_output=True)
    assert report.splitlines()[0] == f"# tpu-inference RPA v3 hd64: {issue.description}"
    assert "kernel_hd64.ragged_paged_attention_hd64`" in report and "side by side" in report
    assert "`num_kv_pages_per_block=2`, `num_queries_per_block=8` (given)" in report
    assert "| its own `ref_ragged_paged_attention_hd64` |" in report
    output = report.split("Output of the script", 1)[1]
    assert "(exit status 1: reproduces)" in output and "attention: 64 of 64 elements differ" in output


def test_report_of_the_cache_finding_lists_the_slots_and_its_script_reproduces():
    issue = FINDINGS["sliding-window-skips-cache-writes"]
    report = bug_report.render(issue.repro, with_script_output=True)
    assert report.splitlines()[0] == f"# tpu-inference RPA v3: {issue.description}"
    expected = report.split("## Expected and actual", 1)[1].split("## Why", 1)[0]
    assert "Attention: right" in expected
    assert "| 2 | 0 | 0, 0 | a new token's | keeps its input contents (not written) |" in expected
    assert "| 2 | 1 | 0, 1 | a new token's | keeps its input contents (not written) |" in expected
    assert "Its own `ref_ragged_paged_attention` returns the expected cache, bit for bit." in expected
    assert "- chip: no particular TPU" in report and "`(4, 2, 2, 2)` (given)" in report
    output = report.split("Output of the script", 1)[1]
    assert "exit status 1: reproduces" in output
    assert (
        "page 2, slot 0 (sequence 0, key position 0, a new token): the kernel left its input contents there"
        in output
    )
    assert "attention: 0 of 640 elements differ" in output and family_report.REPRODUCES in output


def test_a_repro_that_does_not_reproduce_gets_no_report(monkeypatch):
    """A v3 repro whose outputs are right now, or whose call crashes otherwise than recorded, is never
    reported as a bug."""
    repro = repro_files.read(FINDINGS["finite-mask-value-counts-keys-by-block"].repro)
    inputs = v3.v3_inputs(**repro.arrays, **repro.options)
    right = family_report.Observation(inputs)
    right.comparison = type("Right", (), {"ok": True})()
    crash = family_report.Observation(inputs, error="RuntimeError: the interpreter gave up")
    for observation, says in (
        (right, "within the kernel.s precision contract"),
        (crash, "not what was recorded"),
    ):
        monkeypatch.setattr(family_report, "observe", lambda kernel, repro, backend, o=observation: o)
        with pytest.raises(
            NothingToReport, match=f"does not reproduce on interpret: .*{says}.*replay it with"
        ):
            family_report.render(
                v3_report.V3,
                "x.json",
                repro,
                Backend(INTERPRET),
                None,
                "x.json",
                precision=v3_report.V3.precision,
            )
    hang = family_report.Observation(inputs, hang="the TPU interpreter found a deadlock")
    assert family_report.reproduces(hang, repro, None)
    recorded = family_report.Observation(inputs, error="ValueError: Out-of-bounds read of (0 0 vmem 110)")
    assert family_report.reproduces(recorded, repro, FINDINGS["default-blocks-break-v3s-own-rules"])


def test_the_hang_findings_script_reproduces_on_cpu_through_the_deadlock_check(tmp_path):
    """On a TPU the script's watchdog takes the call for a hang; on CPU the launcher turns the TPU
    interpreter's deadlock into the same verdict, in seconds."""
    issue = FINDINGS["q-len-zero-before-a-live-sequence-hangs"]
    program, _ = script_of(issue)
    status, output = family_report.run_script(program, INTERPRET, generations.NONE, tmp_path)
    assert status == 1, output
    assert "the reference rejects these inputs: Require 0 < q_len" in output
    assert (
        f"{family_report.REPRODUCES}: on a TPU the kernel would never return" in output
        and "DEADLOCK" in output
    )
