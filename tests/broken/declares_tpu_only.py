"""A correct kernel that declares it runs only on a TPU: on CPU every numeric property is "cannot run"."""

from rpa_harness.kernel import dynamic_validate_inputs, ragged_paged_attention  # noqa: F401  (the target interface)

RPA_HARNESS_CAPABILITIES = dict(backends=("tpu",))
