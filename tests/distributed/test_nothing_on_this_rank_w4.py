"""Ranks that hold nothing of a table, on 4 gloo ranks: every public collective either gives every rank the
right result or raises the same clear error - never a rank left waiting in a collective the others skipped.

The forms of "nothing on this rank":

* ``plain_empty``: a plain empty local tensor (torch's table-wise example; on a mesh of several ranks, the
  empty piece DTensor's own ``Shard(0)`` split gives the last rank);
* ``empty_wrapper``: an empty ``LocalShardsWrapper`` with ``global_shape`` and ``dtype`` and no layout
  (TorchRec's convention; the ranks that hold data then hold layout-less wrappers too);
* ``empty_wrapper_layout``: an empty ``LocalShardsWrapper`` carrying the table's layout (so do the others');
* a rank outside the mesh: the non-owners of a table on a one-rank mesh, and rank 3 of a table on the
  sub-mesh of ranks {0, 1, 2}.

Scenarios (every rank builds the same tables):

* ``one_rank_mesh``: torch's table-wise pattern - table ``i`` on ``DeviceMesh("cpu", [i])`` with
  ``Replicate()``; the owner's local tensor is a wrapper without a layout (the case that hung: the
  owner broadcast while the others raised), a wrapper with a layout, or a plain tensor;
* ``full_mesh_rows``: row cuts on the mesh of all 4 ranks where ranks 2 and 3 hold no rows;
* ``full_mesh_table_wise``: TorchRec's table-wise DTensor - ``Replicate()`` on the mesh of all 4 ranks,
  rank 1 holds the table, every other rank an empty wrapper;
* ``sub_mesh``: rows cut over the mesh of ranks {0, 1, 2} (rank 1 holds no rows), rank 3 outside it.

Calls: ``full_tensor``, ``to_dtensor`` of the DTensor (layout attached, zero-copy), ``visualize_sharding``,
``storage_metadata``, ``sharded_embedding_bag`` and ``checkpoint.save`` / ``checkpoint.load``; and
``shard_module`` with plans that leave ranks without blocks, and called on a rank outside its mesh.
Each rank reports every call's outcome; the test checks each against the expectation below (an error
names its type and a part of its message) and that the ranks that succeed agree on pictures and chunks.
A hang fails the call after the pool's timeout.

``full_tensor`` agrees before it moves data: an owner whose wrapper misses rows, ranks whose layouts
differ, a non-owner whose layout names another owner - every rank raises; an owner holding its table in
two blocks, and wrappers with and without a layout mixed on one mesh - every rank gets the table.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from .harness import ProcessGroupPool

TIMEOUT = 20.0
SHAPE = (8, 16)
FORMS = ["plain_empty", "empty_wrapper", "empty_wrapper_layout"]
OWNER_FORMS = ["wrapper", "wrapper_layout", "plain"]
CALLS = ["full_tensor", "to_dtensor", "visualize_sharding", "storage_metadata", "sharded_embedding_bag",
         "checkpoint"]


@pytest.fixture(scope="module")
def pool():
    """One process group of 4 ranks for the module, with a short timeout: a hang fails within seconds."""
    p = ProcessGroupPool(4, timeout=TIMEOUT)
    yield p
    p.close()


_MESHES: dict[Any, Any] = {}


def _mesh(ranks: tuple[int, ...]):
    """``DeviceMesh("cpu", ranks)``, made once per process (every rank makes the same meshes in the same order)."""
    from torch.distributed.device_mesh import DeviceMesh

    if ranks not in _MESHES:
        _MESHES[ranks] = DeviceMesh("cpu", list(ranks))
    return _MESHES[ranks]


def _table(seed: int, shape: tuple[int, int] = SHAPE) -> torch.Tensor:
    return torch.arange(shape[0] * shape[1], dtype=torch.float32).reshape(shape) / 8 + 100 * seed


def _batch(rank: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, rows, (5 + rank,), generator=g)
    return ids, torch.tensor([0, 2, 2 + rank])


# ------------------------------------------------------------------ building the tables, the same on every rank
def _dtensor(local: torch.Tensor, mesh, placements, shape: tuple[int, ...]):
    from torch.distributed.tensor import DTensor

    stride = (shape[1], 1)
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(shape), stride=stride)


def _wrapped(layout, table: torch.Tensor, rank: int, with_layout: bool) -> torch.Tensor:
    """``rank``'s blocks of ``table`` in a LocalShardsWrapper (an empty one with global_shape and dtype)."""
    import torchrec_dtensor_bridge as tdb

    specs = layout.shards_on(rank)
    shards = [table[s.slices()].clone() for s in specs]
    return tdb.LocalShardsWrapper(shards, [s.offsets for s in specs], global_shape=table.shape, dtype=table.dtype,
                                  layout=layout if with_layout else None)


def _scenario(rank: int, scenario: str, form: str, owner_form: str = "wrapper", zero: bool = False):
    """``[(name, dtensor, table)]`` of ``scenario`` with ``form`` on the ranks that hold nothing.

    ``zero``: the same tables filled with zeros (a checkpoint's destination).
    """
    from torch.distributed.tensor import Replicate, Shard

    from torchrec_dtensor_bridge.layout import ShardLayout

    out = []
    if scenario == "one_rank_mesh":
        for i in range(4):
            table = _table(i)
            lay = ShardLayout.table_wise(SHAPE, i, dtype=torch.float32, name=f"t{i}")
            values = table * 0 if zero else table
            if rank == i:
                local = values.clone() if owner_form == "plain" else _wrapped(
                    lay, values, rank, owner_form == "wrapper_layout")
            elif form == "plain_empty":
                local = torch.empty(0)
            else:
                local = _wrapped(lay, values, rank, form == "empty_wrapper_layout")
            out.append((f"t{i}", _dtensor(local, _mesh((i,)), [Replicate()], SHAPE), table))
        return out
    if scenario == "full_mesh_rows":
        if form == "plain_empty":  # DTensor's own even split of 3 rows over 4 ranks: rank 3 holds none
            shape = (3, 16)
            table = _table(7, shape)
            values = table * 0 if zero else table
            local = values[rank : rank + 1].clone() if rank < 3 else torch.empty(0, 16)
            return [("rows", _dtensor(local, _mesh((0, 1, 2, 3)), [Shard(0)], shape), table)]
        table = _table(7)
        lay = ShardLayout.row_wise(SHAPE, [5, 3, 0, 0], dtype=torch.float32, name="rows")
        local = _wrapped(lay, table * 0 if zero else table, rank, form == "empty_wrapper_layout")
        return [("rows", _dtensor(local, _mesh((0, 1, 2, 3)), [Shard(0)], SHAPE), table)]
    if scenario == "full_mesh_table_wise":
        table = _table(8)
        lay = ShardLayout.table_wise(SHAPE, 1, dtype=torch.float32, name="tw")
        local = _wrapped(lay, table * 0 if zero else table, rank, form == "empty_wrapper_layout")
        return [("tw", _dtensor(local, _mesh((0, 1, 2, 3)), [Replicate()], SHAPE), table)]
    assert scenario == "sub_mesh", scenario
    mesh = _mesh((0, 1, 2))
    if form == "plain_empty":  # members hold DTensor's even split (3 rows each); rank 3 an empty tensor
        shape = (9, 16)
        table = _table(9, shape)
        values = table * 0 if zero else table
        local = values[3 * rank : 3 * rank + 3].clone() if rank < 3 else torch.empty(0)
        return [("sub", _dtensor(local, mesh, [Shard(0)], shape), table)]
    table = _table(9)
    lay = ShardLayout.row_wise(SHAPE, [6, 0, 2], ranks=[0, 1, 2], dtype=torch.float32, name="sub")
    local = _wrapped(lay, table * 0 if zero else table, rank, form == "empty_wrapper_layout")
    return [("sub", _dtensor(local, mesh, [Shard(0)], SHAPE), table)]


# ------------------------------------------------------------------ the calls, on every rank
def _outcome(fn: Callable[[], Any]) -> tuple[str, Any]:
    try:
        return "ok", fn()
    except Exception as e:  # noqa: BLE001 - reported to the test, which checks the type and message
        return type(e).__name__, str(e)


def _check_to_dtensor(dt, table: torch.Tensor) -> bool:
    from torch.distributed.tensor import Replicate, Shard

    import torchrec_dtensor_bridge as tdb

    attached = tdb.to_dtensor(dt)
    local = attached._local_tensor
    assert isinstance(local, tdb.LocalShardsWrapper) and local.layout_of_table is not None, type(local)
    assert attached.device_mesh is dt.device_mesh
    # TorchRec's table-wise claim, Replicate() on a mesh of several ranks of which one holds the table, is
    # corrected to Shard(0) (DTensor then reduces it across the ranks); every other placement is kept
    replicate_claim = dt.device_mesh.size() > 1 and all(isinstance(p, Replicate) for p in dt.placements)
    assert attached.placements == ((Shard(0),) if replicate_claim else dt.placements), attached.placements
    before = dt._local_tensor
    own = before.local_shards() if callable(getattr(before, "local_shards", None)) else (
        [before] if before.numel() else [])
    assert sorted(t.data_ptr() for t in own if t.numel()) == sorted(
        t.data_ptr() for t in local.local_shards() if t.numel()), "to_dtensor copied a shard"
    assert tdb.layout_of(attached).shards == tdb.layout_of(dt).shards
    mesh = dt.device_mesh
    if mesh.size() == 1 or mesh.get_coordinate() is not None:  # the ranks of the table's group
        assert torch.equal(tdb.full_tensor(attached), table), "full_tensor(to_dtensor(dt)) differs"
    return True


def _check_lookup(rank: int, dt, table: torch.Tensor) -> bool:
    import torchrec_dtensor_bridge as tdb

    ids, offsets = _batch(rank, table.shape[0])
    out = tdb.sharded_embedding_bag(ids, dt, offsets, mode="sum")
    torch.testing.assert_close(out, F.embedding_bag(ids, table, offsets, mode="sum"))
    return True


def _check_checkpoint(rank: int, scenario: str, form: str, owner_form: str, path: str) -> bool:
    import torchrec_dtensor_bridge as tdb

    tables = _scenario(rank, scenario, form, owner_form)
    tdb.checkpoint.save({name: dt for name, dt, _ in tables}, path)
    dest = _scenario(rank, scenario, form, owner_form, zero=True)
    tdb.checkpoint.load({name: dt for name, dt, _ in dest}, path)
    for name, dt, table in dest:  # the loaded values, read back on the members of each table's group
        from torchrec_dtensor_bridge.groups import comm_group

        if rank in comm_group(dt).members:
            assert torch.equal(tdb.full_tensor(dt), table), f"{name}: loaded values differ"
    return True


def nothing_here(rank: int, world_size: int, scenario: str, form: str, calls: list[str],
                 path: str) -> dict[str, list[tuple[str, Any]]]:
    """Every call of ``calls`` on every table of the scenario, for each owner form; outcomes per call."""
    import torchrec_dtensor_bridge as tdb

    owners = OWNER_FORMS if scenario == "one_rank_mesh" else ["wrapper"]
    got: dict[str, list[tuple[str, Any]]] = {c: [] for c in calls}
    for k, owner_form in enumerate(owners):
        for name, dt, table in _scenario(rank, scenario, form, owner_form):
            for call in calls:
                if call == "full_tensor":
                    res = _outcome(lambda: bool(torch.equal(tdb.full_tensor(dt), table)) or "wrong values")
                elif call == "to_dtensor":
                    res = _outcome(lambda: _check_to_dtensor(dt, table))
                elif call == "visualize_sharding":
                    res = _outcome(lambda: tdb.visualize_sharding(dt, name=name))
                elif call == "storage_metadata":
                    res = _outcome(lambda: sorted((tuple(c.offsets), tuple(c.sizes))
                                                  for c in tdb.storage_metadata(dt).chunks))
                elif call == "sharded_embedding_bag":
                    res = _outcome(lambda: _check_lookup(rank, dt, table))
                else:
                    continue
                got[call].append(res)
        if "checkpoint" in calls:
            got["checkpoint"].append(_outcome(
                lambda: _check_checkpoint(rank, scenario, form, owner_form, f"{path}/{owner_form}{k}")))
    return got


# ------------------------------------------------------------------ what each rank must see
_OUTSIDE = ("ValueError", "rank 3 is outside the device mesh of ranks [0, 1, 2]")
_NO_LAYOUT_OUTSIDE = ("ValueError",
                      "rank 3 is not in the group of ranks [0, 1, 2] this DTensor's layout is gathered on")
_LOOKUP_REFUSES = ("NotImplementedError", "without the table's layout")


def _expected(scenario: str, form: str, call: str, rank: int) -> tuple[str, str] | None:
    """``None``: the right result; else (exception type, part of its message)."""
    if scenario == "sub_mesh" and rank == 3:  # outside the mesh: no part in the group's collectives
        if call in ("full_tensor", "sharded_embedding_bag", "checkpoint"):
            return _OUTSIDE
        if form == "empty_wrapper":  # it cannot learn a layout the mesh's ranks gather among themselves
            return _NO_LAYOUT_OUTSIDE
        return None
    if call == "sharded_embedding_bag" and form == "empty_wrapper" and scenario != "one_rank_mesh":
        return _LOOKUP_REFUSES  # lookups do not gather layouts (every rank refuses; to_dtensor attaches it)
    return None


def _check(results: list[dict[str, list[tuple[str, Any]]]], scenario: str, form: str) -> None:
    for call in results[0]:
        for rank, got in enumerate(results):
            want = _expected(scenario, form, call, rank)
            for status, detail in got[call]:
                if want is None:
                    assert status == "ok" and detail is not False and detail != "wrong values", (
                        f"{call} on rank {rank}: expected the right result, got {status}: {detail}")
                else:
                    assert status == want[0] and want[1] in str(detail), (
                        f"{call} on rank {rank}: expected {want[0]}({want[1]!r}), got {status}: {detail}")
        if call in ("visualize_sharding", "storage_metadata"):  # every rank that answers draws the same picture
            answers = [[d for s, d in got[call] if s == "ok"] for got in results]
            answers = [a for a in answers if a]
            assert all(a == answers[0] for a in answers), (call, answers)


CASES = [(s, f) for s in ("one_rank_mesh", "full_mesh_rows", "sub_mesh") for f in FORMS] + [
    ("full_mesh_table_wise", "empty_wrapper"), ("full_mesh_table_wise", "empty_wrapper_layout")]


@pytest.mark.parametrize("scenario,form", CASES, ids=[f"{s}-{f}" for s, f in CASES])
def test_collectives_with_nothing_on_a_rank(pool, tmp_path, scenario, form):
    calls = [c for c in CALLS if c != "checkpoint"]
    _check(pool.run(nothing_here, scenario, form, calls, str(tmp_path)), scenario, form)


@pytest.mark.parametrize("scenario,form", CASES, ids=[f"{s}-{f}" for s, f in CASES])
def test_checkpoint_with_nothing_on_a_rank(pool, tmp_path, scenario, form):
    """``checkpoint.save`` then ``checkpoint.load`` into zeroed tables of the same form (default group)."""
    _check(pool.run(nothing_here, scenario, form, ["checkpoint"], str(tmp_path)), scenario, form)


# ------------------------------------------------------------------ the exact pattern that hung
def torchrec_convention_one_rank_meshes(rank: int, world_size: int) -> list[bool]:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate

    import torchrec_dtensor_bridge as tdb

    tables = [_table(i) for i in range(world_size)]
    dts = []
    for i in range(world_size):
        if rank == i:
            local = tdb.LocalShardsWrapper([tables[i].clone()], [(0, 0)])
        else:
            local = tdb.LocalShardsWrapper([], [], global_shape=(8, 16), dtype=torch.float32)
        dts.append(DTensor.from_local(local, DeviceMesh("cpu", [i]), [Replicate()], shape=(8, 16), stride=(16, 1),
                                      run_check=False))
    return [bool(torch.equal(tdb.full_tensor(dts[i]), tables[i])) for i in range(world_size)]


def test_torchrec_convention_on_one_rank_meshes_gives_every_rank_the_table(pool):
    assert pool.run(torchrec_convention_one_rank_meshes) == [[True] * 4] * 4


# ------------------------------------------------------------------ shard_module
def shard_module_nothing_here(rank: int, world_size: int, outside: bool) -> dict[str, tuple[str, Any]]:
    """A plan leaving ranks without blocks (row cuts [5, 3, 0, 0], a table on rank 1) on the mesh of all
    ranks; or (``outside``) the mesh of ranks {0, 1, 2}, which rank 3 calls too."""
    from torch import nn

    import torchrec_dtensor_bridge as tdb
    from torchrec_dtensor_bridge.layout import ShardLayout

    ranks = (0, 1, 2) if outside else (0, 1, 2, 3)
    mesh = _mesh(ranks)
    emb = nn.ModuleDict({"a": nn.EmbeddingBag(*SHAPE, mode="sum"), "b": nn.EmbeddingBag(*SHAPE, mode="sum")})
    with torch.no_grad():
        emb["a"].weight.copy_(_table(1))
        emb["b"].weight.copy_(_table(2))
    plan = {"a.weight": ShardLayout.row_wise(SHAPE, [5, 3, 0, 0][: len(ranks)], ranks=list(ranks)),
            "b.weight": ShardLayout.row_wise(SHAPE, [0, 8, 0], ranks=[0, 1, 2]) if outside
            else ShardLayout.table_wise(SHAPE, 1)}
    got: dict[str, tuple[str, Any]] = {"shard_module": _outcome(lambda: tdb.shard_module(emb, plan, mesh) and True)}
    if got["shard_module"][0] != "ok":
        return got
    group = mesh.get_group() if outside else None
    for key, table in (("a", _table(1)), ("b", _table(2))):
        w = emb[key].weight
        ids, offsets = _batch(rank, SHAPE[0])
        got[f"forward.{key}"] = _outcome(lambda: torch.testing.assert_close(
            emb[key](ids, offsets), F.embedding_bag(ids, table, offsets, mode="sum")) or True)
        got[f"full_tensor.{key}"] = _outcome(lambda: bool(torch.equal(tdb.full_tensor(w, process_group=group),
                                                                      table)))
        got[f"to_dtensor.{key}"] = _outcome(lambda: _check_to_dtensor(w, table) if not outside else True)
        got[f"visualize_sharding.{key}"] = _outcome(lambda: tdb.visualize_sharding(w, name=key))
        got[f"storage_metadata.{key}"] = _outcome(lambda: sorted(
            (tuple(c.offsets), tuple(c.sizes)) for c in tdb.storage_metadata(w).chunks))
    return got


@pytest.mark.parametrize("outside", [False, True], ids=["blockless_ranks", "rank_outside_the_mesh"])
def test_shard_module_with_nothing_on_a_rank(pool, outside):
    results = pool.run(shard_module_nothing_here, outside)
    for rank, got in enumerate(results):
        if outside and rank == 3:
            assert got == {"shard_module": ("ValueError", got["shard_module"][1])}, got
            assert "rank 3 is not in device_mesh's ranks [0, 1, 2]" in got["shard_module"][1], got
            continue
        for call, (status, detail) in got.items():
            assert status == "ok" and detail is not False, (rank, call, status, detail)
    members = results[:3] if outside else results
    for call in members[0]:
        if call.startswith(("visualize_sharding", "storage_metadata")):
            assert all(m[call] == members[0][call] for m in members), (call, [m[call] for m in members])


# ------------------------------------------------------------------ full_tensor: local checks agreed first
def full_tensor_agreement(rank: int, world_size: int, case: str) -> tuple[str, Any]:
    """A table whose ranks see it inconsistently, or in mixed forms; ``full_tensor``'s outcome on this rank."""
    from torch.distributed.tensor import Replicate, Shard

    import torchrec_dtensor_bridge as tdb
    from torchrec_dtensor_bridge.layout import ShardLayout

    table = _table(3)
    if case in ("another_owner", "owner_short", "owner_two_blocks"):
        lay = ShardLayout.table_wise(SHAPE, 0, dtype=torch.float32)
        if rank == 0:
            rows = {"owner_short": [(0, 4)], "owner_two_blocks": [(0, 3), (3, 5)]}.get(case, [(0, 8)])
            local = tdb.LocalShardsWrapper([table[a : a + n].clone() for a, n in rows], [(a, 0) for a, _ in rows],
                                           global_shape=SHAPE)
        elif rank == 2 and case == "another_owner":  # its empty wrapper's layout names rank 1 as the owner
            local = tdb.LocalShardsWrapper([], [], layout=ShardLayout.table_wise(SHAPE, 1, dtype=torch.float32))
        else:
            local = _wrapped(lay, table, rank, False)
        dt = _dtensor(local, _mesh((0,)), [Replicate()], SHAPE)
    elif case == "mixed_wrappers":  # ranks 0 and 2 carry the layout, ranks 1 and 3 do not: all gather
        lay = ShardLayout.row_wise(SHAPE, [5, 3, 0, 0], dtype=torch.float32)
        dt = _dtensor(_wrapped(lay, table, rank, rank % 2 == 0), _mesh((0, 1, 2, 3)), [Shard(0)], SHAPE)
    else:
        assert case == "layouts_differ", case  # rank 3's layout puts rank 1's rows on rank 2
        lay = ShardLayout.row_wise(SHAPE, [5, 3, 0, 0], dtype=torch.float32)
        other = ShardLayout.row_wise(SHAPE, [5, 3], ranks=[0, 2], dtype=torch.float32)
        local = _wrapped(lay, table, rank, True)
        if rank == 3:
            local = tdb.LocalShardsWrapper([], [], layout=other)
        dt = _dtensor(local, _mesh((0, 1, 2, 3)), [Shard(0)], SHAPE)
    return _outcome(lambda: bool(torch.equal(tdb.full_tensor(dt, name="t"), table)))


AGREEMENT_CASES = {
    "another_owner": ("ValueError", "rank 2: shape [8, 16], all of it on rank 1"),
    "owner_short": ("ValueError", "shards cover 64 of 128 elements"),
    "layouts_differ": ("ValueError",
                       "rank 3: shape [8, 16], blocks ['rank 0 [0, 0]+[5, 16]', 'rank 2 [5, 0]+[3, 16]']"),
    "owner_two_blocks": None,
    "mixed_wrappers": None,
}


@pytest.mark.parametrize("case", sorted(AGREEMENT_CASES))
def test_full_tensor_agrees_before_it_moves_data(pool, case):
    """Every rank returns the table, or every rank raises the same kind of error naming the problem."""
    want = AGREEMENT_CASES[case]
    for rank, (status, detail) in enumerate(pool.run(full_tensor_agreement, case)):
        if want is None:
            assert (status, detail) == ("ok", True), (rank, status, detail)
        else:
            assert status == want[0] and want[1] in detail, (rank, status, detail)
