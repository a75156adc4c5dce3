"""batched RPA's ``rpa-harness report``: the family's report (``tpu_inference.report``) with batched RPA's
call, whose arguments, cache layout and outputs are v3's; it ships no reference, so the report and its
script compare it with v3's ``ref_ragged_paged_attention``."""

from rpa_harness.targets import tpu_inference_batched_rpa as batched
from rpa_harness.targets.tpu_inference import kernels
from rpa_harness.targets.tpu_inference import report as family_report

# Lines of the script's loader: batched RPA's package, as the loader stubs v3's, and a stand-in for
# tpu_inference.logger (vllm's logger), which its tuned parameters import.
SCRIPT_STUBS = (
    family_report.package_stubs("experimental", "batched_rpa")
    + """\
    if "tpu_inference.logger" not in sys.modules and importlib.util.find_spec("vllm") is None:
        sys.modules["tpu_inference.logger"] = types.ModuleType("tpu_inference.logger")
        sys.modules["tpu_inference.logger"].init_logger = __import__("logging").getLogger
"""
)


def block_sizes_in_words(inputs: batched.BatchedInputs) -> str:
    decode, mixed = inputs.decode_block_sizes, inputs.mixed_block_sizes
    if decode is None:
        return "- block sizes: the kernel's own for the chip (`decode_block_sizes`/`prefill_block_sizes` not given)"
    return f"- block sizes (`configs.BlockSizes`, given): decode `{decode}`, mixed `{mixed}`"


BATCHED = family_report.ReportedKernel(
    name="tpu-inference batched RPA (experimental)",
    function="ragged_paged_attention",
    reference="ref_ragged_paged_attention",
    tuning_options=(
        "decode_block_sizes",
        "prefill_block_sizes",
        "vmem_limit_bytes",
        "chunk_prefill_size",
        "update_kv_cache",
        "kv_layout",
    ),
    cache_layout="v3's packed layout",
    **family_report.adapted(batched, batched.batched_inputs, batched.call_batched),
    block_sizes_in_words=block_sizes_in_words,
    script_options=lambda inputs: inputs.kwargs,
    off_a_tpu="no particular TPU: batched RPA reads the chip throughout, so the harness always emulates one",
    on_a_generation=(
        "TPU {generation}: batched RPA takes its layout's alignment, SMEM budget and position integers from "
        "the chip; on a CPU, rpa-harness makes the device report a TPU {generation}"
    ),
    script_stubs=SCRIPT_STUBS,
    reference_module=kernels.load_kernel_module(kernels.V3_KERNEL_MODULE),
    reference_owner="v3's",
)
