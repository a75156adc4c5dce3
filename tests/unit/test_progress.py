"""``rpa-harness run``'s progress: read from the run log incrementally, across processes."""

import json

from rpa_harness import progress, runlog


def _append(path, **fields):
    with open(path, "a") as log:
        log.write(json.dumps(fields) + "\n")


def test_progress_counts_examples_of_their_budget_across_processes(tmp_path):
    _append(tmp_path / f"1{runlog.PLAN_SUFFIX}", test="t.py::a", budget=4)
    _append(tmp_path / f"2{runlog.PLAN_SUFFIX}", test="t.py::a", budget=4)  # every worker collects
    _append(tmp_path / f"2{runlog.PLAN_SUFFIX}", test="t.py::b", budget=10)
    for second in range(3):
        _append(tmp_path / "1.jsonl", test="t.py::a", time=100.0 + second)
    _append(tmp_path / "2.jsonl", test="t.py::b", time=101.0, repro="r.json")
    state = progress.Progress(tmp_path).update()
    assert state.properties["t.py::a"].examples == 3 and state.properties["t.py::a"].budget == 4
    assert state.properties["t.py::a"].rate() == 60.0  # 2 intervals in 2 s
    assert state.properties["t.py::b"].failures == 1
    assert state.totals() == "2/2 properties started, 4 examples, 1 failing"
    assert state.describe("t.py::a") == "t.py::a 3/4 examples, 60/min"
    assert state.running(now=102.5, within=1.0) == ["t.py::a"]


def test_progress_counts_examples_not_the_cases_of_a_group_and_says_when_it_shrinks(tmp_path):
    _append(tmp_path / f"1{runlog.PLAN_SUFFIX}", test="t.py::g", budget=2)
    for second, later in enumerate((False, True, True, False, True)):  # two examples of 3 and 2 cases
        _append(tmp_path / "1.jsonl", test="t.py::g", time=100.0 + second, **{runlog.LATER_CASE: later})
    state = progress.Progress(tmp_path).update()
    assert state.describe("t.py::g").startswith("t.py::g 2/2 examples (5 cases), ")
    _append(tmp_path / "1.jsonl", test="t.py::g", time=106.0, repro="r.json")  # a failure, then shrinking
    assert "t.py::g 3 examples (2 planned, shrinking) (6 cases)" in state.update().describe("t.py::g")


def test_progress_reads_only_new_and_complete_lines(tmp_path):
    log = tmp_path / "1.jsonl"
    _append(log, test="t.py::a", time=1.0)
    state = progress.Progress(tmp_path).update()
    with open(log, "a") as handle:
        handle.write('{"test": "t.py::a", "ti')  # a line another process is still writing
    assert state.update().properties["t.py::a"].examples == 1
    with open(log, "a") as handle:
        handle.write('me": 2.0}\n')
    assert state.update().properties["t.py::a"].examples == 2


def test_plain_lines_name_each_property_that_ran_since_the_last_report(tmp_path):
    _append(tmp_path / "1.jsonl", test="tests/properties/t.py::a", time=50.0)
    _append(tmp_path / "1.jsonl", test="tests/properties/t.py::b", time=95.0)
    state = progress.Progress(tmp_path).update()
    lines = progress.plain_lines(state, now=100.0, since=90.0)
    assert lines[0].startswith("rpa-harness progress ") and "2/2 properties started" in lines[0]
    assert lines[1:] == ["  t.py::b 1 examples, 0/min"]
