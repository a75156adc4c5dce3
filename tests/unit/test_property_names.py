"""Property names are built and read in one place, and a repro stores its kind apart from its name."""

import json
import shutil

import numpy as np
import pytest

from rpa_harness import property_names
from rpa_harness import repro as repro_files
from rpa_harness.property_names import DIFFERENTIAL, PADDING, VALIDATION, PropertyName, large_bucket


@pytest.mark.parametrize(
    "name",
    [
        PropertyName(DIFFERENTIAL, "any-config", "fast-interpret-v6e"),
        PropertyName(DIFFERENTIAL, "long-packed-past-2to15-own-blocks", "interpret"),
        PropertyName(DIFFERENTIAL, label="tpu"),
        PropertyName(VALIDATION, label="num_seqs-too-large #2"),
        PropertyName(PADDING, label="fast-interpret"),
        PropertyName("v3-attention-and-cache", label="interpret"),
    ],
    ids=str,
)
def test_a_name_reads_back_as_it_was_built(name):
    assert property_names.parse(str(name)) == name


def test_a_kind_with_a_hyphen_is_not_read_as_a_shorter_kind_and_a_detail():
    assert property_names.parse("padding-isolation[interpret]").kind == PADDING


@pytest.mark.parametrize("bad", ["", "[interpret]"])
def test_a_name_without_a_kind_is_an_error(bad):
    with pytest.raises(ValueError, match="KIND"):
        property_names.parse(bad)


def _pair(tmp_path, name="differential-any-config[fast-interpret]"):
    arrays = {"q": np.zeros((2, 1, 4), np.float32), "num_seqs": np.array([1], np.int32)}
    return repro_files.write(repro_files.Repro(name, "t", "fast-interpret", arrays, {}), tmp_path)


def test_a_repro_stores_its_kind_and_schema(tmp_path):
    meta = json.loads(_pair(tmp_path).read_text())
    assert (meta["schema"], meta["kind"]) == (repro_files.SCHEMA, DIFFERENTIAL)
    assert repro_files.read(_pair(tmp_path)).kind == DIFFERENTIAL


def test_a_repro_without_a_kind_has_its_name_parsed(tmp_path):
    """Schema 1: the repros written before the kind was stored (docs/*-findings/ hold some)."""
    path = _pair(tmp_path, "validation[rule #0]")
    meta = json.loads(path.read_text())
    del meta["kind"], meta["schema"]
    path.write_text(json.dumps(meta))
    assert repro_files.read(path).kind == VALIDATION


def test_a_pair_renamed_together_still_reads(tmp_path):
    path = _pair(tmp_path)
    renamed = tmp_path / "bug-17.json"
    shutil.move(path, renamed)
    shutil.move(path.with_suffix(".npz"), renamed.with_suffix(".npz"))
    assert repro_files.read(renamed).arrays["q"].shape == (2, 1, 4)
    copy = tmp_path / "copy-of-the-json.json"  # only the JSON renamed: its NPZ is still the named one
    shutil.copy(renamed, copy)
    shutil.move(renamed.with_suffix(".npz"), path.with_suffix(".npz"))
    assert repro_files.read(copy).arrays["q"].shape == (2, 1, 4)


def test_a_large_cases_property_is_known_by_its_bucket():
    """The known-issue replay keeps a long or production case off the checking interpreter, as its
    property does (rpa_harness.properties.test_known_issues)."""
    assert large_bucket("differential-long-packed-upto-2to15-given-blocks[fast-interpret-v6e]") == "long"
    assert large_bucket("differential-production[fast-interpret]") == "production"
    assert large_bucket("differential-any-config[interpret]") is None
    assert large_bucket("differential-longer[interpret]") is None
    assert large_bucket("v3-attention-and-cache[interpret]") is None
