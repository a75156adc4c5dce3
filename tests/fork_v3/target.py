"""The harness's target for ``tests.fork_v3.kernel``, a fork of tpu-inference's v3: upstream's API mapped onto it."""

from rpa_harness.strategies import violations as shared
from rpa_harness.strategies.violations import Rule
from rpa_harness.targets import layouts
from tests.fork_v3 import kernel

RPA_HARNESS_UPDATES_CACHE = True  # ragged_paged_attention returns (attention, updated kv_pages): both judged


def ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options):
    new = layouts.split_new_tokens(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs)
    flat = layouts.flat_page_list(
        page_indices, kv_lens, num_seqs, page_size=kv_pages.shape[1], pad_to=page_indices.size, clip=True
    )
    out, cache = kernel.ragged_paged_attention(
        q, new.keys, new.values, layouts.pad_lanes(new.poisoned_cache(kv_pages)), kv_lens, flat.pages,
        flat.cu_kv_lens, cu_q_lens, layouts.distribution(new.q_lens, num_seqs), **options,
    )  # fmt: skip
    return out, layouts.unpad_lanes(cache, kv_pages.shape[-1])


# The kernel's validator (static only: it has none for the metadata): which inputs it rejects, with which message.
RPA_HARNESS_RULES = {
    "head_dim mismatch": Rule(
        "static",
        shared.break_head_dim,
        lambda q_head_dim, kv_head_dim: f"queries have head_dim {q_head_dim}, keys {kv_head_dim}",
    ),
    "heads not divisible": Rule(
        "static",
        shared.break_head_divisibility,
        lambda num_q_heads, num_kv_heads: (
            f"num_q_heads={num_q_heads} is not a multiple of num_kv_heads={num_kv_heads}"
        ),
    ),
    "sliding_window not positive": Rule(
        "static", shared.break_sliding_window, lambda value: f"sliding_window={value} must be positive"
    ),
    "soft_cap zero": Rule(
        "static", shared.break_soft_cap, lambda value: f"soft_cap={value} would divide by zero"
    ),
}
