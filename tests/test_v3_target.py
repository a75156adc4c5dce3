"""tpu-inference's RPA v3 (``harness.tpu_inference_v3``): both of its outputs, its validators, its hang.

v3 returns the attention and the cache with the new tokens written into it. Each example runs v3 once on
the TPU interpreter (with the compat layer; the generic interpreter cannot run v3's data-dependent copy
sizes) and judges both: the attention against the float64 oracle, the updated cache bit for bit against
the expected one (every new token in its slot, nothing else changed). Bfloat16 outputs are not judged here
against the default float32-accumulation bound: v3 accumulates in the output dtype, which its declared
precision contract (``RPA_HARNESS_PRECISION``) covers once the comparison applies contracts; their cache is
judged, and their error/bound ratio recorded in the run log. The generic properties (``--rpa-target=
harness.tpu_inference_v3``) judge every dtype.

Skipped when tpu-inference is not installed (``pip install --no-deps tpu-inference==0.32.0``).
"""

import dataclasses
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

try:
    from harness import tpu_inference_v3 as v3target
except ImportError as error:
    pytest.skip(str(error), allow_module_level=True)

from harness import targets
from harness.backends import INTERPRET, Backend
from harness.properties import PropertyFailure
from harness.repro import written_on_failure
from strategies.case import Case
from strategies.valid import Capabilities, valid_cases

CAPABILITIES = Capabilities(**v3target.RPA_HARNESS_CAPABILITIES)
TARGET = targets.load("harness.tpu_inference_v3")
BACKEND = Backend(INTERPRET)  # names the repros; v3 runs in v3target.interpreted() (see there)
# A warm v3 call on the TPU interpreter costs 0.1-4 s and each new configuration compiles for 3-10 s.
POOLED_EXAMPLES = max(5, settings.default.max_examples // 4)
ANY_CONFIG_EXAMPLES = max(3, settings.default.max_examples // 8)
PROPERTY = "v3-attention-and-cache"


def draw_and_check(data, repro_dir, *, pooled: bool, variant: str = ""):
    case = data.draw(valid_cases(CAPABILITIES, pooled=pooled), label="case")
    arrays, options = case.arrays(), case.options()
    name = f"{PROPERTY}{variant}[{INTERPRET}]"
    with written_on_failure(repro_dir, name, TARGET, BACKEND, arrays, options, case=case) as notes:
        comparison = v3target.judge(arrays, options)  # raises CacheMismatch on a wrong cache
        notes.update(max_ratio=comparison.max_ratio, q_dtype=case.q_dtype, kv_dtype=case.kv_dtype)
        if case.q_dtype == "float32" and not comparison.ok:
            raise PropertyFailure(str(comparison))


@settings(max_examples=POOLED_EXAMPLES)
@given(data=st.data())
def test_v3_attention_and_updated_cache(repro_dir, data):
    draw_and_check(data, repro_dir, pooled=True)


@settings(max_examples=ANY_CONFIG_EXAMPLES)
@given(data=st.data())
def test_v3_attention_and_updated_cache_any_config(repro_dir, data):
    draw_and_check(data, repro_dir, pooled=False, variant="-any-config")
