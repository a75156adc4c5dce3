"""MLA v2's rule table: its static validator's rules, which are MLA v1's (same checks, same messages) but for
the block sizes it also takes as (decode, prefill, mixed) tuples. It has no dynamic validator, so no rule on
the metadata is declared: a kernel that checks nothing there is not asked to."""

from rpa_harness.strategies.violations import Rule
from rpa_harness.targets.tpu_inference_mla_v1.rules import RULES as V1_RULES

RULES: dict[str, Rule] = {name: rule for name, rule in V1_RULES.items() if rule.stage == "static"}
