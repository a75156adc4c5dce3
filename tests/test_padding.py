"""Padding isolation and determinism: valid output rows depend only on the live data, bit for bit.

Padding is everything outside the live sequences: unused pages, page tails past kv_len, query rows past
cu_q_lens[num_seqs], and the unused slots of kv_lens, cu_q_lens and page_indices.
"""

import dataclasses

from hypothesis import given
from hypothesis import strategies as st

from harness.properties import check_same_bits, run_valid, valid_rows
from harness.repro import written_on_failure
from strategies.valid import valid_cases


@given(data=st.data())
def test_padding_does_not_change_valid_rows(target, volume_backend, runnable, repro_dir, data):
    runnable(volume_backend)
    case = data.draw(valid_cases(target.capabilities), label="case")
    clean = dataclasses.replace(case, poison=False, garbage=False)
    dirty = dataclasses.replace(case, poison=True, garbage=True)
    clean_arrays, dirty_arrays, options = clean.arrays(), dirty.arrays(), case.options()
    name = f"padding-isolation[{volume_backend.name}]"
    with written_on_failure(repro_dir, name, target, volume_backend, dirty_arrays, options, case=dirty):
        check_same_bits(
            run_valid(target, volume_backend, clean_arrays, options),
            run_valid(target, volume_backend, dirty_arrays, options),
            valid_rows(clean_arrays),
            "NaN/garbage padding changed the output (clean padding vs NaN pages/tails/rows and garbage metadata)",
        )


@given(data=st.data())
def test_same_call_gives_same_bits(target, volume_backend, runnable, repro_dir, data):
    runnable(volume_backend)
    case = data.draw(valid_cases(target.capabilities), label="case")
    arrays, options = case.arrays(), case.options()
    name = f"determinism[{volume_backend.name}]"
    with written_on_failure(repro_dir, name, target, volume_backend, arrays, options, case=case):
        first = run_valid(target, volume_backend, arrays, options)
        check_same_bits(
            first,
            run_valid(target, volume_backend, arrays, options),
            valid_rows(arrays),
            "two identical calls",
        )
