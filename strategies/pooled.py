"""The pool: a few fixed configurations, moved inside a target's capabilities, that most examples draw from
so that they share compilations; the block sizes a target that needs them gets."""

from typing import Any

from rpa_harness.spec.interface import (
    MASK_ADDED,
)
from rpa_harness.strategies.buckets import drawn_buckets
from rpa_harness.strategies.capabilities import WHOLE_SPACE, Capabilities
from rpa_harness.strategies.options import kv_pages_cap, kv_scales_paired, kv_scales_unspecified, sinks_for
from rpa_harness.strategies.shapes import kv_heads_for, make_config, page_sizes_for

# A fixed pool of compiled configurations (static config + options) that together touch every feature.
# Properties that need volume draw from it, so that hundreds of ragged layouts reuse a few compiled
# kernels; the first entry is the simplest and is what shrinking moves toward.
POOL: tuple[tuple[dict[str, Any], dict[str, Any]], ...] = (
    (dict(bucket="tiny", page_size=16, num_kv_heads=1, gqa_ratio=1, head_dim=64, q_dtype="float32",
          kv_dtype="float32"), {}),
    (dict(bucket="small", page_size=8, num_kv_heads=2, gqa_ratio=4, head_dim=128, q_dtype="float32",
          kv_dtype="float32"), dict(sliding_window=5, num_queries_per_block=8, num_kv_pages_per_block=3)),
    (dict(bucket="small", page_size=4, num_kv_heads=4, gqa_ratio=2, head_dim=64, q_dtype="bfloat16",
          kv_dtype="bfloat16"), dict(soft_cap=30.0, sm_scale=0.125)),
    (dict(bucket="small", page_size=2, num_kv_heads=2, gqa_ratio=3, head_dim=128, q_dtype="bfloat16",
          kv_dtype="float8_e4m3fn"), dict(k_scale=0.5, v_scale=2.0, q_scale=0.01, num_queries_per_block=3)),
    (dict(bucket="small", page_size=32, num_kv_heads=2, gqa_ratio=1, head_dim=256, q_dtype="float32",
          kv_dtype="float8_e5m2"), dict(mask_value=-2.0, num_kv_pages_per_block=1, num_queries_per_block=16)),
    (dict(bucket="small", page_size=64, num_kv_heads=8, gqa_ratio=1, head_dim=128, q_dtype="float32",
          kv_dtype="float32"), dict(mask_value=None, sliding_window=16, soft_cap=5.0, vmem_limit_bytes=32 * 2**20)),
    (dict(bucket="tiny", page_size=1, num_kv_heads=1, gqa_ratio=8, head_dim=64, q_dtype="float32",
          kv_dtype="bfloat16"), dict(num_queries_per_block=1, sm_scale=0.05)),
    # A quantised query scaled up 10^4 into a bfloat16 cache: where a compiler's quotient rounds otherwise
    # than IEEE's, one element moves by a bfloat16 ulp of a value near 10^4 (the oracle's query doubt).
    (dict(bucket="tiny", page_size=16, num_kv_heads=2, gqa_ratio=3, head_dim=256, q_dtype="float32",
          kv_dtype="bfloat16"), dict(q_scale=1e-4)),
    # Attention sinks from no weight to dominating the row, cycled over the q heads (pool() fits them).
    (dict(bucket="small", page_size=8, num_kv_heads=2, gqa_ratio=4, head_dim=64, q_dtype="bfloat16",
          kv_dtype="bfloat16"), dict(attention_sink=(1.0, -1e30, 5.0, 100.0, float("-inf"), -3.0, 0.0, 30.0),
                                     sliding_window=16)),
)  # fmt: skip


def _nearest(value, allowed):
    return min(allowed, key=lambda a: (abs(a - value), a))


def required_block_sizes(config: dict) -> dict:
    """Block sizes for a target that needs both given (upstream's default lookup needs a TPU)."""
    return dict(num_kv_pages_per_block=min(2, config["pages_per_seq"]), num_queries_per_block=8)


def pool(capabilities: Capabilities = WHOLE_SPACE, selection=None) -> list[tuple[dict, dict]]:
    """POOL moved inside a target's capabilities (nearest supported head_dim, page size, heads, dtypes) and
    the run's bucket ``selection``; an entry that exists only for an option the target does not take is
    left out."""
    entries = []
    for layout, opts in POOL:
        layout = dict(layout)
        if layout["kv_dtype"] not in capabilities.kv_dtypes:
            layout["kv_dtype"] = capabilities.kv_dtypes[0]
        if layout["q_dtype"] not in capabilities.q_dtypes_for(layout["kv_dtype"]):
            layout["q_dtype"] = capabilities.q_dtypes_for(layout["kv_dtype"])[0]
        layout["head_dim"] = _nearest(layout["head_dim"], capabilities.head_dims)
        layout["page_size"] = _nearest(layout["page_size"], page_sizes_for(capabilities, layout["kv_dtype"]))
        layout["num_kv_heads"] = _nearest(
            layout["num_kv_heads"], kv_heads_for(capabilities, layout["kv_dtype"])
        )
        layout["gqa_ratio"] = _nearest(layout["gqa_ratio"], capabilities.gqa_ratios)
        if layout["bucket"] not in drawn_buckets(capabilities, selection):
            layout["bucket"] = drawn_buckets(capabilities, selection)[0]
        config = make_config(**layout)
        opts = {name: value for name, value in opts.items() if name not in capabilities.options_not_taken}
        if capabilities.mask_value_meaning != MASK_ADDED:
            opts["mask_value_meaning"] = capabilities.mask_value_meaning
        if not capabilities.q_scale:
            if set(opts) == {"q_scale"}:
                continue  # an entry that exists for its quantised query
            opts.pop("q_scale", None)
        if "attention_sink" in opts:
            if not capabilities.attention_sink:
                continue  # an entry that exists for its sinks
            opts["attention_sink"] = sinks_for(opts["attention_sink"], config["num_q_heads"])
        if capabilities.needs_block_sizes:
            opts = {**required_block_sizes(config), **opts}
        if "num_kv_pages_per_block" in opts:
            opts["num_kv_pages_per_block"] = min(
                opts["num_kv_pages_per_block"], kv_pages_cap(capabilities, config)
            )
        if kv_scales_paired(capabilities, config) and ("k_scale" in opts) != ("v_scale" in opts):
            opts.pop("k_scale", None)
            opts.pop("v_scale", None)
        if kv_scales_unspecified(capabilities, config):
            opts.pop("k_scale", None)
            opts.pop("v_scale", None)
        entries.append((config, opts))
    return entries
