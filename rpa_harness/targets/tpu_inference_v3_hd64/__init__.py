"""tpu-inference's head_dim-64 RPA kernel as a harness target: ``--rpa-target=rpa_harness.targets.tpu_inference_v3_hd64``.

``ragged_paged_attention_hd64`` (PyPI ``tpu-inference``,
``tpu_inference/kernels/ragged_paged_attention/v3/kernel_hd64.py``) serves head_dim-64 models and is the
kernel that takes attention sinks (gpt-oss). Its API is v3's but for: each KV head's K and V side by side in
one 128-lane row of the cache (``layouts.pack_cache_side_by_side``), ``attention_sink`` (float32, one logit
per q head) as a ninth array, upstream's block options (``num_kv_pages_per_block``,
``num_queries_per_block``) rather than v3's tuples, its own tuned table (``tuned_block_sizes_hd64.py``), a
100 MiB default VMEM limit, and validators of its own (``messages``, ``rules``).

This module is its profile; ``adapter`` maps the call (v3's adapter, ``rpa_harness.targets.tpu_inference_v3``:
the new tokens split from the cache, the distribution, the replacing mask value, with what differs) and
``both_outputs`` judges both outputs as v3's are (the cache bit for bit).
``rpa_harness.tpu_inference_v3_hd64`` is accepted as a shorter target name. Install as for v3:

    pip install --no-deps tpu-inference==0.32.0
"""

from rpa_harness.spec.interface import MASK_REPLACES
from rpa_harness.targets import tpu_inference_v3 as v3_target
from rpa_harness.targets.tpu_inference import kit, releases
from rpa_harness.targets.tpu_inference.judging import ATTENTION_AND_CACHE
from rpa_harness.targets.tpu_inference.releases import run_header
from rpa_harness.targets.tpu_inference_v3_hd64 import known_issues as _known_issues
from rpa_harness.targets.tpu_inference_v3_hd64.adapter import (  # noqa: F401  (the adapter's public names)
    HEAD_DIM,
    NARROW_OUTPUT_TRACES,
    Hd64Inputs,
    call_hd64,
    dynamic_validate_inputs,
    hd64_inputs,
    kernel,
    ragged_paged_attention,
    tpu_device_name,
)
from rpa_harness.targets.tpu_inference_v3_hd64.both_outputs import check_both_outputs, judge  # noqa: F401
from rpa_harness.targets.tpu_inference_v3_hd64.rules import RULES as RPA_HARNESS_RULES  # noqa: F401

RPA_HARNESS_CAPABILITIES = dict(
    v3_target.RPA_HARNESS_CAPABILITIES,
    q_dtypes=("float32", "bfloat16") if NARROW_OUTPUT_TRACES else ("float32",),
    head_dims=(HEAD_DIM,),  # its static validator: "Expected actual_head_dim=... to be 64."
    attention_sink=True,
    # Of v3's options it takes chunk_prefill_size only: it is always causal, accumulates in float32 and
    # writes the new tokens to the cache.
    # It replaces a masked logit with mask_value in every release (v3's kernel added it before 0.13.0: v3's
    # own capabilities read the installed v3 kernel, not this one).
    mask_value_meaning=MASK_REPLACES,
    non_causal=False,
    out_dtype=False,
    skip_kv_mask=False,
    update_kv_cache=False,
    # Its only chip-dependent code is the tuned table (keyed by the chip's name) and its fallback, which has
    # an arm for v4 (512 keys a block) as well as v5/v6 (2,048) and 7x (4,096).
    tpu_generations=("v4", "v5e", "v5p", "v6e", "7x"),
    # Its default KV block at long contexts is 2,048 keys (4,096 on 7x), copied page by page in an unrolled
    # loop: from 64-key pages on, at most 64 copies.
    min_page_size_for_long_default_blocks=64,
)
# Logits, the running max, sum and accumulator are float32 (m/l/acc scratch is float32; P is not rounded
# before P @ V). The normaliser: float32 queries divide exactly (lax.div), narrower ones multiply by
# pltpu.reciprocal(l, approx=True), which the CPU lowering computes in bfloat16.
RPA_HARNESS_PRECISION = ("approx-reciprocal-for-narrow-output",)
# v3/kernel_hd64.py: q @ K^T and P @ V are jnp.matmul calls without a precision: DEFAULT, one bfloat16 pass
# for float32 operands on a TPU.
RPA_HARNESS_PRODUCT_PRECISION = "default"


RPA_HARNESS_VERSION = run_header(kernel_file="kernel_hd64.py")
RPA_HARNESS_KERNEL = kernel  # imported on first use: the target loads only where tpu-inference is installed

# Its known issues (docs/tpu-inference-v3-findings/hd64-*): their cases are not drawn.

RPA_HARNESS_CATALOGUE = _known_issues.RPA_HARNESS_CATALOGUE
RPA_HARNESS_PROPERTIES = {ATTENTION_AND_CACHE: check_both_outputs}
# Where bfloat16 queries cannot run (no pltpu.reciprocal), the sink finding, which needs them, is not declared.
RPA_HARNESS_KNOWN_ISSUES = tuple(
    issue.name
    for issue in RPA_HARNESS_CATALOGUE
    if issue.affects(releases.installed_version())
    and (NARROW_OUTPUT_TRACES or issue.name != "hd64-sink-on-padded-q-heads")
)


# The family's report with this kernel's calls.
def _reported_kernel():  # imported when a report is asked for: the report module loads the kernel
    from rpa_harness.targets.tpu_inference_v3_hd64.report import HD64

    return HD64


RPA_HARNESS_REPORT = kit.deferred_report(_reported_kernel)
