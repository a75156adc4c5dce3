"""Input validation for ragged paged attention.

Every check upstream (``jax.experimental.pallas.ops.tpu.ragged_paged_attention``) makes is made here, in
the same order and with the same message, character for character, so that a caller cannot tell the two
validators apart on the inputs upstream rejects. Where upstream raises a bare ``AssertionError`` or accepts
an input that makes the kernel read out of bounds or loop forever, this module raises a ``ValueError`` that
names the argument, the value and the rule (the README lists each difference).

``static_validate_inputs`` looks only at shapes, dtypes and Python options (it runs at trace time);
``dynamic_validate_inputs`` also reads the metadata arrays (call it eagerly, outside ``jax.jit``).
"""

import jax.numpy as jnp
import numpy as np

DEFAULT_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


def _check_scale(name, value):
    if value is not None and not isinstance(value, float):
        raise ValueError(
            f"{name}={value!r} must be a Python float or None, got {type(value).__name__}; "
            f"pass float({name}) instead."
        )


def static_validate_inputs(
    q,  # [max_num_batched_tokens, num_q_heads, head_dim]
    kv_pages,  # [total_num_pages, page_size, num_combined_kv_heads, head_dim]
    kv_lens,  # i32[max_num_seqs]
    page_indices,  # i32[max_num_seqs, pages_per_seq]
    cu_q_lens,  # i32[max_num_seqs + 1]
    num_seqs,  # i32[1]
    *,
    sm_scale: float | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    mask_value: float | None = None,
    k_scale: float | None = None,
    v_scale: float | None = None,
    num_kv_pages_per_block: int | None = None,
    num_queries_per_block: int | None = None,
    vmem_limit_bytes: int | None = None,
):
    """Checks what is known at trace time; raises ValueError on the first violation."""
    del sm_scale, mask_value  # Any value is allowed.
    _, num_q_heads, head_dim = q.shape
    _, _, num_combined_kv_heads, head_dim_k = kv_pages.shape
    if num_combined_kv_heads % 2 != 0:
        raise ValueError(
            f"kv_pages.shape[2]={num_combined_kv_heads} (num_combined_kv_heads) must be even: K and V "
            "heads are interleaved, so it holds 2 * num_kv_heads."
        )
    _check_scale("k_scale", k_scale)
    _check_scale("v_scale", v_scale)
    num_kv_heads = num_combined_kv_heads // 2
    max_num_seqs, pages_per_seq = page_indices.shape
    if num_seqs.shape != (1,):
        raise ValueError(f"{num_seqs.shape=} must be (1,)")
    if head_dim_k != head_dim:
        raise ValueError(f"Q head_dim {head_dim} must be the same as that of K/V {head_dim_k}.")
    if kv_lens.shape != (max_num_seqs,):
        raise ValueError(
            f"Expected {kv_lens.shape=} to be ({max_num_seqs},) where"
            " `max_num_seqs` is `page_indices.shape[0]`."
        )
    if cu_q_lens.shape != (max_num_seqs + 1,):
        raise ValueError(
            f"Expected {cu_q_lens.shape=} to be ({max_num_seqs + 1},)  where"
            " `max_num_seqs` is `page_indices.shape[0]`."
        )
    if any(a.dtype != jnp.int32 for a in (kv_lens, page_indices, cu_q_lens)):
        raise ValueError(
            "The dtype of `kv_lens`, `page_indices`, and `cu_q_lens` must be"
            f" int32. Got {kv_lens.dtype=}, {page_indices.dtype=},"
            f" {cu_q_lens.dtype=}."
        )
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(f"{num_q_heads=} must be divisible by {num_kv_heads=}")
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"{sliding_window=} must be positive.")
    if soft_cap is not None and soft_cap == 0.0:
        raise ValueError(f"{soft_cap=} must not be 0.0.")
    if num_kv_pages_per_block is not None and not 0 < num_kv_pages_per_block <= pages_per_seq:
        raise ValueError(f"{num_kv_pages_per_block=} must be in range (0, {pages_per_seq}].")
    if num_queries_per_block is not None and num_queries_per_block <= 0:
        raise ValueError(f"{num_queries_per_block=} must be positive.")
    if vmem_limit_bytes is not None and vmem_limit_bytes <= 0:
        raise ValueError(f"{vmem_limit_bytes=} must be positive.")


def dynamic_validate_inputs(
    q,
    kv_pages,
    kv_lens,
    page_indices,
    cu_q_lens,
    num_seqs,
    *,
    sm_scale: float | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    mask_value: float | None = None,
    k_scale: float | None = None,
    v_scale: float | None = None,
    num_kv_pages_per_block: int | None = None,
    num_queries_per_block: int | None = None,
    vmem_limit_bytes: int | None = None,
):
    """Runs the static checks, then the ones that read the metadata values.

    Decisions are taken on NumPy copies (fast); messages are rendered from the caller's own arrays, as
    upstream renders them (a jax array shows as ``Array(7, dtype=int32)``).
    """
    static_validate_inputs(
        q,
        kv_pages,
        kv_lens,
        page_indices,
        cu_q_lens,
        num_seqs,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        mask_value=mask_value,
        k_scale=k_scale,
        v_scale=v_scale,
        num_kv_pages_per_block=num_kv_pages_per_block,
        num_queries_per_block=num_queries_per_block,
        vmem_limit_bytes=vmem_limit_bytes,
    )
    max_num_batched_tokens = q.shape[0]
    total_num_pages, page_size = kv_pages.shape[:2]
    max_num_seqs, pages_per_seq = page_indices.shape
    kv_lens_np = np.asarray(kv_lens)
    cu_q_lens_np = np.asarray(cu_q_lens)
    page_indices_np = np.asarray(page_indices)
    n = int(np.asarray(num_seqs)[0])
    if n < 0:
        raise ValueError(f"{num_seqs[0]=} must be non-negative: it counts the sequences in the batch.")
    if n > max_num_seqs:
        raise ValueError(f"{num_seqs[0]=} must be less or equal to {max_num_seqs=}")
    if pages_per_seq * page_size < int(kv_lens_np.max()):
        max_kv_len = jnp.max(kv_lens)
        min_pages_per_seq = (max_kv_len + (page_size - 1)) // page_size
        raise ValueError(
            f"{pages_per_seq=} must be greater or equal to"
            f" {min_pages_per_seq=} given {max_kv_len=} and {page_size=}."
        )
    if cu_q_lens_np[n] > max_num_batched_tokens:
        raise ValueError(
            f"Total q tokens {cu_q_lens[num_seqs[0]]} must be less or equal to {max_num_batched_tokens=}."
        )
    q_lens_np = np.diff(cu_q_lens_np[: n + 1])
    for i in range(n):
        if q_lens_np[i] < 0:
            q_len = cu_q_lens[i + 1] - cu_q_lens[i]
            raise ValueError(
                f"{q_len=} must be non-negative at sequence {i}: cu_q_lens must not decrease over the"
                " first num_seqs + 1 entries."
            )
        if q_lens_np[i] > kv_lens_np[i]:
            q_len = cu_q_lens[i + 1] - cu_q_lens[i]
            kv_len = kv_lens[i]
            raise ValueError(f"{q_len=} must be less or equal to {kv_len=} at sequence {i}.")
        used = page_indices_np[i, : -(-int(kv_lens_np[i]) // page_size)]
        bad = np.flatnonzero((used < 0) | (used >= total_num_pages))
        if bad.size:
            j = int(bad[0])
            raise ValueError(
                f"page_indices[{i}, {j}]={int(used[j])} must be in [0, {total_num_pages}) "
                f"(total_num_pages): sequence {i} reads page {j} of its kv_len={int(kv_lens_np[i])}."
            )
