"""Progress of a long ``rpa-harness run``: per property, examples done of its budget, examples/min, failures.

The plugin writes each collected property's example budget to the run log (``runlog.record_plan``), and every
example appends a line there (``runlog.record``), from whichever xdist worker runs it. ``Progress`` reads the
log incrementally; the CLI shows it as one live line on a terminal, and as a plain line per running property
every ``RPA_PROGRESS_SECONDS`` (default 60) in a CI log, so that an hour-long nightly never looks hung.
"""

import dataclasses
import json
import time
from pathlib import Path

from rpa_harness import runlog

INTERVAL_ENV = "RPA_PROGRESS_SECONDS"
DEFAULT_INTERVAL_SECONDS = 60.0


@dataclasses.dataclass
class PropertyProgress:
    budget: int | None = None
    examples: int = 0
    cases: int = 0  # a property drawing groups of cases runs several per example
    failures: int = 0  # failing calls so far (the first failure, then the shrinker's)
    first: float | None = None
    last: float | None = None

    def rate(self) -> float:
        """Examples per minute since this property's first example."""
        if self.first is None or self.last is None or self.last <= self.first:
            return 0.0
        return 60.0 * (self.examples - 1) / (self.last - self.first)


class Progress:
    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.properties: dict[str, PropertyProgress] = {}
        self._offsets: dict[Path, int] = {}

    def _new_lines(self, pattern: str):
        for path in sorted(self.directory.glob(pattern)):
            with open(path) as log:
                log.seek(self._offsets.get(path, 0))
                text = log.read()
            complete = text[: text.rfind("\n") + 1]  # a line still being written waits for the next read
            self._offsets[path] = self._offsets.get(path, 0) + len(complete.encode())
            for line in complete.splitlines():
                yield json.loads(line)

    def update(self) -> "Progress":
        for plan in self._new_lines(f"*{runlog.PLAN_SUFFIX}"):
            self.properties.setdefault(plan["test"], PropertyProgress()).budget = plan["budget"]
        for example in self._new_lines("*.jsonl"):
            entry = self.properties.setdefault(example["test"], PropertyProgress())
            entry.examples += runlog.is_example(example)
            entry.cases += 1
            entry.failures += bool(example.get("repro"))
            entry.first = example["time"] if entry.first is None else entry.first
            entry.last = example["time"]
        return self

    def running(self, now: float, within: float) -> list[str]:
        """Properties with an example in the last ``within`` seconds."""
        return [name for name, p in self.properties.items() if p.last is not None and now - p.last <= within]

    def describe(self, name: str) -> str:
        p = self.properties[name]
        done = f"{p.examples}/{p.budget} examples" if p.budget else f"{p.examples} examples"
        if p.budget and p.examples > p.budget:  # the shrinker's examples come after the budget's
            done = f"{p.examples} examples ({p.budget} planned{', shrinking' if p.failures else ''})"
        cases = f" ({p.cases} cases)" if p.cases != p.examples else ""
        failing = f", {p.failures} failing" if p.failures else ""
        return f"{short_name(name)} {done}{cases}, {p.rate():.0f}/min{failing}"

    def totals(self) -> str:
        started = sum(1 for p in self.properties.values() if p.examples)
        examples = sum(p.examples for p in self.properties.values())
        failing = sum(1 for p in self.properties.values() if p.failures)
        planned = sum(1 for p in self.properties.values() if p.budget)
        return f"{started}/{planned or started} properties started, {examples} examples, {failing} failing"


def short_name(nodeid: str) -> str:
    return nodeid.rsplit("/", 1)[-1]


def live_line(progress: Progress, now: float) -> str:
    running = progress.running(now, within=10.0)
    parts = [progress.describe(name) for name in running] or ["(compiling or between properties)"]
    return f"rpa-harness: {progress.totals()} | " + " | ".join(parts)


def plain_lines(progress: Progress, now: float, since: float) -> list[str]:
    stamp = time.strftime("%H:%M:%S", time.localtime(now))
    lines = [f"rpa-harness progress {stamp}: {progress.totals()}"]
    lines += [f"  {progress.describe(name)}" for name in progress.running(now, within=now - since)]
    return lines
