"""Example counts derived from the loaded Hypothesis profile (conftest loads it before tests import)."""

from hypothesis import settings

# The checking interpreter costs 10-100x the fast one per call: it runs a fifth of the examples.
CHECKING_EXAMPLES = max(5, settings.default.max_examples // 5)
