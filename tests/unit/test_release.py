"""The release a user pins is one number, said everywhere they read it, with CHANGELOG.md's entry for it."""

import re
import tomllib
from pathlib import Path

from packaging.version import Version

from rpa_harness import __version__, cli, failures

ROOT = Path(__file__).resolve().parents[2]
RELEASE_HEADING = re.compile(r"^## \[(\d+\.\d+\.\d+)\] - (\d{4}-\d{2}-\d{2})", re.MULTILINE)


def changelog_releases() -> list[str]:
    """CHANGELOG.md's release headings, newest first (Keep a Changelog's ``## [x.y.z] - date``)."""
    return [version for version, _ in RELEASE_HEADING.findall((ROOT / "CHANGELOG.md").read_text())]


def test_the_version_is_the_changelogs_newest_release_and_newer_than_the_first():
    releases = changelog_releases()
    assert releases and releases[0] == __version__, (releases[:1], __version__)
    assert Version(__version__) > Version("0.1.0")
    assert [Version(v) for v in releases] == sorted((Version(v) for v in releases), reverse=True)


def test_the_package_metadata_reads_the_one_constant():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "rpa_harness.__version__"}


def test_version_and_readme_name_the_release():
    assert cli._version().startswith(f"rpa-harness {__version__} (jax ")
    wheels = re.findall(r"rpa_harness-([\w.]+)-py3-none-any\.whl", (ROOT / "README.md").read_text())
    assert wheels and set(wheels) == {__version__}, wheels


def test_a_stricter_check_names_a_release_whose_entry_says_it_is_stricter():
    """A failure of a check a release made stricter names that release (``failures.StricterSince``):
    its CHANGELOG.md entry has a Stricter section, which says what the check reports."""
    text = (ROOT / "CHANGELOG.md").read_text()
    entries = dict(
        zip(changelog_releases(), re.split(r"^## \[\d+\.\d+\.\d+\].*$", text, flags=re.M)[1:], strict=True)
    )
    said = {failures.EXIT_STATE_CHECK: "`would halt a TPU`", failures.PRODUCTS_ON_TPU_GENERATIONS: "DEFAULT"}
    checks = [value for value in vars(failures).values() if isinstance(value, failures.StricterSince)]
    assert set(checks) == set(said)
    for check in checks:
        stricter = entries[check.version].split("### Stricter", 1)
        assert len(stricter) == 2 and said[check] in stricter[1].split("### ", 1)[0], check.version
