"""A per-run log of examples, for the summary of ``rpa-harness run`` (works across xdist workers).

When ``RPA_RUN_LOG`` names a directory, every example a property runs appends one JSON line (the pytest
test it belongs to, its coverage labels, and a repro path if it failed) to a file per process.
"""

import json
import os
import time
from pathlib import Path

ENV = "RPA_RUN_LOG"
# Marks the second and later cases of one Hypothesis example (a property that draws a group of cases
# sharing one compilation records each case): counts of examples skip them.
LATER_CASE = "later_case"


def is_example(entry: dict) -> bool:
    """Whether a logged entry starts a Hypothesis example (not a later case of a group)."""
    return not entry.get(LATER_CASE)


def record(**fields) -> None:
    directory = os.environ.get(ENV)
    if not directory:
        return
    test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" (", 1)[0]
    with open(Path(directory) / f"{os.getpid()}.jsonl", "a") as log:
        log.write(json.dumps({"test": test, "pid": os.getpid(), "time": time.time(), **fields}) + "\n")


def read(directory) -> list[dict]:
    return [
        json.loads(line)
        for path in sorted(Path(directory).glob("*.jsonl"))
        for line in path.read_text().splitlines()
    ]


PLAN_SUFFIX = ".plan"


def record_plan(test: str, budget: int) -> None:
    """A collected property and its example budget (``rpa-harness run`` shows examples done of it)."""
    directory = os.environ.get(ENV)
    if not directory:
        return
    with open(Path(directory) / f"{os.getpid()}{PLAN_SUFFIX}", "a") as log:
        log.write(json.dumps({"test": test, "budget": budget}) + "\n")


SESSION_FILE = "session.json"


def write_session(**fields) -> None:
    """The run's own verdicts (e.g. that no numeric property ran), written by the process that sees every test."""
    directory = os.environ.get(ENV)
    if directory:
        (Path(directory) / SESSION_FILE).write_text(json.dumps(fields) + "\n")


def read_session(directory) -> dict:
    path = Path(directory) / SESSION_FILE
    return json.loads(path.read_text()) if path.exists() else {}


def record_event(kind: str, **fields) -> None:
    """Appends one event that is not an example (e.g. a known issue avoided) to the run log's events."""
    directory = os.environ.get(ENV)
    if not directory:
        return
    test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" (", 1)[0]
    with open(Path(directory) / f"{os.getpid()}.events", "a") as log:
        log.write(json.dumps({"kind": kind, "test": test, "pid": os.getpid(), **fields}) + "\n")


def read_events(directory) -> list[dict]:
    return [
        json.loads(line)
        for path in sorted(Path(directory).glob("*.events"))
        for line in path.read_text().splitlines()
    ]
