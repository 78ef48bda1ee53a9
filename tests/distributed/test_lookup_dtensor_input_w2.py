"""DTensor inputs of ``sharded_embedding_bag`` / ``sharded_embedding`` on 2 gloo ranks.

* ``Replicate()`` input (the same whole batch on every rank): the output's
  ``full_tensor()`` and the weight's gradient equal ``F.embedding_bag`` /
  ``F.embedding`` on the full table, and the output's placements are the
  documented ones (``Replicate`` for a replicated weight, ``Shard(1)`` for an
  even column cut, ``Partial`` for row cuts and uneven/table-wise column cuts,
  ``Shard(0)`` for max's fallback on those).
* ``Shard(0)`` input (each rank's own batch): a ``Shard(0)`` output of all
  ranks' bags in rank order, with parity of outputs and gradients (even
  batches), and of outputs for uneven batches (carried by a LocalShardsWrapper).
* Validation raises on every rank, never hangs. Checks that need a collective
  (the ranks' inputs differing in kind - ``Replicate()`` on one rank, a plain
  tensor on the other - or in the values of a ``Replicate()`` batch) run under
  ``TORCH_DISTRIBUTED_DEBUG=DETAIL``, as torch's own consistency checks.
* A ``Replicate()`` input makes no collective in forward or backward where no
  data must move (DTensor's contract), and ONE small agreement ``all_gather``
  under ``DETAIL``.
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from torchrec_dtensor_bridge.layout import ShardLayout

from .checks import layouts_w2
from .harness import make_pool_fixture

pool = make_pool_fixture(2)

SHAPE = (12, 8)


@contextlib.contextmanager
def debug_detail(on: bool = True):
    """``TORCH_DISTRIBUTED_DEBUG=DETAIL`` for the lookups inside (the process group itself stays as it is)."""
    old = os.environ.get("TORCH_DISTRIBUTED_DEBUG")
    if on:
        os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
        dist.set_debug_level_from_env()
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TORCH_DISTRIBUTED_DEBUG", None)
        else:
            os.environ["TORCH_DISTRIBUTED_DEBUG"] = old
        dist.set_debug_level_from_env()

LAYOUTS = layouts_w2(SHAPE)

# the output placement a replicated input gets, per layout (max on Partial layouts falls back to Shard(0))
REPLICATED_PLACEMENT = {
    "replicated": "R", "row_wise": "P(sum)", "row_wise_two_per_rank": "P(sum)", "grid": "P(sum)",
    "column_wise": "S(1)", "column_wise_uneven": "P(sum)", "column_wise_two_per_rank": "P(sum)",
    "table_wise": "P(sum)",
}


def _table() -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(7))


def _weight(layout: ShardLayout, table: torch.Tensor, rank: int):
    from torchrec_dtensor_bridge.convert import dtensor_from_local_shards

    return dtensor_from_local_shards(layout, [table[s.slices()].clone() for s in layout.shards_on(rank)]).requires_grad_()


def _mesh():
    from torchrec_dtensor_bridge.convert.placements import world_mesh

    return world_mesh("cpu")


def _batch(seed: int, n_bags: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids with bags of varied length (one empty bag, padding id 0 present), offsets, per-sample weights."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 5, (n_bags,), generator=g)
    lengths[1] = 0
    ids = torch.randint(0, SHAPE[0], (int(lengths.sum()),), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lengths, 0)[:-1]])
    return ids, offsets, torch.rand(ids.shape, generator=g)


def _grad_of(weight) -> torch.Tensor:
    import torchrec_dtensor_bridge as tdb

    return tdb.full_tensor(weight.grad)


# ------------------------------------------------------------ Replicate() input
def replicated_bag(rank: int, world_size: int, layout_name: str, mode: str, psw: bool, padding: int | None) -> str:
    from torch.distributed.tensor import DTensor, Replicate

    from torchrec_dtensor_bridge.lookup import sharded_embedding_bag

    ids, offsets, w = _batch(3, 6)
    table = _table()
    mesh = _mesh()
    weight = _weight(LAYOUTS[layout_name], table, rank)
    d = [DTensor.from_local(t, mesh, [Replicate()], run_check=False) for t in (ids, offsets, w)]
    out = sharded_embedding_bag(d[0], weight, d[1], mode=mode, per_sample_weights=d[2] if psw else None,
                                padding_idx=padding)
    assert isinstance(out, DTensor), type(out)
    ref_w = table.clone().requires_grad_()
    ref = F.embedding_bag(ids, ref_w, offsets, mode=mode, per_sample_weights=w if psw else None, padding_idx=padding)
    full = out.full_tensor()
    torch.testing.assert_close(full, ref, rtol=1e-5, atol=1e-5)
    g = torch.randn(ref.shape, generator=torch.Generator().manual_seed(5))
    (full * g).sum().backward()
    (ref * g).sum().backward()
    torch.testing.assert_close(_grad_of(weight), ref_w.grad, rtol=1e-5, atol=1e-5)
    return str(out.placements[0])


@pytest.mark.parametrize("layout_name", sorted(LAYOUTS))
@pytest.mark.parametrize("mode,psw,padding", [("sum", False, None), ("sum", True, None), ("mean", False, 0),
                                              ("max", False, None)])
def test_replicated_input_bag(pool, layout_name, mode, psw, padding):
    want = REPLICATED_PLACEMENT[layout_name]
    if mode == "max" and want == "P(sum)":
        want = "S(0)"
    for placement in pool.run(replicated_bag, layout_name, mode, psw, padding):
        assert placement == want


def replicated_embedding(rank: int, world_size: int, layout_name: str) -> str:
    from torch.distributed.tensor import DTensor, Replicate

    from torchrec_dtensor_bridge.lookup import sharded_embedding

    ids = torch.randint(0, SHAPE[0], (3, 4), generator=torch.Generator().manual_seed(1))
    table = _table()
    weight = _weight(LAYOUTS[layout_name], table, rank)
    out = sharded_embedding(DTensor.from_local(ids, _mesh(), [Replicate()], run_check=False), weight, padding_idx=2)
    assert isinstance(out, DTensor) and out.shape == (3, 4, SHAPE[1]), out.shape
    ref_w = table.clone().requires_grad_()
    ref = F.embedding(ids, ref_w, padding_idx=2)
    full = out.full_tensor()
    torch.testing.assert_close(full, ref)
    g = torch.randn(ref.shape, generator=torch.Generator().manual_seed(5))
    (full * g).sum().backward()
    (ref * g).sum().backward()
    torch.testing.assert_close(_grad_of(weight), ref_w.grad, rtol=1e-5, atol=1e-5)
    return str(out.placements[0])


@pytest.mark.parametrize("layout_name", ["replicated", "row_wise", "column_wise", "grid", "table_wise"])
def test_replicated_input_embedding(pool, layout_name):
    want = {"S(1)": "S(2)"}.get(REPLICATED_PLACEMENT[layout_name], REPLICATED_PLACEMENT[layout_name])
    for placement in pool.run(replicated_embedding, layout_name):
        assert placement == want


def replicated_max_norm(rank: int, world_size: int, layout_name: str) -> None:
    from torch.distributed.tensor import DTensor, Replicate

    from torchrec_dtensor_bridge.lookup import sharded_embedding_bag

    ids, offsets, _ = _batch(4, 5)
    table = _table() * 3
    weight = _weight(LAYOUTS[layout_name], table, rank)
    mesh = _mesh()
    out = sharded_embedding_bag(DTensor.from_local(ids, mesh, [Replicate()], run_check=False), weight,
                                DTensor.from_local(offsets, mesh, [Replicate()], run_check=False),
                                mode="sum", max_norm=1.0)
    ref_t = table.clone()
    ref = F.embedding_bag(ids, ref_t, offsets, mode="sum", max_norm=1.0)
    torch.testing.assert_close(out.full_tensor(), ref, rtol=1e-5, atol=1e-5)
    import torchrec_dtensor_bridge as tdb

    torch.testing.assert_close(tdb.full_tensor(weight.detach()), ref_t, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout_name", ["row_wise", "column_wise", "replicated"])
def test_replicated_input_max_norm(pool, layout_name):
    pool.run(replicated_max_norm, layout_name)


# ------------------------------------------------------------ Shard(0) input (each rank's own batch)
def sharded_bag(rank: int, world_size: int, layout_name: str, mode: str, even: bool) -> str:
    from torch.distributed.tensor import DTensor, Shard

    import torchrec_dtensor_bridge as tdb
    from torchrec_dtensor_bridge.lookup import sharded_embedding_bag

    mesh = _mesh()
    batches = [_batch(20 + r, 4 if even else 4 + r) for r in range(world_size)]
    ids, offsets, _ = batches[rank]
    table = _table()
    weight = _weight(LAYOUTS[layout_name], table, rank)
    d_ids = DTensor.from_local(ids, mesh, [Shard(0)], run_check=False)
    d_off = DTensor.from_local(offsets, mesh, [Shard(0)], run_check=False)
    out = sharded_embedding_bag(d_ids, weight, d_off, mode=mode)
    assert isinstance(out, DTensor)
    ref_w = table.clone().requires_grad_()
    ref = torch.cat([F.embedding_bag(i, ref_w, o, mode=mode) for i, o, _ in batches])
    assert tuple(out.shape) == tuple(ref.shape)
    if not even:
        torch.testing.assert_close(tdb.full_tensor(out), ref, rtol=1e-5, atol=1e-5)
        return str(out.placements[0])
    full = out.full_tensor()
    torch.testing.assert_close(full, ref, rtol=1e-5, atol=1e-5)
    g = torch.randn(ref.shape, generator=torch.Generator().manual_seed(5))
    (full * g).sum().backward()
    (ref * g).sum().backward()
    torch.testing.assert_close(_grad_of(weight), ref_w.grad, rtol=1e-5, atol=1e-5)
    return str(out.placements[0])


@pytest.mark.parametrize("layout_name", ["replicated", "row_wise", "column_wise", "grid", "table_wise"])
@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("even", [True, False], ids=["even", "uneven"])
def test_batch_sharded_input_bag(pool, layout_name, mode, even):
    for placement in pool.run(sharded_bag, layout_name, mode, even):
        assert placement == "S(0)"


def sharded_embedding_2d(rank: int, world_size: int, layout_name: str) -> None:
    from torch.distributed.tensor import DTensor, Shard

    from torchrec_dtensor_bridge.lookup import sharded_embedding

    all_ids = [torch.randint(0, SHAPE[0], (2, 3), generator=torch.Generator().manual_seed(r)) for r in range(2)]
    table = _table()
    weight = _weight(LAYOUTS[layout_name], table, rank)
    out = sharded_embedding(DTensor.from_local(all_ids[rank], _mesh(), [Shard(0)], run_check=False), weight)
    ref_w = table.clone().requires_grad_()
    ref = F.embedding(torch.cat(all_ids), ref_w)
    full = out.full_tensor()
    torch.testing.assert_close(full, ref)
    g = torch.randn(ref.shape, generator=torch.Generator().manual_seed(5))
    (full * g).sum().backward()
    (ref * g).sum().backward()
    torch.testing.assert_close(_grad_of(weight), ref_w.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout_name", ["row_wise", "column_wise", "replicated"])
def test_batch_sharded_input_embedding(pool, layout_name):
    pool.run(sharded_embedding_2d, layout_name)


# ------------------------------------------------------------ validation: every rank raises, nothing hangs
def bad_input(rank: int, world_size: int, case: str) -> str:
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from torchrec_dtensor_bridge.lookup import sharded_embedding_bag

    mesh = _mesh()
    weight = _weight(LAYOUTS["row_wise"], _table(), rank)
    ids, offsets, _ = _batch(1, 3)
    if case == "replicated_bad_id":
        ids = ids.clone()
        ids[0] = SHAPE[0]
        args = (DTensor.from_local(ids, mesh, [Replicate()], run_check=False), weight,
                DTensor.from_local(offsets, mesh, [Replicate()], run_check=False))
    elif case == "sharded_bad_id_on_rank_1":
        if rank == 1:
            ids = ids.clone()
            ids[0] = -1
        args = (DTensor.from_local(ids, mesh, [Shard(0)], run_check=False), weight,
                DTensor.from_local(offsets, mesh, [Shard(0)], run_check=False))
    elif case == "shard_dim_1":
        args = (DTensor.from_local(ids.view(-1, 1), mesh, [Shard(1)], run_check=False), weight, None)
    elif case == "mixed_placements":
        args = (DTensor.from_local(ids, mesh, [Replicate()], run_check=False), weight,
                DTensor.from_local(offsets, mesh, [Shard(0)], run_check=False))
    elif case in ("replicated_bad_id_on_rank_0_max", "replicated_values_differ", "replicated_values_differ_unchecked"):
        if rank == 0:  # a "replicated" batch that is not the same on every rank
            ids = ids.clone()
            ids[0] = SHAPE[0] if case == "replicated_bad_id_on_rank_0_max" else (int(ids[0]) + 1) % SHAPE[0]
        args = (DTensor.from_local(ids, mesh, [Replicate()], run_check=False), weight,
                DTensor.from_local(offsets, mesh, [Replicate()], run_check=False))
    elif case == "replicate_on_rank_0_plain_on_rank_1":
        args = ((DTensor.from_local(ids, mesh, [Replicate()], run_check=False), weight,
                 DTensor.from_local(offsets, mesh, [Replicate()], run_check=False)) if rank == 0
                else (ids, weight, offsets))
    else:  # plain input, DTensor offsets
        args = (ids, weight, DTensor.from_local(offsets, mesh, [Replicate()], run_check=False))
    cross_rank = case in ("replicated_bad_id_on_rank_0_max", "replicated_values_differ",
                          "replicate_on_rank_0_plain_on_rank_1")
    try:
        with debug_detail(cross_rank):  # differences between ranks' Replicate() batches: a DETAIL check
            sharded_embedding_bag(*args, mode="max" if case.endswith("_max") else "sum")
    except (TypeError, ValueError, NotImplementedError) as e:
        return type(e).__name__
    return "no error"


@pytest.mark.parametrize("case,kind", [
    ("replicated_bad_id", "ValueError"),
    ("sharded_bad_id_on_rank_1", "ValueError"),
    ("shard_dim_1", "NotImplementedError"),
    ("mixed_placements", "ValueError"),
    ("plain_input_dtensor_offsets", "TypeError"),
    ("replicated_bad_id_on_rank_0_max", "ValueError"),
    ("replicated_values_differ", "ValueError"),
    ("replicate_on_rank_0_plain_on_rank_1", "ValueError"),
    ("replicated_values_differ_unchecked", "no error"),  # without DETAIL nothing compares the ranks' batches
])
def test_dtensor_input_validation(pool, case, kind):
    assert pool.run(bad_input, case) == [kind, kind]


def bad_input_message(rank: int, world_size: int, case: str) -> str:
    """The message each rank raises (the kind is checked by ``test_dtensor_input_validation``)."""
    from torch.distributed.tensor import DTensor, Replicate

    from torchrec_dtensor_bridge.lookup import sharded_embedding_bag

    mesh = _mesh()
    weight = _weight(LAYOUTS["row_wise"], _table(), rank)
    ids, offsets, _ = _batch(1, 3)
    if case == "kind" and rank == 1:
        args = (ids, weight, offsets)
    else:
        if case == "values" and rank == 0:
            ids = ids.clone()
            ids[0] = (int(ids[0]) + 1) % SHAPE[0]
        args = (DTensor.from_local(ids, mesh, [Replicate()], run_check=False), weight,
                DTensor.from_local(offsets, mesh, [Replicate()], run_check=False))
    try:
        with debug_detail():
            sharded_embedding_bag(*args, mode="sum")
    except ValueError as e:
        return str(e)
    return "no error"


def test_dtensor_input_disagreement_messages(pool):
    for msg in pool.run(bad_input_message, "kind"):
        assert "ranks disagree on the input's kind: ['a Replicate() DTensor', 'a plain tensor']" in msg, msg
    for msg in pool.run(bad_input_message, "values"):
        assert "a Replicate() input must be the same batch on every rank" in msg, msg


# ------------------------------------------------------------ Replicate() input: the agreement, no data collective
def replicated_counts(rank: int, world_size: int, layout_name: str, call: str, detail: bool = False,
                      ) -> tuple[dict, dict]:
    from torch.distributed.tensor import DTensor, Replicate

    from torchrec_dtensor_bridge.lookup import sharded_embedding, sharded_embedding_bag

    from .test_lookup_comm_w2 import CommCounter

    ids, offsets, _ = _batch(3, 6)
    mesh = _mesh()
    weight = _weight(LAYOUTS[layout_name], _table(), rank)
    d_ids = DTensor.from_local(ids, mesh, [Replicate()], run_check=False)
    with debug_detail(detail), CommCounter() as fwd:
        if call == "embedding":
            out = sharded_embedding(d_ids, weight)
        else:
            out = sharded_embedding_bag(d_ids, weight, DTensor.from_local(offsets, mesh, [Replicate()],
                                                                          run_check=False), mode="mean")
    with CommCounter() as bwd:
        out.to_local().sum().backward()
    return fwd.counts, bwd.counts


@pytest.mark.parametrize("layout_name", ["replicated", "row_wise", "column_wise", "column_wise_two_per_rank", "grid",
                                         "table_wise"])
@pytest.mark.parametrize("call", ["bag", "embedding"])
def test_replicated_input_makes_no_collective(pool, layout_name, call):
    for fwd, bwd in pool.run(replicated_counts, layout_name, call):
        assert fwd == {} and bwd == {}, (fwd, bwd)


@pytest.mark.parametrize("layout_name", ["row_wise", "column_wise"])
def test_replicated_input_checked_under_debug_detail(pool, layout_name):
    for fwd, bwd in pool.run(replicated_counts, layout_name, "bag", True):
        assert fwd == {"all_gather": 1} and bwd == {}, (fwd, bwd)
