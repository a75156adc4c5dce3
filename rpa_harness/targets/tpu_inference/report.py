"""The upstream-ready report of a repro of one of tpu-inference's kernels (``rpa-harness report``): the
family's skeleton, which each target fills with its kernel.

Their API is not upstream's: they take the new tokens' keys and values and return the cache with the
attention, so their report is their own; ``ReportedKernel`` holds what differs between the kernels with
v3's API (``tpu_inference_v3.report.V3``, the hd64 target's ``HD64``, batched RPA's, the CP fork's).
``render`` is the report of every kernel that fills ``Reported`` (MLA's ``ReportedMla`` too): its call,
its cache check, its reference, its words and its script, in one skeleton
(``report_sections.UpstreamReadyReport``). The report re-runs the repro on its
backend (and emulated TPU generation), says what is wrong (the known issue's description when the repro
is a finding's), the case in the upstream-style words the harness draws and as the kernel's call
(distribution, block sizes, options), expected against actual for both outputs (the attention's worst
element and the map of where it is wrong; the returned cache slot by slot), and a standalone script in the
kernel's own layout that needs only jax, numpy and tpu-inference: it compares the kernel with its own
reference (attention and cache) and exits 1 while the discrepancy reproduces.

The script runs as written on a TPU (of the repro's generation, when the finding depends on the chip).
jax's TPU interpreters cannot run these kernels as they ship (their ``ref.bitcast``/``ref.reshape``
views), so on a CPU it runs only under rpa-harness's interpreter compatibility layer, which patches the
interpreters, never the kernel: ``cpu_launcher`` is the program that does so, and the report prints it.

A repro that does not reproduce (it passes now, or the call raises something other than what was
recorded) gets no report: ``NothingToReport``.
"""

import base64
import dataclasses
import enum
import io
import tempfile
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, Protocol

import numpy as np

from rpa_harness import reference
from rpa_harness import repro as repro_files
from rpa_harness.device import FAST_INTERPRET, INTERPRET, TPU, Backend, Deadlock, processes
from rpa_harness.failures import CacheMismatch
from rpa_harness.generations import NONE
from rpa_harness.report_sections import (
    NothingToReport,
    UpstreamReadyReport,
    case_in_words,
    code_block,
    environment,
    error_map_block,
    script_output,
    worst_element_table,
)
from rpa_harness.targets import first_line_of_error
from rpa_harness.targets.tpu_inference.arguments import KernelInputs
from rpa_harness.targets.tpu_inference.judging import check_updated_cache
from rpa_harness.targets.tpu_inference.kernels import device_arrays, install_command
from rpa_harness.targets.tpu_inference.releases import run_header

REPRODUCES = "REPRODUCES"  # the first word of the script's verdict line while the discrepancy shows
HANG_SECONDS = 300  # how long the script waits for the kernel before it takes the call for a hang
SCRIPT_TIMEOUT = 900  # seconds: a first call of v3 on the generic interpreter can take minutes
MAX_SLOT_ROWS = 16  # differing cache slots listed one by one, then counted


@dataclasses.dataclass(frozen=True)
class ReportedKernel:
    """What a report runs and says of one of tpu-inference's v3 kernels."""

    name: str  # as the report's title names it
    module: types.ModuleType  # the kernel's module (loaded without tpu_inference/__init__.py)
    function: str  # the kernel's function in ``module``
    reference: str  # its reference's function in ``module``
    tuning_options: tuple[str, ...]  # its options that its reference does not take
    cache_layout: str  # the cache's layout, in words
    inputs: Callable[..., KernelInputs]  # (arrays, options of a repro) -> the target's inputs
    call: Callable  # inputs -> (attention, updated cache), on the caller's backend
    precision: tuple[str, ...]  # the target's precision contract
    block_sizes_in_words: Callable  # inputs -> the report's line on the block sizes
    script_options: Callable  # inputs -> the keyword options the standalone script passes
    off_a_tpu: str  # what the chip line says of a case observed on a CPU device
    on_a_generation: str  # ... and of one observed on an emulated generation ({generation})
    script_stubs: str = ""  # Python lines the script's loader runs before it imports the kernel
    # Where its reference (and the cache helpers the script's random data uses) lives, for a kernel that
    # ships none (batched RPA: v3's), with the words that name its owner.
    reference_module: types.ModuleType | None = None
    reference_owner: str = "its own"

    @property
    def qualified_function(self) -> str:
        return f"{self.module.__name__}.{self.function}"

    @property
    def reference_functions(self) -> types.ModuleType:
        return self.reference_module or self.module

    @property
    def reference_in_words(self) -> str:
        return f"{self.reference_owner} `{self.reference}`"

    # What the shared report (``observe``, ``render``) asks of a v3 kernel: ``Reported``.
    def observed_inputs(self, inputs: KernelInputs, repro: repro_files.Repro) -> KernelInputs:
        return inputs

    def upstream_outputs(self, outputs, inputs: KernelInputs) -> tuple:
        return outputs

    def check_cache(self, cache, inputs: KernelInputs, repro: repro_files.Repro) -> None:
        check_updated_cache(inputs, cache)

    def reference_inputs(self, inputs: KernelInputs, repro: repro_files.Repro) -> KernelInputs:
        return inputs

    def reference_outputs(self, own_out, own_cache, inputs: KernelInputs) -> tuple[np.ndarray, Any]:
        return np.asarray(own_out, np.float64), own_cache

    def environment_words(self, repro: repro_files.Repro, backend: Backend) -> list[str]:
        return [
            f"- {run_header()} (`{self.qualified_function}`, installed with `{install_command()}`)",
            *environment(repro.versions, leave_out=("hypothesis",)),
            f"- chip: {chip_words(self, backend.generation)}",
            f"- observed on: {interpreter_words(backend.name)}"
            + (
                " on CPU, through rpa-harness's interpreter compatibility layer (jax's TPU interpreters cannot "
                "run the kernel as it ships: its `ref.bitcast`/`ref.reshape` views; the layer patches the "
                "interpreters, never the kernel)"
                if backend.name != TPU
                else ""
            ),
        ]

    def case_words(self, repro: repro_files.Repro, inputs: KernelInputs) -> list[str]:
        return [*case_in_words(repro), *call_in_words(self, inputs)]

    def standalone_script(
        self, inputs: KernelInputs, repro: repro_files.Repro, description: str, generation: str
    ) -> tuple[str, str]:
        return script(self, inputs, description, generation), data_words(embedded_inputs(inputs))

    def script_words(self, data: str, backend: Backend) -> str:
        return (
            f"The script needs only jax, numpy and tpu-inference. It runs as written on "
            f"{'a TPU ' + backend.generation if backend.generation != NONE else 'a TPU'}"
            f" (`python repro.py`); its data is {data}, its lengths, page table, block sizes and options "
            f"the case's. It compares the kernel with {self.reference_in_words}, the attention "
            "within a tolerance and the returned cache slot by slot, and exits 1 while they disagree."
        )

    def launcher_words(self, backend: Backend) -> str:
        return (
            "On a CPU, jax's interpreters cannot run the kernel without rpa-harness's compatibility layer; with "
            "rpa-harness installed, this runs the same script there, on the interpreter the case was observed on"
            + (f", the CPU device reporting a TPU {backend.generation}" if backend.generation != NONE else "")
            + ":"
        )


class Reported(Protocol):
    """A reported kernel (``ReportedKernel``, MLA's ``ReportedMla``): a frozen dataclass (the report judges
    it under the precision contract it is given), what the report's words read of it, and the pieces it
    fills the shared report with: its call, its cache check, its reference, its words and its script."""

    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]

    @property
    def name(self) -> str: ...
    @property
    def reference(self) -> str: ...
    @property
    def reference_in_words(self) -> str: ...  # "its own `ref_...`", or whose reference it is
    @property
    def reference_functions(self) -> types.ModuleType: ...  # the module its reference is called from
    @property
    def tuning_options(self) -> tuple[str, ...]: ...  # the call's options its reference does not take
    @property
    def precision(self) -> tuple[str, ...]: ...
    @property
    def inputs(self) -> Callable: ...  # (arrays, options of a repro) -> the target's inputs for the call
    @property
    def call(self) -> Callable: ...  # those inputs -> the kernel's outputs, on the caller's backend

    # The call's inputs as the report reads them: the cache's words read their new_slots, slot_owner,
    # slot_position, and the reference's cache is compared with their expected_cache.
    def observed_inputs(self, inputs, repro: repro_files.Repro) -> Any: ...
    def upstream_outputs(self, outputs, inputs) -> tuple: ...  # (attention in upstream's layout, cache)
    def check_cache(self, cache, inputs, repro: repro_files.Repro) -> None: ...  # raises CacheMismatch
    # The inputs of its reference's call (their args and kwargs).
    def reference_inputs(self, inputs, repro: repro_files.Repro) -> Any: ...
    # The reference's (attention, cache) in the layouts the observed ones are in.
    def reference_outputs(self, own_out, own_cache, inputs) -> tuple[np.ndarray, Any]: ...
    def environment_words(self, repro: repro_files.Repro, backend: Backend) -> list[str]: ...
    def case_words(self, repro: repro_files.Repro, inputs) -> list[str]: ...
    # The standalone script and the words for its data.
    def standalone_script(
        self, inputs, repro: repro_files.Repro, description: str, generation: str
    ) -> tuple[str, str]: ...
    def script_words(self, data: str, backend: Backend) -> str: ...  # what the script needs and does
    def launcher_words(self, backend: Backend) -> str: ...  # what the CPU launcher does


@dataclasses.dataclass
class Observation:
    """What the kernel does on the repro's inputs now, on the repro's backend."""

    # The call's inputs as the kernel's report reads them (``Reported.observed_inputs``).
    inputs: Any
    hang: str | None = None  # the TPU interpreter's deadlock account
    error: str | None = None  # the exception the call raised
    comparison: reference.Comparison | None = None  # the attention against the float64 oracle
    own_reference: np.ndarray | None = None  # the kernel's reference's attention (float64)
    own_reference_cache_matches: bool | None = None  # its cache against the expected packed cache
    reference_rejects: str | None = None  # the reference's validator rejected the inputs
    cache_error: CacheMismatch | None = None

    @property
    def wrong_output(self) -> bool:
        return self.comparison is not None and (not self.comparison.ok or self.cache_error is not None)


def observe(kernel: Reported, repro: repro_files.Repro, backend: Backend) -> Observation:
    """Runs the kernel once as the harness ran it (the inputs mapped inside the backend, which may emulate a
    chip), judges both outputs, then runs the kernel's reference on the same case."""
    mapped = []

    def call():
        mapped.append(kernel.inputs(**repro.arrays, **repro.options))
        return kernel.call(mapped[0])

    try:
        outputs = backend.run(call)
    except Exception as error:  # the report says what the call raised (or refuses it as a crash)
        if not mapped:
            raise NothingToReport(
                f"the repro's case cannot be mapped to the kernel's call: {first_line_of_error(error)}"
            ) from None
        observation = Observation(kernel.observed_inputs(mapped[0], repro))
        if isinstance(error, Deadlock):
            observation.hang = str(error)
        else:
            observation.error = first_line_of_error(error)
    else:
        observation = Observation(kernel.observed_inputs(mapped[0], repro))
        judge_outputs(kernel, observation, outputs, repro)
    run_reference(kernel, observation, repro)
    return observation


def judge_outputs(kernel: Reported, observation: Observation, outputs, repro: repro_files.Repro) -> None:
    """The attention against the float64 oracle under the kernel's precision contract; the cache by the
    kernel's check."""
    attention, cache = kernel.upstream_outputs(outputs, observation.inputs)
    observation.comparison = reference.compare(
        attention,
        reference.oracle(**repro.arrays, **repro.options),
        label="kernel",
        precision=kernel.precision,
    )
    try:
        kernel.check_cache(cache, observation.inputs, repro)
    except CacheMismatch as mismatch:
        observation.cache_error = mismatch


def run_reference(kernel: Reported, observation: Observation, repro: repro_files.Repro) -> None:
    """The kernel's reference on the same case: its attention, whether its cache is the expected one bit for
    bit, or what its validator rejects the inputs with."""
    inputs = kernel.reference_inputs(observation.inputs, repro)
    try:
        own_out, own_cache = getattr(kernel.reference_functions, kernel.reference)(
            *device_arrays(inputs.args),
            **{k: v for k, v in inputs.kwargs.items() if k not in kernel.tuning_options},
        )
    except ValueError as error:
        observation.reference_rejects = str(error)
        return
    observation.own_reference, own_cache = kernel.reference_outputs(own_out, own_cache, inputs)
    expected = observation.inputs.expected_cache
    bits = f"u{expected.dtype.itemsize}"
    observation.own_reference_cache_matches = bool(
        np.array_equal(np.asarray(own_cache).view(bits), expected.view(bits))
    )


def reproduces(observation: Observation, repro: repro_files.Repro, issue) -> bool:
    """A hang or a wrong output always; a raised error only when it is the one recorded or the finding's."""
    if observation.hang is not None or observation.wrong_output:
        return True
    if observation.error is None:
        return False
    recorded = (
        repro.error is not None
        and observation.error.startswith(f"{repro.error['type']}: ")
        and repro.error["message"].strip().splitlines()[-1].strip() in observation.error
    )
    return recorded or (issue is not None and issue.shows(observation.error))


def chip_words(kernel: ReportedKernel, generation: str) -> str:
    return kernel.off_a_tpu if generation == NONE else kernel.on_a_generation.format(generation=generation)


def call_in_words(kernel: ReportedKernel, inputs) -> list[str]:
    """The kernel's side of the case: what it is passed besides the arrays."""
    _, keys, _, kv_cache, _, _, cu_q_lens, distribution = inputs.args[:8]
    options = {k: v for k, v in inputs.kwargs.items() if v is not None and k not in kernel.tuning_options}
    return [
        f"- the kernel's call: `distribution = {distribution.tolist()}` (decode-only sequences first, then "
        f"mixed), `kv_cache` of shape `{kv_cache.shape}` {kv_cache.dtype} ({kernel.cache_layout}), new "
        f"tokens' `keys`/`values` of shape `{keys.shape}`, `cu_q_lens = {cu_q_lens.tolist()}`",
        kernel.block_sizes_in_words(inputs),
        f"- `vmem_limit_bytes={inputs.kwargs['vmem_limit_bytes']}`"
        + ("" if inputs.kwargs["vmem_limit_bytes"] is not None else " (the kernel's default)"),
        "- its options: " + (", ".join(f"`{k}={v!r}`" for k, v in options.items()) or "none (defaults)"),
    ]


def capitalized(words: str) -> str:
    return words[:1].upper() + words[1:]


def attention_in_words(kernel: Reported, observation: Observation) -> list[str]:
    c = observation.comparison
    assert c is not None  # the call returned (expected_vs_actual)
    if c.ok:
        return [
            f"Attention: right (max error/bound {c.max_ratio:.3g} against the float64 oracle under the "
            "kernel's precision contract)."
        ]
    w = c.worst
    assert w is not None, "no live rows, so no worst element: only the output's dtype is wrong"
    own = observation.own_reference
    return [
        f"Attention: {c.num_over + c.nonfinite} of {c.num_checked} output elements of the live rows are "
        f"wrong ({c.nonfinite} non-finite). Worst: sequence {w.sequence}, token {w.token} (row {w.row}), "
        f"head {w.head}, dim {w.dim}.",
        "",
        *worst_element_table(
            c,
            expected="expected (float64 oracle)",
            own_reference=None if own is None else (kernel.reference_in_words, own[w.row, w.head, w.dim]),
            actual="actual (the kernel)",
        ),
        *error_map_block(c),
    ]


def cache_in_words(kernel: Reported, observation: Observation) -> list[str]:
    inputs, mismatch = observation.inputs, observation.cache_error
    if mismatch is None:
        return ["Cache: right (bit for bit: every new token in its slot, nothing else changed)."]
    assert mismatch.slots is not None and mismatch.stale is not None, "the cache's shape or dtype differs"
    slots = np.argwhere(mismatch.slots)
    new = int((mismatch.slots & inputs.new_slots).sum())
    lines = [
        f"Cache: the returned cache differs from the expected one (the input cache with every new token "
        f"written to its slot) in {len(slots)} slot{'s' * (len(slots) != 1)}, {new} of them new tokens' slots "
        f"(of {int(inputs.new_slots.sum())}):",
        "",
        "| page | slot | sequence, key position | slot's role | returned slot |",
        "|---|---|---|---|---|",
    ]
    for page, slot in slots[:MAX_SLOT_ROWS]:
        owner, position = inputs.slot_owner[page, slot], inputs.slot_position[page, slot]
        whose = f"{owner}, {position}" if owner >= 0 else "no live sequence"
        role = "a new token's" if inputs.new_slots[page, slot] else "must stay unchanged"
        held = "keeps its input contents (not written)" if mismatch.stale[page, slot] else "other values"
        lines.append(f"| {page} | {slot} | {whose} | {role} | {held} |")
    if len(slots) > MAX_SLOT_ROWS:
        lines.append(f"| ... | | {len(slots) - MAX_SLOT_ROWS} more slots | | |")
    if observation.own_reference_cache_matches is not None:
        verdict = "returns" if observation.own_reference_cache_matches else "does not return either"
        lines += ["", f"{capitalized(kernel.reference_in_words)} {verdict} the expected cache, bit for bit."]
    return lines


def expected_vs_actual(kernel: Reported, observation: Observation) -> list[str]:
    rejects = (
        f"{capitalized(kernel.reference_in_words)} rejects these inputs (its `dynamic_validate_inputs`: "
        f"`{observation.reference_rejects}`), which the kernel does not run: the call must return or fail."
    )
    if observation.hang is not None:
        return [
            "Expected: the call returns." + (f" {rejects}" if observation.reference_rejects else ""),
            "",
            f"Actual: the call never returns: {observation.hang}.",
        ]
    if observation.error is not None:
        return [
            "Expected: the attention and the updated cache.",
            "",
            f"Actual: the call raises `{observation.error}`.",
        ]
    return [*attention_in_words(kernel, observation), "", *cache_in_words(kernel, observation)]


# The parts of a report's standalone script that every kernel's shares, spliced into its template (their
# fields: ``hang_seconds``, ``reproduces``, ``reference_words``): the watchdog that takes a call that does
# not return for a hang, the attention compared with the reference, and the verdict.
SCRIPT_WATCHDOG = """returned = threading.Event()


def watchdog():
    if not returned.wait({hang_seconds}):
        print("{reproduces}: the kernel did not return within {hang_seconds} s", flush=True)
        os._exit(1)


threading.Thread(target=watchdog, daemon=True).start()
"""
SCRIPT_ATTENTION = """tolerance = 1e-4 if out.dtype == jnp.float32 else 5e-2
wrong = ~np.isclose(got, want, rtol=tolerance, atol=tolerance)
print(f"attention: {{int(wrong.sum())}} of {{wrong.size}} elements differ from the reference (tolerance {{tolerance}})")
if wrong.any():
    row, head, dim = np.argwhere(wrong)[0]
    sequence = int(np.searchsorted(cu_q_lens[1:], row, side="right"))
    print(f"  first at sequence {{sequence}}, token {{row - cu_q_lens[sequence]}}, head {{head}}, dim {{dim}}: "
          f"kernel {{got[row, head, dim]}}, reference {{want[row, head, dim]}}")
"""
SCRIPT_VERDICT = """if wrong.any() or differs.any():
    print("{reproduces}: the kernel disagrees with {reference_words}")
    sys.exit(1)
print("does not reproduce: the kernel agrees with {reference_words}")
"""

SCRIPT = (
    '''"""{name}: {description}

Runs as written on {where}: `python repro.py` exits 1 while the kernel disagrees with {reference_words}
(or does not return), 0 otherwise. {data_words}; the lengths, page
table, block sizes and options are the failing case's.
"""

import base64
import importlib
import importlib.util
import io
import os
import sys
import threading
import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np


def load_kernel():
    """The kernel's module, without tpu_inference/__init__.py (it imports vllm)."""
    root = list(importlib.util.find_spec("tpu_inference").submodule_search_locations)[0]
    parts = ("tpu_inference", "kernels", "ragged_paged_attention", "v3")
    for depth in range(1, len(parts) + 1):
        package = types.ModuleType(".".join(parts[:depth]))
        package.__path__ = [os.path.join(root, *parts[1:depth])]
        sys.modules.setdefault(package.__name__, package)
{stubs}    return importlib.import_module("{module}")


kernel = load_kernel()
reference = importlib.import_module("{reference_module}")
warnings.filterwarnings("ignore", "Some donated buffers were not usable")  # on CPU; the kernel donates its inputs
q_dtype, kv_dtype = jnp.{q_dtype}, jnp.{kv_dtype}
tokens, q_heads, kv_heads, head_dim = {tokens}, {q_heads}, {kv_heads}, {head_dim}
pages, page_size = {pages}, {page_size}
kv_lens = np.array({kv_lens}, np.int32)
page_indices = {page_indices}  # flat: [max_num_seqs * pages_per_seq]
cu_q_lens = np.array({cu_q_lens}, np.int32)
distribution = np.array({distribution}, np.int32)  # decode-only sequences, then mixed; num_seqs
options = {options}
{sink_lines}
rows = int(cu_q_lens[distribution[2]])
{data_lines}arrays = (queries, keys, values, kv_cache, kv_lens, page_indices, cu_q_lens, distribution{sink_arg})

tuning = {tuning!r}
try:
    expected_out, expected_cache = reference.{reference}(
        *map(jnp.asarray, arrays), **{{k: v for k, v in options.items() if k not in tuning}}
    )
except ValueError as error:  # the kernel does not run this validator: it must still return
    print("the reference rejects these inputs:", error)
    expected_out = expected_cache = None

'''
    + SCRIPT_WATCHDOG
    + """try:
    out, cache = jax.block_until_ready(kernel.{function}(*map(jnp.asarray, arrays), **options))
except Exception as error:
    if expected_out is None:  # inputs the reference rejects: only a call that never returns is a finding
        raise
    lines = [line.strip() for line in str(error).splitlines() if line.strip()] or [""]
    raised = [line for line in lines if line.split(": ", 1)[0].endswith(("Error", "Exception"))]
    said = raised[-1] if raised else lines[0]  # the innermost exception's line, else the message's first
    print(f"{reproduces}: the kernel raises on inputs its reference accepts: {{type(error).__name__}}: {{said}}")
    sys.exit(1)
returned.set()
if expected_out is None:
    print("does not reproduce: the kernel returned")
    sys.exit(0)

got, want = np.asarray(out[:rows], np.float32), np.asarray(expected_out[:rows], np.float32)
"""
    + SCRIPT_ATTENTION
    + """
bits = f"u{{kv_cache.dtype.itemsize}}"
returned_bits, expected_bits = np.asarray(cache).view(bits), np.asarray(expected_cache).view(bits)
differs = (returned_bits != expected_bits).reshape(pages, page_size, -1).any(axis=-1)
kept = (returned_bits == kv_cache.view(bits)).reshape(pages, page_size, -1).all(axis=-1)
print(f"cache: {{int(differs.sum())}} of {{pages * page_size}} slots differ from the reference's")
pages_per_seq = len(page_indices) // len(kv_lens)
for i in range(int(distribution[2])):  # slot by slot: whose key each differing slot holds
    q_len, kv_len = int(cu_q_lens[i + 1] - cu_q_lens[i]), int(kv_lens[i])
    for position in range(kv_len):
        page, slot = page_indices[i * pages_per_seq + position // page_size], position % page_size
        if differs[page, slot]:
            role = "a new token" if position >= kv_len - q_len else "a cached key"
            held = "left its input contents there" if kept[page, slot] else "wrote other values"
            print(f"  page {{page}}, slot {{slot}} (sequence {{i}}, key position {{position}}, {{role}}): the kernel {{held}}")

"""
    + SCRIPT_VERDICT
)


RANDOM_DATA = """\
rng = np.random.default_rng(0)
queries = (rng.standard_normal((tokens, q_heads, head_dim)) / head_dim**0.5).astype(q_dtype)  # unit-variance logits
keys = rng.standard_normal((tokens, kv_heads, head_dim)).astype(kv_dtype)  # the new tokens
values = rng.standard_normal((tokens, kv_heads, head_dim)).astype(kv_dtype)
queries[rows:], keys[rows:], values[rows:] = 0, 0, 0
cached_k = rng.standard_normal((pages * page_size, kv_heads, head_dim)).astype(kv_dtype)
cached_v = rng.standard_normal((pages * page_size, kv_heads, head_dim)).astype(kv_dtype)
cache_shape = reference.get_kv_cache_shape(pages, page_size, kv_heads, head_dim, kv_dtype)
kv_cache = np.asarray(reference.merge_kv(jnp.asarray(cached_k), jnp.asarray(cached_v))).reshape(cache_shape)
"""
EXACT_DATA = """\
# The failing case's own inputs (raw bits of numpy arrays, compressed): queries, new keys and values, cache.
stored = np.load(io.BytesIO(base64.b64decode({encoded!r})))
queries = stored["queries"].view(q_dtype)
keys, values, kv_cache = (stored[name].view(kv_dtype) for name in ("keys", "values", "kv_cache"))
"""
# The largest compressed inputs a script embeds; larger cases get random data of the case's shapes.
MAX_EMBEDDED_BYTES = 16 * 2**10


def embedded_inputs(inputs) -> str | None:
    """The call's queries, new keys and values and cache as ``embedded_arrays`` gives them."""
    q, keys, values, kv_cache = inputs.args[:4]
    return embedded_arrays(dict(queries=q, keys=keys, values=values, kv_cache=kv_cache))


def embedded_arrays(named: dict) -> str | None:
    """The ``named`` arrays as base64 of a compressed NPZ of their bits, or None when that exceeds
    ``MAX_EMBEDDED_BYTES``: what a script embeds."""
    buffer = io.BytesIO()
    # Any: unpacked into savez_compressed, whose allow_pickle mypy would match an array to.
    bits: dict[str, Any] = {
        name: np.asarray(a).view(f"u{np.asarray(a).dtype.itemsize}") for name, a in named.items()
    }
    np.savez_compressed(buffer, **bits)
    if buffer.tell() > MAX_EMBEDDED_BYTES:
        return None
    return base64.b64encode(buffer.getvalue()).decode()


def adapted(adapter, inputs, call) -> dict[str, Any]:
    """The fields of a reported kernel that its adapter module gives: the kernel module, the mapping of an
    upstream-style case to its inputs, its call on them and its precision contract."""
    return dict(module=adapter.kernel(), inputs=inputs, call=call, precision=adapter.RPA_HARNESS_PRECISION)


def package_stubs(*parts: str) -> str:
    """Lines of a script's loader (``ReportedKernel.script_stubs``) that make the packages of a kernel under
    ``tpu_inference/kernels/`` importable without their ``__init__.py``, as the loader does for v3's."""
    path = ("tpu_inference", "kernels", *parts)
    return (
        f"    for depth in range(3, {len(path) + 1}):\n"
        f"        parts = {path!r}[:depth]\n"
        '        package = types.ModuleType(".".join(parts))\n'
        "        package.__path__ = [os.path.join(root, *parts[1:])]\n"
        "        sys.modules.setdefault(package.__name__, package)\n"
    )


# The longest int32 array a script spells out; a longer one (a long page table) is embedded compressed.
MAX_LISTED_ENTRIES = 1024


def array_source(array) -> str:
    """An int32 array as the script's source: its entries listed, or, past ``MAX_LISTED_ENTRIES``, the
    base64 of a compressed NPZ of them."""
    array = np.asarray(array, np.int32)
    if array.size <= MAX_LISTED_ENTRIES:
        return f"np.array({array.tolist()}, np.int32)"
    buffer = io.BytesIO()
    np.savez_compressed(buffer, entries=array)
    encoded = base64.b64encode(buffer.getvalue()).decode()
    return f'np.load(io.BytesIO(base64.b64decode("{encoded}")))["entries"]'


def value_source(value) -> str:
    """``value`` as the script's Python source: dtypes as jnp's names, non-finite floats spelled out, a
    kernel's configuration objects (dataclasses, enums) built from their module."""
    if isinstance(value, np.dtype):
        return f"jnp.{value.name}"
    owner = f"importlib.import_module({type(value).__module__!r}).{type(value).__qualname__}"
    if isinstance(value, enum.Enum):
        return f"{owner}.{value.name}"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = ", ".join(
            f"{f.name}={value_source(getattr(value, f.name))}" for f in dataclasses.fields(value)
        )
        return f"{owner}({fields})"
    if isinstance(value, float) and not np.isfinite(value):
        return f"float({str(value)!r})"
    return repr(value)


def options_source(options: dict) -> str:
    return "{" + ", ".join(f"{name!r}: {value_source(value)}" for name, value in options.items()) + "}"


def script(kernel: ReportedKernel, inputs, description: str, generation: str) -> str:
    """The standalone program (jax, numpy, tpu-inference) that makes the repro's call on its own inputs
    where they are small (``embedded_inputs``), else on random data of their shapes (the attention sinks,
    when given, are the repro's: they are options, not data)."""
    q, keys, _, kv_cache, kv_lens, page_indices, cu_q_lens, distribution, *sinks = inputs.args
    pages, page_size = kv_cache.shape[:2]
    where = f"a TPU {generation}" if generation != NONE else "a TPU"
    given_sinks = bool(sinks) and sinks[0] is not None
    sink_values = ", ".join(value_source(float(x)) for x in sinks[0]) if given_sinks else ""
    encoded = embedded_inputs(inputs)
    return SCRIPT.format(
        name=kernel.name.replace("tpu-inference", run_header(), 1),
        data_words="Random data (seed 0)" if encoded is None else "The failing case's own data",
        data_lines=RANDOM_DATA if encoded is None else EXACT_DATA.format(encoded=encoded),
        module=kernel.module.__name__,
        function=kernel.function,
        reference=kernel.reference,
        reference_module=kernel.reference_functions.__name__,
        reference_words=kernel.reference_in_words,
        stubs=kernel.script_stubs,
        sink_lines=f"attention_sink = np.array([{sink_values}], np.float32)  # one logit per q head\n"
        if given_sinks
        else "",
        sink_arg=", attention_sink" if given_sinks else "",
        description=description,
        where=where,
        q_dtype=q.dtype.name,
        kv_dtype=keys.dtype.name,
        tokens=q.shape[0],
        q_heads=q.shape[1],
        kv_heads=keys.shape[1],
        head_dim=q.shape[2],
        pages=pages,
        page_size=page_size,
        kv_lens=kv_lens.tolist(),
        page_indices=array_source(page_indices),
        cu_q_lens=cu_q_lens.tolist(),
        distribution=distribution.tolist(),
        options=options_source(kernel.script_options(inputs)),
        tuning=kernel.tuning_options,
        hang_seconds=HANG_SECONDS,
        reproduces=REPRODUCES,
    )


def cpu_launcher(script_path: str, backend_name: str, generation: str) -> str:
    """The program that runs a report's script on a CPU: rpa-harness's compat layer, the interpreter the
    repro ran on, the chip it emulated. A deadlock the TPU interpreter finds is the hang, in seconds."""
    params = "pltpu.InterpretParams()" if backend_name == INTERPRET else "True"
    emulate = f", generations.emulated({generation!r})" if generation != NONE else ""
    return "\n".join(
        [
            "import sys",
            "from jax.experimental.pallas import tpu as pltpu",
            f"from rpa_harness import {'generations, ' if emulate else ''}interpret_compat",
            "from rpa_harness.interpret_compat.tpu import DEADLOCK_MESSAGE",
            "",
            "interpret_compat.install()  # patches jax's interpreters, never the kernel",
            f"with pltpu.force_tpu_interpret_mode({params}){emulate}:",
            "    try:",
            f"        exec(compile(open({script_path!r}).read(), {script_path!r}, 'exec'), {{'__name__': '__main__'}})",
            "    except Exception as error:",
            "        found = [line for line in str(error).splitlines() if DEADLOCK_MESSAGE in line]",
            "        if not found:",
            "            raise",
            f"        print('{REPRODUCES}: on a TPU the kernel would never return:', found[-1].strip())",
            "        sys.exit(1)",
        ]
    )


def run_script(program: str, backend_name: str, generation: str, directory) -> tuple[int, str]:
    """Runs the script as the report says to (on CPU through ``cpu_launcher``, unless on a TPU); returns
    (exit status, its output: what it printed, and the end of its error output when it printed no verdict)."""
    path = Path(directory) / "repro.py"
    path.write_text(program)
    text = program if backend_name == TPU else cpu_launcher(str(path), backend_name, generation)
    result = processes.run(processes.python("-c", text), timeout=SCRIPT_TIMEOUT)
    if result.returncode is None:
        raise TimeoutError(f"the report's script did not finish within {SCRIPT_TIMEOUT:g} s")
    output = result.stdout.rstrip()
    if REPRODUCES not in output and "does not reproduce" not in output:
        output += "\n" + "\n".join(result.stderr.strip().splitlines()[-12:])
    return result.returncode, output.strip()


def check_reproduces(observation: Observation, repro, issue, path, backend: Backend, shown_path: str) -> None:
    """Raises ``NothingToReport`` (saying what happened instead) unless the repro reproduces."""
    if reproduces(observation, repro, issue):
        return
    what = (
        f"the call raises `{observation.error}`, not what was recorded (a crash of the interpreter or of the "
        "harness is not a reproduced bug)"
        if observation.error is not None
        else "the attention is within the kernel's precision contract and its returned cache is right"
    )
    raise NothingToReport(f"{path}: it does not reproduce on {backend.label}: {what}; nothing to report "
                          f"(replay it with `rpa-harness replay {shown_path}`)")  # fmt: skip


def script_run(program: str, backend: Backend) -> list[str]:
    """The report's section with the output of its script, run as the report says to."""
    with tempfile.TemporaryDirectory(prefix="rpa-tpu-inference-report-") as directory:
        status, output = run_script(program, backend.name, backend.generation, directory)
    verdict = "reproduces" if status != 0 and REPRODUCES in output else "does not reproduce"
    return script_output(
        f"Output of the script on this report's machine (exit status {status}: {verdict}):", output
    )


def title(kernel: Reported, observation: Observation, issue) -> str:
    if issue is not None:
        return f"{kernel.name}: {issue.description}"
    if observation.hang is not None:
        return f"{kernel.name}: the call never returns"
    if observation.error is not None:
        return f"{kernel.name} raises on valid inputs: {observation.error[:100]}"
    assert observation.comparison is not None  # the call returned
    wrong = [name for name, bad in (("attention", not observation.comparison.ok),
                                    ("cache", observation.cache_error is not None)) if bad]  # fmt: skip
    return f"{kernel.name} returns a wrong {' and '.join(wrong)}"


def render(
    kernel: Reported,
    path,
    repro: repro_files.Repro,
    backend: Backend,
    issue,
    shown_path: str,
    *,
    precision: tuple[str, ...],
    with_script_output=False,
):
    """The Markdown report, or ``NothingToReport`` when the repro does not reproduce on ``backend``;
    the attention judged under ``precision`` (the contract the repro failed under), the sections filled by
    ``kernel``."""
    kernel = dataclasses.replace(kernel, precision=precision)
    observation = observe(kernel, repro, backend)
    check_reproduces(observation, repro, issue, path, backend, shown_path)
    heading = title(kernel, observation, issue)
    description = issue.description if issue is not None else heading.removeprefix(f"{kernel.name} ")
    program, data = kernel.standalone_script(observation.inputs, repro, description, backend.generation)
    return UpstreamReadyReport(
        title=heading,
        environment=kernel.environment_words(repro, backend),
        case=kernel.case_words(repro, observation.inputs),
        outcome=expected_vs_actual(kernel, observation),
        why=issue.explanation if issue is not None else None,
        reproduce=[
            kernel.script_words(data, backend),
            "",
            *code_block(program.rstrip()),
            "",
            kernel.launcher_words(backend),
            "",
            *code_block(cpu_launcher("repro.py", backend.name, backend.generation)),
        ],
        script_output=script_run(program, backend) if with_script_output else [],
        shown_path=shown_path,
    ).markdown()


def interpreter_words(backend_name: str) -> str:
    """Where the case was observed, as the environment's words name it."""
    return {INTERPRET: "the Pallas TPU interpreter", FAST_INTERPRET: "the generic Pallas interpreter"}.get(
        backend_name, "a TPU"
    )


def data_words(encoded: str | None) -> str:
    """The script's data in words: the case's own where it embeds them (``embedded_inputs``), else random."""
    return "random (seed 0)" if encoded is None else "the case's own"
