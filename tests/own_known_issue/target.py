"""A target declaring a known issue of its own: ``tests.broken.skips_a_cache_write``'s kernel, whose bug is
declared so that runs hunt for other ones (``docs/known-issues.md``'s example)."""

import dataclasses
from pathlib import Path

from rpa_harness.failures import CacheMismatch
from rpa_harness.known_issues import KnownIssue
from tests.broken.skips_a_cache_write import (  # noqa: F401  (the kernel under test and its profile)
    RPA_HARNESS_CAPABILITIES,
    RPA_HARNESS_UPDATES_CACHE,
    dynamic_validate_inputs,
    ragged_paged_attention,
)


def has_a_prefill(case) -> bool:
    """True when the case can trigger the issue: a live sequence with two or more new tokens."""
    return any(q_len >= 2 for q_len in case.q_lens)


def decodes_only(case):
    """The nearest case outside it: each prefill cut to one new token (its kv_len unchanged)."""
    return dataclasses.replace(case, q_lens=tuple(min(q_len, 1) for q_len in case.q_lens))


RPA_HARNESS_KNOWN_ISSUES = (
    KnownIssue(
        name="prefill-tail-not-written",
        description="a prefill's last new token is not written to the returned cache",
        repro=Path(__file__).parent / "prefill-tail-not-written" / "differential_fast-interpret.json",
        matches=has_a_prefill,
        nearest_outside=decodes_only,
        symptom="updated cache differs from the expected cache",  # a regex the repro's failure shows
        fails_as=(CacheMismatch,),  # the failure kind it shows as: offered under failures of that kind
    ),
)
