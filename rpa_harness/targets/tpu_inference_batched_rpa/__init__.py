"""tpu-inference's batched RPA (experimental) as a harness target:
``--rpa-target=rpa_harness.targets.tpu_inference_batched_rpa``.

``ragged_paged_attention`` from ``tpu_inference/kernels/experimental/batched_rpa/wrapper.py`` (PyPI
``tpu-inference``; "experimental and not fully tested", its docstring says) is derived from RPA v3: v3's
arguments and packed cache, its decode and mixed kernels rewritten to batch several sequences per grid
step through a precomputed schedule and a triple-buffered pipeline. ``adapter`` maps upstream-style
cases onto it as v3's adapter does, with batched RPA's block sizes; both outputs are judged as v3's are.
Install as for v3:

    pip install --no-deps tpu-inference==0.32.0
"""

import jax

from rpa_harness.targets.tpu_inference import judging, kit
from rpa_harness.targets.tpu_inference_batched_rpa import known_issues as _known_issues
from rpa_harness.targets.tpu_inference_batched_rpa.adapter import (  # noqa: F401  (the adapter's public names)
    BatchedInputs,
    batched_inputs,
    call_batched,
    kernel,
    ragged_paged_attention,
)
from rpa_harness.targets.tpu_inference_batched_rpa.rules import RULES as RPA_HARNESS_RULES  # noqa: F401

RPA_HARNESS_CAPABILITIES = kit.v3_derived_capabilities(
    # XLA:CPU (jax 0.12) cannot run some of its bfloat16 x bfloat16 dots with a float32 result ("Unsupported
    # element type for DotThunk::Execute: BF16 x BF16 = F32", e.g. one KV head), which the interpreters
    # compile for the CPU: that pair is drawn only where jax runs on a TPU.
    excluded_dtype_pairs=(("bfloat16", "bfloat16"),) if jax.default_backend() == "cpu" else (),
    page_size_multiple_of_kv_packing=True,
    # Its code grows with a KV block's pages (a copy per page, per batched sequence and buffer): a block of
    # 16 two-key pages took 144 s to compile, of 4 52 s, of 1 28 s (a loaded machine); 49 outlived the
    # watchdog's 300 s, a slow compilation taken for a hang.
    max_kv_pages_per_block=8,
    # It reads the chip (pltpu.get_tpu_info) for its layout's alignment, SMEM budget and position integers
    # (int16 for packed queries on v6 and v7).
    tpu_generations=("v5e", "v6e", "7x"),
    buckets=("tiny", "small", "long"),
)
# The logits rounded to the output dtype (q's) after a float32 q.K product, scaled, capped and
# exponentiated in it (flash_attention.py: qk.astype(dtype_out), p = exp(qk - m)); the block's row sum and
# P @ V (a float32 product) rounded to it, the running max, sum and accumulator kept in it; float32 and
# bfloat16 outputs divide exactly.
RPA_HARNESS_PRECISION = ("accumulators-in-output-dtype", "softmax-in-output-dtype")
# batched_rpa/flash_attention.py: q @ K^T and P @ V are lax.dot calls without a precision: DEFAULT, one
# bfloat16 pass for float32 operands on a TPU.
RPA_HARNESS_PRODUCT_PRECISION = "default"
RPA_HARNESS_VERSION = kit.version("experimental batched_rpa")
RPA_HARNESS_KERNEL = kernel  # imported on first use: the target loads only where tpu-inference is installed
judge = judging.judge_with("tpu-inference batched RPA", batched_inputs, call_batched)
check_both_outputs = judging.checks_both_outputs(judge)
RPA_HARNESS_PROPERTIES = kit.both_outputs_judged(check_both_outputs)
# Its known issues (docs/tpu-inference-batched-rpa-findings/): their cases are not drawn.
RPA_HARNESS_CATALOGUE, RPA_HARNESS_KNOWN_ISSUES = kit.every_finding(_known_issues.RPA_HARNESS_CATALOGUE)


# The family's report with batched RPA's call and v3's reference.
def _reported_kernel():  # imported when a report is asked for: the report module loads the kernel
    from rpa_harness.targets.tpu_inference_batched_rpa.report import BATCHED

    return BATCHED


RPA_HARNESS_REPORT = kit.deferred_report(_reported_kernel)
