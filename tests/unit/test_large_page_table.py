"""A page table larger than SMEM (1 MiB on every TPU): the kernel compiles for a chip and computes right.

The kernel keeps the page table in HBM and copies into SMEM only a window of tiles around one KV block's
entries. Compiling a serving-sized configuration with the real TPU compiler shows that nothing scales
with the table; running a table of awkward size on the interpreters checks the windows themselves: rows
that do not start at a tile, blocks whose entries straddle a tile boundary, and a last block at the very
end of the table, where the window is clamped to end within it.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from rpa_harness import ahead_of_time, device, reference, targets
from rpa_harness.checks import check_compiles
from rpa_harness.kernel.pallas_rpa import ragged_paged_attention
from rpa_harness.repro import stand_ins
from rpa_harness.strategies.case import Case
from tests.cases import GARBAGE, INTERPRETERS, sized_case

SMEM_BYTES = 1024 * 1024

# 256 sequences of 2048 pages: a 2 MiB page table.
SERVING = Case(
    max_num_batched_tokens=512, max_num_seqs=256, pages_per_seq=2048, total_num_pages=8192, page_size=16,
    num_q_heads=8, num_kv_heads=1, head_dim=128, q_lens=(1,), kv_lens=(16,),
)  # fmt: skip

# 3000 rows of 100 entries (1.2 MiB, not a whole number of 128-entry tiles). Only the last sequence has
# query rows; the others have none and hold no pages, so the interpreters visit its 34 KV blocks only. Its
# blocks of 3 pages straddle a tile boundary, and its last block is one page, the table's last entry.
_NUM_EMPTY_SEQS = 2999
LARGE_TABLE = sized_case(
    (0,) * _NUM_EMPTY_SEQS + (5,), (0,) * _NUM_EMPTY_SEQS + (199,), page_size=2, spare_seqs=0, spare_pages=0,
    spare_cache_pages=3, num_q_heads=4, num_kv_heads=2, head_dim=128, num_kv_pages_per_block=3,
    garbage_values=GARBAGE,
)  # fmt: skip


def test_cases_are_what_they_claim():
    assert SERVING.max_num_seqs * SERVING.pages_per_seq * 4 > SMEM_BYTES
    assert LARGE_TABLE.max_num_seqs * LARGE_TABLE.pages_per_seq * 4 > SMEM_BYTES
    assert (LARGE_TABLE.max_num_seqs * LARGE_TABLE.pages_per_seq) % 128 != 0
    assert LARGE_TABLE.num_seqs == LARGE_TABLE.max_num_seqs
    assert -(-LARGE_TABLE.kv_lens[-1] // LARGE_TABLE.page_size) == LARGE_TABLE.pages_per_seq
    assert LARGE_TABLE.pages_per_seq % LARGE_TABLE.num_kv_pages_per_block == 1


@pytest.mark.parametrize("generation", ["v5e", "v6e"])
def test_serving_sized_page_table_compiles(generation):
    reason = ahead_of_time.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    check_compiles(
        targets.load("rpa_harness.kernel"),
        device.Backend(device.TPU_COMPILER, True, generation),
        stand_ins(SERVING.array_shapes()),
        SERVING.options(),
    )


@pytest.mark.parametrize("interpreter", list(INTERPRETERS))
def test_large_page_table_matches_oracle(interpreter):
    arrays = LARGE_TABLE.arrays()
    with pltpu.force_tpu_interpret_mode(INTERPRETERS[interpreter]):
        output = ragged_paged_attention(
            **{name: jnp.asarray(a) for name, a in arrays.items()}, **LARGE_TABLE.options()
        )
    comparison = reference.compare(
        np.asarray(output), reference.oracle(**arrays, **LARGE_TABLE.options()), label="kernel"
    )
    assert comparison.ok, str(comparison)
