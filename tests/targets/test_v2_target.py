"""tpu-inference's RPA v2 target: its kernel is upstream's (the reason its profile is upstream's), it
matches the oracle on both interpreters and under emulation, and upstream's findings reproduce on it."""

import dataclasses
import io
import tokenize
from pathlib import Path

import pytest

from rpa_harness import repro as repro_files
from rpa_harness import targets
from rpa_harness.checks import PropertyFailure, check_differential, recheck
from rpa_harness.device import FAST_INTERPRET, INTERPRET, Backend
from rpa_harness.run_settings import for_repro
from rpa_harness.targets import tpu_inference_v2 as v2target
from rpa_harness.targets import upstream
from tests.cases import MIXED, skip_without_tpu_inference

skip_without_tpu_inference(module_level=True)
TARGET = targets.load(targets.V2_TARGET)
# Where v2's kernel differs from jax's, token by token: its own cdiv and memory-space spelling, and one
# masked store written as a read, a jnp.where and a store (the same values). Anything else: revisit the
# profile, which is upstream's because the kernels are the same.
KNOWN_DIFFERENCES = {
    ("", "import jax . numpy as jnp"),
    ("import jax . numpy as jnp", ""),
    ("pl .", ""),
    ("pltpu . store ( ref , val ,", ""),
    ("", "ref [ ... ] = jnp . where ( mask , val , ref [ ... ]"),
    ("", "cdiv ( a , b ) : assert b != 0 return ( a + b - 1 ) // b def"),
    ("functools . partial (", ""),
    (",", "("),
    (",", ""),
    ("", ". MemorySpace"),
}


def _tokens(path: str) -> list[str]:
    layout = {tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.COMMENT}
    source = Path(path).read_text()
    return [t.string for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type not in layout]


def test_v2s_kernel_is_upstreams_but_for_spelling_and_one_masked_store():
    import difflib

    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as jax_kernel

    ours, theirs = _tokens(jax_kernel.__file__), _tokens(v2target.kernel().__file__)
    matcher = difflib.SequenceMatcher(None, ours, theirs, autojunk=False)
    differences = {
        (" ".join(ours[i1:i2]), " ".join(theirs[j1:j2]))
        for op, i1, i2, j1, j2 in matcher.get_opcodes()
        if op != "equal"
    }
    assert differences <= KNOWN_DIFFERENCES, differences - KNOWN_DIFFERENCES


@pytest.mark.parametrize(
    "backend",
    [Backend(FAST_INTERPRET), Backend(INTERPRET), Backend(FAST_INTERPRET, generation="v6e")],
    ids=lambda b: b.label,
)
def test_v2_matches_the_oracle(backend):
    """A mixed batch (a chunk across query blocks, a decode, a prefill); on v6e the block sizes are left
    to the tuned table v2 reads (jax's)."""
    case = dataclasses.replace(MIXED, head_dim=128)
    if backend.has_tpu_generation:
        case = dataclasses.replace(case, num_kv_pages_per_block=None, num_queries_per_block=None)
    check_differential(TARGET, backend, case.arrays(), case.options())


@pytest.mark.parametrize("issue", upstream.RPA_HARNESS_CATALOGUE, ids=lambda issue: issue.name)
def test_upstreams_findings_reproduce_on_v2(issue):
    repro = repro_files.read(issue.repro)
    run = for_repro(repro, target=targets.V2_TARGET)
    if run.backends[0].skip_reason:  # a compile finding where the TPU compiler is not installed
        pytest.skip(f"{issue.name}: {run.backends[0].skip_reason}")
    with pytest.raises(PropertyFailure) as failure:
        recheck(run.target, run.backends[0], repro)
    assert issue.shows(str(failure.value)), str(failure.value)


def test_v2s_profile_is_upstreams():
    assert TARGET.capabilities == upstream.RPA_HARNESS_CAPABILITIES
    assert {issue.name for issue in TARGET.known_issues} == set(upstream.RPA_HARNESS_KNOWN_ISSUES)
    assert TARGET.version.endswith("(RPA v2)") and not TARGET.own_rules
