"""A ShardedTensor may list its local shards in another order than its global metadata (2 gloo ranks).

Two equal-size row shards per rank, the local list reversed against the metadata: taking the local shards
in stored order would give every shape check a pass and put the rows in the wrong place. ``to_dtensor``,
``full_tensor`` (of both) and the round trip ``to_sharded_tensor`` must match shards by offsets.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import torchrec_dtensor_bridge as tdb
from torchrec_dtensor_bridge._compat import make_sharded_tensor
from torchrec_dtensor_bridge.convert import local_shards_of
from torchrec_dtensor_bridge.convert.metadata import layout_to_sharded_tensor_metadata

from .checks import reference_table
from .harness import make_pool_fixture

pool = make_pool_fixture(2)

LAYOUT = tdb.ShardLayout.row_wise((8, 4), [2, 2, 2, 2], ranks=[0, 1, 0, 1], dtype=torch.float32)


def check_reversed_local_shards(rank: int, world: int) -> None:
    table = reference_table((8, 4), seed=3)
    metadata = layout_to_sharded_tensor_metadata(LAYOUT)
    mine = [m for m in metadata.shards_metadata if m.placement.rank() == rank]
    assert len(mine) == 2 and mine[0].shard_sizes == mine[1].shard_sizes
    local = [(table[m.shard_offsets[0] : m.shard_offsets[0] + 2].clone(), m) for m in reversed(mine)]
    st = make_sharded_tensor(local, metadata, dist.group.WORLD)
    assert [s.metadata.shard_offsets[0] for s in st.local_shards()] == [m.shard_offsets[0] for m in reversed(mine)]
    assert torch.equal(tdb.full_tensor(st), table)
    dt = tdb.to_dtensor(st)
    assert torch.equal(tdb.full_tensor(dt), table)
    by_ptr = {s.tensor.data_ptr() for s in st.local_shards()}
    assert {t.data_ptr() for t in local_shards_of(dt)} == by_ptr, "zero-copy"
    for spec, t in zip(LAYOUT.shards_on(rank), local_shards_of(dt)):  # each block holds its own rows
        assert torch.equal(t, table[spec.offsets[0] : spec.offsets[0] + spec.sizes[0]]), spec
    back = tdb.to_sharded_tensor(dt)
    assert torch.equal(tdb.full_tensor(back), table)


def test_local_shards_in_another_order_than_the_metadata(pool):
    pool.run(check_reversed_local_shards)
