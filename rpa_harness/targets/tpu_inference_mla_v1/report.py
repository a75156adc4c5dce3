"""An upstream-ready report of a repro of tpu-inference's MLA kernels (``rpa-harness report``).

Their API is MLA's (the split query, the new tokens apart, the latent cache they return), so their report
is their own; ``ReportedMla`` holds what differs between MLA v1 (``MLA_V1``) and v2 (the MLA v2 target's
``report.MLA_V2``). The report re-runs the repro on its backend through the target (the attention and the
cache in upstream's layout, judged as the properties judge them), runs MLA v1's
``ref_mla_ragged_paged_attention`` (the reference tpu-inference ships for both) on the same case, and
writes what the family's report writes (``ReportedMla`` fills ``tpu_inference.report.render``): the case, the
call, expected against actual for both outputs, and a standalone script in the kernel's own layout that
needs only jax, numpy and tpu-inference and exits 1 while the kernel disagrees with that reference.
"""

import dataclasses
import types
from collections.abc import Callable
from typing import Any

import numpy as np

from rpa_harness import repro as repro_files
from rpa_harness.cache_judge import check_updated_cache, expected_upstream_cache
from rpa_harness.device import TPU, Backend
from rpa_harness.generations import NONE
from rpa_harness.report_sections import case_in_words, environment
from rpa_harness.targets import tpu_inference_mla_v1 as mla_v1
from rpa_harness.targets.tpu_inference import kernels, releases
from rpa_harness.targets.tpu_inference import report as family_report

# MLA v1's options that its reference does not take.
TUNING_OPTIONS = ("chunk_prefill_size", "num_kv_pages_per_block", "num_queries_per_block", "vmem_limit_bytes")


@dataclasses.dataclass(frozen=True)
class CallInputs:
    """The kernel's call (``mla``) and what the report reads of the expected cache: its cache table, and
    the cache the reference's is compared with."""

    mla: mla_v1.MlaInputs
    expected_cache: np.ndarray
    new_slots: np.ndarray
    slot_owner: np.ndarray
    slot_position: np.ndarray


@dataclasses.dataclass(frozen=True)
class ReportedMla:
    """What a report runs and says of one of tpu-inference's MLA kernels."""

    name: str  # as the report's title names it
    module: types.ModuleType  # the kernel's module
    inputs: Callable  # (arrays, options of a repro) -> the target's MlaInputs
    call: Callable  # MlaInputs -> the kernel's (attention, cache), on the caller's backend
    precision: tuple[str, ...]  # the target's precision contract
    head_major: bool  # the kernel takes ql_nope and returns the attention [H, T, lkv] (MLA v2)
    script_stubs: str = ""  # Python lines the script's loader runs before it imports the kernel
    function: str = "mla_ragged_paged_attention"
    reference: str = "ref_mla_ragged_paged_attention"  # MLA v1's: v2 ships none
    reference_owner: str = "its own"  # the words that name whose reference it is
    tuning_options: tuple[str, ...] = TUNING_OPTIONS  # the call's options its reference does not take

    @property
    def qualified_function(self) -> str:
        return f"{self.module.__name__}.{self.function}"

    @property
    def reference_in_words(self) -> str:
        return f"{self.reference_owner} `{self.reference}`"

    @property
    def reference_functions(self) -> types.ModuleType:
        return mla_v1.kernel()

    # What the family's report (``tpu_inference.report``: ``observe``, ``render``) asks of a kernel:
    # ``Reported``. The kernel is judged in upstream's layout; its reference is MLA v1's on v1's call for
    # the case.
    def observed_inputs(self, inputs: mla_v1.MlaInputs, repro: repro_files.Repro) -> CallInputs:
        expected = expected_upstream_cache(repro.arrays)
        return CallInputs(
            inputs, expected.cache, expected.new_slots, expected.slot_owner, expected.slot_position
        )

    def upstream_outputs(self, outputs, inputs: CallInputs) -> tuple:
        """The kernel's (attention, cache) in upstream's layout: ``[T, H, head_dim]`` and the target's cache."""
        out, cache = outputs
        attention = np.asarray(out).transpose(1, 0, 2) if self.head_major else np.asarray(out)
        mla = inputs.mla
        return _padded(attention, mla.head_dim), mla_v1.upstream_cache(cache, mla.lkv, mla.head_dim)

    def check_cache(self, cache, inputs: CallInputs, repro: repro_files.Repro) -> None:
        check_updated_cache(cache, repro.arrays, "the kernel")

    def reference_inputs(self, inputs: CallInputs, repro: repro_files.Repro) -> mla_v1.MlaInputs:
        return mla_v1.mla_inputs(**repro.arrays, **repro.options)

    def reference_outputs(self, own_out, own_cache, inputs: mla_v1.MlaInputs) -> tuple[np.ndarray, Any]:
        own = np.asarray(own_out, np.float64)[..., : inputs.lkv]  # its lanes are padded to 128
        return _padded(own, inputs.head_dim), mla_v1.upstream_cache(own_cache, inputs.lkv, inputs.head_dim)

    def environment_words(self, repro: repro_files.Repro, backend: Backend) -> list[str]:
        return [
            f"- tpu-inference {releases.installed_version()} (`{self.qualified_function}`, installed with "
            f"`{kernels.INSTALL_COMMAND}`)",
            *environment(repro.versions, leave_out=("hypothesis",)),
            f"- observed on: {family_report.interpreter_words(backend.name)}"
            + (
                " on CPU, through rpa-harness's interpreter compatibility layer"
                if backend.name != TPU
                else ""
            )
            + (
                f", the CPU device reporting a TPU {backend.generation}" if backend.generation != NONE else ""
            ),
        ]

    def case_words(self, repro: repro_files.Repro, inputs: CallInputs) -> list[str]:
        return [
            "Latent attention as the harness states it: one KV head whose key is `[kv_c ; k_pe]` and whose "
            "value is `[kv_c ; 0]` (the key's first lkv dims), the query split the same way.",
            "",
            *case_in_words(repro),
            *call_in_words(self, inputs),
        ]

    def standalone_script(
        self, inputs: CallInputs, repro: repro_files.Repro, description: str, generation: str
    ) -> tuple[str, str]:
        v1_inputs = mla_v1.mla_inputs(**repro.arrays, **repro.options)
        program = script(self, v1_inputs, inputs.mla, description, generation)
        return program, family_report.data_words(embedded_inputs(v1_inputs))

    def script_words(self, data: str, backend: Backend) -> str:
        return (
            f"The script needs only jax, numpy and tpu-inference; its data is {data}, its lengths, page table, "
            "block sizes and options the case's. It compares the kernel with MLA v1's "
            "`ref_mla_ragged_paged_attention`, the attention within a tolerance and the returned cache slot by "
            "slot, and exits 1 while they disagree."
        )

    def launcher_words(self, backend: Backend) -> str:
        return (
            "On a CPU, with rpa-harness installed, this runs the same script on the interpreter the case was "
            "observed on:"
        )


def _padded(attention: np.ndarray, head_dim: int) -> np.ndarray:
    """[T, H, lkv] zero-padded to head_dim, as the specification's output."""
    padded = np.zeros((*attention.shape[:-1], head_dim), attention.dtype)
    padded[..., : attention.shape[-1]] = attention
    return padded


def call_in_words(kernel: ReportedMla, inputs: CallInputs) -> list[str]:
    """The kernel's side of the case: what it is passed besides the arrays."""
    ql_nope, q_pe, new_kv_c, _, cache, _, _, cu_q_lens, distribution = inputs.mla.args
    options = {k: v for k, v in inputs.mla.kwargs.items() if v is not None and k not in kernel.tuning_options}
    layout = "[H, T, lkv], head-major" if kernel.head_major else "[T, H, lkv]"
    return [
        f"- the kernel's call: `ql_nope` {ql_nope.shape} ({layout}), `q_pe` {q_pe.shape}, new tokens' "
        f"`new_kv_c` {new_kv_c.shape} and `new_k_pe`, `cache_kv` of shape `{cache.shape}` {cache.dtype} "
        "(`[pages, page_size / packing, packing, kv_c and k_pe each padded to 128 lanes]`), "
        f"`cu_q_lens = {cu_q_lens.tolist()}`, `distribution = {distribution.tolist()}`",
        f"- block sizes: `num_kv_pages_per_block={inputs.mla.kwargs['num_kv_pages_per_block']}`, "
        f"`num_queries_per_block={inputs.mla.kwargs['num_queries_per_block']}`, "
        f"`vmem_limit_bytes={inputs.mla.kwargs['vmem_limit_bytes']}`",
        "- its options: " + (", ".join(f"`{k}={v!r}`" for k, v in options.items()) or "none (defaults)"),
    ]


SCRIPT = (
    '''"""{name}: {description}

Runs as written on {where}: `python repro.py` exits 1 while the kernel disagrees with MLA v1's
`ref_mla_ragged_paged_attention` (or does not return), 0 otherwise. {data_words}; the lengths, page
table, block sizes and options are the failing case's.
"""

import base64
import importlib
import importlib.util
import io
import logging
import os
import sys
import threading
import traceback
import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np


ROOT = list(importlib.util.find_spec("tpu_inference").submodule_search_locations)[0]


def load(name):
    """A module of tpu-inference's kernels, without tpu_inference/__init__.py (it imports vllm)."""
    for parts in (("tpu_inference",), ("tpu_inference", "kernels"), ("tpu_inference", "kernels", "mla"),
                  ("tpu_inference", "kernels", "mla", "v1"), ("tpu_inference", "kernels", "mla", "v2"),
                  ("tpu_inference", "kernels", "ragged_paged_attention"),
                  ("tpu_inference", "kernels", "ragged_paged_attention", "v3")):
        package = types.ModuleType(".".join(parts))
        package.__path__ = [os.path.join(ROOT, *parts[1:])]
        sys.modules.setdefault(package.__name__, package)
{stubs}    return importlib.import_module(name)


kernel, v1 = load("{module}"), load("tpu_inference.kernels.mla.v1.kernel")
warnings.filterwarnings("ignore", "Some donated buffers were not usable")  # on CPU
kv_lens = np.array({kv_lens}, np.int32)
page_indices = np.array({page_indices}, np.int32)  # flat: [max_num_seqs * pages_per_seq]
cu_q_lens = np.array({cu_q_lens}, np.int32)
distribution = np.array({distribution}, np.int32)  # decode-only sequences, chunked prefills; num_seqs
options = {options}
rows = int(cu_q_lens[distribution[2]])
{data_lines}arrays = (ql_nope, q_pe, new_kv_c, new_k_pe, cache_kv, kv_lens, page_indices, cu_q_lens, distribution)

tuning = {tuning!r} + {kernel_only!r}
expected_out, expected_cache = v1.ref_mla_ragged_paged_attention(
    *map(jnp.asarray, arrays), **{{k: v for k, v in options.items() if k not in tuning}}
)
'''
    + family_report.SCRIPT_WATCHDOG
    + """call_arrays = ({query_arg}, *arrays[1:])
try:
    out, cache = jax.block_until_ready(kernel.mla_ragged_paged_attention(*map(jnp.asarray, call_arrays), **options))
except Exception as error:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()] or [""]
    raised = [line for line in lines if line.split(": ", 1)[0].endswith(("Error", "Exception"))]
    said = raised[-1] if raised else lines[0]  # the innermost exception's line, else the message's first
    if not said:  # a bare assert: where it is
        frame = traceback.extract_tb(error.__traceback__)[-1]
        said = f"at {{os.path.basename(frame.filename)}}:{{frame.lineno}} ({{frame.line}})"
    print(f"{reproduces}: the kernel raises on inputs its reference accepts: {{type(error).__name__}}: {{said}}")
    sys.exit(1)
returned.set()

lkv = ql_nope.shape[-1]  # the reference pads its output's lanes to 128
got = np.asarray({attention_out}, np.float32)[:rows, :, :lkv]
want = np.asarray(expected_out, np.float32)[:rows, :, :lkv]
"""
    + family_report.SCRIPT_ATTENTION
    + """
pages, page_size = cache_kv.shape[0], cache_kv.shape[1] * cache_kv.shape[2]
bits = f"u{{cache_kv.dtype.itemsize}}"
slot_bits = lambda c: np.asarray(c).view(bits).reshape(pages, page_size, -1)  # noqa: E731
differs = (slot_bits(cache) != slot_bits(expected_cache)).any(axis=-1)
print(f"cache: {{int(differs.sum())}} of {{pages * page_size}} slots differ from the reference's")
pages_per_seq = len(page_indices) // len(kv_lens)
for page, slot in np.argwhere(differs)[:16]:
    owner = [i for i in range(int(distribution[2]))
             if page in page_indices[i * pages_per_seq:(i + 1) * pages_per_seq][:-(-int(kv_lens[i]) // page_size)]]
    whose = f"sequence {{owner[0]}}" if owner else "no live sequence"
    print(f"  page {{page}}, slot {{slot}} ({{whose}})")

"""
    + family_report.SCRIPT_VERDICT
)

RANDOM_DATA = """\
rng = np.random.default_rng(0)
tokens, heads, lkv, r, pages, page_size = {tokens}, {heads}, {lkv}, {r}, {pages}, {page_size}
q_dtype, kv_dtype = jnp.{q_dtype}, jnp.{kv_dtype}
ql_nope = (rng.standard_normal((tokens, heads, lkv)) / (lkv + r) ** 0.5).astype(q_dtype)
q_pe = (rng.standard_normal((tokens, heads, r)) / (lkv + r) ** 0.5).astype(q_dtype)
new_kv_c = rng.standard_normal((tokens, lkv)).astype(kv_dtype)
new_k_pe = rng.standard_normal((tokens, r)).astype(kv_dtype)
cache_kv = np.zeros({cache_shape}, kv_dtype)  # [pages, page_size / packing, packing, kv_c and k_pe lanes]
cache_kv[..., :lkv] = rng.standard_normal(cache_kv[..., :lkv].shape).astype(kv_dtype)
cache_kv[..., {r_lanes}:{r_lanes} + r] = rng.standard_normal(cache_kv[..., {r_lanes}:{r_lanes} + r].shape).astype(kv_dtype)
"""
EXACT_DATA = """\
# The failing case's own inputs (raw bits of numpy arrays, compressed), in MLA v1's layout.
stored = np.load(io.BytesIO(base64.b64decode({encoded!r})))
q_dtype, kv_dtype = jnp.{q_dtype}, jnp.{kv_dtype}
ql_nope, q_pe = (stored[name].view(q_dtype) for name in ("ql_nope", "q_pe"))
new_kv_c, new_k_pe, cache_kv = (stored[name].view(kv_dtype) for name in ("new_kv_c", "new_k_pe", "cache_kv"))
"""


def embedded_inputs(inputs: mla_v1.MlaInputs) -> str | None:
    """v1's query, new tokens and cache as the family's report embeds a script's data
    (``embedded_arrays``)."""
    names = ("ql_nope", "q_pe", "new_kv_c", "new_k_pe", "cache_kv")
    return family_report.embedded_arrays(dict(zip(names, inputs.args[:5], strict=True)))


def script(kernel: ReportedMla, v1_inputs: mla_v1.MlaInputs, call: mla_v1.MlaInputs, description: str,
           generation: str) -> str:  # fmt: skip
    """The standalone program (jax, numpy, tpu-inference) that makes the repro's call in the kernel's layout
    on the case's own data where it is small, else on random data of its shapes, with MLA v1's reference on
    v1's layout of the same data."""
    ql_nope, q_pe, _, _, cache, kv_lens, page_indices, cu_q_lens, distribution = v1_inputs.args
    encoded = embedded_inputs(v1_inputs)
    lkv, r = v1_inputs.lkv, v1_inputs.head_dim - v1_inputs.lkv
    dtypes = dict(q_dtype=ql_nope.dtype.name, kv_dtype=cache.dtype.name)
    data = (
        EXACT_DATA.format(encoded=encoded, **dtypes)
        if encoded is not None
        else RANDOM_DATA.format(
            tokens=ql_nope.shape[0],
            heads=ql_nope.shape[1],
            lkv=lkv,
            r=r,
            pages=cache.shape[0],
            page_size=cache.shape[1] * cache.shape[2],
            cache_shape=cache.shape,
            r_lanes=-(-lkv // 128) * 128,
            **dtypes,
        )  # fmt: skip
    )
    kernel_only = tuple(k for k in call.kwargs if k not in v1_inputs.kwargs)
    return SCRIPT.format(
        name=f"{kernel.name} (tpu-inference {releases.installed_version()})",
        description=description,
        where=f"a TPU {generation}" if generation != NONE else "a TPU",
        data_words="Random data (seed 0)" if encoded is None else "The failing case's own data",
        stubs=kernel.script_stubs,
        module=kernel.module.__name__,
        kv_lens=kv_lens.tolist(),
        page_indices=page_indices.tolist(),
        cu_q_lens=cu_q_lens.tolist(),
        distribution=distribution.tolist(),
        options=family_report.options_source(call.kwargs),
        data_lines=data,
        tuning=kernel.tuning_options,
        kernel_only=kernel_only,
        hang_seconds=family_report.HANG_SECONDS,
        reproduces=family_report.REPRODUCES,
        reference_words="MLA v1's reference",
        query_arg="ql_nope.transpose(1, 0, 2)" if kernel.head_major else "ql_nope",
        attention_out="out.transpose(1, 0, 2)" if kernel.head_major else "out",
    )


MLA_V1 = ReportedMla(
    name="tpu-inference MLA v1",
    **family_report.adapted(mla_v1, mla_v1.mla_inputs, mla_v1.call_mla),
    head_major=False,
)
