"""Sharded lookups on 3 gloo ranks: layouts where some rank holds nothing, odd splits, replicas on a subset."""

import pytest

from torchrec_dtensor_bridge.layout import ShardLayout

from .harness import make_pool_fixture
from .test_lookup_w2 import BAG_CASES, check_bad_inputs, check_bag_parity, check_embedding_parity

pool = make_pool_fixture(3)

LAYOUTS_W3 = {
    "row_wise_torchrec_ceil": ShardLayout.row_wise((13, 5), 3),
    "row_wise_uneven_multi": ShardLayout.row_wise((13, 4), [3, 1, 4, 2, 3], ranks=[0, 1, 2, 0, 1]),
    "table_row_wise": ShardLayout.row_wise((9, 4), [5, 4], ranks=[1, 2]),
    "column_wise_uneven": ShardLayout.column_wise((7, 9), [2, 3, 4]),
    "table_column_wise": ShardLayout.column_wise((7, 6), [3, 3], ranks=[0, 2]),
    "table_wise": ShardLayout.table_wise((8, 5), 2),
    "grid": ShardLayout.grid((8, 6), [4, 4], [3, 3], [0, 1, 2, 0]),
    "replicated": ShardLayout.replicated((6, 4), [0, 1, 2]),
    "replicated_on_two": ShardLayout.replicated((6, 4), [0, 2]),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS_W3))
def test_embedding_bag_parity(pool, name):
    assert pool.run(check_bag_parity, LAYOUTS_W3[name].with_name(name), 3) == [len(BAG_CASES)] * 3


@pytest.mark.parametrize("name", ["row_wise_uneven_multi", "table_column_wise", "grid", "replicated_on_two"])
def test_embedding_parity(pool, name):
    pool.run(check_embedding_parity, LAYOUTS_W3[name].with_name(name), 3)


def test_bad_inputs_raise_on_every_rank(pool):
    pool.run(check_bad_inputs, LAYOUTS_W3["table_row_wise"].with_name("table_row_wise"))
