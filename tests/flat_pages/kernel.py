"""A stand-in for a third-party RPA kernel with another paged-KV API, for ``docs/targets.md``'s example.

Its API differs from upstream's the ways real kernels do: separate K and V caches, one flat page list in
which sequence ``i`` owns the pages ``page_list[cu_kv_lens[i] // page_size : cu_kv_lens[i + 1] // page_size]``
(cumulative kv lengths rounded up to whole pages), the real kv lengths in their own array, a plain integer
``num_seqs``, other option names, and validators with their own rules and messages. It computes through the
bundled kernel, converting back: what the example exercises is the adapter and its declarations, not a
second attention implementation.
"""

import math

import numpy as np

from rpa_harness import kernel as bundled
from rpa_harness.targets import layouts


def check_static(q, k_cache, v_cache, *, window=None, logit_cap=None):
    """Shape and option errors, raised by ``paged_attention`` itself."""
    if q.shape[-1] != k_cache.shape[-1]:
        raise ValueError(f"head size mismatch: q has {q.shape[-1]}, the caches {k_cache.shape[-1]}")
    if q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"{q.shape[1]} query heads cannot be grouped over {k_cache.shape[2]} KV heads")
    if window is not None and window <= 0:
        raise ValueError(f"window must be a positive number of keys, got {window}")
    if logit_cap == 0:
        raise ValueError(f"logit_cap must be non-zero, got {logit_cap}")


def check_inputs(q, k_cache, v_cache, kv_lens, page_list, cu_kv_lens, cu_q_lens, num_seqs):
    """Metadata errors, checked on the host before a call."""
    kv_lens, page_list = np.asarray(kv_lens), np.asarray(page_list)
    cu_kv_lens, cu_q_lens = np.asarray(cu_kv_lens), np.asarray(cu_q_lens)
    page_size, num_pages = k_cache.shape[1], k_cache.shape[0]
    if num_seqs > len(kv_lens):
        raise ValueError(f"num_seqs={num_seqs} exceeds the {len(kv_lens)} sequence slots")
    if cu_q_lens[num_seqs] > q.shape[0]:
        raise ValueError(
            f"the sequences hold {cu_q_lens[num_seqs]} query tokens, q has room for {q.shape[0]}"
        )
    for seq in range(num_seqs):
        q_len, kv_len = cu_q_lens[seq + 1] - cu_q_lens[seq], kv_lens[seq]
        if q_len < 0:
            raise ValueError(f"cu_q_lens decreases at sequence {seq}")
        if q_len > kv_len:
            raise ValueError(f"sequence {seq}: {q_len} queries but only {kv_len} keys")
        first, end = cu_kv_lens[seq] // page_size, cu_kv_lens[seq + 1] // page_size
        if math.ceil(kv_len / page_size) > end - first:
            raise ValueError(
                f"sequence {seq}: kv_len {kv_len} needs {math.ceil(kv_len / page_size)} pages, "
                f"the page list gives it {end - first}"
            )
        for page in range(math.ceil(kv_len / page_size)):
            if not 0 <= page_list[first + page] < num_pages:
                raise ValueError(
                    f"sequence {seq}'s page {page} is {page_list[first + page]}, outside the cache's "
                    f"{num_pages} pages"
                )


def paged_attention(
    q, k_cache, v_cache, kv_lens, page_list, cu_kv_lens, cu_q_lens, num_seqs, *, max_pages_per_seq,
    scale=1.0, window=None, logit_cap=None, mask_value=bundled.DEFAULT_MASK_VALUE, k_scale=None,
    v_scale=None, pages_per_block=None, queries_per_block=None, vmem_bytes=None,
):  # fmt: skip
    """Attention of sequence ``i < num_seqs``'s queries ``q[cu_q_lens[i]:cu_q_lens[i + 1]]`` over its
    ``kv_lens[i]`` keys. ``max_pages_per_seq`` (static) bounds any sequence's pages."""
    check_static(q, k_cache, v_cache, window=window, logit_cap=logit_cap)
    page_size = k_cache.shape[1]
    table = layouts.page_table_from_flat(
        page_list, np.asarray(cu_kv_lens) // page_size, pages_per_seq=max_pages_per_seq
    )
    return bundled.ragged_paged_attention(
        q, layouts.combine_kv(k_cache, v_cache), kv_lens, table, cu_q_lens, np.array([num_seqs], np.int32),
        sm_scale=scale, sliding_window=window, soft_cap=logit_cap, mask_value=mask_value, k_scale=k_scale,
        v_scale=v_scale, num_kv_pages_per_block=pages_per_block, num_queries_per_block=queries_per_block,
        vmem_limit_bytes=vmem_bytes,
    )  # fmt: skip
