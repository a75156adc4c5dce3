"""stacked RPA's rule table: its wrapper's refusals of the options it does not take and the checks of its
validators (``decode.config.DecodeConfig.validate_inputs``, the mixed kernel's alike) that an input can reach.

Its wrapper refuses non-causal attention and ``chunk_prefill_size`` with batched RPA's words, and its
metadata checks are v3's, with v3's messages: batched RPA's table. Its checks of q, k and v cannot fire:
the wrapper reshapes and concatenates them (``prepare_inputs``) before it validates, as batched RPA's does.
Its check that ``page_size`` is a multiple of 128 is not declared: only 128 is drawn for it.
"""

from rpa_harness.strategies.violations import Rule
from rpa_harness.targets.tpu_inference_batched_rpa.rules import RULES as BATCHED_RULES

RULES: dict[str, Rule] = dict(BATCHED_RULES)
