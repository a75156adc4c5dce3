"""The v3 targets on any tpu-inference release (``rpa_harness.targets.tpu_inference.releases``): the API
read from a kernel's signature, the options passed for it, the findings by release and the run header.

None of these needs tpu-inference: each reads stand-in kernel files and signatures.
"""

import textwrap
import types

import pytest
from packaging.specifiers import InvalidSpecifier

from rpa_harness.known_issues import KnownIssue
from rpa_harness.targets.tpu_inference import releases
from rpa_harness.targets.tpu_inference_v3 import adapter

EARLY = """
def ragged_paged_attention(queries, keys, values, kv_cache, kv_lens, page_indices, cu_q_lens, distribution,
                           *, sm_scale=1.0, num_kv_pages_per_block=None, num_queries_per_block=None):
    pass
"""
BLOCK_TUPLES = EARLY.replace("num_kv_pages_per_block=None, num_queries_per_block=None", "d_block_sizes=None")
WITH_UPDATE = BLOCK_TUPLES.replace("*,", "*, use_causal_mask=True, update_kv_cache=True,")


def stand_in_release(tmp_path, monkeypatch, source: str, *, version: str = "0.19.0"):
    """A kernel file where the installed v3 would be, and the release ``version`` installed."""
    folder = tmp_path / version
    folder.mkdir()
    path = folder / "kernel.py"
    path.write_text(textwrap.dedent(source))
    monkeypatch.setattr(releases, "v3_file", lambda name: path if name == "kernel.py" else None)
    monkeypatch.setattr(releases, "installed_version", lambda: version)
    return path


@pytest.mark.parametrize(
    "source, block_tuples, update_kv_cache",
    [(EARLY, False, False), (BLOCK_TUPLES, True, False), (WITH_UPDATE, True, True)],
    ids=["0.11-0.13", "0.18-0.21", "0.22.1 on"],
)
def test_the_api_is_read_from_the_kernels_signature(
    tmp_path, monkeypatch, source, block_tuples, update_kv_cache
):
    stand_in_release(tmp_path, monkeypatch, source)
    api = releases.v3_api()
    assert (api.block_tuples, api.update_kv_cache) == (block_tuples, update_kv_cache)
    assert api.takes("sm_scale") and not api.takes("attention_sink")


def test_no_api_without_tpu_inference(monkeypatch):
    monkeypatch.setattr(releases, "v3_file", lambda name: None)
    assert releases.v3_api() is None and releases.kernel_digest() is None


def test_a_kernel_without_the_function_is_named(tmp_path, monkeypatch):
    path = stand_in_release(tmp_path, monkeypatch, "def other(): pass\n")
    with pytest.raises(LookupError, match=f"{path} defines no function 'ragged_paged_attention'"):
        releases.v3_api()


def test_the_run_header_names_the_release_and_the_kernel_file(tmp_path, monkeypatch):
    path = stand_in_release(tmp_path, monkeypatch, WITH_UPDATE, version="0.23.0")
    digest = releases.kernel_digest()
    assert len(digest) == 12 and int(digest, 16) >= 0
    assert releases.run_header() == f"tpu-inference 0.23.0 (v3/kernel.py {digest})"
    path.write_text(path.read_text() + "\n# another release's kernel\n")
    releases._digest.cache_clear()
    assert releases.kernel_digest() != digest
    monkeypatch.setattr(releases, "v3_file", lambda name: None)
    assert releases.run_header("kernel_hd64") == "tpu-inference 0.23.0 (kernel_hd64)"


def kernel_taking(*parameters: str) -> types.ModuleType:
    module = types.ModuleType("stand_in_kernel")
    namespace: dict = {}
    exec(f"def ragged_paged_attention(q, *, {', '.join(parameters)}): pass", namespace)
    module.ragged_paged_attention = namespace["ragged_paged_attention"]  # type: ignore[attr-defined]
    return module


def test_update_kv_cache_is_passed_only_to_a_kernel_that_takes_it(monkeypatch):
    monkeypatch.setattr(adapter, "installed_version", lambda: "0.19.0")
    taking = adapter.api_of(kernel_taking("sm_scale=None", "update_kv_cache=True"))
    lacking = adapter.api_of(kernel_taking("sm_scale=None"))
    assert adapter.update_kv_cache_option(False, taking) == {"update_kv_cache": False}
    assert adapter.update_kv_cache_option(True, taking) == {"update_kv_cache": True}
    assert adapter.update_kv_cache_option(True, lacking) == {}
    with pytest.raises(
        ValueError, match=r"update_kv_cache=False: the installed tpu-inference 0.19.0 has no such"
    ):
        adapter.update_kv_cache_option(False, lacking)


def issue_of(releases_range: str) -> KnownIssue:
    return KnownIssue("an-issue", "what goes wrong", None, lambda case: False, lambda case: case, "FAIL",
                      releases=releases_range)  # fmt: skip


@pytest.mark.parametrize(
    "version, affected",
    [
        ("0.18.0", True),
        ("0.22.1", True),
        ("0.22.1+tpu", True),  # a local build of an affected release
        ("0.23.0.dev4", False),  # a development build of the release that fixed it counts as that release
        ("0.23.0", False),
        ("0.13.3", False),
        ("not installed", True),  # no number: never dropped
    ],
)
def test_a_finding_names_the_releases_it_affects(version, affected):
    assert issue_of(">=0.18.0,<0.23.0").affects(version) is affected
    assert issue_of("").affects(version)


def test_a_malformed_release_range_fails_at_import():
    with pytest.raises(InvalidSpecifier):
        issue_of("0.18 to 0.22")
