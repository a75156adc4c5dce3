"""Nightly shards share what they find: a failure one process saves to the example database replays first in
another that shares it, as a folder both write (shared storage) or as a read-only source
(``RPA_HYPOTHESIS_DB_READ``: another shard's folder, or a repository's CI artifact)."""

import os

import pytest

from rpa_harness.plugin import SHARED_DATABASES_ENV, settings_of
from tests.processes import run_python

TEST = "tests/properties/test_differential.py::test_kernel_matches_oracle"


@pytest.fixture(autouse=True)
def _bundled_kernel_only(pytestconfig):
    if settings_of(pytestconfig).target.name != "rpa_harness.kernel":
        pytest.skip("runs a broken target of its own")


def shard(profile: str, database, tmp_path, root, **env):
    """One shard's run of the differential property against a target that writes NaN into a live row."""
    return run_python(
        "-m", "pytest", TEST, "-p", "no:cacheprovider", "-p", "no:xdist", "-q",
        "--rpa-target=tests.broken.nan_in_a_live_row", "--rpa-backend=fast-interpret",
        f"--hypothesis-profile={profile}", f"--rpa-repro-dir={tmp_path / 'repros'}",
        cwd=root,
        env={**os.environ, "RPA_HYPOTHESIS_DB": str(database), "RPA_MAX_EXAMPLES": "20", **env},
    )  # fmt: skip


def test_a_failure_one_shard_saves_replays_first_in_another(tmp_path, pytestconfig):
    root, shared = pytestconfig.rootpath, tmp_path / "shared"
    first = shard("nightly", shared, tmp_path, root)
    assert first.returncode == 1 and "non-finite values in live rows" in first.stdout, first.stdout[-3000:]
    assert any(shared.rglob("*")), "the failing example was not saved"

    # A second machine writing to the same folder: the repro profile only replays what the database holds.
    same_folder = shard("repro", shared, tmp_path, root)
    assert same_folder.returncode == 1 and "non-finite values in live rows" in same_folder.stdout

    # A shard with a database of its own reads the shared one too, and never writes to it.
    before = sorted(path.name for path in shared.rglob("*"))
    own = tmp_path / "own"
    own.mkdir()
    reading = shard("repro", own, tmp_path, root, **{SHARED_DATABASES_ENV: str(shared)})
    assert reading.returncode == 1 and "non-finite values in live rows" in reading.stdout, reading.stdout[
        -3000:
    ]
    assert sorted(path.name for path in shared.rglob("*")) == before

    # Nothing shared, nothing replayed: the repro profile generates no example.
    empty = tmp_path / "empty"
    empty.mkdir()
    alone = shard("repro", empty, tmp_path, root)
    assert "non-finite values" not in alone.stdout, alone.stdout[-3000:]


def test_a_malformed_shared_source_is_one_usage_error(tmp_path, pytestconfig):
    result = shard(
        "nightly", tmp_path / "db", tmp_path, pytestconfig.rootpath, **{SHARED_DATABASES_ENV: "github:me"}
    )
    assert result.returncode == 4 and "is not github:OWNER/REPO[/ARTIFACT]" in result.stderr, result.stderr[
        -2000:
    ]
