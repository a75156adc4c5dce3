"""batched RPA's rule table: the checks of its validator (``configs.RpaConfigs.validate_inputs``) that an
input can reach, and its refusals of the options it does not take.

Its metadata checks are v3's, with v3's messages (``tpu_inference.rules``). Its checks of q, k and v
(three dimensions, equal K and V shapes and token counts, equal head_dims) cannot fire: the wrapper
reshapes and concatenates q, k and v (``prepare_inputs``) before it validates, so such an input fails
there first, with jax's error (docs/experimental-kernels.md), and no rule of them is declared.
"""

from rpa_harness.strategies.violations import Rule
from rpa_harness.targets.tpu_inference.rules import RULES as V3_RULES


def _chunk_prefill_size(arrays, options, case, param):
    """A chunked prefill of one query block's rows: any value is refused."""
    options["chunk_prefill_size"] = 8 * (1 + param % 2)
    return {}


def _non_causal(arrays, options, case, param):
    options["use_causal_mask"] = False
    return {}


RULES: dict[str, Rule] = {
    # The wrapper's refusals, before anything else (wrapper.py, ragged_paged_attention).
    "non-causal attention refused": Rule(
        "static", _non_causal, lambda: "Only causal attention is supported."
    ),
    "chunk_prefill_size refused": Rule(
        "static", _chunk_prefill_size, lambda: "Specifying chunk prefill size is not supported.", variants=2
    ),
    # Its validator's metadata checks, in its order.
    **{name: V3_RULES[name] for name in ("index dtype", "kv_lens shape", "cu_q_lens shape")},
}
