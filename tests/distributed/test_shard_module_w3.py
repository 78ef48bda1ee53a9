"""``shard_module`` on 3 gloo ranks: a rank holding nothing of a table, 3-way cuts, ``src_rank=1``.

The per-rank routines are those of ``test_shard_module_w2.py``.
"""

from __future__ import annotations

import pytest

from torchrec_dtensor_bridge.layout import ShardLayout

from .harness import make_pool_fixture
from .test_shard_module_w2 import BAG_CASES, DIM, ROWS, check_ebc_row_wise, check_module_parity, check_src_rank

pool = make_pool_fixture(3)

LAYOUTS_W3 = {
    "row_wise_rank_1_empty": ShardLayout.row_wise((ROWS, DIM), [4, 0, 6]),
    "column_wise_3": ShardLayout.column_wise((ROWS, DIM), [1, 2, 3], ranks=[2, 0, 1]),
    "grid_3": ShardLayout.grid((ROWS, DIM), [5, 5], [3, 3], [0, 1, 2, 0]),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS_W3))
def test_module_parity(pool, name):
    assert pool.run(check_module_parity, LAYOUTS_W3[name].with_name(name)) == [len(BAG_CASES) + 2] * 3


def test_ebc_row_wise_rank_2_holds_little(pool):
    pool.run(check_ebc_row_wise, False, False)


def test_src_rank_scatters_its_values(pool):
    pool.run(check_src_rank)
