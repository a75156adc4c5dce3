"""``rpa-harness bench``: its accounting of bytes and FLOPs, its table, the regression gate and its usage
errors, on the fast interpreter (the times are the CPU's; what is checked is that each is measured and
judged)."""

import dataclasses
import json
import sys
import types

import pytest

from rpa_harness import bench, cli, targets
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
