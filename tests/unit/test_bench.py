"""``rpa-harness bench``: its accounting of bytes and FLOPs, its table, the regression gate and its usage
errors, on the fast interpreter (the times are the CPU's; what is checked is that each is measured and
judged)."""

import dataclasses
import json
import sys
import types

import pytest

from rpa_harness import bench, cli, targets, tuning
from rpa_harness.known_issues import TuningFinding
from rpa_harness.strategies.case import Case

TWO_SEQUENCES = Case(
    max_num_batched_tokens=8, max_num_seqs=2, pages_per_seq=2, total_num_pages=5, page_size=4,
    num_q_heads=2, num_kv_heads=1, head_dim=128, q_dtype="bfloat16", kv_dtype="bfloat16",
    q_lens=(1, 3), kv_lens=(5, 3),
)  # fmt: skip


def test_bytes_are_the_pages_read_and_the_queries_and_output():
    pages = 2 + 1  # 5 keys in pages of 4, then 3
    kv = pages * 4 * 1 * 2 * 128 * 2  # slots x KV heads x (K, V) x head_dim x bytes
    q_and_out = 2 * 4 * 2 * 128 * 2  # (q, out) x tokens x q heads x head_dim x bytes
    assert bench.hbm_bytes(TWO_SEQUENCES) == kv + q_and_out


def test_flops_count_the_keys_each_row_sees_under_the_causal_mask():
    seen = 5 + (1 + 2 + 3)  # a decode sees its 5 keys; a prefill of 3 rows sees 1, 2 and 3
    assert bench.attention_flops(TWO_SEQUENCES) == 4 * seen * 2 * 128


def test_a_batch_a_target_does_not_take_is_named_not_run():
    target = targets.load("rpa_harness.kernel")
    only_64 = dataclasses.replace(
        target, capabilities=dataclasses.replace(target.capabilities, head_dims=(64,))
    )
    assert bench.unsupported(target, bench.BATCHES["small"].case) is None
    assert bench.unsupported(only_64, bench.BATCHES["small"].case) == "head_dim 128 is not one it takes (64)"


def _bench(*args):
    return cli.main(["bench", "--backend", "fast-interpret", "--batch", "small", "--calls", "1", *args])


def test_it_times_the_target_and_its_baseline(tmp_path, capsys):
    timings = tmp_path / "bench.json"
    assert _bench("--json", str(timings)) == bench.PASSES
    out = capsys.readouterr().out
    assert "the interpreter's times, nothing about a chip" in out
    for name in ("rpa_harness.kernel", targets.UPSTREAM_TARGET):
        assert any(line.startswith(f"small  {name} ") for line in out.splitlines()), out
    written = json.loads(timings.read_text())
    assert written["baselines"] == {"rpa_harness.kernel": targets.UPSTREAM_TARGET}
    assert all(row["median_s"] > 0 and row["first_call_s"] > 0 for row in written["timings"])


def test_a_time_past_max_slowdown_of_the_previous_run_fails(tmp_path, capsys):
    previous = tmp_path / "previous.json"
    previous.write_text(
        json.dumps({"timings": [{"batch": "small", "target": "rpa_harness.kernel", "median_s": 1e-9}]})
    )
    assert (
        _bench("--baseline", "none", "--previous", str(previous), "--max-slowdown", "1.5") == bench.REGRESSED
    )
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("REGRESSION")]
    assert "rpa_harness.kernel on batch small" in line and "its time in the previous run" in line
    assert (
        _bench("--baseline", "none", "--previous", str(tmp_path / "none.json"), "--max-slowdown", "1.5") == 0
    )


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--batch", "huge"], "--batch=huge: not a batch"),
        (["--max-slowdown", "0"], "--max-slowdown=0 must be positive"),
        (["--max-ratio", "-1"], "--max-ratio=-1 must be positive"),
        (["--calls", "0"], "--calls=0 must be at least 1"),
        (["--target", "no_such_module"], "cannot import it"),
        (["--tpu-generation", "v99"], "--tpu-generation=v99 is not one this jax knows"),
        (["--json", "no/such/folder/out.json"], "--json=no/such/folder/out.json: its folder does not exist"),
        (["--sweep-blocks", "--tuning-threshold", "1"], "--tuning-threshold=1 must be above 1"),
        (["--sweep-blocks", "--report-dir", "no/such/folder"], "--report-dir=no/such/folder: not a folder"),
    ],
)
def test_a_usage_error_is_one_line_and_exit_4(args, said, capsys):
    assert cli.main(["bench", "--backend", "fast-interpret", *args]) == bench.USAGE
    err = capsys.readouterr().err.strip()
    assert said in err and "\n" not in err


def test_a_tpu_backend_without_a_tpu_is_a_usage_error(capsys):
    assert cli.main(["bench", "--backend", "tpu"]) == bench.USAGE
    assert "no TPU visible to jax" in capsys.readouterr().err


def test_a_time_past_max_ratio_of_its_baseline_fails(capsys):
    """A ratio to the baseline (upstream's kernel) that no time can meet fails the bundled kernel."""
    assert _bench("--max-ratio", "1e-6") == bench.REGRESSED
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("REGRESSION")]
    assert f"times its baseline {targets.UPSTREAM_TARGET}'s" in line and "--max-ratio is 1e-06" in line


def test_a_malformed_previous_file_is_a_usage_error(tmp_path, capsys):
    previous = tmp_path / "previous.json"
    previous.write_text("{}")
    assert _bench("--previous", str(previous)) == bench.USAGE
    assert f"--previous={previous}: not a file `rpa-harness bench --json` wrote" in capsys.readouterr().err


def test_a_target_that_raises_at_a_batch_fails_the_bench_and_the_others_still_run(monkeypatch, capsys):
    module = types.ModuleType("raising_target")

    def ragged_paged_attention(**inputs):
        raise RuntimeError("out of VMEM at this batch")

    module.ragged_paged_attention = ragged_paged_attention
    module.dynamic_validate_inputs = lambda **inputs: None
    monkeypatch.setitem(sys.modules, "raising_target", module)
    assert _bench("--target", "raising_target") == bench.REGRESSED
    out = capsys.readouterr().out
    assert "small  raising_target" in out and "raised: RuntimeError: out of VMEM at this batch" in out
    assert "RAISED: raising_target on batch small: RuntimeError: out of VMEM at this batch" in out
    assert any(line.startswith(f"small  {targets.UPSTREAM_TARGET} ") for line in out.splitlines())


def test_a_sweep_times_the_own_choice_and_every_pair_that_fits_and_reports_it(tmp_path, capsys):
    """The bundled kernel on the small batch (4 pages a sequence, 16 tokens): its own choice and 2 x 2
    pairs, each timed; the report holds the table and the command that measures it on a chip."""
    assert _bench("--sweep-blocks", "--tuning-threshold", "1.0001", "--report-dir", str(tmp_path)) == 0
    out = capsys.readouterr().out
    table = out.split("block sizes swept:\n", 1)[1].splitlines()
    labels = {line.split("  ")[1].strip() for line in table[1:6]}
    assert labels == {tuning.OWN, *(f"{k} pages x {q} queries" for k in (2, 4) for q in (8, 16))}, out
    assert "no tuning verdict: an interpreter's times are the CPU's" in out
    assert "rpa_harness.kernel" in out and targets.UPSTREAM_TARGET not in out  # the baseline is not swept
    reports = list(tmp_path.glob("tuning-*.md"))
    if reports:  # written where its own choice was the slower, which an interpreter's times may say
        text = reports[0].read_text()
        assert "## Time per call" in text and "--sweep-blocks" in text and "--backend tpu" in text


def _timing(seconds):
    return bench.Timing("t", "mixed", seconds=[seconds] * 3)


def _sweep(own_s, pairs):
    timings = {tuning.Blocks(None, None): _timing(own_s)}
    timings.update({tuning.Blocks(k, q): _timing(s) for (k, q), s in pairs.items()})
    return tuning.Sweep("t", "mixed", timings)


SLOW_OWN = _sweep(10.8e-3, {(32, 32): 3.43e-3, (8, 16): 5.2e-3})
DECLARED = (TuningFinding("own-blocks-slow", batch="mixed", generations=("v5e",)),)


def test_a_declared_tuning_finding_reproduces_where_its_own_choice_loses_by_the_threshold():
    (verdict,) = tuning.verdicts(SLOW_OWN, DECLARED, "v5e", 1.5)
    assert not verdict.fails and verdict.finding is DECLARED[0]
    assert verdict.words == (
        "reproduces on v5e: its own choice 10.800 ms, 32 pages x 32 queries 3.430 ms: 3.15x"
    )


def test_a_chip_the_finding_is_not_declared_for_gets_a_verdict_of_its_own():
    verdicts = tuning.verdicts(SLOW_OWN, DECLARED, "v6e", 1.5)
    assert [(v.finding, v.fails) for v in verdicts] == [(DECLARED[0], False), (None, True)]
    assert verdicts[0].words == "does not apply to v6e (declared for v5e)"
    assert verdicts[1].words.startswith("TUNING FINDING on v6e: its own choice 10.800 ms")


def test_a_declared_finding_not_seen_fails_and_an_interpreter_gives_no_verdict():
    tuned = _sweep(3.5e-3, {(32, 32): 3.43e-3})
    (verdict,) = tuning.verdicts(tuned, DECLARED, "v5e", 1.5)
    assert verdict.fails and verdict.words.startswith("NOT SEEN on v5e") and "under 1.5x" in verdict.words
    assert tuning.verdicts(SLOW_OWN, DECLARED, None, 1.5) == []
    assert tuning.verdicts(tuned, (), "v5e", 1.5) == []


def test_the_pairs_swept_fit_the_batch_and_the_targets_declared_block_limit():
    mixed = bench.BATCHES["mixed"].case  # 512 pages a sequence, 512 tokens
    assert len(tuning.candidates(mixed)) == len(tuning.KV_PAGES_PER_BLOCK) * len(tuning.QUERIES_PER_BLOCK)
    assert {b.kv_pages for b in tuning.candidates(mixed, max_kv_pages_per_block=16)} == {2, 4, 8, 16}
    small = bench.BATCHES["small"].case
    assert {(b.kv_pages, b.queries) for b in tuning.candidates(small)} == {(2, 8), (2, 16), (4, 8), (4, 16)}


def test_v3_declares_its_mixed_batch_finding_for_the_v5e_it_was_measured_on():
    from rpa_harness.targets import tpu_inference_v3 as v3

    (finding,) = v3.RPA_HARNESS_TUNING_FINDINGS
    assert (finding.batch, finding.generations) == ("mixed", ("v5e",)) and finding.batch in bench.BATCHES


def test_a_tuning_finding_that_is_no_tuning_finding_fails_the_load(monkeypatch):
    module = types.ModuleType("user_target")
    module.ragged_paged_attention = lambda *args, **kwargs: None
    module.dynamic_validate_inputs = lambda *args, **kwargs: None
    module.RPA_HARNESS_TUNING_FINDINGS = ("mixed",)
    monkeypatch.setitem(sys.modules, "user_target", module)
    with pytest.raises(targets.TargetError, match="holds 'mixed', which is no TuningFinding"):
        targets.load("user_target")
