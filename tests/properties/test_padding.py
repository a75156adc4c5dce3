"""Padding isolation and determinism: valid output rows depend only on the live data, bit for bit.

Padding is everything outside the live sequences: unused pages, page tails past kv_len, query rows past
cu_q_lens[num_seqs], and the unused slots of kv_lens, cu_q_lens and page_indices.
"""

import dataclasses

from hypothesis import event, given, reject
from hypothesis import strategies as st

from rpa_harness.checks import check_determinism, check_padding_isolation
from rpa_harness.property_names import DETERMINISM, PADDING, PropertyName
from rpa_harness.recording import recorded
from rpa_harness.strategies.valid import valid_cases


@given(data=st.data())
def test_padding_does_not_change_valid_rows(target, volume_backend, repro_dir, bucket_selection, data):
    capabilities, issues = target.capabilities_on(volume_backend), target.known_issues_on(volume_backend)
    cases = valid_cases(capabilities, pooled=True, excluding=issues, selection=bucket_selection)
    case = data.draw(cases, label="case")
    # The padding is the case's to change: the dirtiest padding that no declared known issue reacts to
    # (e.g. NaN in page tails, which a kernel with such an issue multiplies by a zero weight).
    paddings = (dataclasses.replace(case, poison=poison, garbage=True) for poison in (True, False))
    dirty = next((padded for padded in paddings if not any(issue.matches(padded) for issue in issues)), None)
    if dirty is None:
        reject()
    if not dirty.poison:
        event("padding without NaN: a declared known issue reacts to it")
    dirty_arrays = dirty.arrays()  # recorded and run: built once
    name = PropertyName(PADDING, label=volume_backend.label)
    with recorded(repro_dir, name, target, volume_backend, dirty_arrays, case.options(), case=dirty):
        check_padding_isolation(target, volume_backend, case, dirty_arrays)


@given(data=st.data())
def test_same_call_gives_same_bits(target, volume_backend, repro_dir, bucket_selection, data):
    capabilities, issues = target.capabilities_on(volume_backend), target.known_issues_on(volume_backend)
    cases = valid_cases(capabilities, pooled=True, excluding=issues, selection=bucket_selection)
    case = data.draw(cases, label="case")
    arrays, options = case.arrays(), case.options()
    name = PropertyName(DETERMINISM, label=volume_backend.label)
    with recorded(repro_dir, name, target, volume_backend, arrays, options, case=case):
        check_determinism(target, volume_backend, arrays, options)
