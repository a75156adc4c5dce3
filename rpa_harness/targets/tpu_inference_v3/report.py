"""v3's upstream-ready report: the family's (``tpu_inference.report``) with v3's kernel, its reference, its
block sizes in words and what the chip means to it (``V3``)."""

from rpa_harness.targets import tpu_inference_v3 as v3
from rpa_harness.targets.tpu_inference.report import ReportedKernel, adapted
from rpa_harness.targets.tpu_inference_v3.adapter import V3Inputs


def v3_block_sizes_in_words(inputs: V3Inputs) -> str:
    given = inputs.kwargs["m_block_sizes"] is not None
    return (
        f"- block sizes `(bq, bkv, bq_chunk, bkv_chunk)`: decode `{inputs.decode_block_sizes}`, mixed "
        f"`{inputs.mixed_block_sizes}`"
        + (
            " (given)"
            if given
            else " (v3's defaults for the chip: `d_block_sizes`/`m_block_sizes` not given)"
        )
    )


V3 = ReportedKernel(
    name="tpu-inference RPA v3",
    function="ragged_paged_attention",
    reference="ref_ragged_paged_attention",
    tuning_options=(
        "d_block_sizes",
        "p_block_sizes",
        "m_block_sizes",
        "vmem_limit_bytes",
        "chunk_prefill_size",
        "update_kv_cache",
    ),
    cache_layout="v3's packed layout",
    **adapted(v3, v3.v3_inputs, v3.call_v3),
    block_sizes_in_words=v3_block_sizes_in_words,
    script_options=lambda inputs: inputs.kwargs,  # block sizes and VMEM limit as passed: None is v3's default
    off_a_tpu=(
        "no particular TPU: observed on a CPU device, where v3 sees no TPU generation (`get_tpu_version()` "
        "is -1: none of its v6-and-later branches); the block sizes and VMEM limit are given, so the script "
        "makes the same call on any TPU (from v6 on, packed queries take the int16-position branch)"
    ),
    on_a_generation=(
        "TPU {generation}: v3 takes its default block sizes, VMEM limit and generation branches from the "
        "chip, and this finding depends on them; on a CPU, rpa-harness makes the device report a TPU "
        "{generation}"
    ),
)
