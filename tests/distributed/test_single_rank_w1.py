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


def _check_one_rank_training(rank, world_size, kind):
    """On a one-rank group a whole (replicated) table's fused update needs nothing from other ranks: the
    kernel op updates it in one pass (not the exchange path's torch math), with the same result."""
    import os

    from torchrec_dtensor_bridge.convert import dtensor_from_local_shards
    from torchrec_dtensor_bridge.convert.placements import world_mesh

    layout = ShardLayout.replicated((50, 8), [0])
    ids = [torch.randint(0, 50, (6, 3), generator=torch.Generator().manual_seed(t)) for t in range(2)]
    results = {}
    for impl in ("native", "torch"):
        os.environ["TDB_KERNELS"] = impl
        try:
            weights = [dtensor_from_local_shards(layout.with_name(f"t{t}"), [reference_table((50, 8), seed=t)],
                                                 device_mesh=world_mesh("cpu")).requires_grad_() for t in range(2)]
            opt = tdb.FusedOptimizer({f"t{t}": w for t, w in enumerate(weights)}, kind, lr=0.1, eps=1e-8)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                outs = tdb.sharded_embedding_bags(ids, weights, mode="sum", optimizer=opt)
                sum(o.square().sum() for o in outs).backward()
            calls = sum(e.name == "tdb::sparse_update" for e in prof.events())
            results[impl] = ([tdb.full_tensor(w) for w in weights], calls)
        finally:
            os.environ.pop("TDB_KERNELS", None)
    (native, calls), (reference, _) = results["native"], results["torch"]
    assert calls == 2, f"one kernel op call per table's storage, got {calls}"
    for t, (got, want) in enumerate(zip(native, reference)):
        torch.testing.assert_close(got, want)
        assert not torch.equal(got, reference_table((50, 8), seed=t)), "the step updated the table"


@pytest.mark.parametrize("kind", ["sgd", "rowwise_adagrad"])
def test_single_rank_replicated_table_trains_through_the_kernel(pool, kind):
    pool.run(_check_one_rank_training, kind)
