"""The head_dim-64 kernel's ``rpa-harness report``: the family's report (``tpu_inference.report``) with this
kernel's function, reference, options and cache layout.

Its standalone script passes the block sizes the harness's call ran with, the tuned table's choice where
the harness left them to the kernel: the kernel uses given sizes exactly as it uses its table's, and the
script then needs no chip name, which tpu-inference reads through vllm (absent with ``--no-deps``: the
loader stubs the two names the table imports).
"""

from rpa_harness.targets import tpu_inference_v3_hd64 as hd64
from rpa_harness.targets.tpu_inference import report as family_report


def block_sizes_in_words(inputs: hd64.Hd64Inputs) -> str:
    pages, queries = inputs.block_sizes
    given = inputs.kwargs["num_kv_pages_per_block"] is not None
    return f"- `num_kv_pages_per_block={pages}`, `num_queries_per_block={queries}`" + (
        " (given)" if given else " (the kernel's tuned table for the chip: neither was given)"
    )


def script_options(inputs: hd64.Hd64Inputs) -> dict:
    pages, queries = inputs.block_sizes
    return dict(inputs.kwargs, num_kv_pages_per_block=pages, num_queries_per_block=queries)


# Lines of the script's loader: its tuned table imports tpu_inference.logger and tpu_inference.utils, which
# import vllm; the block sizes are given, so neither name is used.
SCRIPT_STUBS = """\
    if importlib.util.find_spec("vllm") is None:  # tpu-inference installed with --no-deps
        for name, attribute in (("tpu_inference.logger", "init_logger"), ("tpu_inference.utils", "get_device_name")):
            stub = types.ModuleType(name)
            setattr(stub, attribute, lambda *args: None)  # unused: the block sizes are given
            sys.modules.setdefault(name, stub)
"""

HD64 = family_report.ReportedKernel(
    name="tpu-inference RPA v3 hd64",
    function="ragged_paged_attention_hd64",
    reference="ref_ragged_paged_attention_hd64",
    tuning_options=(
        "num_kv_pages_per_block",
        "num_queries_per_block",
        "vmem_limit_bytes",
        "chunk_prefill_size",
    ),
    cache_layout="each KV head's K and V side by side in one 128-lane row",
    **family_report.adapted(hd64, hd64.hd64_inputs, hd64.call_hd64),
    block_sizes_in_words=block_sizes_in_words,
    script_options=script_options,
    off_a_tpu=(
        "no particular TPU: observed on a CPU device; the kernel's only chip-dependent code is its tuned "
        "table, and the script gives the block sizes, so it makes the same call on any TPU"
    ),
    on_a_generation=(
        "TPU {generation}: the block sizes are the kernel's tuned table's for that chip (the script gives "
        "them, so it makes the same call on any TPU); on a CPU, rpa-harness makes the device report a TPU "
        "{generation}"
    ),
    script_stubs=SCRIPT_STUBS,
)
