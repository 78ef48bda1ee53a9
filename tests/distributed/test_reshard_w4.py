"""The resharding matrix: save on {1,2,3,4} ranks x load on {1,2,3,4} ranks, changing every layout.

One 4-rank gloo pool; smaller worlds are prefix subgroups of it (ranks outside sit out).
"""

import random

import pytest
import torch
import torch.distributed as dist
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, init_from_local_shards

import torchrec_dtensor_bridge as tdb
from torchrec_dtensor_bridge.layout import ShardLayout

from .checks import reference_table
from .harness import make_pool_fixture

pool = make_pool_fixture(4)
_GROUPS: dict[int, dist.ProcessGroup] = {}


def _group(k: int) -> dist.ProcessGroup:
    if not _GROUPS:  # every rank creates every group once, in the same order
        for n in (1, 2, 3):
            _GROUPS[n] = dist.new_group(list(range(n)))
        _GROUPS[4] = dist.group.WORLD
    return _GROUPS[k]


def _cuts(n: int, parts: int, rng: random.Random) -> list[int]:
    points = sorted(rng.sample(range(1, n), parts - 1)) if parts > 1 else []
    edges = [0, *points, n]
    return [b - a for a, b in zip(edges, edges[1:])]


def layouts(k: int, variant: str) -> dict[str, ShardLayout]:
    """Awkward layouts of the same tables on ``k`` ranks; ``variant`` 'save' and 'load' differ."""
    rng = random.Random(f"{k}-{variant}")
    rows, dim = 997, 36
    last = k - 1
    if variant == "save":
        return {
            "a": ShardLayout.row_wise((rows, dim), _cuts(rows, k, rng)),
            "b": ShardLayout.column_wise((rows, dim), _cuts(dim, 2 * k, rng), ranks=[i % k for i in range(2 * k)]),
            "c": ShardLayout.table_wise((rows, dim), last),
            "d": ShardLayout.grid((rows, dim), _cuts(rows, 2, rng), _cuts(dim, 2, rng), [i % k for i in range(4)]),
            "v": ShardLayout.row_wise((rows,), _cuts(rows, k, rng)),
            "e": ShardLayout.row_wise((rows, 4), _cuts(rows, max(k - 1, 1), rng), ranks=list(range(1, k)) or [0]),
        }
    return {
        "a": ShardLayout.column_wise((rows, dim), _cuts(dim, k, rng)),
        "b": ShardLayout.row_wise((rows, dim), k),
        "c": ShardLayout.grid((rows, dim), _cuts(rows, 3, rng), [dim], [i % k for i in range(3)]),
        "d": ShardLayout.table_wise((rows, dim), 0),
        "v": ShardLayout.row_wise((rows,), list(reversed(_cuts(rows, k, rng)))),
        "e": ShardLayout.column_wise((rows, 4), [4], ranks=[last]),
    }


def _build(layout, table, rank, group):
    local = [
        Shard(table[s.slices()].clone(), ShardMetadata(list(s.offsets), list(s.sizes), f"rank:{rank}/cpu"))
        for s in layout.shards_on(rank)
    ]
    return tdb.to_dtensor(init_from_local_shards(local, *table.shape, process_group=group))


def _tables(k_layouts):
    return {n: reference_table(lay.global_shape, seed=i) for i, (n, lay) in enumerate(sorted(k_layouts.items()))}


def _reshard(rank, world_size, save_ws, path):
    for k in (1, 2, 3, 4):
        _group(k)
    src = layouts(save_ws, "save")
    tables = _tables(src)
    if rank < save_ws:
        g = _group(save_ws)
        sd = {f"t.{n}": _build(lay.with_name(n), tables[n], rank, g) for n, lay in src.items()}
        tdb.checkpoint.save(sd, path, process_group=g)
    dist.barrier()
    checked = []
    for load_ws in (1, 2, 3, 4):
        if rank < load_ws:
            g = _group(load_ws)
            dst = layouts(load_ws, "load")
            zeros = {n: torch.zeros_like(t) for n, t in tables.items()}
            sd = {f"t.{n}": _build(lay.with_name(n), zeros[n], rank, g) for n, lay in dst.items()}
            tdb.checkpoint.load(sd, path, process_group=g)
            for n, table in tables.items():
                got = tdb.full_tensor(sd[f"t.{n}"], process_group=g)
                assert torch.equal(got, table), f"save {save_ws} -> load {load_ws}: table {n} differs"
            checked.append(load_ws)
        dist.barrier()
    return checked


@pytest.mark.parametrize("save_ws", [1, 2, 3, 4])
def test_reshard_matrix(pool, tmp_path, save_ws):
    checked = pool.run(_reshard, save_ws, str(tmp_path / "ck"))
    assert checked[0] == [1, 2, 3, 4] and checked[3] == [4]
