"""An upstream-ready bug report, in Markdown, from a repro pair (``rpa-harness report REPRO.json``).

The report says what fails in words a kernel maintainer reads without the harness: a title, the
environment, the case (sequences as ``(q_len, kv_len)``, heads, dtypes, options, the page table rows of
the live sequences), expected against actual at the worst element (re-run now, on the repro's backend),
and a standalone script that needs only jax, numpy and ml_dtypes. Off TPU the script also needs the
harness's interpreter compatibility layer when the kernel cannot run in jax's interpreters without it
(upstream's cannot, on jax 0.10.2); the report says so. The script's data is drawn from a fixed seed (q
scaled for unit-variance logits) and its metadata (lengths, page table, options) is the repro's; it
compares the kernel with a float64 reference written out in the script and, when the module has one,
with the module's own reference.
"""

import dataclasses
from collections.abc import Callable
from pathlib import Path

import ml_dtypes
import numpy as np

from rpa_harness import known_issues, reference
from rpa_harness import repro as repro_files
from rpa_harness.device import INTERPRET, TPU, Backend, processes
from rpa_harness.generations import DEVICE_KINDS, NONE
from rpa_harness.property_names import COMPILATION, DIFFERENTIAL
from rpa_harness.report_sections import (
    UpstreamReadyReport,
    case_in_words,
    code_block,
    environment,
    error_map_block,
    script_output,
    worst_element_table,
)
from rpa_harness.run_settings import for_repro
from rpa_harness.snippets import snippet
from rpa_harness.spec.interface import ARRAY_NAMES, EXTENSION_NAMES
from rpa_harness.targets import UPSTREAM_TARGET, V2_TARGET, Target, first_line_of_error, shipped_catalogue

REPO_ROOT = Path(__file__).resolve().parent.parent
BLOCK_OPTIONS = ("num_kv_pages_per_block", "num_queries_per_block", "vmem_limit_bytes")


@dataclasses.dataclass
class Observation:
    """What the kernel does on the repro's inputs now."""

    error: str | None  # the exception, when the call raised
    comparison: reference.Comparison | None
    module_reference: float | None  # the module's own reference at the worst element, if it has one


def known_issue_for(path: Path) -> known_issues.KnownIssue | None:
    for issue in shipped_catalogue():
        if issue.repro.resolve() == path.resolve():
            return issue
    return None


def observe(target: Target, backend: Backend, repro: repro_files.Repro) -> Observation:
    arrays, options = repro.arrays, repro.options
    try:
        actual = backend.run(target.attention, arrays, options)
    except Exception as error:  # the report shows whatever the call raised
        return Observation(first_line_of_error(error), None, None)
    comparison = reference.compare(
        actual, reference.oracle(**arrays, **options), label="kernel", precision=target.precision_on(backend)
    )
    module_reference = None
    own = getattr(target.module, "ref_ragged_paged_attention", None)
    if own is not None and comparison.worst is not None:
        try:
            ref_options = {k: v for k, v in options.items() if k not in BLOCK_OPTIONS}
            ref_out = np.asarray(own(*_as_jax_list(arrays), **ref_options)).astype(np.float64)
            w = comparison.worst
            module_reference = float(ref_out[w.row, w.head, w.dim])
        except Exception:  # a reference that cannot run on these inputs is left out of the report
            module_reference = None
    return Observation(None, comparison, module_reference)


def _as_jax_list(arrays: dict) -> list:
    import jax.numpy as jnp

    return [jnp.asarray(arrays[name]) for name in ARRAY_NAMES]


def expected_vs_actual(observation: Observation) -> list[str]:
    if observation.error is not None:
        return [
            "Expected: an output of shape `q.shape` (the call is valid: upstream's validators accept it, and "
            "its reference computes it).",
            "",
            f"Actual: the call raises `{observation.error}`.",
        ]
    c = observation.comparison
    assert c is not None  # the call returned
    if c.ok:
        return ["The kernel now agrees with the float64 reference on this case: the repro passes."]
    w = c.worst
    assert w is not None, "no live rows, so no worst element: only the output's dtype is wrong"
    own = observation.module_reference
    return [
        f"Worst element: sequence {w.sequence}, token {w.token} (output row {w.row}), head {w.head}, dim {w.dim}.",
        "",
        *worst_element_table(
            c,
            expected="expected (float64 reference)",
            own_reference=None if own is None else ("the module's own `ref_ragged_paged_attention`", own),
            actual="actual (kernel)",
        ),
        "",
        f"{c.num_over} of {c.num_checked} output elements of the live rows are off "
        f"({c.nonfinite} non-finite).",
        *error_map_block(c),
    ]


SCRIPT_REFERENCE = '''
def reference(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale=1.0, sliding_window=None,
              soft_cap=None, mask_value=None, k_scale=None, v_scale=None, **block_sizes):
    """float64 attention with the kernel's documented semantics: sequence i's queries attend to its keys
    [0, kv_len), query j at position kv_len - q_len + j; soft cap, then the mask value is added to
    masked logits; K/V scales multiply in float32 and round to q's dtype."""
    mask_value = -0.7 * float(np.finfo(np.float32).max) if mask_value is None else mask_value
    kv_heads, head_dim = kv_pages.shape[2] // 2, kv_pages.shape[3]
    group = q.shape[1] // kv_heads
    out = np.zeros(q.shape, np.float64)
    for i in range(int(num_seqs[0])):
        start, end, kv_len = int(cu_q_lens[i]), int(cu_q_lens[i + 1]), int(kv_lens[i])
        if start == end:
            continue
        pages = kv_pages[page_indices[i]]
        k = pages[:, :, 0::2].reshape(-1, kv_heads, head_dim)[:kv_len]
        v = pages[:, :, 1::2].reshape(-1, kv_heads, head_dim)[:kv_len]
        if k_scale is not None:
            k = (k.astype(np.float32) * np.float32(k_scale)).astype(q.dtype)
        if v_scale is not None:
            v = (v.astype(np.float32) * np.float32(v_scale)).astype(q.dtype)
        k = np.repeat(k.astype(np.float64), group, axis=1)
        v = np.repeat(v.astype(np.float64), group, axis=1)
        logits = np.einsum("qhd,khd->hqk", q[start:end].astype(np.float64), k) * sm_scale
        if soft_cap is not None:
            logits = soft_cap * np.tanh(logits / soft_cap)
        position = kv_len - (end - start) + np.arange(end - start)[:, None]
        key = np.arange(kv_len)[None, :]
        masked = key > position
        if sliding_window is not None:
            masked |= position - sliding_window >= key
        logits = logits + np.where(masked, mask_value, 0.0)
        weights = np.exp(logits - logits.max(axis=-1, keepdims=True))
        weights /= weights.sum(axis=-1, keepdims=True)
        out[start:end] = np.einsum("hqk,khd->qhd", weights, v)
    return out
'''


def script(
    repro: repro_files.Repro,
    target_name: str,
    backend_name: str,
    needs_compat: bool,
    *,
    generation: str = NONE,
) -> str:
    """A standalone program: jax, numpy and ml_dtypes (and, off TPU when needed, the compat layer and the
    emulated TPU generation)."""
    lines = [
        "import contextlib",
        "import importlib",
        "",
        "import jax",
        "import jax.numpy as jnp",
        "import ml_dtypes",
        "import numpy as np",
        "from jax.experimental.pallas import tpu as pltpu",
        "",
        f"module = importlib.import_module({target_name!r})",
        'on_tpu = jax.default_backend() == "tpu"',
        "if not on_tpu:",
        *_off_tpu_lines(backend_name, needs_compat, generation),
        "else:",
        "    run_on = contextlib.nullcontext()",
        "",
        *_data_lines(repro),
        SCRIPT_REFERENCE,
        *_comparison_lines(target_name, repro.arrays["kv_pages"].dtype),
    ]
    return "\n".join(lines) + "\n"


def _off_tpu_lines(backend_name: str, needs_compat: bool, generation: str) -> list[str]:
    """The script's ``run_on`` off a TPU: the repro's interpreter, behind the compat layer when the kernel
    needs it, with the emulated generation when the repro had one."""
    interpret = "pltpu.InterpretParams()" if backend_name == INTERPRET else "True"
    compat = (
        [
            "    # jax's TPU interpreters cannot run this kernel as they ship (ref reshape/bitcast transforms,",
            "    # masked stores, scalar-prefetch state between grid steps): rpa-harness's compatibility layer",
            "    # patches the interpreters, never the kernel (pip install rpa-harness).",
            "    from rpa_harness import interpret_compat",
            "",
            "    interpret_compat.install()",
        ]
        if needs_compat
        else []
    )
    if generation == NONE:
        return [*compat, f"    run_on = pltpu.force_tpu_interpret_mode({interpret})"]
    return [
        *compat,
        f"    # The kernel reads the chip while it is traced: rpa-harness makes the CPU device report a TPU {generation}",
        "    # (device kind and TPU info), so that it takes that chip's tuned defaults and branches.",
        "    from rpa_harness import generations",
        "",
        "    run_on = contextlib.ExitStack()  # entered now, left after the kernel's call",
        f"    run_on.enter_context(pltpu.force_tpu_interpret_mode({interpret}))",
        f"    run_on.enter_context(generations.emulated({generation!r}))",
    ]


def _data_lines(repro: repro_files.Repro) -> list[str]:
    """The script's inputs: q and the cache drawn from seed 0 in the repro's shapes and dtypes, the repro's
    own metadata and options."""
    arrays = repro.arrays
    q, kv_pages = arrays["q"], arrays["kv_pages"]
    return [
        "rng = np.random.default_rng(0)",
        "# unit-variance logits: q scaled by 1 / sqrt(head_dim)",
        f"q = (rng.standard_normal({q.shape}, dtype=np.float32) / np.float32({q.shape[-1]} ** 0.5)).astype("
        f"{_dtype_expr(q.dtype)})",
        f"kv_pages = rng.standard_normal({kv_pages.shape}, dtype=np.float32).astype("
        f"{_dtype_expr(kv_pages.dtype)})",
        *(
            f"{name} = np.array({arrays[name].tolist()}, np.int32)"
            for name in ("kv_lens", "page_indices", "cu_q_lens", "num_seqs")
        ),
        f"options = {repro.options!r}",
    ]


def _comparison_lines(target_name: str, cache_dtype: np.dtype) -> list[str]:
    """The script's verdict: the kernel's call against the script's reference (and upstream's own, where the
    module has one), failing past the tolerance upstream's own tests allow."""
    own_reference = (
        [
            "own = module.ref_ragged_paged_attention(*inputs, **{k: v for k, v in options.items() if k not in "
            f"{BLOCK_OPTIONS!r}}})",
            'print("module reference at the worst element:", float(np.asarray(own, np.float64)[worst]))',
        ]
        if target_name.startswith("jax.experimental.pallas.ops.tpu.ragged_paged_attention")
        else []
    )
    return [
        "inputs = [jnp.asarray(x) for x in (q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs)]",
        "rows = int(cu_q_lens[num_seqs[0]])",
        "expected = reference(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options)[:rows]",
        "with run_on:",
        "    out = module.ragged_paged_attention(*inputs, **options)",
        "actual = np.asarray(out, np.float64)[:rows]",
        "error = np.abs(actual - expected)",
        "worst = np.unravel_index(int(np.argmax(error)), error.shape)",
        'print("worst (row, head, dim):", tuple(int(i) for i in worst))',
        'print("expected (float64 reference):", expected[worst], " kernel:", actual[worst], " error:", error[worst])',
        *own_reference,
        "# upstream's own tests allow 0.15 (float32 cache) / 0.2 (other caches); the error is far larger",
        f"assert error.max() <= {0.15 if cache_dtype == np.float32 else 0.2}, "
        '"the kernel disagrees with the reference"',
    ]


def _dtype_expr(dtype: np.dtype) -> str:
    return (
        f"ml_dtypes.{dtype.name}" if hasattr(ml_dtypes, dtype.name) and dtype.kind == "V" else f"np.{dtype}"
    )


def run_script(text: str, timeout: float = 900) -> tuple[int, str]:
    """Runs a script in a fresh interpreter from the current folder (where a user's target imports);
    returns (status, output)."""
    result = processes.run(processes.python("-c", text), timeout=timeout)
    if result.returncode is None:
        raise TimeoutError(f"the report's script did not finish within {timeout:g} s")
    tail = [line for line in (result.stdout + result.stderr).splitlines() if "Warning" not in line]
    return result.returncode, "\n".join(tail[-12:])


def render(path: Path, *, target_name=None, backend_name=None, with_script_output=False) -> str:
    """The Markdown report for the repro at ``path``, re-run as ``rpa-harness replay`` re-runs it (the
    repro's settings, ``run_settings.for_repro``; ``target_name`` and ``backend_name`` override them)."""
    repro = repro_files.read(path)
    run = for_repro(repro, target=target_name, backend=backend_name)
    target, backend = run.target, run.backends[0]
    if target.report is not None:  # a kernel with its own API renders its own report
        return target.report(
            path,
            repro,
            backend,
            known_issue_for(path),
            _relative(path),
            precision=target.precision_on(backend),
            with_script_output=with_script_output,
        )
    if target.updates_cache:
        raise repro_files.ReproError(
            f"{path}: target {target.name} returns the updated cache (RPA_HARNESS_UPDATES_CACHE), which the "
            f"report for upstream's API cannot show: replay it with `rpa-harness replay {path}`, or declare the "
            "target's own RPA_HARNESS_REPORT (docs/targets.md)"
        )
    if repro.kind == COMPILATION:
        return compile_report(path, repro, target, backend, with_script_output=with_script_output)
    _check_upstreams_api_states_it(path, repro)
    return differential_report(path, repro, target, backend, with_script_output=with_script_output)


def _check_upstreams_api_states_it(path: Path, repro: repro_files.Repro) -> None:
    """Raises ``ReproError`` for a repro the report for upstream's API cannot state: one of another property
    than the differential, or a case with options outside upstream's signature."""
    if repro.kind != DIFFERENTIAL:
        raise repro_files.ReproError(
            f"{path}: a report is written for differential repros (kernel output against the reference); "
            f"this one is {repro.property!r}: replay it with `rpa-harness replay {path}`"
        )
    extensions = [name for name in EXTENSION_NAMES if name in repro.options]
    if extensions:
        raise repro_files.ReproError(
            f"{path}: the case uses the extension option(s) {', '.join(extensions)} (semantics outside "
            "upstream's signature, such as tpu-inference v3's); a report's script calls upstream's API and "
            f"reference, which cannot state it: replay it with `rpa-harness replay {path}`"
        )


def differential_report(
    path: Path, repro: repro_files.Repro, target: Target, backend: Backend, *, with_script_output=False
) -> str:
    """The report of a kernel with upstream's API whose output is wrong (or that raises) on valid inputs:
    the case re-run on ``backend``, and a script that compares the kernel with a float64 reference."""
    issue = known_issue_for(path)
    observation = observe(target, backend, repro)
    # Upstream's kernel (and RPA v2, the same kernel) runs in jax's interpreters only with the compat layer.
    needs_compat = backend.name != TPU and target.name.startswith((UPSTREAM_TARGET, V2_TARGET))
    program = script(repro, target.name, backend.name, needs_compat, generation=backend.generation)
    return UpstreamReadyReport(
        title=_title(f"{target.name}.ragged_paged_attention", issue, observation),
        environment=[
            *environment(repro.versions),
            f"- ml_dtypes {ml_dtypes.__version__}",
            _run_on_words(backend, needs_compat),
        ],
        case=[
            *case_in_words(repro),
            "",
            "The inputs are valid: upstream's `dynamic_validate_inputs` accepts them.",
        ],
        outcome=expected_vs_actual(observation),
        reproduce=[_script_needs(needs_compat), "", *code_block(program.rstrip())],
        script_output=(
            _ran(program, " on the CPU of this report's environment", _differential_verdict)
            if with_script_output
            else []
        ),
        shown_path=_relative(path),
    ).markdown()


def _title(function: str, issue: known_issues.KnownIssue | None, observation: Observation) -> str:
    if issue is not None:
        return f"`{function}`: {issue.description}"
    if observation.error is not None:
        return f"`{function}` raises on valid inputs: {observation.error[:100]}"
    assert observation.comparison is not None  # the call returned
    worst = observation.comparison.worst
    assert worst is not None, "no live rows, so no worst element: only the output's dtype is wrong"
    return f"`{function}` returns wrong output (error {worst.error:.3g})"


def _run_on_words(backend: Backend, needs_compat: bool) -> str:
    """The environment's line on where the kernel ran: the backend, the emulated chip, the compat layer."""
    return (
        f"- run on: {_backend_words(backend.name)}"
        + (
            f", traced as on a TPU {backend.generation} (the chip's device kind and TPU info emulated on the "
            "CPU device: the kernel takes that chip's tuned defaults and branches)"
            if backend.generation != NONE
            else ""
        )
        + (
            "; the kernel runs in jax's interpreters only with rpa-harness's interpreter compatibility "
            "layer (`rpa_harness.interpret_compat`), which patches the interpreters, never the kernel"
            if needs_compat
            else ""
        )
    )


def _script_needs(needs_compat: bool) -> str:
    return (
        "Needs jax, numpy and ml_dtypes"
        + (
            "; off TPU also rpa-harness's interpreter compatibility layer (`pip install` rpa-harness: the "
            "script imports `rpa_harness.interpret_compat`): without it jax's interpreters cannot run this "
            "kernel at all."
            if needs_compat
            else "."
        )
        + " The data is random (seed 0, logits of unit variance); the lengths, page table and options are "
        "the failing case's."
    )


def _ran(program: str, where: str, verdict: Callable[[int, str], str]) -> list[str]:
    """The script's output, run here, under a heading that says where it ran, its exit status and what that
    status means (``verdict`` of the status and the output)."""
    status, output = run_script(program)
    return script_output(
        f"Output of the script{where} (exit status {status}: {verdict(status, output)}):", output
    )


def _differential_verdict(status: int, output: str) -> str:
    if status == 0:
        return "PASSES: the issue does not show with this data"
    if "the kernel disagrees with the reference" in output:
        return "fails: the kernel disagrees with the reference"
    return "fails with an exception (see the output)"


def compile_report(path: Path, repro, target: Target, backend: Backend, *, with_script_output=False) -> str:
    """The report of a configuration the chip's compiler refuses: the call by its shapes and options (its
    values do not matter), the compiler's words now, and a script that compiles it with libtpu on any
    host."""
    from rpa_harness.checks import PropertyFailure, check_compiles

    issue = known_issue_for(path)
    chip = f"TPU {backend.generation} (`{DEVICE_KINDS.get(backend.generation, '?')}`)"
    title = issue.description if issue is not None else f"does not compile for {chip}"
    try:
        check_compiles(target, backend, repro.arrays, repro.options)
        refusal = "it compiles now: the repro no longer shows the issue"
    except PropertyFailure as failure:
        refusal = str(failure)
    case = repro.case.describe() if repro.case is not None else "see the repro"
    program = snippet(repro, path, target.name, backend)
    return UpstreamReadyReport(
        title=f"`{target.name}.ragged_paged_attention`: {title}",
        environment=[
            *environment(repro.versions),
            f"- libtpu {_libtpu_version()}",
            f"- compiled for {chip} on a host without a TPU: jax's topology API describes the chip and libtpu "
            "compiles for it (the compiler a TPU VM runs); traced as on that chip (its device kind and TPU info "
            "emulated), so the kernel takes the chip's tuned defaults and branches",
        ],
        case_heading="The call",
        case=[
            f"Valid inputs of these shapes (the values do not matter: nothing runs): {case}",
            "",
            *(f"- `{name}`: {list(value.shape)} {value.dtype}" for name, value in repro.arrays.items()),
            f"- options: `{repro.options}`" if repro.options else "- options: none (every default)",
        ],
        outcome_heading="What the compiler says",
        outcome=code_block(refusal, language=""),
        reproduce=[
            'Needs jax with libtpu (`pip install "jax[tpu]"`; no TPU) and rpa-harness for '
            "`rpa_harness.generations`, which makes the kernel see the chip while it is traced.",
            "",
            *code_block(program.rstrip()),
        ],
        script_output=(
            _ran(program, "", lambda status, _: "compiles" if status == 0 else "refused")
            if with_script_output
            else []
        ),
        shown_path=_relative(path),
    ).markdown()


def _libtpu_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("libtpu")
    except PackageNotFoundError:
        return "not installed"


def _backend_words(name: str) -> str:
    return {
        INTERPRET: "CPU, Pallas TPU interpreter (`force_tpu_interpret_mode(InterpretParams(...))`)",
        TPU: "TPU",
    }.get(name, "CPU, generic Pallas interpreter (`force_tpu_interpret_mode(True)`)")


def _relative(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(REPO_ROOT))
    except ValueError:
        return str(path)
