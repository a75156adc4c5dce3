"""The extension options (rpa_harness.spec.interface.EXTENSION_NAMES: q_scale, mask_value_meaning) stay out of
upstream's interface and are computed by both judges.

Upstream's kernel and ours keep upstream's signature: neither takes an extension keyword, and the
strategies draw one only for a target whose capabilities declare it.
"""

import dataclasses
import inspect

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from rpa_harness import kernel, reference
from rpa_harness.spec.interface import EXTENSION_NAMES, MASK_REPLACES, OPTION_NAMES, Options
from rpa_harness.strategies.case import Case
from rpa_harness.strategies.valid import Capabilities, valid_cases
from rpa_harness.targets.bundled import RPA_HARNESS_CAPABILITIES as OUR_KERNEL
from rpa_harness.targets.upstream import RPA_HARNESS_CAPABILITIES as UPSTREAM_KERNEL

# What tpu-inference v3 declares (harness/tpu_inference_v3.py), without importing it.
EXTENDED = Capabilities(mask_value_meaning=MASK_REPLACES, q_scale=True, page_size_multiple_of_kv_packing=True)
TINY = Case(max_num_batched_tokens=8, max_num_seqs=1, pages_per_seq=3, total_num_pages=4, page_size=4,
            num_q_heads=1, num_kv_heads=1, head_dim=64, q_lens=(2,), kv_lens=(3,), poison=False)  # fmt: skip


def test_our_kernel_keeps_upstream_signature():
    parameters = inspect.signature(kernel.ragged_paged_attention).parameters
    assert not set(EXTENSION_NAMES) & set(parameters)
    assert set(OPTION_NAMES) <= set(parameters)
    arrays = TINY.arrays()
    with pytest.raises(TypeError, match="q_scale"):
        kernel.ragged_paged_attention(**arrays, q_scale=0.5)


@pytest.mark.parametrize("capabilities", [OUR_KERNEL, UPSTREAM_KERNEL], ids=["ours", "upstream"])
@settings(max_examples=60, deadline=None)
@given(data=__import__("hypothesis").strategies.data())
def test_extensions_are_drawn_only_when_declared(capabilities, data):
    for pooled in (False, True):
        case = data.draw(valid_cases(capabilities, pooled=pooled))
        assert not set(EXTENSION_NAMES) & set(case.options())


@settings(max_examples=40, deadline=None)
@given(case=valid_cases(EXTENDED))
def test_reference_matches_oracle_with_extensions(case):
    """The jnp reference and the float64 oracle agree on the extension semantics too."""
    arrays, options = case.arrays(), case.options()
    comparison = reference.compare(
        reference.ragged_paged_attention(**arrays, **options),
        reference.oracle(**arrays, **options),
        label="reference",
    )
    assert comparison.ok, f"{case.describe()}\n{comparison}"


def test_replacing_mask_value_weights_masked_keys():
    """Replaced, a masked logit is mask_value itself: with 3 keys and query rows at positions 1 and 2,
    row 0 (position 1) gives key 2 the weight exp(mask_value) / sum (logits made 0 by a zero query)."""
    case = dataclasses.replace(TINY, mask_value=0.0, mask_value_meaning=MASK_REPLACES)
    arrays = case.arrays()
    arrays["q"][:] = 0.0  # every live logit 0: masked ones replaced by 0 too, so all weights equal
    out = reference.oracle(**arrays, **case.options()).out
    v = arrays["kv_pages"][arrays["page_indices"][0, 0], :3, 1].astype(np.float64)
    np.testing.assert_allclose(out[0, 0], v.mean(axis=0), rtol=1e-12)
    added = reference.oracle(**arrays, **dataclasses.replace(case, mask_value_meaning="added").options()).out
    np.testing.assert_allclose(added[0, 0], v.mean(axis=0), rtol=1e-12)  # 0 added: no mask at all
    default = reference.oracle(**arrays, **dataclasses.replace(case, mask_value=None).options()).out
    np.testing.assert_allclose(default[0, 0], v[:2].mean(axis=0), rtol=1e-12)  # finfo.min: masked


def test_q_scale_clips_to_the_kv_range_and_casts():
    """q / q_scale beyond fp8 e4m3fn's 448 is clipped to 448, then q is cast to fp8; logits times q_scale."""
    from rpa_harness.reference.float64 import quantised_query

    q = np.array([1.0, -10.0, 0.3], np.float32)
    got = quantised_query(q, 0.01, np.dtype(ml_dtypes.float8_e4m3fn))
    expected = np.array([100.0, -448.0, 30.0], np.float32).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    np.testing.assert_array_equal(got, expected)
    assert Options(q_scale=0.5).extension_keywords() == {"q_scale": 0.5}
