"""tpu-inference's stacked RPA (experimental) as a harness target:
``--rpa-target=rpa_harness.targets.tpu_inference_stacked_rpa``.

``ragged_paged_attention`` from ``tpu_inference/kernels/experimental/stacked_rpa/wrapper.py`` (PyPI
``tpu-inference``) takes v3's arguments with a cache that keeps the sequence on the lanes, ``[pages, 2 *
kv_heads, padded_head_dim, page_size]`` with ``page_size`` a multiple of 128, and runs decode and mixed
kernels that stack several sequences per grid step on ``emit_pipeline``. ``adapter`` maps upstream-style
cases onto it (``layout`` converts the cache), ``both_outputs`` judges the attention and the returned cache.
It traces on jax < 0.12 (0.11.2, the jax tpu-inference 0.32.0 pins, and 0.10.2): on jax 0.12 loading the
target is a usage error that says so. Install as for v3:

    pip install --no-deps tpu-inference==0.32.0
"""

from rpa_harness.targets.tpu_inference import judging, kit
from rpa_harness.targets.tpu_inference_stacked_rpa import known_issues as _known_issues
from rpa_harness.targets.tpu_inference_stacked_rpa import layout  # noqa: F401  (the converter, public)
from rpa_harness.targets.tpu_inference_stacked_rpa.adapter import (  # noqa: F401  (the adapter's public names)
    StackedInputs,
    call_stacked,
    kernel,
    ragged_paged_attention,
    stacked_inputs,
)
from rpa_harness.targets.tpu_inference_stacked_rpa.both_outputs import check_updated_cache, judge  # noqa: F401
from rpa_harness.targets.tpu_inference_stacked_rpa.rules import RULES as RPA_HARNESS_RULES  # noqa: F401

RPA_HARNESS_CAPABILITIES = kit.v3_derived_capabilities(
    # Its validator requires a multiple of 128 (the sequence is on the lanes); 256 and up would only
    # lengthen each call's compilation.
    page_sizes=(128,),
    # Its schedules emit a DMA per page of a KV block, unrolled (for i in range(bkv_p_cache)), per stacked
    # sequence; larger blocks were not measured.
    max_kv_pages_per_block=2,
    # The generic interpreter judges the attention. The TPU interpreter (with the compat gap
    # tpu-wait-for-nothing) takes 8-50 s a call, too slow for a campaign: the target's tests and its
    # findings' replays run it, to judge the cache where jax 0.10's generic interpreter returns it as
    # given (0.11 writes it).
    slow_backends=("interpret",),
    # It reads the chip (pltpu.get_tpu_info) for lanes, sublanes, its MXU width, VMEM and position integers
    # (int16 for packed queries on v6 and v7). v6e is what an everyday run emulates; each compilation takes
    # XLA:CPU ~25 s, so v5e's paths (int32 positions, a 128-wide MXU) are not declared.
    tpu_generations=("v6e", "7x"),
    buckets=("tiny", "small"),
)
# The logits rounded to the output dtype (q's) after a float32 q.K product, scaled, capped and
# exponentiated in it (flash_attention.py: .astype(accum_dtype(dtype_out)), p = exp(qk - m)); the row sum
# and P @ V (a float32 product) rounded to it, the running max, sum and accumulator kept in it; float32 and
# bfloat16 outputs divide exactly (_normalize_and_store: lax.div).
RPA_HARNESS_PRECISION = ("accumulators-in-output-dtype", "softmax-in-output-dtype")
# stacked_rpa/flash_attention.py: q @ K^T and P @ V are lax.dot_general calls without a precision: DEFAULT,
# one bfloat16 pass for float32 operands on a TPU.
RPA_HARNESS_PRODUCT_PRECISION = "default"
RPA_HARNESS_VERSION = kit.version("experimental stacked_rpa")
RPA_HARNESS_KERNEL = kernel  # imported on first use: it fails to load where the kernel cannot run
check_both_outputs = judging.checks_both_outputs(judge)
RPA_HARNESS_PROPERTIES = kit.both_outputs_judged(check_both_outputs)
# Its known issues (docs/tpu-inference-stacked-rpa-findings/): their cases are not drawn.
RPA_HARNESS_CATALOGUE, RPA_HARNESS_KNOWN_ISSUES = kit.every_finding(_known_issues.RPA_HARNESS_CATALOGUE)
