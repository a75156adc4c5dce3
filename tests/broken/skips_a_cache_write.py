"""Returns the updated cache (``RPA_HARNESS_UPDATES_CACHE``) without each prefill's last new token: the
slot keeps the value it was given (NaN, as ``NewTokens.poisoned_cache`` poisons it). The attention is right."""

import jax
import numpy as np

from rpa_harness.kernel import dynamic_validate_inputs  # noqa: F401  (part of the target interface)
from rpa_harness.targets import layouts
from tests.broken import SMALL_SPACE, oracle_output

RPA_HARNESS_CAPABILITIES = SMALL_SPACE
RPA_HARNESS_UPDATES_CACHE = True


def ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options):
    out = oracle_output(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options)
    new = layouts.split_new_tokens(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs)
    cache = np.array(kv_pages)
    for i, q_len in enumerate(new.q_lens):
        if q_len >= 2:
            last = (
                new.new_slots & (new.slot_owner == i) & (new.slot_position == int(np.asarray(kv_lens)[i]) - 1)
            )
            cache[last] = np.nan
    return jax.device_put(out), jax.device_put(cache)
