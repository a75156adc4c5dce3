"""tpu-inference's head_dim-64 RPA kernel as a harness target: ``--rpa-target=rpa_harness.targets.tpu_inference_v3_hd64``.

``ragged_paged_attention_hd64`` (PyPI ``tpu-inference``,
``tpu_inference/kernels/ragged_paged_attention/v3/kernel_hd64.py``) serves head_dim-64 models and is the
kernel that takes attention sinks (gpt-oss). Its API is v3's but for: each KV head's K and V side by side in
one 128-lane row of the cache (``layouts.pack_cache_side_by_side``), ``attention_sink`` (float32, one logit
per q head) as a ninth array, upstream's block options (``num_kv_pages_per_block``,
``num_queries_per_block``) rather than v3's tuples, its own tuned table (``tuned_block_sizes_hd64.py``), a
100 MiB default VMEM limit, and validators of its own (``messages``, ``rules``).

The adapter is v3's (``rpa_harness.targets.tpu_inference_v3``: the new tokens split from the cache, the
distribution, the replacing mask value, the cache judged bit for bit); this module adds what differs.
``rpa_harness.tpu_inference_v3_hd64`` is accepted as a shorter target name. Install as for v3:

    pip install --no-deps tpu-inference==0.32.0
"""

import dataclasses
import importlib.util
import logging
import sys
import types
from importlib.metadata import version as _version

import jax
import numpy as np
from jax.experimental.pallas import tpu as pltpu
from rpa_harness.spec.interface import MASK_ADDED
from rpa_harness.targets import layouts
from rpa_harness.targets import tpu_inference_v3 as v3_target

_KERNEL_MODULE = "tpu_inference.kernels.ragged_paged_attention.v3.kernel_hd64"


class _OnceLogger:
    """What the tuned table asks of tpu-inference's logger (vllm's): ``warning_once`` and ``info_once``."""

    def __init__(self, name: str):
        self._logger = logging.getLogger(name)
        self._said: set = set()

    def _once(self, level, message, *args):
        if (message, args) not in self._said:
            self._said.add((message, args))
            self._logger.log(level, message, *args)

    def warning_once(self, message, *args):
        self._once(logging.WARNING, message, *args)

    def info_once(self, message, *args):
        self._once(logging.INFO, message, *args)


def tpu_device_name() -> str:
    """The chip as tpu-inference's tuned tables name it (``TPU v5e``, ``TPU v6e``, ``TPU v5``, ``TPU v7``),
    read from ``jax.devices()`` at each call so that TPU generation emulation answers; off a TPU the
    ``RuntimeError`` tpu-inference's ``get_device_name`` raises."""
    kind = jax.devices()[0].device_kind
    if "TPU" not in kind:
        raise RuntimeError("Expected TPU devices")
    suffix = ""
    for ending, letter in ((" lite", "e"), ("e", "e"), ("p", "p"), ("i", "i")):
        if kind.endswith(ending):
            kind, suffix = kind[: -len(ending)], letter
            break
    if kind.startswith("TPU7") or kind.startswith("TPU8"):
        kind = f"TPU v{kind[3]}"
    return kind + suffix


def _stub_tuned_table_imports() -> None:
    """The tuned table imports ``tpu_inference.logger`` (vllm's logger) and ``tpu_inference.utils`` (torch,
    vllm) for one name each. Where vllm is not installed (``--no-deps``) they are stubbed with those names."""
    if importlib.util.find_spec("vllm") is not None:
        return
    for name, attribute, value in (
        ("tpu_inference.logger", "init_logger", _OnceLogger),
        ("tpu_inference.utils", "get_device_name", tpu_device_name),
    ):
        if name not in sys.modules:
            stub = types.ModuleType(name)
            setattr(stub, attribute, value)
            sys.modules[name] = stub


_stub_tuned_table_imports()
hd64 = v3_target.load_kernel_module(_KERNEL_MODULE)

HEAD_DIM = 64
# The kernel normalises an output narrower than float32 with pltpu.reciprocal, which jax 0.10.2 lacks (it
# has pl.reciprocal only): there it fails to trace for bfloat16 queries, on every backend, and only float32
# queries are drawn.
HAS_TPU_RECIPROCAL = hasattr(pltpu, "reciprocal")
RPA_HARNESS_CAPABILITIES = dict(
    v3_target.RPA_HARNESS_CAPABILITIES,
    q_dtypes=("float32", "bfloat16") if HAS_TPU_RECIPROCAL else ("float32",),
    head_dims=(HEAD_DIM,),  # its static validator: "Expected actual_head_dim=... to be 64."
    attention_sink=True,
    # Of v3's options it takes chunk_prefill_size only: it is always causal, accumulates in float32 and
    # writes the new tokens to the cache.
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


@dataclasses.dataclass(frozen=True)
class Hd64Inputs(v3_target.KernelInputs):
    """One upstream-style call in the hd64 kernel's terms, and the cache it must return (``args`` end with
    the sinks)."""

    # (num_kv_pages_per_block, num_queries_per_block): passed, or those the tuned table chooses.
    block_sizes: tuple[int, int]


def sink_array(attention_sink) -> np.ndarray | None:
    """The specification's sinks (a tuple of floats, one per q head) as the kernel's f32[num_q_heads]."""
    return None if attention_sink is None else np.asarray(attention_sink, np.float32)


def hd64_inputs(
    q,
    kv_pages,
    kv_lens,
    page_indices,
    cu_q_lens,
    num_seqs,
    *,
    sm_scale: float = 1.0,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    mask_value: float | None = v3_target.UPSTREAM_DEFAULT_MASK_VALUE,
    k_scale: float | None = None,
    v_scale: float | None = None,
    num_kv_pages_per_block: int | None = None,
    num_queries_per_block: int | None = None,
    vmem_limit_bytes: int | None = None,
    q_scale: float | None = None,
    mask_value_meaning: str = MASK_ADDED,
    attention_sink: tuple[float, ...] | None = None,
    chunk_prefill_size: int | None = None,
) -> Hd64Inputs:
    """Maps an upstream-style call to the hd64 kernel's, as ``tpu_inference_v3.v3_inputs`` does for v3
    (the new tokens, their poisoned slots, the distribution, the mask value), with the cache packed side by
    side and the block options passed as they are. Off a TPU generation, block options left None get v3's
    target defaults (8 query rows, 2 pages): the tuned table needs a chip. The specification's default
    replacing mask value (None) is the kernel's default (-0.7 * float32 max, replaced): both mask fully."""
    q, kv_pages = np.asarray(q), np.asarray(kv_pages)
    tokens = layouts.split_new_tokens(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs)
    pages_per_seq = np.asarray(page_indices).shape[1]
    given = v3_target.given_block_options(num_queries_per_block, num_kv_pages_per_block, pages_per_seq)
    if given is not None:
        num_queries_per_block, num_kv_pages_per_block = given
    kwargs = dict(
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        q_scale=q_scale,
        k_scale=k_scale,
        v_scale=v_scale,
        num_kv_pages_per_block=num_kv_pages_per_block,
        num_queries_per_block=num_queries_per_block,
        vmem_limit_bytes=vmem_limit_bytes,
        chunk_prefill_size=chunk_prefill_size,
    )
    replacing = v3_target.replacing_mask_value(mask_value, mask_value_meaning)
    if replacing is not None:  # None: the kernel's default (passed as None, it fails to trace: a finding)
        kwargs["mask_value"] = replacing
    cache = layouts.pack_cache_side_by_side(tokens.poisoned_cache(kv_pages))
    args = (
        *v3_target.kernel_arguments(
            q,
            tokens,
            cache,
            kv_lens,
            page_indices,
            cu_q_lens,
            num_seqs,
            chunk_prefill_size=chunk_prefill_size,
        ),
        sink_array(attention_sink),
    )
    if given is None:
        # It validates its inputs before it looks its block sizes up: an invalid input raises its message.
        hd64.static_validate_inputs(*args, **kwargs)
        block_sizes = tuned_block_sizes(
            q, kv_pages.dtype, tokens.keys.shape[1], kv_pages.shape[1], pages_per_seq, sliding_window
        )
    else:
        queries_per_block, kv_pages_per_block = given
        block_sizes = (kv_pages_per_block, queries_per_block)
    return Hd64Inputs(
        args,
        kwargs,
        layouts.pack_cache_side_by_side(kv_pages),
        tokens.new_slots,
        tokens.slot_owner,
        tokens.slot_position,
        block_sizes,
    )


def tuned_block_sizes(
    q, kv_dtype, num_kv_heads: int, page_size: int, pages_per_seq: int, sliding_window
) -> tuple[int, int]:
    """(num_kv_pages_per_block, num_queries_per_block) the kernel's tuned table chooses on the chip it sees
    for ``q`` ([tokens, q heads, head_dim]), called with the arguments the kernel passes."""
    num_tokens, num_q_heads, head_dim = q.shape
    return hd64.get_tuned_block_sizes(
        q.dtype, kv_dtype, num_q_heads, num_kv_heads, head_dim, page_size, num_tokens, pages_per_seq,
        sliding_window,
    )  # fmt: skip


def call_hd64(inputs: Hd64Inputs):
    """Runs the kernel (on whatever backend the caller's context selects): ``(attention, updated cache)``."""
    return v3_target.jitted(hd64.ragged_paged_attention_hd64, inputs.kwargs)(
        *v3_target.device_arrays(inputs.args)
    )


def ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options):
    """Upstream's call on the hd64 kernel: the attention (it raises its static validators' errors while
    tracing)."""
    out, _ = call_hd64(hd64_inputs(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options))
    return out


def dynamic_validate_inputs(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options):
    """The kernel's own ``dynamic_validate_inputs`` (its rules, its messages) on the mapped inputs."""
    inputs = hd64_inputs(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options)
    hd64.dynamic_validate_inputs(*v3_target.device_arrays(inputs.args), **inputs.kwargs)


def judge(
    arrays: dict, options: dict, backend=v3_target.CHECKING, *, precision=RPA_HARNESS_PRECISION
) -> v3_target.Verdict:
    """Runs the kernel once on ``backend`` (the checking TPU interpreter) and judges both outputs: the
    attention against the float64 oracle under the declared contract, the updated cache bit for bit."""
    from rpa_harness import reference

    inputs = hd64_inputs(**arrays, **options)
    out, cache = backend.run(call_hd64, inputs)
    comparison = reference.compare(
        out,
        reference.oracle(**arrays, **options),
        label=f"tpu-inference v3 hd64 on {backend.label}",
        precision=precision,
    )
    try:
        v3_target.check_updated_cache(inputs, cache)
    except v3_target.CacheMismatch as error:
        return v3_target.Verdict(comparison, error, None)
    return v3_target.Verdict(comparison, None, None)


from rpa_harness.targets.tpu_inference_v3_hd64.rules import RULES as RPA_HARNESS_RULES  # noqa: E402, F401

RPA_HARNESS_VERSION = f"tpu-inference {_version('tpu-inference')} (kernel_hd64)"

# Its known issues (docs/tpu-inference-v3-findings/hd64-*): their cases are not drawn. Imported last: the
# predicates read the adapter above.
from rpa_harness.targets.tpu_inference_v3_hd64 import known_issues as _known_issues  # noqa: E402

RPA_HARNESS_CATALOGUE = _known_issues.RPA_HARNESS_CATALOGUE
check_both_outputs = v3_target.checks_both_outputs(judge)
RPA_HARNESS_PROPERTIES = {v3_target.ATTENTION_AND_CACHE: check_both_outputs}
# Where bfloat16 queries cannot run (no pltpu.reciprocal), the sink finding, which needs them, is not declared.
RPA_HARNESS_KNOWN_ISSUES = tuple(
    issue.name
    for issue in RPA_HARNESS_CATALOGUE
    if HAS_TPU_RECIPROCAL or issue.name != "hd64-sink-on-padded-q-heads"
)


def RPA_HARNESS_REPORT(*args, **kwargs):  # noqa: N802  (a profile attribute, named as the others)
    """v3's report with this kernel's calls (``report.HD64``): imported when a report is asked for."""
    from rpa_harness.targets.tpu_inference_v3 import report as v3_report
    from rpa_harness.targets.tpu_inference_v3_hd64.report import HD64

    return v3_report.render(HD64, *args, **kwargs)
