"""What a tpu-inference target's profile is built from: the capabilities its family shares, the
run header, the findings declared, both outputs judged as v3's are, and a report imported when asked for.

A profile (the target package's ``__init__``) calls these with what differs and names the result as the
loader reads it (``RPA_HARNESS_*``, ``rpa_harness.targets``); docs/targets.md walks through a new one.
"""

from collections.abc import Callable

from rpa_harness.spec.interface import MASK_REPLACES
from rpa_harness.targets.tpu_inference.judging import ATTENTION_AND_CACHE, HANG
from rpa_harness.targets.tpu_inference.releases import installed_version

EVERY_BACKEND = ("interpret", "fast-interpret", "tpu")


def v3_derived_capabilities(**differs) -> dict:
    """The capabilities of an experimental kernel derived from v3 that tunes its own blocks (batched RPA,
    stacked RPA), with what ``differs``."""
    return dict(
        empty_sequences=False,  # v3's distribution: every live sequence has a query row
        mask_value_meaning=MASK_REPLACES,  # a masked logit is replaced (jnp.where), default finfo(out_dtype).min
        # q / q_scale clipped to the KV dtype's range and cast to it; logits times q_scale and k_scale;
        # v_scale multiplies P @ V, unrounded.
        q_scale=True,
        kv_scales_round_to_q_dtype=False,
        head_dims=(64, 128, 256),
        update_kv_cache=True,
        # Its own blocks fill the chip's VMEM whatever the problem size: on the interpreters the case gives
        # them; a TPU draws its own too.
        needs_block_sizes=True,
        kernel_block_sizes_on_interpreters=False,
        backends=EVERY_BACKEND,
        **differs,
    )


def latent_capabilities(value_head_dims: tuple[tuple[int, int], ...], **differs) -> dict:
    """The capabilities of a latent attention kernel (MLA v1, DeepSeek-V4's mla_swa): one KV head whose key
    is ``head_dim`` wide and whose value its first ``value_head_dim`` (``value_head_dims``: the pairs it
    runs), given block sizes and chunked prefills, with what ``differs``."""
    return dict(
        head_dims=tuple(head_dim for head_dim, _ in value_head_dims),
        value_head_dims=value_head_dims,
        num_kv_heads=(1,),  # one latent vector per token, shared by every q head
        # Both block sizes must be given: "num_kv_pages_per_block and num_queries_per_block must be
        # specified."
        needs_block_sizes=True,
        chunk_prefill_size=True,
        backends=EVERY_BACKEND,
        **differs,
    )


def version(kernel: str) -> str:
    """The run header of a target of the installed tpu-inference: the release and which ``kernel``."""
    return f"tpu-inference {installed_version()} ({kernel})"


def every_finding(catalogue: tuple) -> tuple[tuple, tuple[str, ...]]:
    """(``RPA_HARNESS_CATALOGUE``, ``RPA_HARNESS_KNOWN_ISSUES``) of a target whose findings all hold in
    every release it runs on: each catalogued, none of their cases drawn."""
    return catalogue, tuple(issue.name for issue in catalogue)


def both_outputs_judged(check: Callable) -> dict:
    """``RPA_HARNESS_PROPERTIES`` of a kernel with v3's outputs: ``check``
    (``both_outputs.checks_both_outputs``) replays its repros of both kinds, both outputs judged and a
    hang."""
    return dict.fromkeys((ATTENTION_AND_CACHE, HANG), check)


def deferred_report(reported_kernel: Callable) -> Callable:
    """``RPA_HARNESS_REPORT``: the family's report (``report.render``) of the kernel ``reported_kernel()``
    returns (a ``report.Reported``), both imported when a report is asked for, not with the target: a
    reported kernel loads its kernel module (tpu-inference), which a target that only draws cases needs not."""

    def report(*args, **kwargs):
        # The report's own modules (its sections, the script's runner) come with a report, not with a target.
        from rpa_harness.targets.tpu_inference.report import render

        return render(reported_kernel(), *args, **kwargs)

    return report
