"""Example counts per kind of property, derived from the loaded Hypothesis profile's max_examples.

The harness's pytest plugin (``rpa_harness.plugin``) loads the profile before test modules are imported. A
kernel call costs ~2-10 ms warm on the fast interpreter but 0.3-2 s when a new static configuration compiles,
so properties over the pooled configurations (few compilations) get the volume, and the whole static space
gets fewer examples.
"""

from hypothesis import settings

_LOADED = settings.default
assert _LOADED is not None  # None only while Hypothesis itself is imported
_BASE = _LOADED.max_examples
POOLED_EXAMPLES = _BASE * 5  # fast interpreter, a few compiled kernels, ragged layouts vary
ANY_CONFIG_EXAMPLES = max(5, _BASE // 2)  # fast interpreter, nearly every example compiles
CHECKING_EXAMPLES = _BASE  # TPU interpreter, pooled: 50-200x the fast one per warm call
CHECKING_ANY_CONFIG_EXAMPLES = max(5, _BASE // 4)  # TPU interpreter, nearly every example compiles (~2 s)
# Compiled for a TPU generation ahead of time, never called (tests/properties/test_compilation.py): 3-4 s of
# libtpu's compiler each on a 2-core host, whatever the shapes (the ci profile: 10 a generation).
COMPILE_EXAMPLES = max(5, _BASE // 4)
# The checking TPU interpreter's cost grows with the (query block, KV block) pairs a call visits
# (``Case.block_steps``; MLA v2, whose steps cost the most: 192 take 1.8 s warm, 768 take 26 s, 3,104 over
# 300 s): its properties draw no case with more.
CHECKING_MAX_BLOCK_STEPS = 512
# Each variant of each invalid-input rule on its own (every one drawn on every run): cheap, nothing runs
# past validation.
EXAMPLES_PER_VARIANT = max(3, _BASE // 10)
# Serving-scale examples (tests/properties/test_production.py): tens of seconds each on the fast interpreter, so a
# handful per run (the nightly profile: 5), never more.
PRODUCTION_EXAMPLES = max(1, min(5, _BASE // 80))
# Long-context examples (the same module): seconds each on the fast interpreter. Every run draws each corner
# of the long bucket (ci 1 each, nightly 2); the nightly profile adds 20 random ones (ci draws none).
LONG_CORNER_EXAMPLES = max(1, _BASE // 200)
LONG_EXAMPLES = max(1, min(20, _BASE // 10))
