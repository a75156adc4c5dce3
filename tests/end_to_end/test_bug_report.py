"""`rpa-harness report` writes an upstream-ready report, and `rpa-harness run` summarises the known issues."""

import pytest

from rpa_harness import bug_report, cli, interpret_compat
from rpa_harness.device import FAST_INTERPRET
from rpa_harness.known_issues import findings_dir
from rpa_harness.targets import upstream
from tests.processes import run_python, without_checkout_names

ONE_SCALE = {issue.name: issue for issue in upstream.RPA_HARNESS_CATALOGUE}["one-kv-scale-with-mixed-dtypes"]


def test_report_of_a_known_issue():
    if interpret_compat.unpatched_gaps("generic"):
        pytest.skip(f"upstream's kernel cannot run here: {interpret_compat.unpatched_gaps('generic')}")
    report = bug_report.render(ONE_SCALE.repro, backend_name=FAST_INTERPRET)
    assert ONE_SCALE.description in report.splitlines()[0]
    for part in ("## Environment", "- jax ", "## The case", "`(1, 1)`", "q bfloat16, KV cache float32",
                 "`v_scale=0.5`", "## Expected and actual", "AssertionError", "```python",
                 "rpa_harness.interpret_compat"):  # fmt: skip
        assert part in report, part
    script = report.split("```python\n", 1)[1].split("```", 1)[0]
    compile(script, "report script", "exec")
    status, output = bug_report.run_script(without_checkout_names(script))
    assert status != 0 and "assert k.dtype == v.dtype" in output, output


def test_report_of_a_bad_file_is_one_error(tmp_path, pytestconfig):
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    result = run_python("-m", "rpa_harness.cli", "report", str(bad), cwd=pytestconfig.rootpath)
    assert result.returncode == 2 and "not a readable repro file" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_repro_with_extension_semantics_gets_no_report_that_misstates_it(tmp_path, pytestconfig):
    """v3's repros carry mask_value_meaning="replaces" (and may carry q_scale): reported against upstream's
    kernel, whose API and the script's reference cannot state them, report refuses, naming the option and
    the replay (v3's own report states them: tests/targets/test_v3_report.py)."""
    path = (
        findings_dir("tpu-inference-v3-findings")
        / "rescale-in-output-dtype"
        / "differential_fast-interpret.json"
    )
    upstream_kernel = "jax.experimental.pallas.ops.tpu.ragged_paged_attention"
    result = run_python(
        "-m", "rpa_harness.cli", "report", str(path), "--target", upstream_kernel, cwd=pytestconfig.rootpath
    )
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert (
        "extension option(s) q_scale, mask_value_meaning" in result.stderr
        and "Traceback" not in result.stderr
    )
    assert f"rpa-harness replay {path}" in result.stderr and not result.stdout


def test_summary_lists_declared_issues_with_avoided_counts_and_replays():
    events = [
        {"kind": "known-issue-avoided", "issue": "a"},
        {"kind": "known-issue-avoided", "issue": "a"},
        {"kind": "known-issue-replay", "issue": "a", "backend": "interpret", "outcome": "reproduces"},
        {"kind": "known-issue-replay", "issue": "b", "backend": "interpret", "outcome": "FIXED"},
    ]
    lines = cli.known_issues_summary(events).splitlines()
    assert lines[0].startswith("known issues declared (2)")
    assert lines[2].split() == ["a", "2", "interpret:", "reproduces"]
    assert lines[3].split() == ["b", "0", "interpret:", "FIXED"]
    assert "none declared" in cli.known_issues_summary([])


def test_a_report_maps_where_the_output_is_wrong():
    if interpret_compat.unpatched_gaps("generic"):
        pytest.skip(f"upstream's kernel cannot run here: {interpret_compat.unpatched_gaps('generic')}")
    path = (
        findings_dir("upstream-findings")
        / "zero-query-tail-skips-head-blocks"
        / "differential_fast-interpret.json"
    )
    report = bug_report.render(path, backend_name=FAST_INTERPRET)
    expected = report.split("## Expected and actual", 1)[1].split("## Reproduce", 1)[0]
    drawn = expected.split("```\n", 1)[1].split("```", 1)[0]
    assert "where the output is wrong" in drawn and "sequence 0, token 0  ....8898" in drawn, expected
