"""A world of one rank: every shard local, several per rank, DCP on one process."""

import pytest
import torch
import torch.distributed.checkpoint as dcp

import torchrec_dtensor_bridge as tdb
from torchrec_dtensor_bridge.layout import ShardLayout

from .checks import build_sharded_tensor, check_layout, reference_table
from .harness import make_pool_fixture

pool = make_pool_fixture(1)

LAYOUTS = {
    "whole_table": ShardLayout.table_wise((5, 3), 0),
    "three_row_shards": ShardLayout.row_wise((9, 4), [2, 3, 4], ranks=[0, 0, 0]),
    "two_column_shards": ShardLayout.column_wise((4, 6), [3, 3], ranks=[0, 0]),
    "grid_on_one_rank": ShardLayout.grid((4, 4), [2, 2], [1, 3], [0, 0, 0, 0]),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_single_rank_layouts(pool, name):
    pool.run(check_layout, LAYOUTS[name].with_name(name))


def _check_dcp(rank, world_size, path):
    layout = LAYOUTS["three_row_shards"]
    table = reference_table(layout.global_shape)
    dt = tdb.to_dtensor(build_sharded_tensor(layout, table, rank))
    dcp.save({"t": dt}, checkpoint_id=path)
    for t in tdb.convert.local_shards_of(dt):
        t.zero_()
    dcp.load({"t": dt}, checkpoint_id=path)
    assert torch.equal(tdb.full_tensor(dt), table)


def test_single_rank_dcp(pool, tmp_path):
    pool.run(_check_dcp, str(tmp_path / "c"))
