"""What the findings of the family's kernels share (each target's ``known_issues``): the logits as v3 and
the kernels that score as it does compute them, the mask value that gives masked keys weight (and whether it does), and the
edits of a case that keep a finding's case but for the finding (v3's default mask value, a window that
cannot wrap int16 positions).
"""

import dataclasses
import math
from collections.abc import Iterable

import numpy as np

from rpa_harness.known_issues import (
    FLOAT32_EXP_UNDERFLOW,
    case_arrays,
    hidden_keys,
    sequence_queries_and_keys,
    soft_capped_logits,
)
from rpa_harness.reference.float64 import quantised_query
from rpa_harness.spec.interface import MASK_REPLACES
from rpa_harness.strategies.case import Case


def v3_logits(
    case: Case, q: np.ndarray, k: np.ndarray, seq: int, mask_value: float, rows=slice(None), keys=slice(None)
):
    """[rows, num_q_heads, keys] logits of sequence ``seq`` (its queries ``q`` and keys ``k`` as
    ``sequence_queries_and_keys`` reads them), v3's semantics: q quantised with q_scale, k_scale and q_scale
    folded into the score scale, soft cap, masked logits replaced by mask_value."""
    q = quantised_query(q[rows], case.q_scale, k.dtype)
    scale = case.sm_scale * (case.k_scale or 1.0) * (case.q_scale or 1.0)
    logits = soft_capped_logits(case, q, k[keys], scale)
    masked = hidden_keys(case, case.q_lens[seq], case.kv_lens[seq], rows, keys)
    return np.where(masked[:, None, :], mask_value, logits)


def v3_row_max_logits(case: Case, arrays: dict, seq: int, mask_value: float) -> np.ndarray:
    """[q_len, num_q_heads] largest logit over keys [0, kv_len), v3's semantics (``v3_logits``)."""
    q, k = sequence_queries_and_keys(case, arrays, seq)
    return v3_logits(case, q, k, seq, mask_value).max(axis=-1)


def finite_replacing_mask_value(case: Case) -> float | None:
    """The case's mask_value if it is finite and replaces the masked logits (the mask value that gives masked
    keys weight), else None."""
    if (
        case.mask_value_meaning == MASK_REPLACES
        and case.mask_value is not None
        and math.isfinite(case.mask_value)
    ):
        return case.mask_value
    return None


def masked_keys_weigh(
    case: Case, mask_value: float, sequences: Iterable[int], *, sinks: bool = False
) -> bool:
    """Whether a finite replacing ``mask_value`` gives masked keys weight in a row of one of ``sequences``:
    exp(mask_value - row max) does not underflow in float32, the row max of v3's logits (and, with
    ``sinks``, of the case's attention sinks)."""
    arrays = None
    for seq in sequences:
        arrays = arrays or case_arrays(case)
        row_max = v3_row_max_logits(case, arrays, seq, mask_value)
        if sinks and case.attention_sink is not None:
            row_max = np.maximum(row_max, np.asarray(case.attention_sink)[None, :])
        if (mask_value - row_max > FLOAT32_EXP_UNDERFLOW).any():
            return True
    return False


def with_v3_default_mask_value(case: Case) -> Case:
    """v3's default mask value (finfo(output dtype).min: masked keys get no weight)."""
    return dataclasses.replace(case, mask_value=None)


# The largest int16: positions past it wrap where a kernel computes them in int16 (v3 on TPU v6 and later).
INT16_MAX = 32767


def with_a_window_within_int16(case: Case) -> Case:
    """No window where it covers every key (the same attention), else the widest window that cannot wrap."""
    assert case.sliding_window is not None  # a case of the issue: it has a window
    if case.sliding_window >= max(case.kv_lens, default=0):
        return dataclasses.replace(case, sliding_window=None)
    return dataclasses.replace(case, sliding_window=max(1, INT16_MAX - case.kv_capacity))
