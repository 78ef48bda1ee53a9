"""Converters on 4 gloo ranks over real ShardedTensors of every layout TorchRec cannot make on CPU."""

import pytest

from torchrec_dtensor_bridge.layout import LayoutKind, ShardLayout

from .checks import check_layout
from .harness import make_pool_fixture

pool = make_pool_fixture(4)

LAYOUTS = {
    "row_wise_even": ShardLayout.row_wise((8, 16), 4),
    "row_wise_uneven": ShardLayout.row_wise((8, 16), [1, 3, 1, 3]),
    "row_wise_7_3": ShardLayout.row_wise((10, 4), [7, 3, 0, 0]),
    "row_wise_torchrec_ceil": ShardLayout.row_wise((10, 5), 4),
    "row_wise_two_per_rank": ShardLayout.row_wise((12, 4), [2, 1, 3, 1, 2, 3], ranks=[0, 1, 2, 0, 1, 3]),
    "table_wise": ShardLayout.table_wise((8, 16), 2),
    "column_wise_even": ShardLayout.column_wise((8, 16), 4),
    "column_wise_uneven": ShardLayout.column_wise((8, 20), [4, 8, 3, 5]),
    "column_wise_two_per_rank": ShardLayout.column_wise((6, 16), [4, 4, 4, 4], ranks=[0, 1, 0, 1]),
    "table_row_wise": ShardLayout.row_wise((9, 8), [5, 4], ranks=[2, 3]),
    "table_column_wise": ShardLayout.column_wise((5, 12), [6, 6], ranks=[1, 3]),
    "grid": ShardLayout.grid((8, 16), [4, 4], [8, 8], [0, 1, 2, 3]),
    "grid_diagonal_pairs": ShardLayout.grid((8, 16), [4, 4], [8, 8], [0, 1, 1, 0]),
    "one_row": ShardLayout.row_wise((1, 7), [0, 1, 0, 0]),
    "vector_row_wise": ShardLayout.row_wise((10,), [4, 3, 3, 0]),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_layout_roundtrip(pool, name):
    layout = LAYOUTS[name].with_name(name)
    pictures = pool.run(check_layout, layout)
    assert len(set(pictures)) == 1, "ranks disagree on the sharding picture"


def test_kinds_cover_every_type():
    kinds = {lay.kind for lay in LAYOUTS.values()}
    assert kinds >= {LayoutKind.ROW_WISE, LayoutKind.COLUMN_WISE, LayoutKind.TABLE_WISE, LayoutKind.GRID}


def _check_bad_input(rank, world_size):
    import torch
    from torch.distributed.tensor import DTensor, Replicate

    import torchrec_dtensor_bridge as tdb
    from torchrec_dtensor_bridge.convert import dtensor_from_local_shards
    from torchrec_dtensor_bridge.convert.placements import world_mesh

    def raises(exc, match, fn):
        try:
            fn()
        except exc as e:
            assert match in str(e), (match, str(e))
            return
        raise AssertionError(f"{fn} did not raise {exc.__name__}")

    raises(TypeError, "got Tensor", lambda: tdb.to_dtensor(torch.ones(3)))
    raises(TypeError, "got Tensor", lambda: tdb.to_sharded_tensor(torch.ones(3)))
    raises(TypeError, "got list", lambda: tdb.full_tensor([1, 2]))
    lay = ShardLayout.row_wise((8, 4), 4, name="emb")
    # a local shard whose shape disagrees with the layout: names table, rank and both shapes
    raises(ValueError, f"table 'emb': local shard 0 on rank {rank} has shape [3, 4], layout says [2, 4]",
           lambda: dtensor_from_local_shards(lay, [torch.zeros(3, 4)]))
    raises(ValueError, "holds 1 shards in the layout but 2 local tensors",
           lambda: dtensor_from_local_shards(lay, [torch.zeros(2, 4), torch.zeros(2, 4)]))
    rep = DTensor.from_local(torch.ones(2, 2), world_mesh("cpu"), [Replicate()], run_check=False)
    raises(ValueError, "replicated DTensor", lambda: tdb.to_sharded_tensor(rep))
    assert torch.equal(tdb.full_tensor(rep), torch.ones(2, 2))


def test_bad_input_is_reported_on_every_rank(pool):
    pool.run(_check_bad_input)


def _check_dtensor_own_gather_on_wrapper(rank, world_size):
    """DTensor's own full_tensor() through a wrapper local tensor: the functional collectives
    (all_gather_into_tensor, wait_tensor) reach the wrapper's op table and gather its shards."""
    import torch
    from torch.distributed.tensor import DTensor, Shard

    import torchrec_dtensor_bridge as tdb
    from torchrec_dtensor_bridge.convert.placements import world_mesh

    from .checks import reference_table

    table = reference_table((8, 6))
    local = tdb.LocalShardsWrapper([table[2 * rank : 2 * rank + 2].clone()], [(2 * rank, 0)], (8, 6))
    dt = DTensor.from_local(local, world_mesh("cpu"), [Shard(0)], run_check=False, shape=table.shape,
                            stride=table.stride())
    assert torch.equal(dt.full_tensor(), table)
    assert torch.equal(tdb.full_tensor(dt), table)


def test_dtensor_full_tensor_through_wrapper_ops(pool):
    pool.run(_check_dtensor_own_gather_on_wrapper)
