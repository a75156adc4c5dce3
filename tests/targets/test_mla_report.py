"""`rpa-harness report` of the repros of tpu-inference's MLA kernels: every MLA v1 and v2 finding gets a
report whose script runs the kernel in its own layout against MLA v1's reference.

Every finding's script is built from its repro and checked to be standalone and to make the repro's call;
one report (MLA v2's cache finding) is rendered and its script run (~30 s): the slot table, the reference's
cache, the script reproducing without sympy or vllm. Each finding's report.md holds its script's output.
"""

import ast

import jax.numpy as jnp
import numpy as np
import pytest

from tests.cases import skip_without_tpu_inference

skip_without_tpu_inference(module_level=True)

from rpa_harness import bug_report  # noqa: E402  (needs tpu-inference)
from rpa_harness import repro as repro_files  # noqa: E402
from rpa_harness.targets import tpu_inference_mla_v1 as mla_v1  # noqa: E402
from rpa_harness.targets import tpu_inference_mla_v2 as mla_v2  # noqa: E402
from rpa_harness.targets.tpu_inference_mla_v1 import report as mla_report  # noqa: E402
from rpa_harness.targets.tpu_inference_mla_v2.report import MLA_V2  # noqa: E402

ISSUES = {
    **{issue.name: (issue, mla_report.MLA_V1) for issue in mla_v1.RPA_HARNESS_CATALOGUE},
    **{issue.name: (issue, MLA_V2) for issue in mla_v2.RPA_HARNESS_CATALOGUE},
}
STANDALONE_IMPORTS = {
    "base64",
    "importlib",
    "io",
    "logging",
    "os",
    "sys",
    "threading",
    "traceback",
    "types",
    "warnings",
}


@pytest.mark.parametrize("name", sorted(ISSUES))
def test_every_findings_script_is_standalone_and_makes_the_repros_call(name):
    issue, kernel = ISSUES[name]
    repro = repro_files.read(issue.repro)
    call = kernel.inputs(**repro.arrays, **repro.options)
    v1_inputs = mla_v1.mla_inputs(**repro.arrays, **repro.options)
    program = mla_report.script(kernel, v1_inputs, call, issue.description, repro.tpu_generation)
    tree = ast.parse(program)
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}  # fmt: skip
    assert imported <= STANDALONE_IMPORTS | {"jax", "numpy"}
    assert not any(isinstance(node, ast.ImportFrom) for node in ast.walk(tree))
    assert f'load("{kernel.module.__name__}")' in program and "v1.ref_mla_ragged_paged_attention(" in program
    line = next(line for line in program.splitlines() if line.startswith("options = "))
    assert eval(line.removeprefix("options = "), {"jnp": jnp, "np": np}) == call.kwargs
    assert ("ql_nope.transpose(1, 0, 2)" in program) == kernel.head_major
    assert issue.explanation, f"{name}: the report's Why section is empty"


def test_mla_v2s_cache_finding_report_lists_the_slot_and_its_script_reproduces():
    issue = ISSUES["mla-v2-packed-cache-overwrites-the-slot-past-kv-len"][0]
    report = bug_report.render(issue.repro, with_script_output=True)
    assert report.splitlines()[0] == f"# tpu-inference MLA v2: {issue.description}"
    expected = report.split("## Expected and actual", 1)[1].split("## Why", 1)[0]
    assert "Attention: right" in expected and "in 1 slot, 0 of them new tokens' slots" in expected
    assert "| 2 | 1 | 0, 1 | must stay unchanged | other values |" in expected
    assert "MLA v1's `ref_mla_ragged_paged_attention` returns the expected cache, bit for bit." in expected
    assert "`ql_nope` (1, 8, 32) ([H, T, lkv], head-major)" in report
    output = report.split("Output of the script", 1)[1]
    assert "(exit status 1: reproduces)" in output
    assert "cache: 1 of 112 slots differ from the reference's" in output and "page 2, slot 1" in output
