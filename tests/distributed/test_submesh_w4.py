"""The DTensor's own mesh, on 4 gloo ranks: sub-meshes, a 2-D mesh, torch's table-wise pattern, no hidden
collective.

* torch's table-wise example (each table's owner wraps it in torch's ``LocalShardsWrapper`` without a
  layout on a one-rank mesh ``DeviceMesh("cpu", [i])`` with ``Replicate()``; every other rank holds an
  empty plain tensor): ``full_tensor``, ``storage_metadata`` and ``visualize_sharding`` on every rank.
* Every public collective on the sub-mesh of ranks {0, 1} while ranks {2, 3} look up other tables on
  their own sub-mesh (or do nothing): results equal the unsharded ops; a collective on WORLD would hang
  (pytest-timeout / the pool's timeout make that a failure).
* 2-D mesh ``(replica, shard)`` = ``[[0, 1], [2, 3]]`` with ``[Replicate(), Shard(0)]``: lookups run on
  the shard axis (each replica group on its own) and equal the unsharded op; ``full_tensor``,
  ``storage_metadata`` and ``visualize_sharding`` see one copy of the table.
* Adversarial lookups on each pair at once: one rank's weight has no layout while the other's input is
  bad; a layout that differs between the ranks (rows [6, 4] on one, [7, 3] on the other): every rank raises.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from .checks import expect_raises
from .harness import make_pool_fixture

pool = make_pool_fixture(4)

SHAPE = (10, 6)
_MESHES: dict[str, object] = {}


def _mesh_2d():
    """The 2-D mesh ``(replica, shard)`` over ``[[0, 1], [2, 3]]`` (made once per process)."""
    from torch.distributed.device_mesh import DeviceMesh

    if "2d" not in _MESHES:
        _MESHES["2d"] = DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("replica", "shard"))
    return _MESHES["2d"]


def _pair_mesh():
    """This rank's sub-mesh of 2: ranks {0, 1} or {2, 3} (the 2-D mesh's shard axis)."""
    return _mesh_2d()["shard"]


def _table(seed: int = 0, shape: tuple[int, int] = SHAPE) -> torch.Tensor:
    return (torch.arange(shape[0] * shape[1], dtype=torch.float32) / 7 + seed).reshape(shape)


def _weight(layout, table: torch.Tensor, rank: int, mesh, *, grad: bool = False):
    from torchrec_dtensor_bridge.convert import dtensor_from_local_shards

    shards = [table[s.slices()].clone() for s in layout.shards_on(rank)]
    dt = dtensor_from_local_shards(layout, shards, device_mesh=mesh)
    return torch.nn.Parameter(dt) if grad else dt


def _batch(seed: int, bags: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (bags,), generator=g)
    ids = torch.randint(0, SHAPE[0], (int(lengths.sum()),), generator=g)
    return ids, torch.cat([lengths.new_zeros(1), lengths.cumsum(0)[:-1]])



# ------------------------------------------------------------ torch's table-wise example pattern
def torch_table_wise(rank: int, world_size: int) -> list[str]:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper as TorchWrapper

    import torchrec_dtensor_bridge as tdb

    tables = [_table(i, (8, 4)) for i in range(world_size)]
    dts = []
    for i in range(world_size):
        local = TorchWrapper([tables[i].clone()], [(0, 0)]) if rank == i else torch.empty(0)
        mesh = DeviceMesh("cpu", torch.tensor([i], dtype=torch.int64))
        dts.append(DTensor.from_local(local, mesh, [Replicate()], run_check=False, shape=tables[i].shape,
                                      stride=tables[i].stride()))
    pictures = []
    for i, dt in enumerate(dts):
        assert torch.equal(tdb.full_tensor(dt), tables[i]), i  # every rank: the whole table, no hang
        chunks = tdb.storage_metadata(dt).chunks
        assert [(tuple(c.offsets), tuple(c.sizes)) for c in chunks] == [((0, 0), (8, 4))], chunks
        pictures.append(tdb.visualize_sharding(dt, name=f"t{i}"))
        assert tdb.layout_of(dt).shards_on(i)[0].sizes == (8, 4)
    return pictures


def test_torch_table_wise_pattern_on_every_rank(pool):
    pictures = pool.run(torch_table_wise)
    assert all(p == pictures[0] for p in pictures), "ranks draw different pictures"
    for i, picture in enumerate(pictures[0]):
        assert f"\n{i}     0:8   0:4   8x4" in picture, picture


# ------------------------------------------------------------ every public collective on a sub-mesh of 2
def _pair_layouts(ranks: list[int]):
    from torchrec_dtensor_bridge.layout import ShardLayout

    return {
        "row_wise_uneven": ShardLayout.row_wise(SHAPE, [7, 3], ranks=ranks),
        "column_wise": ShardLayout.column_wise(SHAPE, [2, 4], ranks=ranks),
        "table_wise": ShardLayout.table_wise(SHAPE, ranks[1]),
        "grid_two_per_rank": ShardLayout.grid(SHAPE, [5, 5], [3, 3], [ranks[0], ranks[1], ranks[1], ranks[0]]),
    }


def _busy_pair(rank: int, mesh, ranks: list[int]) -> None:
    """The other pair: lookups of its own tables on its own sub-mesh."""
    from torchrec_dtensor_bridge.layout import ShardLayout
    from torchrec_dtensor_bridge.lookup import sharded_embedding_bag

    table = _table(5)
    w = _weight(ShardLayout.row_wise(SHAPE, [4, 6], ranks=ranks), table, rank, mesh)
    for step in range(3):
        ids, offsets = _batch(100 * rank + step, 3 + rank)
        out = sharded_embedding_bag(ids, w, offsets, mode="sum")
        torch.testing.assert_close(out, F.embedding_bag(ids, table, offsets, mode="sum"))


def _pair_collectives(rank: int, mesh, ranks: list[int]) -> None:
    """Every public collective on this pair's mesh, checked against the unsharded ops."""
    from torch import nn

    import torchrec_dtensor_bridge as tdb
    from torchrec_dtensor_bridge.layout import ShardLayout

    me = ranks.index(rank)
    for k, (name, layout) in enumerate(_pair_layouts(ranks).items()):
        table = _table(k)
        plain = _weight(layout.with_name(name), table, rank, mesh)
        assert torch.equal(tdb.full_tensor(plain), table), name
        md = tdb.storage_metadata(plain)
        assert sum(c.sizes.numel() for c in md.chunks) == table.numel(), name
        assert f"{name}: 10x6" in tdb.visualize_sharding(plain, name=name), name
        st = tdb.to_sharded_tensor(plain)
        assert torch.equal(tdb.full_tensor(st), table), name
        back = tdb.to_dtensor(st, name=name)
        assert torch.equal(tdb.full_tensor(back), table), name
        sd = tdb.state_dict_to_sharded_tensor({"w": plain})
        assert torch.equal(tdb.full_tensor(tdb.state_dict_to_dtensor(sd)["w"]), table), name
        # lookups: this rank's own batch; gradient of both ranks' batches
        w = _weight(layout.with_name(name), table, rank, mesh, grad=True)
        batches = [_batch(10 * k + r, 3 + r) for r in range(2)]
        ids, offsets = batches[me]
        ref_w = table.clone().requires_grad_()
        out = tdb.sharded_embedding_bag(ids, w, offsets, mode="mean")
        torch.testing.assert_close(out, F.embedding_bag(ids, ref_w, offsets, mode="mean"))
        out.sum().backward()
        sum(F.embedding_bag(i, ref_w, o, mode="mean").sum() for i, o in batches).backward()
        torch.testing.assert_close(tdb.full_tensor(w.grad), ref_w.grad)
        rows = tdb.sharded_embedding(ids.view(-1, 1), w)
        torch.testing.assert_close(rows, F.embedding(ids.view(-1, 1), table))
        outs = tdb.sharded_embedding_bags([ids, ids], [w, w], [offsets, offsets], mode=["sum", "max"])
        torch.testing.assert_close(outs[0], F.embedding_bag(ids, table, offsets, mode="sum"))
        torch.testing.assert_close(outs[1], F.embedding_bag(ids, table, offsets, mode="max"))
    # shard_module on the pair's mesh, a table-wise entry among them (its one-rank mesh inside the pair)
    torch.manual_seed(0)
    emb = nn.ModuleDict({"a": nn.EmbeddingBag(*SHAPE, mode="sum"), "b": nn.Embedding(*SHAPE)})
    ref = {k: m.weight.detach().clone() for k, m in emb.items()}
    plan = {"a.weight": ShardLayout.row_wise(SHAPE, [3, 7], ranks=ranks),
            "b.weight": ShardLayout.table_wise(SHAPE, ranks[0])}
    tdb.shard_module(emb, plan, mesh, src_rank=ranks[0])
    ids, offsets = _batch(77 + me, 4)
    torch.testing.assert_close(emb["a"](ids, offsets), F.embedding_bag(ids, ref["a"], offsets, mode="sum"))
    torch.testing.assert_close(emb["b"](ids), F.embedding(ids, ref["b"]))
    assert torch.equal(tdb.full_tensor(emb["a"].weight), ref["a"])


def sub_mesh_collectives(rank: int, world_size: int, others: str) -> None:
    mesh = _pair_mesh()
    ranks = [int(r) for r in mesh.mesh.tolist()]
    if ranks == [0, 1]:
        _pair_collectives(rank, mesh, ranks)
    elif others == "busy":
        _busy_pair(rank, mesh, ranks)


@pytest.mark.parametrize("others", ["busy", "idle"])
def test_public_collectives_on_a_sub_mesh(pool, others):
    pool.run(sub_mesh_collectives, others)


def layout_less_sub_mesh(rank: int, world_size: int) -> None:
    """TorchRec-style DTensors (torch's wrapper, no layout) on each pair's sub-mesh: the layout gather runs
    on the pair's group, the lookups refuse them on both ranks."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper as TorchWrapper

    import torchrec_dtensor_bridge as tdb

    mesh = _pair_mesh()
    me = mesh.get_local_rank()
    table = _table(rank // 2)
    rows = [(0, 7), (7, 3)][me] if rank < 2 else [(0, 2), (2, 8)][me]
    local = TorchWrapper([table[rows[0] : rows[0] + rows[1]].clone()], [(rows[0], 0)])
    dt = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=table.shape, stride=table.stride())
    assert torch.equal(tdb.full_tensor(dt), table)
    assert [s.sizes[0] for s in tdb.layout_of(dt).shards] == ([7, 3] if rank < 2 else [2, 8])
    ids, offsets = _batch(rank, 3)
    expect_raises(NotImplementedError, "without the table's layout",
                  lambda: tdb.sharded_embedding_bag(ids, dt, offsets, mode="sum"))
    attached = tdb.to_dtensor(tdb.to_sharded_tensor(dt))
    torch.testing.assert_close(tdb.sharded_embedding_bag(ids, attached, offsets, mode="sum"),
                               F.embedding_bag(ids, table, offsets, mode="sum"))
    attached = tdb.to_dtensor(dt)  # the same, without the ShardedTensor round trip
    torch.testing.assert_close(tdb.sharded_embedding_bag(ids, attached, offsets, mode="sum"),
                               F.embedding_bag(ids, table, offsets, mode="sum"))


def test_layout_less_wrappers_on_sub_meshes(pool):
    pool.run(layout_less_sub_mesh)


# ------------------------------------------------------------ 2-D mesh (replica, shard)
def two_d_mesh(rank: int, world_size: int) -> None:
    from torch.distributed.tensor import DTensor, Replicate, Shard

    import torchrec_dtensor_bridge as tdb

    mesh = _mesh_2d()
    table = _table(3)
    shard = mesh.get_local_rank("shard")
    local = table.chunk(2)[shard].clone()
    w = torch.nn.Parameter(DTensor.from_local(local, mesh, [Replicate(), Shard(0)], run_check=False))
    assert torch.equal(tdb.full_tensor(w), table)
    md = tdb.storage_metadata(w)
    assert sorted((tuple(c.offsets), tuple(c.sizes)) for c in md.chunks) == [((0, 0), (5, 6)), ((5, 0), (5, 6))]
    picture = tdb.visualize_sharding(w, name="t2d")
    for line in ("0     0:5   0:6   5x6", "1     5:10  0:6   5x6", "2     0:5   0:6   5x6", "3     5:10  0:6   5x6",
                 "rows  0:5  |******|"):  # both replica groups hold rows 0:5 (ranks 0 and 2)
        assert line in picture, picture
    replica_group = [r for r in range(world_size) if r // 2 == rank // 2]
    batches = {r: _batch(50 + r, 2 + r) for r in replica_group}
    ids, offsets = batches[rank]
    ref_w = table.clone().requires_grad_()
    for mode in ("sum", "mean", "max"):
        out = tdb.sharded_embedding_bag(ids, w, offsets, mode=mode)
        torch.testing.assert_close(out, F.embedding_bag(ids, table, offsets, mode=mode))
    out = tdb.sharded_embedding_bag(ids, w, offsets, mode="sum")
    out.sum().backward()
    sum(F.embedding_bag(i, ref_w, o, mode="sum").sum() for i, o in batches.values()).backward()
    # the gradient of this replica group's batches, on this rank's rows
    torch.testing.assert_close(w.grad.to_local(), ref_w.grad.chunk(2)[shard])
    outs = tdb.sharded_embedding_bags([ids], [w], [offsets], mode="sum")
    torch.testing.assert_close(outs[0], F.embedding_bag(ids, table, offsets, mode="sum"))


def test_two_d_mesh_lookups_on_the_shard_axis(pool):
    pool.run(two_d_mesh)


# ------------------------------------------------------------ ranks that disagree: every rank raises
def no_layout_and_bad_input(rank: int, world_size: int) -> list[str]:
    """On each pair: the first rank's weight is a layout-less wrapper, the second's input holds an
    out-of-range id; both raise (neither hangs in the agreement)."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper as TorchWrapper

    import torchrec_dtensor_bridge as tdb
    from torchrec_dtensor_bridge.layout import ShardLayout

    mesh = _pair_mesh()
    me = mesh.get_local_rank()
    ranks = [int(r) for r in mesh.mesh.tolist()]
    table = _table()
    layout = ShardLayout.row_wise(SHAPE, [6, 4], ranks=ranks)
    if me == 0:
        spec = layout.shards_on(rank)[0]
        local = TorchWrapper([table[spec.slices()].clone()], [spec.offsets])
        w = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=table.shape, stride=table.stride())
    else:
        w = _weight(layout, table, rank, mesh)
    ids, offsets = _batch(rank, 3)
    if me == 1:
        ids = ids.clone()
        ids[0] = SHAPE[0]
    messages = []
    for call in (lambda: tdb.sharded_embedding_bag(ids, w, offsets, mode="sum"),
                 lambda: tdb.sharded_embedding_bags([ids], [w], [offsets], mode="max")):
        try:
            call()
        except (TypeError, ValueError, NotImplementedError) as e:
            messages.append(f"{type(e).__name__}: {e}")
        else:
            messages.append("no error")
    return messages


def test_no_layout_on_one_rank_bad_input_on_another(pool):
    for rank, messages in enumerate(pool.run(no_layout_and_bad_input)):
        for m in messages:
            if rank % 2 == 0:
                assert m.startswith("NotImplementedError") and "without the table's layout" in m, (rank, m)
            else:  # each failing rank raises its own problem; neither waits for the other
                assert m.startswith("ValueError") and "input holds id 10, outside" in m, (rank, m)


def layout_differs(rank: int, world_size: int) -> list[str]:
    """Each rank builds the table with its own row cut: [6, 4] on the pair's first rank, [7, 3] on the
    second (each DTensor consistent on its own rank)."""
    import torchrec_dtensor_bridge as tdb
    from torchrec_dtensor_bridge.layout import ShardLayout

    mesh = _pair_mesh()
    ranks = [int(r) for r in mesh.mesh.tolist()]
    me = ranks.index(rank)
    table = _table()
    w = _weight(ShardLayout.row_wise(SHAPE, [6, 4] if me == 0 else [7, 3], ranks=ranks), table, rank, mesh)
    ids, offsets = _batch(rank, 4)
    out = []
    for call in (lambda: tdb.sharded_embedding_bag(ids, w, offsets, mode="sum"),
                 lambda: tdb.sharded_embedding(ids, w),
                 lambda: tdb.sharded_embedding_bags([ids, ids], [w, w], [offsets, offsets], mode="mean")):
        try:
            call()
        except ValueError as e:
            out.append(str(e))
        else:
            out.append("no error")
    return out


def test_layout_that_differs_between_ranks(pool):
    for messages in pool.run(layout_differs):
        for m in messages:
            assert "the weight's layout differs between ranks" in m, m
