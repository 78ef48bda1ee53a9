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


def check_reduce_rows(rank: int, world: int, counts: list[int], width: int) -> None:
    """:func:`reduce_rows` of every rank's partial rows equals the sum of the pieces (own first, then the other
    ranks' in rank order), as a new tensor, ``full`` left as it was."""
    import torch

    from torchrec_dtensor_bridge.collectives import reduce_rows, row_starts

    def partial(r: int) -> torch.Tensor:  # rank r's partial rows for every rank
        return torch.randn(sum(counts), width, generator=torch.Generator().manual_seed(10 + r))

    full = partial(rank)
    before = full.clone()
    got = reduce_rows(full, counts, None)
    start, n = row_starts(counts)[rank], counts[rank]
    want = partial(rank)[start : start + n].clone()
    for r in range(world):
        if r != rank:
            want += partial(r)[start : start + n]
    assert got.shape == (n, width), (rank, tuple(got.shape))
    assert torch.equal(got, want), f"rank {rank}: rows differ"
    assert torch.equal(full, before), f"rank {rank}: reduce_rows wrote into its input"
    if n:
        assert got.untyped_storage().data_ptr() != full.untyped_storage().data_ptr(), "a new tensor"


@pytest.mark.parametrize("counts", [[2, 3, 4], [0, 5, 1], [3, 0, 2], [4, 4, 0], [0, 0, 0]],
                         ids=["uneven", "first_empty", "middle_empty", "last_empty", "all_empty"])
def test_reduce_rows_sums_every_rank_s_rows_from_where_they_lie(pool, counts):
    """Ranks at either end send only the other ranks' rows; the middle rank sends all, its own to itself."""
    pool.run(check_reduce_rows, counts, 5)
