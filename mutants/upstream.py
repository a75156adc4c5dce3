"""Seeded bugs in upstream's kernel, each importable as a target: ``--rpa-target=mutants.upstream.NAME``.

They show that declaring upstream's known issues leaves the rest of upstream's kernel under test: each
variant is upstream's kernel file (as installed) with one patch of a mask, prefetch or online-softmax line,
exec'd as a fresh module that declares upstream's capabilities and its known issues, so a campaign against
it passes only if it misses the seeded bug (``python ci/kill_rate.py --upstream``). They live beside our
kernel's catalogue (``mutants/``) because they are the same kind of thing, built the same way: a patch that
must apply exactly once to the current source, so an upstream change of a patched line fails loudly.

Public API: ``MUTANTS``, ``BY_NAME``, ``UPSTREAM_KERNEL_FILE``, ``build(mutant)``; one module per mutant,
registered as ``mutants.upstream.NAME``.
"""

import dataclasses
import importlib.util
import sys
from pathlib import Path

from mutants import PatchError, _as_target, _exec_module
from rpa_harness.targets import upstream

UPSTREAM_PACKAGE = "jax.experimental.pallas.ops.tpu.ragged_paged_attention"
UPSTREAM_KERNEL_FILE = Path(importlib.util.find_spec(f"{UPSTREAM_PACKAGE}.kernel").origin)
# What a mutant keeps of upstream's target: its whole profile.
PROFILE = ("RPA_HARNESS_CAPABILITIES", "RPA_HARNESS_KNOWN_ISSUES", "RPA_HARNESS_CATALOGUE")


@dataclasses.dataclass(frozen=True)
class UpstreamMutant:
    name: str  # a Python identifier: the mutant runs as --rpa-target=mutants.upstream.NAME
    description: str
    original: str  # exact source text, present exactly once in upstream's kernel.py
    replacement: str


MUTANTS = (
    UpstreamMutant(
        "causal_off_by_one",
        "the causal mask also hides the diagonal: a query does not attend to its own key",
        "causal_mask = row_ids < col_ids",
        "causal_mask = row_ids <= col_ids",
    ),
    UpstreamMutant(
        "sliding_window_off_by_one",
        "the sliding window keeps one key too many (> instead of >= at its far edge)",
        "row_ids - sliding_window >= col_ids",
        "row_ids - sliding_window > col_ids",
    ),
    UpstreamMutant(
        "softmax_sum_not_rescaled",
        "online softmax: the running sum is not rescaled when the running maximum grows",
        "l_next = l_alpha + beta * l_curr",
        "l_next = l_prev + beta * l_curr",
    ),
    UpstreamMutant(
        "partial_last_page_not_fetched",
        "prefetch: pages counted with floor division, so a partial last page is fetched from the first one",
        "pages_per_seq, pl.cdiv(kv_lens_ref[seq_idx], page_size)",
        "pages_per_seq, kv_lens_ref[seq_idx] // page_size",
    ),
    UpstreamMutant(
        "last_block_prefetch_off_by_one",
        "prefetch: a sequence whose kv_len fills its last KV block exactly prefetches one block too many, "
        "and the next sequence computes its first block from it",
        "is_last_kv_blk = next_kv_blk_idx * num_kv_per_blk >= kv_len",
        "is_last_kv_blk = next_kv_blk_idx * num_kv_per_blk > kv_len",
    ),
)
BY_NAME = {mutant.name: mutant for mutant in MUTANTS}


def patched_source(mutant: UpstreamMutant) -> str:
    source = UPSTREAM_KERNEL_FILE.read_text()
    count = source.count(mutant.original)
    if count != 1:
        raise PatchError(
            f"upstream mutant {mutant.name}: its original text occurs {count} times in {UPSTREAM_KERNEL_FILE} "
            f"(expected exactly once): {mutant.original!r}. Upstream's kernel changed; update the patch in "
            "mutants/upstream.py."
        )
    return source.replace(mutant.original, mutant.replacement)


def build(mutant: UpstreamMutant):
    """The target module of one upstream mutant (not registered anywhere)."""
    module = _exec_module(
        f"{__name__}.{mutant.name}", patched_source(mutant), f"upstream mutant {mutant.name}: kernel.py"
    )
    profile = {name: getattr(upstream, name) for name in PROFILE}
    return _as_target(module, mutant, "upstream's RPA kernel", profile)


for _mutant in MUTANTS:
    _module = build(_mutant)
    sys.modules[_module.__name__] = _module
    globals()[_mutant.name] = _module
