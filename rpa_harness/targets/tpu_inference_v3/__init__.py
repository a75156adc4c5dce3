"""tpu-inference's ragged paged attention v3 as a harness target: ``--rpa-target=rpa_harness.targets.tpu_inference_v3``.

v3 (PyPI ``tpu-inference``, ``tpu_inference/kernels/ragged_paged_attention/v3/kernel.py``) is the kernel
that serves vLLM on TPU. Its API differs from upstream jax's: the new tokens' keys and values are inputs
that the kernel writes into a packed cache, which it returns with the attention. This module adapts an
upstream-style call (a cache that already holds every key) to v3's, so that the harness's properties run
unchanged. This module is its profile (the ``RPA_HARNESS_*`` declarations); the rest of the package:

- ``adapter``: ``ragged_paged_attention`` / ``dynamic_validate_inputs`` with upstream's signatures (the
  attention output), ``v3_inputs`` (the upstream-style case in v3's layout: what is passed, and what the
  cache must become) and ``call_v3`` (the same call returning v3's updated cache too);
- ``both_outputs``: v3's judge of the family's property, both outputs judged (``tpu_inference.judging``);
- ``known_issues``: its findings with their predicates; ``report``: its upstream-ready reports (the
  family's, ``tpu_inference.report``, with v3's kernel); ``early_*``: tpu-inference 0.11.1 to 0.13.x's v3.

Its validators' messages and rule table are the family's (``tpu_inference.messages``,
``tpu_inference.rules``): the other kernels with v3's validators word theirs as v3 does. The adapter's and
v3's judge's public names are also this module's. ``rpa_harness.tpu_inference_v3`` is accepted as a
shorter target name.

Install v3 without its dependencies (its ``__init__`` imports vllm, and it pins a jax it does not need):

    pip install --no-deps tpu-inference==0.32.0
"""

from rpa_harness.spec.interface import MASK_REPLACES
from rpa_harness.targets.tpu_inference import kit
from rpa_harness.targets.tpu_inference.judging import ATTENTION_AND_CACHE, HANG, checks_both_outputs
from rpa_harness.targets.tpu_inference.releases import installed_version, run_header, v3_api
from rpa_harness.targets.tpu_inference.rules import RULES as _RULES
from rpa_harness.targets.tpu_inference_v3 import early_known_issues as _early_known_issues
from rpa_harness.targets.tpu_inference_v3 import early_rules as _early_rules
from rpa_harness.targets.tpu_inference_v3 import known_issues as _known_issues
from rpa_harness.targets.tpu_inference_v3.adapter import (  # noqa: F401  (the adapter's public names)
    V3Inputs,
    call_v3,
    compiled_call,
    dynamic_validate_inputs,
    kernel,
    ragged_paged_attention,
    v3_inputs,
    validator_options,
)
from rpa_harness.targets.tpu_inference_v3.both_outputs import (  # noqa: F401  (the judge's public names)
    SLIDING_WINDOW_FINDING,
    judge,
    unwritten_by_sliding_window,
)
from rpa_harness.targets.tpu_inference_v3.early_api import kernel_mask_value_meaning

_api = v3_api()  # the installed release's (None without tpu-inference)
# tpu-inference 0.11.1 to 0.13.x: upstream's block options, none of the options below from non_causal on
# (early_api).
_early = _api is not None and not _api.block_tuples

# What the strategies draw for v3 (fields of rpa_harness.strategies.valid.Capabilities). Outside of it: q_len == 0 (v3
# forbids it, and before a live sequence the TPU interpreter finds the kernel deadlocked: finding
# q-len-zero-before-a-live-sequence-hangs) and page sizes v3 rejects for a KV dtype.
RPA_HARNESS_CAPABILITIES = dict(
    head_dims=(64, 128, 256),
    page_size_multiple_of_kv_packing=True,
    empty_sequences=False,
    # v3 replaces a masked logit with mask_value (default finfo(out_dtype).min); upstream adds it, and so
    # do 0.11.1 and 0.12.0 (read from the installed kernel: early_api.kernel_mask_value_meaning).
    mask_value_meaning=kernel_mask_value_meaning() if _early else MASK_REPLACES,
    # v3's quantised query: q / q_scale clipped to the KV dtype's range, cast to it; logits times q_scale.
    q_scale=True,
    # v3 folds k_scale into the score scale and applies v_scale after P @ V, without upstream's rounding
    # of the scaled cache to q's dtype (docs/tpu-inference-v3-findings/README.md).
    kv_scales_round_to_q_dtype=False,
    # The generic interpreter runs v3's data-dependent copy sizes (pl.ds with a traced length) through the
    # compat layer's gap generic-dynamic-size-copies (masked copies of a static window).
    backends=("interpret", "fast-interpret", "tpu"),
    # v3 reads the chip (util.get_tpu_version, pltpu.get_tpu_info) for its default block sizes and VMEM
    # limit, its position integers (int16 for packed queries from v6 on) and its output memory space (v7).
    # v4 has no default block sizes in v3 (NotImplementedError).
    tpu_generations=("v5e", "v5p", "v6e", "7x"),
    # v3's options beyond upstream's, as the specification's extensions: use_causal_mask, out_dtype (the
    # accumulators' dtype; the output stays q's), skip_kv_mask, chunk_prefill_size, update_kv_cache.
    non_causal=not _early,
    out_dtype=not _early,
    skip_kv_mask=not _early,
    chunk_prefill_size=True,
    # Drawn where the installed release takes it (0.22.1 on: releases.py).
    update_kv_cache=_api is not None and _api.update_kv_cache,
    buckets=("tiny", "small", "long"),
    # At long contexts v3's default decode block is 16,384 keys for a bfloat16 cache (32,768 for fp8),
    # copied page by page, each copy unrolled: with small pages one call outlives the watchdog on the fast
    # interpreter, with 256-key pages (64 copies) it does not (docs/measurements.md, "TPU generations and long
    # contexts").
    min_page_size_for_long_default_blocks=256,
)
# v3 keeps its softmax max, denominator and P @ V accumulator in the output dtype (bfloat16 for bfloat16
# queries: l_ref/m_ref/acc_ref are allocated with out_dtype, and P @ V is cast to it before accumulating).
# Its kernel computes logits and P in float32 and does not round P to V's dtype (its reference does).
RPA_HARNESS_PRECISION = ("accumulators-in-output-dtype",)
# v3/kernel.py (0.32.0): q @ K^T and P @ V are jnp.matmul calls without a precision:
# DEFAULT, one bfloat16 pass for float32 operands on a TPU.
RPA_HARNESS_PRODUCT_PRECISION = "default"
if _early:
    # 0.11.1 to 0.13.x keep m, l and acc in float32 (their scratch) and do not round P before P @ V; they
    # normalise a float32 output with lax.div and a narrower one with pl.reciprocal(l, approx=True).
    RPA_HARNESS_PRECISION = ("approx-reciprocal-for-narrow-output",)
RPA_HARNESS_RULES = _early_rules.RULES if _early else _RULES

RPA_HARNESS_CATALOGUE = _known_issues.RPA_HARNESS_CATALOGUE + _early_known_issues.RPA_HARNESS_CATALOGUE
# Measured on 0.32.0's tuned table; the early releases' tables were not swept.
RPA_HARNESS_TUNING_FINDINGS = () if _early else _known_issues.TUNING_FINDINGS
check_both_outputs = checks_both_outputs(judge)
RPA_HARNESS_PROPERTIES = dict.fromkeys((ATTENTION_AND_CACHE, HANG), check_both_outputs)
RPA_HARNESS_KNOWN_ISSUES = tuple(
    issue.name for issue in RPA_HARNESS_CATALOGUE if issue.affects(installed_version())
)
RPA_HARNESS_VERSION = run_header()
RPA_HARNESS_KERNEL = kernel  # imported on first use: the target loads only where tpu-inference is installed
RPA_HARNESS_COMPILED_CALL = compiled_call  # the compile property's: the adapter maps a call with NumPy


def _reported_kernel():  # imported when a report is asked for: the report module loads the kernel
    from rpa_harness.targets.tpu_inference_v3 import early_api, report

    return early_api.reported_kernel(report.V3) if _early else report.V3


RPA_HARNESS_REPORT = kit.deferred_report(_reported_kernel)  # v3's own report: the family's with v3's kernel
