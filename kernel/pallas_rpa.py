"""Ragged paged attention as a Pallas TPU kernel, with upstream's API and semantics.

Layout of the computation
-------------------------
Grid: ``(num_head_blocks, num_query_blocks)``. A grid step owns ``block_q`` consecutive query tokens (rows of
``q``) and one block of heads: ``kv_heads_per_block`` KV heads and the ``group`` query heads of each
(``group = num_q_heads // num_kv_heads``). Both grid axes are independent ("parallel"): a step keeps no state
for the next one, and every DMA it starts it also waits for.

Within a step, the sequences whose query rows overlap the block are visited in order (the first one is
precomputed per query block outside the kernel). For each such sequence, its KV pages are visited in blocks
of ``kv_pages_per_block`` pages: the pages of a block are gathered from HBM by one async DMA per page into one
of two VMEM slots, and the DMAs of the next block (of this sequence, or of the next sequence with work)
are started before the current block is waited for, so the copy overlaps the computation. A page is copied
only if it holds keys of the sequence (``page < cdiv(kv_len, page_size)``, never past ``pages_per_seq``):
page-table entries past that point, and rows of padding sequences, are never dereferenced. A block's
copies are waited for together (a DMA semaphore counts bytes): one wait per power of two in the page
count, so a block of ``n`` pages costs ``popcount(n)`` waits instead of ``n``. A sequence's metadata is
read from SMEM once and carried through the loop. Both matter most in the TPU interpreter, where every
SMEM read, VMEM access and DMA is a host callback.

The page table stays in HBM: SMEM holds 1 MiB on every TPU, and a serving-sized table (256 sequences of
2048 pages) is 2 MiB. Before a block's page copies are started, the page-table entries of the block are
copied into a small SMEM window (and waited for: the copies read them): the 128-entry tiles of the flat
table that hold them, clamped to end within the table, so its size does not depend on the table's. Other
entries of the window are copied as numbers only, never dereferenced. One window serves both slots, since
the entries are read only while a block's copies are started.

Per KV block, every query row of the block is scored against every key (each row belongs to at most one
sequence; rows of other sequences are computed and then discarded with ``jnp.where``), and an online softmax
state (running max ``m``, normaliser ``l``, unnormalised output ``acc``, all float32 VMEM scratch) is updated
for the rows of the current sequence only (``m`` and ``l`` share one scratch buffer, so one load and one
store each). The output block is ``acc / l``, written once at the end of the step.

The options that only weigh numbers (``sm_scale``, ``soft_cap``, ``mask_value``, ``k_scale``, ``v_scale``,
``sliding_window``) reach the kernel as run-time scalars in SMEM, so calls that differ only in their values
share one compilation; whether each is None stays static, since it changes the computation. The block
sizes and ``vmem_limit_bytes`` decide shapes and stay static.

Query heads are folded into rows: for KV head ``h`` the matmul operand is ``[block_q * group, head_dim]``
with row ``r`` holding token ``r // group``, query head ``h * group + r % group``.

What the TPU interpreter cannot run (reshaping or bitcasting a ref, masked loads and stores) is avoided by
loading whole blocks as values and reshaping, slicing and masking the values.
"""

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src import config as jax_config
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.extend.core import Primitive
from jax.interpreters import mlir

from rpa_harness.spec.interface import Options, static_validate_inputs, takes_options

# Lane width of the m / l scratch rows: Mosaic keeps per-row statistics broadcast over a full vreg row.
_STAT_LANES = 128
# Default block sizes aim at about this many folded query rows and keys per block ...
_TARGET_ROWS_PER_BLOCK = 1024
_TARGET_KEYS_PER_BLOCK = 512
# ... while the double-buffered KV scratch stays under this many bytes of VMEM.
_KV_BUFFER_BUDGET_BYTES = 4 * 1024 * 1024
# Without a vmem_limit_bytes from the caller, the kernel may use this share of the chip's VMEM: the
# compiler's default scoped limit (16 MiB on v5e) is smaller than what block sizes a caller may pass need
# (128 pages of 32 float32 keys at head_dim 256 take 16 MiB of KV buffers alone).
_DEFAULT_VMEM_SHARE = 0.75

_CPU_WITHOUT_INTERPRET_MESSAGE = (
    "ragged_paged_attention is a Pallas TPU kernel and is being compiled for the CPU backend outside "
    "interpret mode. Run it on a TPU, or on CPU trace and call it inside "
    "`with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):` (TPU interpreter, checks memory "
    "accesses) or `with pltpu.force_tpu_interpret_mode(True):` (generic interpreter, faster, checks nothing)."
)

# An identity on q that refuses to be lowered for CPU: it makes a call on CPU outside interpret mode fail
# with one clear message at compile time, while tracing and lowering for TPU (e.g. from a CPU host) work.
_requires_tpu_or_interpreter_p = Primitive("rpa_requires_tpu_or_interpreter")
_requires_tpu_or_interpreter_p.def_abstract_eval(lambda aval: aval)


def _refuse_cpu_lowering(ctx, x):
    del ctx, x
    raise RuntimeError(_CPU_WITHOUT_INTERPRET_MESSAGE)


mlir.register_lowering(_requires_tpu_or_interpreter_p, lambda ctx, x: [x])
mlir.register_lowering(_requires_tpu_or_interpreter_p, _refuse_cpu_lowering, platform="cpu")


# A 1-D int32 array in HBM is tiled in runs of this many entries: a DMA of the page table starts at a tile
# boundary and spans whole tiles.
_PAGE_TABLE_TILE = 128


def _page_table_window_size(kv_pages_per_block, pages_per_seq, padded_table_size) -> int:
    """Entries of the SMEM window: whole tiles covering a KV block's entries wherever they start in a tile
    (a block never holds more than ``pages_per_seq`` pages), or the whole table if that is smaller."""
    entries = min(kv_pages_per_block, pages_per_seq) + _PAGE_TABLE_TILE - 1
    return min(pl.cdiv(entries, _PAGE_TABLE_TILE) * _PAGE_TABLE_TILE, padded_table_size)


# Options read at run time: floats in one f32 SMEM row, integers in one i32 row (in this order).
_RUNTIME_FLOAT_OPTIONS = ("sm_scale", "soft_cap", "mask_value", "k_scale", "v_scale")
_RUNTIME_INT_OPTIONS = ("sliding_window",)


class _AtRunTime:
    """Stands for a set run-time option in the compiled kernel's static options (one compilation for all
    its values)."""

    def __repr__(self):
        return "<at run time>"


_AT_RUN_TIME = _AtRunTime()


def _split_options(options: Options) -> tuple[Options, np.ndarray, np.ndarray]:
    """(static options, f32 values, i32 values): each set run-time option replaced by ``_AT_RUN_TIME``."""

    def value(name):
        return 0 if getattr(options, name) is None else getattr(options, name)

    # Any: the sentinel stands in fields typed for the values it replaces.
    at_run_time: dict[str, Any] = {
        name: None if getattr(options, name) is None else _AT_RUN_TIME
        for name in _RUNTIME_FLOAT_OPTIONS + _RUNTIME_INT_OPTIONS
    }
    static = dataclasses.replace(options, **at_run_time)
    floats = np.array([value(name) for name in _RUNTIME_FLOAT_OPTIONS], np.float32)
    ints = np.array([value(name) for name in _RUNTIME_INT_OPTIONS], np.int32)
    return static, floats, ints


def _interpret_mode_forced() -> bool:
    """True under ``pltpu.force_tpu_interpret_mode(...)`` (either interpreter); read at trace time."""
    return bool(jax_config.pallas_tpu_interpret_mode_context_manager.value)


def _sublane_tile(dtype) -> int:
    """Rows of ``dtype`` in one (8 x 32-bit) sublane tile: 8 for float32, 16 for bfloat16, 32 for fp8."""
    return 8 * (4 // jnp.dtype(dtype).itemsize)


def kv_heads_per_head_block(num_q_heads, num_kv_heads, q_dtype, kv_dtype) -> int:
    """Smallest number of KV heads per grid step whose q and K/V head slices are whole sublane tiles.

    A head block must either cover all heads or slice the q block and the combined K/V head axis (both
    second-minor dimensions on TPU) at tile boundaries; when no smaller block does, all heads form one block.
    """
    group = num_q_heads // num_kv_heads
    for kv_heads in range(1, num_kv_heads):
        if (
            num_kv_heads % kv_heads == 0
            and (2 * kv_heads) % _sublane_tile(kv_dtype) == 0
            and (kv_heads * group) % _sublane_tile(q_dtype) == 0
        ):
            return kv_heads
    return num_kv_heads


def default_num_queries_per_block(num_tokens, num_q_heads_per_block) -> int:
    """About ``_TARGET_ROWS_PER_BLOCK`` folded rows, never more queries than there are tokens."""
    return max(1, min(num_tokens, _TARGET_ROWS_PER_BLOCK // num_q_heads_per_block))


def default_num_kv_pages_per_block(
    page_size, pages_per_seq, num_combined_heads_per_block, head_dim, kv_dtype
):
    """About ``_TARGET_KEYS_PER_BLOCK`` keys per block, within the KV buffer budget and ``pages_per_seq``."""
    bytes_per_key = 2 * num_combined_heads_per_block * head_dim * jnp.dtype(kv_dtype).itemsize
    max_keys = min(_TARGET_KEYS_PER_BLOCK, _KV_BUFFER_BUDGET_BYTES // bytes_per_key)
    return max(1, min(pages_per_seq, max_keys // page_size))


def default_vmem_limit_bytes() -> int | None:
    """The scoped VMEM limit when the caller gives none: ``_DEFAULT_VMEM_SHARE`` of the chip's VMEM; None
    (the compiler's default) in interpret mode, where no chip is asked."""
    if _interpret_mode_forced():
        return None
    try:
        capacity = pltpu.get_tpu_info().vmem_capacity_bytes
    except ValueError:  # not a TPU (a CPU device outside interpret mode): the call is refused as such
        return None
    return int(capacity * _DEFAULT_VMEM_SHARE)


def vmem_bound_bytes(
    block_q, q_heads_per_block, kv_pages_per_block, page_size, kv_heads_per_block, head_dim, q_dtype, kv_dtype
) -> int:
    """An upper bound of the VMEM a grid step takes: the double-buffered q and output blocks and KV slots,
    the float32 statistics and accumulator, the float32 copy of a KV block, and per KV head (the loop is
    unrolled) its K and V in float32 and its logits and probabilities."""
    keys = kv_pages_per_block * page_size
    rows = block_q * (q_heads_per_block // kv_heads_per_block)
    q_bytes = jnp.dtype(q_dtype).itemsize
    kv_block = keys * 2 * kv_heads_per_block * head_dim
    blocks = (
        4 * block_q * q_heads_per_block * head_dim * q_bytes + 2 * kv_block * jnp.dtype(kv_dtype).itemsize
    )
    state = kv_heads_per_block * rows * (2 * _STAT_LANES + head_dim) * 4
    per_head = (2 * keys * head_dim + 2 * rows * keys) * 4
    return blocks + state + 4 * kv_block + kv_heads_per_block * per_head


def blocks_within_vmem(block_q, kv_pages_per_block, limit, **shapes) -> tuple[int, int]:
    """The block sizes, the KV block (then the query block) halved until ``vmem_bound_bytes`` fits ``limit``.

    Block sizes only order the work (every one gives the same attention), so a given one is an upper
    bound on a chip: a caller's KV block of 128 pages of 32 float32 keys at head_dim 256 with 4 KV heads
    takes over 200 MiB, more than any TPU's VMEM. Unchanged where ``limit`` is None (interpret mode, no
    limit given)."""
    if limit is None:
        return block_q, kv_pages_per_block
    while (
        kv_pages_per_block > 1
        and vmem_bound_bytes(block_q, kv_pages_per_block=kv_pages_per_block, **shapes) > limit
    ):
        kv_pages_per_block //= 2
    while block_q > 1 and vmem_bound_bytes(block_q, kv_pages_per_block=kv_pages_per_block, **shapes) > limit:
        block_q //= 2
    return block_q, kv_pages_per_block


def _matmul_dtype(q_dtype, kv_dtype, scaled):
    """Operand dtype of q @ K^T: q's dtype for scaled K (cast to it), else the wider of q and K.

    Every conversion into this dtype is exact (fp8 and bfloat16 values are bfloat16 and float32 values), so
    unscaled fp8 K is merely upcast, as in upstream's promotion.
    """
    if scaled or jnp.dtype(q_dtype) == jnp.float32:
        return jnp.dtype(q_dtype)
    return jnp.dtype(jnp.float32) if jnp.dtype(kv_dtype) == jnp.float32 else jnp.dtype(jnp.bfloat16)


def _product_precision(operand_dtype):
    """HIGHEST for float32 operands: at DEFAULT a TPU multiplies them in one bfloat16 pass (operands rounded
    to bfloat16), which the kernel's float32 promise excludes; narrower operands are exact in that pass."""
    return lax.Precision.HIGHEST if jnp.dtype(operand_dtype) == jnp.float32 else None


class _SeqLayout(NamedTuple):
    """Where one sequence's rows and keys are (read from SMEM once per sequence and carried)."""

    seq_index: jax.Array  # clamped into [0, max_num_seqs): every SMEM read stays in bounds
    q_start: jax.Array
    q_end: jax.Array
    kv_len: jax.Array
    num_pages: jax.Array  # resident pages: cdiv(kv_len, page_size), at most pages_per_seq


def _rpa_kernel(
    # Scalar prefetch (SMEM).
    kv_lens_ref,  # i32[max_num_seqs]
    cu_q_lens_ref,  # i32[max_num_seqs + 1]
    num_seqs_ref,  # i32[1], clamped to [0, max_num_seqs]
    first_seq_ref,  # i32[num_query_blocks]: no sequence before it has rows in the block
    float_options_ref,  # f32[len(_RUNTIME_FLOAT_OPTIONS)]
    int_options_ref,  # i32[len(_RUNTIME_INT_OPTIONS)]
    # Inputs.
    q_ref,  # [block_q, q_heads_per_block, head_dim] (VMEM block)
    kv_hbm_ref,  # [total_num_pages, page_size, 2 * num_kv_heads, head_dim] (HBM)
    page_indices_hbm_ref,  # i32[whole tiles], row-major page table padded with zeros (HBM)
    # Output.
    o_ref,  # [block_q, q_heads_per_block, head_dim] (VMEM block)
    # Scratch.
    kv_buf,  # [2, kv_pages_per_block, page_size, 2 * kv_heads_per_block, head_dim]: two DMA slots
    sems,  # DMA semaphores, one per slot
    page_table_window_ref,  # i32[window_size] (SMEM): the page-table tiles holding one KV block's entries
    page_indices_sem,  # DMA semaphore of the page-index copy
    stats_ref,  # f32[2, kv_heads_per_block, block_q * group, _STAT_LANES]: running max m, normaliser l
    acc_ref,  # f32[kv_heads_per_block, block_q * group, head_dim]: unnormalised output
    *,
    pages_per_seq,
    options,  # Options.semantics() with the set run-time options _AT_RUN_TIME
):
    def runtime_option(name):
        """The option's value (a scalar read from SMEM once per grid step), or None if it is not set."""
        if getattr(options, name) is None:
            return None
        if name in _RUNTIME_INT_OPTIONS:
            return int_options_ref[_RUNTIME_INT_OPTIONS.index(name)]
        return float_options_ref[_RUNTIME_FLOAT_OPTIONS.index(name)]

    sm_scale, sliding_window, soft_cap = map(runtime_option, ("sm_scale", "sliding_window", "soft_cap"))
    mask_value, k_scale, v_scale = map(runtime_option, ("mask_value", "k_scale", "v_scale"))
    block_q, q_heads_per_block, head_dim = q_ref.shape
    _, kv_pages_per_block, page_size, combined_heads_per_block, _ = kv_buf.shape
    kv_heads_per_block = combined_heads_per_block // 2
    group = q_heads_per_block // kv_heads_per_block
    num_rows = block_q * group
    keys_per_block = kv_pages_per_block * page_size
    window_size = page_table_window_ref.shape[0]
    max_num_seqs = kv_lens_ref.shape[0]

    head_block = pl.program_id(0)
    query_block = pl.program_id(1)
    block_start = query_block * block_q
    block_end = block_start + block_q
    num_seqs = num_seqs_ref[0]
    # The K/V heads this step copies. With one head block that is the whole axis, sliced statically: a
    # dynamic offset into a tiled axis must be provably tile-aligned, and Mosaic cannot prove 0 * width
    # aligned to the cache's tile (4 rows of fp8), so one KV head of fp8 would not compile.
    if combined_heads_per_block == kv_hbm_ref.shape[2]:
        kv_heads_slice = pl.ds(0, combined_heads_per_block)
    else:
        head_start = pl.multiple_of(head_block * combined_heads_per_block, combined_heads_per_block)
        kv_heads_slice = pl.ds(head_start, combined_heads_per_block)

    def seq_layout(seq) -> _SeqLayout:
        s = jnp.clip(seq, 0, max_num_seqs - 1)
        kv_len = kv_lens_ref[s]
        num_pages = jnp.clip((kv_len + page_size - 1) // page_size, 0, pages_per_seq)
        return _SeqLayout(s, cu_q_lens_ref[s], cu_q_lens_ref[s + 1], kv_len, num_pages)

    def in_block(seq, layout):
        """``seq`` is a real sequence that does not start after this query block."""
        return jnp.logical_and(seq < num_seqs, layout.q_start < block_end)

    def has_work(layout):
        q_start, q_end = layout.q_start, layout.q_end
        rows_overlap = jnp.maximum(q_start, block_start) < jnp.minimum(q_end, block_end)
        return jnp.logical_and(rows_overlap, layout.num_pages > 0)

    def next_seq_with_work(seq):
        """(seq, layout) of the first sequence from ``seq`` on with rows here and keys, or of one for which
        ``in_block`` is False."""
        return lax.while_loop(
            lambda state: jnp.logical_and(in_block(*state), jnp.logical_not(has_work(state[1]))),
            lambda state: (state[0] + 1, seq_layout(state[0] + 1)),
            (seq, seq_layout(seq)),
        )

    def pages_in_block(layout, kv_block):
        """Resident pages of the sequence in KV block ``kv_block``: the ones copied (no other is read)."""
        return jnp.clip(layout.num_pages - kv_block * kv_pages_per_block, 0, kv_pages_per_block)

    def start_copies(layout, kv_block, slot):
        """One DMA per resident page of the block into ``slot``, after copying a window of the page table
        that holds the block's entries into SMEM (other entries in the window are never read as pages).

        The entries are read only here, so one SMEM window serves both slots. The window starts at a tile of
        the table, clamped so that it ends within the table (it then still starts at or before the block's
        first entry, since the block's resident pages end within the table).
        """
        first_entry = layout.seq_index * pages_per_seq + kv_block * kv_pages_per_block
        window_start = jnp.minimum(
            first_entry // _PAGE_TABLE_TILE * _PAGE_TABLE_TILE, page_indices_hbm_ref.shape[0] - window_size
        )
        window_start = pl.multiple_of(window_start, _PAGE_TABLE_TILE)
        index_copy = pltpu.make_async_copy(
            page_indices_hbm_ref.at[pl.ds(window_start, window_size)], page_table_window_ref, page_indices_sem
        )
        index_copy.start()
        index_copy.wait()
        window_offset = first_entry - window_start

        def start_page_copy(i, carry):
            page = page_table_window_ref[window_offset + i]
            pltpu.make_async_copy(
                kv_hbm_ref.at[page, :, kv_heads_slice, :],
                kv_buf.at[slot, i],
                sems.at[slot],
            ).start()
            return carry

        lax.fori_loop(0, pages_in_block(layout, kv_block), start_page_copy, 0)

    def wait_copies(layout, kv_block, slot):
        """Waits for all the page copies into ``slot`` at once.

        A DMA semaphore counts bytes, so the wait needs only a descriptor of the same total size: the page
        count is split into powers of two, each waited for with a descriptor of that many pages of the slot.
        """
        num_pages = pages_in_block(layout, kv_block)
        for bit in range(kv_pages_per_block.bit_length()):
            chunk = kv_buf.at[slot, pl.ds(0, 1 << bit)]

            @pl.when(num_pages & (1 << bit) != 0)
            def _(chunk=chunk):
                pltpu.make_async_copy(chunk, chunk, sems.at[slot]).wait()

    # Queries of each KV head, folded to rows (loaded once per grid step; Mosaic folds 16-bit values only
    # when group fills whole packed rows, so such q is widened first, which is exact).
    compute_q_dtype = q_ref.dtype
    if jnp.dtype(q_ref.dtype).itemsize < 4 and group % (4 // jnp.dtype(q_ref.dtype).itemsize):
        compute_q_dtype = jnp.float32
    qk_dtype = _matmul_dtype(compute_q_dtype, kv_buf.dtype, k_scale is not None)
    q_rows = [
        q_ref[:, pl.ds(h * group, group), :]
        .astype(compute_q_dtype)
        .reshape(num_rows, head_dim)
        .astype(qk_dtype)
        for h in range(kv_heads_per_block)
    ]
    row_token = block_start + lax.broadcasted_iota(jnp.int32, (num_rows, 1), 0) // group

    stat_index = lax.broadcasted_iota(jnp.int32, stats_ref.shape, 0)
    stats_ref[...] = jnp.where(stat_index == 0, -jnp.inf, 0.0).astype(jnp.float32)  # m = -inf, l = 0
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def attend(layout, kv_block, slot):
        """Online-softmax update of this sequence's rows with the keys of one KV block (in ``slot``)."""
        q_start, q_end, kv_len = layout.q_start, layout.q_end, layout.kv_len
        first_key = kv_block * keys_per_block
        # Keys past kv_len (page tails, pages not copied) hold anything, NaN included: they are zeroed in K
        # and V and get probability 0, so they cannot reach a row even through 0 * NaN.
        num_valid_keys = jnp.minimum(kv_len, layout.num_pages * page_size) - first_key
        key_valid_col = lax.broadcasted_iota(jnp.int32, (keys_per_block, 1), 0) < num_valid_keys
        key_pos = first_key + lax.broadcasted_iota(jnp.int32, (1, keys_per_block), 1)
        key_valid = key_pos < first_key + num_valid_keys
        query_pos = kv_len - (q_end - q_start) + (row_token - q_start)  # [rows, 1]
        row_in_seq = jnp.logical_and(row_token >= q_start, row_token < q_end)
        masked = key_pos > query_pos
        if sliding_window is not None:
            masked = jnp.logical_or(masked, query_pos - sliding_window >= key_pos)
        mask_bias = jnp.where(masked, jnp.float32(mask_value), jnp.float32(0.0))

        kv = kv_buf[slot].astype(jnp.float32)
        kv = kv.reshape(keys_per_block, combined_heads_per_block, head_dim)
        stats, acc_all = stats_ref[...], acc_ref[...]
        m_all, l_all = stats[0], stats[1]
        m_new_all, l_new_all, acc_new_all = [], [], []
        for h in range(kv_heads_per_block):
            k = kv[:, 2 * h, :]
            v = kv[:, 2 * h + 1, :]
            if k_scale is not None:
                k = (k * k_scale).astype(q_ref.dtype)
            if v_scale is not None:
                v = (v * v_scale).astype(q_ref.dtype).astype(jnp.float32)
            k = jnp.where(key_valid_col, k.astype(jnp.float32), 0.0).astype(qk_dtype)
            v = jnp.where(key_valid_col, v, 0.0)

            logits = lax.dot_general(
                q_rows[h],
                k,
                (((1,), (1,)), ((), ())),
                precision=_product_precision(qk_dtype),
                preferred_element_type=jnp.float32,
            )
            logits = logits * sm_scale
            if soft_cap is not None:
                logits = soft_cap * jnp.tanh(logits / soft_cap)
            logits = jnp.where(key_valid, logits + mask_bias, -jnp.inf)

            m_prev = m_all[h][:, :1]
            l_prev = l_all[h][:, :1]
            m_new = jnp.maximum(m_prev, jnp.max(logits, axis=1, keepdims=True))
            probs = jnp.exp(logits - m_new)
            rescale = jnp.exp(m_prev - m_new)
            l_new = rescale * l_prev + jnp.sum(probs, axis=1, keepdims=True)
            acc_new = rescale * acc_all[h] + jnp.dot(
                probs, v, precision=_product_precision(v.dtype), preferred_element_type=jnp.float32
            )

            m_new_all.append(jnp.where(row_in_seq, jnp.broadcast_to(m_new, m_all[h].shape), m_all[h]))
            l_new_all.append(jnp.where(row_in_seq, jnp.broadcast_to(l_new, l_all[h].shape), l_all[h]))
            acc_new_all.append(jnp.where(row_in_seq, acc_new, acc_all[h]))
        stats_ref[...] = jnp.stack([jnp.stack(m_new_all), jnp.stack(l_new_all)])
        acc_ref[...] = jnp.stack(acc_new_all)

    # Work items are (sequence, KV block) pairs in order; the loop carries the current one, its layout and
    # its slot.
    def step(state):
        seq, layout, kv_block, slot = state
        num_kv_blocks = (layout.num_pages + kv_pages_per_block - 1) // kv_pages_per_block
        next_seq, next_layout, next_kv_block = lax.cond(
            kv_block + 1 < num_kv_blocks,
            lambda: (seq, layout, kv_block + 1),
            lambda: (*next_seq_with_work(seq + 1), jnp.int32(0)),
        )
        next_slot = 1 - slot

        @pl.when(in_block(next_seq, next_layout))
        def _():
            start_copies(next_layout, next_kv_block, next_slot)

        wait_copies(layout, kv_block, slot)
        attend(layout, kv_block, slot)
        return next_seq, next_layout, next_kv_block, next_slot

    first_seq, first_layout = next_seq_with_work(first_seq_ref[query_block])

    @pl.when(in_block(first_seq, first_layout))
    def _():
        start_copies(first_layout, 0, 0)

    lax.while_loop(
        lambda state: in_block(state[0], state[1]),
        step,
        (first_seq, first_layout, jnp.int32(0), jnp.int32(0)),
    )

    # Rows of no sequence have l == 0 and acc == 0; dividing by 1 keeps them finite.
    l_all, acc_all = stats_ref[1], acc_ref[...]
    for h in range(kv_heads_per_block):
        l_rows = l_all[h][:, :1]
        out = acc_all[h] / jnp.where(l_rows == 0.0, 1.0, l_rows)
        o_ref[:, pl.ds(h * group, group), :] = out.reshape(block_q, group, head_dim).astype(o_ref.dtype)


def _first_seq_per_query_block(cu_q_lens, num_seqs, num_query_blocks, block_q):
    """For each query block, how many real sequences end at or before its first token."""
    max_num_seqs = cu_q_lens.shape[0] - 1
    is_real = jnp.arange(max_num_seqs, dtype=jnp.int32) < num_seqs[0]
    seq_ends = jnp.where(is_real, cu_q_lens[1:], jnp.iinfo(jnp.int32).max)
    block_starts = jnp.arange(num_query_blocks, dtype=jnp.int32) * block_q
    return jnp.sum(seq_ends[None, :] <= block_starts[:, None], axis=1, dtype=jnp.int32)


@takes_options
def ragged_paged_attention(
    q,  # [max_num_batched_tokens, num_q_heads, head_dim]
    kv_pages,  # [total_num_pages, page_size, 2 * num_kv_heads, head_dim], K/V heads interleaved
    kv_lens,  # i32[max_num_seqs]
    page_indices,  # i32[max_num_seqs, pages_per_seq]
    cu_q_lens,  # i32[max_num_seqs + 1]
    num_seqs,  # i32[1]
    options: Options,  # upstream's keyword options (rpa_harness.spec.interface.Options)
):
    """Attention of mixed prefill and decode sequences over a paged KV cache (upstream's API).

    Sequence ``i < num_seqs[0]`` owns query rows ``[cu_q_lens[i], cu_q_lens[i + 1])`` and keys
    ``[0, kv_lens[i])`` stored in pages ``page_indices[i, :]``. Metadata past ``num_seqs`` and page-table
    entries past a sequence's last page are never read as page numbers. Output rows past
    ``cu_q_lens[num_seqs[0]]`` are unspecified. A block size left as None gets a default that works on any
    backend (the other one, if given, is kept). On CPU the call must be traced under
    ``pltpu.force_tpu_interpret_mode(...)``; otherwise compiling it raises a RuntimeError saying so.

    Like upstream's, it may be called inside ``jax.jit`` with the options as Python values; the options
    that only weigh numbers are compiled as run-time values (see the module docstring).
    """
    static_validate_inputs(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options.keywords())
    static, float_values, int_values = _split_options(
        dataclasses.replace(options, mask_value=options.semantics().mask_value)
    )
    return _ragged_paged_attention(
        q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, float_values, int_values, options=static
    )


@functools.partial(jax.jit, static_argnames=("options",))
def _ragged_paged_attention(
    q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, float_values, int_values, *, options: Options
):
    """The compiled kernel: ``options`` static, with the set run-time options ``_AT_RUN_TIME``."""
    num_tokens, num_q_heads, head_dim = q.shape
    _, page_size, num_combined_kv_heads, _ = kv_pages.shape
    num_kv_heads = num_combined_kv_heads // 2
    max_num_seqs, pages_per_seq = page_indices.shape
    group = num_q_heads // num_kv_heads

    kv_heads_per_block = kv_heads_per_head_block(num_q_heads, num_kv_heads, q.dtype, kv_pages.dtype)
    q_heads_per_block = kv_heads_per_block * group
    block_q = options.num_queries_per_block or default_num_queries_per_block(num_tokens, q_heads_per_block)
    kv_pages_per_block = options.num_kv_pages_per_block or default_num_kv_pages_per_block(
        page_size, pages_per_seq, 2 * kv_heads_per_block, head_dim, kv_pages.dtype
    )
    vmem_limit = options.vmem_limit_bytes or default_vmem_limit_bytes()
    block_q, kv_pages_per_block = blocks_within_vmem(
        block_q, kv_pages_per_block, vmem_limit, q_heads_per_block=q_heads_per_block, page_size=page_size,
        kv_heads_per_block=kv_heads_per_block, head_dim=head_dim, q_dtype=q.dtype, kv_dtype=kv_pages.dtype,
    )  # fmt: skip
    num_head_blocks = num_kv_heads // kv_heads_per_block
    num_query_blocks = pl.cdiv(num_tokens, block_q)
    num_rows = block_q * group

    table_size = max_num_seqs * pages_per_seq
    padded_table_size = pl.cdiv(table_size, _PAGE_TABLE_TILE) * _PAGE_TABLE_TILE
    padded_page_table = jnp.pad(page_indices.reshape(-1), (0, padded_table_size - table_size))
    window_size = _page_table_window_size(kv_pages_per_block, pages_per_seq, padded_table_size)

    num_seqs_clamped = jnp.clip(num_seqs, 0, max_num_seqs).astype(jnp.int32)
    scalar_prefetch = (
        kv_lens,
        cu_q_lens,
        num_seqs_clamped,
        _first_seq_per_query_block(cu_q_lens, num_seqs_clamped, num_query_blocks, block_q),
        float_values,
        int_values,
    )
    q_block = pl.BlockSpec((block_q, q_heads_per_block, head_dim), lambda h, b, *_: (b, h, 0))
    kernel = functools.partial(_rpa_kernel, pages_per_seq=pages_per_seq, options=options.semantics())
    call = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(scalar_prefetch),
            grid=(num_head_blocks, num_query_blocks),
            in_specs=[q_block, pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=q_block,
            scratch_shapes=[
                pltpu.VMEM(
                    (2, kv_pages_per_block, page_size, 2 * kv_heads_per_block, head_dim), kv_pages.dtype
                ),
                pltpu.SemaphoreType.DMA((2,)),
                pltpu.SMEM((window_size,), jnp.int32),
                pltpu.SemaphoreType.DMA,
                pltpu.VMEM((2, kv_heads_per_block, num_rows, _STAT_LANES), jnp.float32),
                pltpu.VMEM((kv_heads_per_block, num_rows, head_dim), jnp.float32),
            ],
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel"),
            vmem_limit_bytes=vmem_limit,
        ),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        name="rpa_harness_ragged_paged_attention",
    )
    if not _interpret_mode_forced():
        q = _requires_tpu_or_interpreter_p.bind(q)
    return call(*scalar_prefetch, q, kv_pages, padded_page_table)
