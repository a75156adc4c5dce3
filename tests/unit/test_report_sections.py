"""The sections every report shares say what produced its values."""

from rpa_harness import repro as repro_files
from rpa_harness.report_sections import environment


def test_the_environment_is_this_reports_and_names_the_recorded_versions_that_differ():
    current = repro_files.versions()
    lines = environment({**current, "jax": "0.0.1", "numpy": current["numpy"]})
    assert lines[: len(current)] == [f"- {name} {version}" for name, version in current.items()]
    assert lines[len(current) :] == ["- the repro was recorded with jax 0.0.1"]
    assert environment(current, leave_out=("hypothesis",)) == [
        f"- {name} {version}" for name, version in current.items() if name != "hypothesis"
    ]
