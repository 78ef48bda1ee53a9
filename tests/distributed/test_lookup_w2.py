"""Sharded lookups on 2 gloo ranks: parity with F.embedding_bag / F.embedding, gradients, bad inputs.

The per-rank routines here are shared with ``test_lookup_w3.py``. Each
``pool.run`` checks one layout against every mode x option case, so a layout
costs one round trip to the workers.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from torchrec_dtensor_bridge.layout import LayoutKind, ShardLayout

from .checks import expect_raises
from .harness import make_pool_fixture

pool = make_pool_fixture(2)

TOL = dict(rtol=1e-5, atol=1e-5)

# (name, mode, options): every mode x option combination torch accepts.
BAG_CASES = [
    (f"{mode}-{opt}", mode, opt)
    for mode in ("sum", "mean", "max")
    for opt in ("offsets", "2d", "last_offset", "padding", "max_norm", "max_norm_p1")
] + [("sum-psw", "sum", "psw"), ("sum-psw-padding", "sum", "psw_padding")]


def _table(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g)


def _weight(layout: ShardLayout, table: torch.Tensor, rank: int):
    from torchrec_dtensor_bridge.convert import dtensor_from_local_shards

    shards = [table[s.slices()].clone() for s in layout.shards_on(rank)]
    return dtensor_from_local_shards(layout, shards).requires_grad_()


def _batch(rank: int, rows: int, opt: str, seed: int, extra: int = 0) -> dict:
    """This rank's own batch (sizes differ per rank; ``extra`` more bags), with one empty bag."""
    g = torch.Generator().manual_seed(seed * 97 + rank)
    num_bags = 3 + 2 * rank + extra
    if opt == "2d":
        return {"input": torch.randint(0, rows, (num_bags, 3), generator=g)}
    lengths = torch.randint(1, 5, (num_bags,), generator=g)
    lengths[1] = 0
    ids = torch.randint(0, rows, (int(lengths.sum()),), generator=g)
    if opt in ("padding", "psw_padding"):
        ids[::3] = 2  # padding ids, including a whole bag of them when lengths allow
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    kw: dict = {"input": ids, "offsets": offsets[:-1]}
    if opt == "last_offset":
        kw.update(offsets=offsets, include_last_offset=True)
    if opt.startswith("psw"):
        kw["per_sample_weights"] = torch.rand(ids.shape, generator=g)
    if opt in ("padding", "psw_padding"):
        kw["padding_idx"] = 2
    if opt == "max_norm":
        kw["max_norm"] = 1.5
    if opt == "max_norm_p1":
        kw.update(max_norm=2.0, norm_type=1.0)
    return kw


def _everyone(obj: object) -> list:
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _assert_grad(grad, ref: torch.Tensor, layout: ShardLayout, rank: int, what: str) -> None:
    import torchrec_dtensor_bridge as tdb
    from torchrec_dtensor_bridge.convert import layout_of, local_shards_of

    assert grad is not None, f"{what}: no weight.grad"
    assert layout_of(grad).shards == layout.shards, f"{what}: grad layout differs from the weight's"
    for spec, g in zip(layout.shards_on(rank), local_shards_of(grad)):
        torch.testing.assert_close(g, ref[spec.slices()], **TOL, msg=lambda m: f"{what} shard {spec}: {m}")
    torch.testing.assert_close(tdb.full_tensor(grad), ref, **TOL)


def check_bag_parity(rank: int, world_size: int, layout: ShardLayout, seed: int = 0) -> int:
    """Every mode x option case of ``sharded_embedding_bag`` on ``layout``: outputs,
    gradients (sum over all ranks' batches) and in-place ``max_norm``."""
    import torchrec_dtensor_bridge as tdb
    from torchrec_dtensor_bridge.lookup import sharded_embedding_bag

    table = _table(layout.global_shape, seed)
    rows = layout.global_shape[0]
    for k, (name, mode, opt) in enumerate(BAG_CASES):
        what = f"{layout.name}/{name} rank {rank}"
        weight = _weight(layout, table, rank)
        mine = _batch(rank, rows, opt, seed + k)
        kw = {key: v for key, v in mine.items() if key != "input"}
        out = sharded_embedding_bag(mine["input"], weight, mode=mode, **kw)
        full = table.clone().requires_grad_()
        loss = 0.0
        for q, theirs in enumerate(_everyone(mine)):
            tkw = {key: v for key, v in theirs.items() if key != "input"}
            ref = F.embedding_bag(theirs["input"], full, mode=mode, **tkw)
            g_out = torch.linspace(-1, 1, ref.numel()).view_as(ref) * (q + 1)
            loss = loss + (ref * g_out).sum()
            if q == rank:
                torch.testing.assert_close(out, ref.detach(), **TOL, msg=lambda m: f"{what}: {m}")
                (out * g_out).sum().backward()
        loss.backward()
        _assert_grad(weight.grad, full.grad, layout, rank, what)
        if "max_norm" in kw:
            torch.testing.assert_close(tdb.full_tensor(weight.detach()), full.detach(), **TOL)
    return len(BAG_CASES)


def check_embedding_parity(rank: int, world_size: int, layout: ShardLayout, seed: int = 0) -> None:
    """``sharded_embedding``: plain, padding_idx (negative), max_norm; grads accumulate over two calls."""
    from torchrec_dtensor_bridge.lookup import sharded_embedding

    table = _table(layout.global_shape, seed)
    rows = layout.global_shape[0]
    for opts in ({}, {"padding_idx": -1}, {"max_norm": 1.0}):
        what = f"{layout.name}/embedding{opts} rank {rank}"
        weight = _weight(layout, table, rank)
        g = torch.Generator().manual_seed(seed + rank)
        ids = torch.randint(0, rows, (2 + rank, 3), generator=g)
        ids[0, 0] = rows - 1
        full = table.clone().requires_grad_()
        for _ in range(2):  # the second backward accumulates into weight.grad
            out = sharded_embedding(ids, weight, **opts)
            loss = 0.0
            for q, theirs in enumerate(_everyone(ids)):
                ref = F.embedding(theirs, full, **opts)
                g_out = torch.linspace(-1, 1, ref.numel()).view_as(ref) + q
                loss = loss + (ref * g_out).sum()
                if q == rank:
                    torch.testing.assert_close(out, ref.detach(), **TOL, msg=lambda m: f"{what}: {m}")
                    (out * g_out).sum().backward()
            loss.backward()
        _assert_grad(weight.grad, full.grad, layout, rank, what)


def check_no_grad(rank: int, world_size: int, layout: ShardLayout) -> None:
    """Under ``torch.no_grad`` (and with a weight that needs none) no graph is kept."""
    from torchrec_dtensor_bridge.lookup import sharded_embedding_bag

    table = _table(layout.global_shape, 1)
    weight = _weight(layout, table, rank)
    ids = torch.arange(layout.global_shape[0]).view(-1, 1)[rank:]
    with torch.no_grad():
        out = sharded_embedding_bag(ids, weight, mode="sum")
    assert not out.requires_grad
    torch.testing.assert_close(out, table[rank:], **TOL)


LAYOUTS_W2 = {
    "row_wise_even": ShardLayout.row_wise((10, 6), 2),
    "row_wise_two_per_rank": ShardLayout.row_wise((11, 6), [2, 4, 3, 2], ranks=[0, 1, 0, 1]),
    "row_wise_one_rank_empty": ShardLayout.row_wise((7, 4), [7, 0]),
    "column_wise": ShardLayout.column_wise((9, 8), [3, 5]),
    "column_wise_two_per_rank": ShardLayout.column_wise((9, 8), [2, 2, 3, 1], ranks=[0, 1, 1, 0]),
    "table_wise": ShardLayout.table_wise((9, 5), 1),
    "grid": ShardLayout.grid((10, 8), [4, 6], [3, 5], [0, 1, 1, 0]),
    "replicated": ShardLayout.replicated((9, 5), [0, 1]),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS_W2))
def test_embedding_bag_parity(pool, name):
    layout = LAYOUTS_W2[name].with_name(name)
    assert pool.run(check_bag_parity, layout) == [len(BAG_CASES)] * 2


@pytest.mark.parametrize("name", ["row_wise_two_per_rank", "column_wise_two_per_rank", "grid", "table_wise"])
def test_embedding_parity(pool, name):
    pool.run(check_embedding_parity, LAYOUTS_W2[name].with_name(name))


def test_no_grad(pool):
    pool.run(check_no_grad, LAYOUTS_W2["row_wise_even"])


def test_layouts_cover_every_kind():
    assert {lay.kind for lay in LAYOUTS_W2.values()} == set(LayoutKind)


# ---------------------------------------------------------------- several tables in one call
# per table: (mode, option) - every mode, per-table padding / per_sample_weights / max_norm
TABLE_CASES = [("sum", "offsets"), ("mean", "padding"), ("max", "2d"), ("sum", "psw"),
               ("mean", "max_norm"), ("max", "padding"), ("sum", "last_offset"), ("mean", "2d")]


def check_bags_parity(rank: int, world_size: int, layouts: list[ShardLayout], seed: int = 0,
                      vary: bool = False) -> int:
    """``sharded_embedding_bags`` over tables of different layouts, shapes, modes and options at once:
    every output equals ``F.embedding_bag`` on its full table and every ``weight.grad`` the gradient of
    all ranks' batches; ``max_norm`` renormalises its table in place. ``vary``: the tables' batches
    also differ in size from one table to the next (the exchanges cannot lay all tables' rows side
    by side)."""
    import torchrec_dtensor_bridge as tdb

    tables = [_table(lay.global_shape, seed + t) for t, lay in enumerate(layouts)]
    weights = [_weight(lay, tab, rank) for lay, tab in zip(layouts, tables)]
    cases = [TABLE_CASES[(t + seed) % len(TABLE_CASES)] for t in range(len(layouts))]
    # every table's batch: different sizes per rank and per table; 2-D and 1-D inputs mixed
    mine = [_batch(rank, lay.global_shape[0], opt, seed + 31 * t, t % 3 if vary else 0)
            for t, (lay, (_, opt)) in enumerate(zip(layouts, cases))]
    for kw in mine:
        if "offsets" in kw and not kw.get("include_last_offset"):
            continue
        if "offsets" in kw:  # one include_last_offset for all tables: give every 1-D table its last offset
            kw["offsets"] = kw["offsets"][:-1]
            kw.pop("include_last_offset")
    options = {
        "mode": [m for m, _ in cases],
        "padding_idx": [kw.pop("padding_idx", None) for kw in mine],
        "max_norm": [kw.pop("max_norm", None) for kw in mine],
        "norm_type": [kw.pop("norm_type", 2.0) for kw in mine],
    }
    outs = tdb.sharded_embedding_bags(
        [kw["input"] for kw in mine], weights, [kw.get("offsets") for kw in mine],
        per_sample_weights=[kw.get("per_sample_weights") for kw in mine], **options,
    )
    assert len(outs) == len(layouts)
    everyone = _everyone(mine)
    for t, (lay, tab, w) in enumerate(zip(layouts, tables, weights)):
        what = f"table {t} ({lay.name}, {cases[t]}) rank {rank}"
        full = tab.clone().requires_grad_()
        loss = 0.0
        for q, theirs in enumerate(everyone):
            kw = theirs[t]
            ref = F.embedding_bag(kw["input"], full, kw.get("offsets"), mode=options["mode"][t],
                                  per_sample_weights=kw.get("per_sample_weights"),
                                  padding_idx=options["padding_idx"][t], max_norm=options["max_norm"][t],
                                  norm_type=options["norm_type"][t])
            g_out = torch.linspace(-1, 1, ref.numel()).view_as(ref) * (q + 1 + t)
            loss = loss + (ref * g_out).sum()
            if q == rank:
                torch.testing.assert_close(outs[t], ref.detach(), **TOL, msg=lambda m: f"{what}: {m}")
                outs[t].mul(g_out).sum().backward(retain_graph=True)
        loss.backward()
        _assert_grad(w.grad, full.grad, lay, rank, what)
        if options["max_norm"][t] is not None:
            torch.testing.assert_close(tdb.full_tensor(w.detach()), full.detach(), **TOL)
    return len(layouts)


def test_embedding_bags_every_layout_at_once(pool):
    layouts = [lay.with_name(name) for name, lay in sorted(LAYOUTS_W2.items())]
    assert pool.run(check_bags_parity, layouts) == [len(layouts)] * 2


def test_embedding_bags_shifted_options(pool):
    """The same tables with every table given another mode/option case than above."""
    layouts = [lay.with_name(name) for name, lay in sorted(LAYOUTS_W2.items())]
    assert pool.run(check_bags_parity, layouts, 3) == [len(layouts)] * 2


def test_embedding_bags_tables_of_different_batch_sizes(pool):
    """Every layout at once, each table with its own number of bags per rank."""
    layouts = [lay.with_name(name) for name, lay in sorted(LAYOUTS_W2.items())]
    assert pool.run(check_bags_parity, layouts, 1, True) == [len(layouts)] * 2


def _half_bags_reference(table: torch.Tensor, layout: ShardLayout, ids: torch.Tensor, offsets: torch.Tensor,
                         world_size: int) -> torch.Tensor:
    """The sum bags of an fp16 row-cut table as the lookup defines them, from plain torch ops on the whole
    table: each row block pooled in fp32 and rounded to fp16 (the kernels' output), a rank's blocks added in
    fp16 (the table's dtype), the ranks' sums added and rounded to fp16 once (exact in fp32 for the tables
    here, whose every sum is a multiple of 2**-9 below 2**5)."""
    full = table.float()
    per_rank = []
    for r in range(world_size):
        acc = torch.zeros(offsets.numel(), layout.global_shape[1], dtype=torch.float16)
        for spec in layout.shards_on(r):
            block = torch.zeros_like(full)
            block[spec.slices()] = full[spec.slices()]
            acc = acc + F.embedding_bag(ids, block, offsets, mode="sum").half()
        per_rank.append(acc)
    return sum(p.float() for p in per_rank).half()


def check_row_cut_tables_of_mixed_dtypes(rank: int, world_size: int) -> None:
    """Row-cut tables of one batch size in ONE call: the reduce message is row-major, and here it cannot be a
    kernel's output (three storages, a table with two row blocks on a rank, an fp16 table beside fp32 ones:
    its blocks are summed in fp16, then placed in the fp32 message). Every output has its weight's dtype and
    equals ``F.embedding_bag`` on its full table (the fp16 table's bit for bit, pooled in the order the lookup
    defines, alone or beside the fp32 tables), and every gradient the gradient of all ranks' batches."""
    import torchrec_dtensor_bridge as tdb

    layouts = [ShardLayout.row_wise((10, 6), 2), ShardLayout.row_wise((13, 4), [3, 4, 3, 3], ranks=[0, 1, 0, 1]),
               ShardLayout.grid((8, 6), [4, 4], [3, 3], [0, 1, 1, 0])]
    dtypes = [torch.float32, torch.float16, torch.float32]
    tables = [_table(lay.global_shape, 40 + t).to(dt) for t, (lay, dt) in enumerate(zip(layouts, dtypes))]
    # fp16 values k / 512 (|k| < 2048): a block's fp32 sum of a bag is exact in any order, its fp16 rounding
    # is not, and a rank's two blocks added in fp16 round again
    g = torch.Generator().manual_seed(41)
    tables[1] = (torch.randint(-2047, 2048, layouts[1].global_shape, generator=g) / 512).half()
    weights = [_weight(lay, tab, rank) for lay, tab in zip(layouts, tables)]
    mine = [_batch(rank, lay.global_shape[0], "offsets", 60 + t) for t, lay in enumerate(layouts)]
    for kw in mine[1:]:  # one batch size for every table: the bags of table 0, ids drawn for each table
        g = torch.Generator().manual_seed(70 + rank)
        kw["offsets"] = mine[0]["offsets"]
        kw["input"] = torch.randint(0, 8, mine[0]["input"].shape, generator=g)
    lengths = torch.full((len(mine[0]["offsets"]),), 6)  # table 1: as many bags, longer, in all 4 row blocks
    lengths[1] = 0
    mine[1]["offsets"] = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)[:-1]])
    mine[1]["input"] = torch.randint(0, 13, (int(lengths.sum()),), generator=torch.Generator().manual_seed(80 + rank))
    outs = tdb.sharded_embedding_bags([kw["input"] for kw in mine], weights, [kw["offsets"] for kw in mine],
                                      mode="sum")
    assert [o.dtype for o in outs] == dtypes, [o.dtype for o in outs]
    alone = tdb.sharded_embedding_bag(mine[1]["input"], weights[1], mine[1]["offsets"], mode="sum")
    want = _half_bags_reference(tables[1], layouts[1], mine[1]["input"], mine[1]["offsets"], world_size)
    assert torch.equal(outs[1], want), (rank, outs[1], want)
    assert torch.equal(alone, want), (rank, alone, want)
    rounded_once = F.embedding_bag(mine[1]["input"], tables[1].float(), mine[1]["offsets"], mode="sum").half()
    telling = not torch.equal(want, rounded_once)
    everyone = _everyone(mine)
    for t, (tab, w) in enumerate(zip(tables, weights)):
        full = tab.float().clone().requires_grad_()
        loss = 0.0
        for q, theirs in enumerate(everyone):
            ref = F.embedding_bag(theirs[t]["input"], full, theirs[t]["offsets"], mode="sum")
            g_out = torch.linspace(-1, 1, ref.numel()).view_as(ref) * (q + 1 + t)
            loss = loss + (ref * g_out).sum()
            if q == rank:
                if dtypes[t] is torch.float32:
                    torch.testing.assert_close(outs[t], ref.detach(), **TOL,
                                               msg=lambda m, t=t: f"table {t} rank {rank}: {m}")
                outs[t].float().mul(g_out).sum().backward(retain_graph=True)
        loss.backward()
        tol = TOL if dtypes[t] is torch.float32 else dict(rtol=1e-2, atol=1e-2)
        grad = tdb.full_tensor(w.grad).float()
        torch.testing.assert_close(grad, full.grad, **tol, msg=lambda m, t=t: f"table {t} grad, rank {rank}: {m}")
    assert any(_everyone(telling)), "no rank's batch tells the defined order from one rounding of the whole sum"


def test_row_cut_tables_of_mixed_dtypes_in_one_call(pool):
    pool.run(check_row_cut_tables_of_mixed_dtypes)


def check_bags_edge_cases(rank: int, world_size: int) -> None:
    """One call with an fp64 and an fp32 table (messages travel in a common dtype), a rank with no bag at all,
    and an output left out of the loss (its gradient is zero)."""
    import torchrec_dtensor_bridge as tdb

    import dataclasses

    dtypes = [torch.float64, torch.float32, torch.float32]
    untyped = [LAYOUTS_W2["table_wise"], LAYOUTS_W2["row_wise_two_per_rank"], LAYOUTS_W2["column_wise"]]
    layouts = [dataclasses.replace(lay, dtype=d) for lay, d in zip(untyped, dtypes)]
    tables = [_table(lay.global_shape, t).to(d) for t, (lay, d) in enumerate(zip(layouts, dtypes))]
    weights = [_weight(lay, tab, rank) for lay, tab in zip(layouts, tables)]
    g = torch.Generator().manual_seed(5 + rank)
    ids = [torch.randint(0, lay.global_shape[0], (0 if rank == 0 else 4, 3), generator=g) for lay in layouts]
    # table 0 lives on rank 1: built from a layout without a dtype, rank 0's (empty) DTensor says float32
    careless = [_weight(untyped[0], tables[0], rank)] + weights[1:]
    expect_raises(ValueError, "dtype differs between ranks for table 0: ['torch.float32', 'torch.float64']",
                  lambda: tdb.sharded_embedding_bags(ids, careless, mode="sum"))
    outs = tdb.sharded_embedding_bags(ids, weights, mode="sum")
    everyone = _everyone(ids)
    for t, (lay, tab) in enumerate(zip(layouts, tables)):
        assert outs[t].dtype == dtypes[t] and outs[t].shape == (ids[t].shape[0], lay.global_shape[1])
        torch.testing.assert_close(outs[t], F.embedding_bag(ids[t], tab, mode="sum"), **TOL)
    (outs[0].sum() + outs[1].sum()).backward()  # table 2 is not in the loss
    for t in range(2):
        full = tables[t].clone().requires_grad_()
        sum(F.embedding_bag(theirs[t], full, mode="sum").sum() for theirs in everyone).backward()
        _assert_grad(weights[t].grad, full.grad, layouts[t], rank, f"table {t}")
    assert float(tdb.full_tensor(weights[2].grad).abs().sum()) == 0.0


def test_embedding_bags_edge_cases(pool):
    pool.run(check_bags_edge_cases)


def check_bags_bad_inputs(rank: int, world_size: int) -> int:
    """A bad argument of one table on one rank, a mismatch of the table count: every rank raises."""
    import torchrec_dtensor_bridge as tdb

    layouts = [LAYOUTS_W2["table_wise"], LAYOUTS_W2["row_wise_even"], LAYOUTS_W2["column_wise"]]
    weights = [_weight(lay, _table(lay.global_shape, t), rank) for t, lay in enumerate(layouts)]
    good = [torch.tensor([[0, 1]])] * 3
    last = rank == world_size - 1
    n = 0
    bad_ids = [good[0], good[1], torch.tensor([[0, 9]]) if last else good[2]]  # table 2 has 9 rows
    want = "sharded_embedding_bags (table 2): input holds id 9" if last else f"rank {world_size - 1} rejected"
    expect_raises(ValueError, want, lambda: tdb.sharded_embedding_bags(bad_ids, weights, mode="sum"))
    n += 1
    fewer = weights[:2] if last else weights
    want = "different numbers of tables" if not last else "different numbers of tables"
    expect_raises(ValueError, want, lambda: tdb.sharded_embedding_bags(good[: len(fewer)], fewer, mode="sum"))
    n += 1
    modes = ["sum", "mean", "max"] if not last else ["sum", "mean", "sum"]
    expect_raises(ValueError, "ranks disagree on mode for table 2",
                  lambda: tdb.sharded_embedding_bags(good, weights, mode=modes))
    n += 1
    for exc, match, call in (
        (ValueError, "need one input per weight", lambda: tdb.sharded_embedding_bags(good[:2], weights)),
        (ValueError, "mode must be one value or one per table (3), got 2 values",
         lambda: tdb.sharded_embedding_bags(good, weights, mode=["sum", "max"])),
        (TypeError, "(table 1): weight must be a DTensor",
         lambda: tdb.sharded_embedding_bags(good, [weights[0], torch.ones(3, 2), weights[2]])),
        (TypeError, "inputs must be a list of Tensors", lambda: tdb.sharded_embedding_bags(good[0], weights)),
    ):
        expect_raises(exc, match, call)
        n += 1
    outs = tdb.sharded_embedding_bags(good, weights, mode="sum")  # the group is still in step
    assert [tuple(o.shape) for o in outs] == [(1, lay.global_shape[1]) for lay in layouts]
    return n


def test_embedding_bags_bad_inputs_raise_on_every_rank(pool):
    assert pool.run(check_bags_bad_inputs) == [7, 7]


def check_agreement_failure_on_one_rank(rank: int, world_size: int) -> float:
    """The last rank fails while preparing its part of the agreement step itself (injected: its kernel
    choice raises): it still meets the others there, and every rank raises at once (no timeout needed)."""
    import time

    import torchrec_dtensor_bridge as tdb
    from torchrec_dtensor_bridge import kernels

    lay = LAYOUTS_W2["row_wise_even"]
    weight = _weight(lay, _table(lay.global_shape, 0), rank)
    ids = torch.tensor([[0, 1], [2, 3]])
    last = rank == world_size - 1
    real = kernels.choice_code

    def broken(device):
        raise OSError("injected: the kernel choice failed")

    if last:
        kernels.choice_code = broken
    t0 = time.monotonic()
    try:
        want = ("this rank could not prepare its part of the agreement step: OSError: injected" if last
                else f"rank {world_size - 1} rejected its arguments")
        expect_raises(RuntimeError, want, lambda: tdb.sharded_embedding_bag(ids, weight, mode="sum"))
    finally:
        kernels.choice_code = real
    elapsed = time.monotonic() - t0
    out = tdb.sharded_embedding_bag(ids, weight, mode="sum")  # the group is still in step
    assert out.shape == (2, lay.global_shape[1])
    return elapsed


def test_a_rank_failing_inside_the_agreement_makes_every_rank_raise_at_once(pool):
    assert all(s < 30 for s in pool.run(check_agreement_failure_on_one_rank)), "the pool's group timeout is 120 s"


def check_gather_bags(rank: int, world_size: int) -> None:
    """The id exchange: int32 on the wire when ids fit, int64 when a table has 2**31 rows or more; each
    table's batch reaches exactly its readers - a row-cut table only the ids in each reader's rows, with
    per-bag lengths counting just those; per-sample weights follow their ids."""
    from torchrec_dtensor_bridge.lookup.entry import gather_bags, resolve_routes
    from torchrec_dtensor_bridge.lookup.plan import Route
    from torchrec_dtensor_bridge.lookup.strategies.rows import plan_route
    from torchrec_dtensor_bridge.lookup.arguments import Bags
    from torchrec_dtensor_bridge.lookup.arguments import RankInfo

    g = torch.Generator().manual_seed(rank)
    mine = []
    for t in range(4):
        lengths = torch.randint(0, 4, (2 + rank + t,), generator=g)
        ids = torch.randint(0, 2**40 if t == 1 else 50, (int(lengths.sum()),), generator=g)
        mine.append(Bags(ids, lengths, torch.rand(ids.shape, generator=g, dtype=torch.float64) if t in (2, 3) else None))
    n = [int(b.ids.numel()) for b in mine]
    cut = ShardLayout.row_wise((50, 4), [20, 30])  # table 3: rows 0:20 on rank 0, 20:50 on rank 1
    routes = [Route((True, True), (n[0], n[0])), Route((False, True), (0, n[1])), Route((True, False), (n[2], 0)),
              resolve_routes([plan_route(cut, mine[3], world_size)])[0]]
    everyone = _everyone((mine, [r.counts for r in routes]))
    infos = [[RankInfo(b[t].num_bags, int(b[t].ids.numel()), b[t].weights is not None, sends[t])
              for b, sends in everyone] for t in range(4)]
    got = gather_bags(mine, infos, None, float_dtype=torch.float64, rows=2**40, routes=routes)
    for t, bags in enumerate(got):
        theirs = [b[t] for b, _ in everyone]
        if routes[t].masks[rank] is False:
            assert bags.ids.numel() == 0 and int(bags.lengths.sum()) == 0
            assert bags.num_bags == sum(b.num_bags for b in theirs)
            continue
        keep = [torch.ones_like(b.ids, dtype=torch.bool) if t < 3 else
                (b.ids >= (0 if rank == 0 else 20)) & (b.ids < (20 if rank == 0 else 50)) for b in theirs]
        assert torch.equal(bags.ids, torch.cat([b.ids[k] for b, k in zip(theirs, keep)])), f"table {t} ids"
        want_lengths = [torch.bincount(b.bag_of_id()[k], minlength=b.num_bags) for b, k in zip(theirs, keep)]
        assert torch.equal(bags.lengths, torch.cat(want_lengths)), f"table {t} lengths"
        if t in (2, 3):
            assert torch.equal(bags.weights, torch.cat([b.weights[k] for b, k in zip(theirs, keep)]))
    assert routes[3].counts[0] + routes[3].counts[1] == n[3]  # every id of a row cut crosses once
    narrow = gather_bags(mine[:1], infos[:1], None, float_dtype=torch.float32, rows=50, routes=routes[:1])
    assert narrow[0].ids.dtype == torch.int64 and torch.equal(narrow[0].ids, torch.cat([b[0].ids for b, _ in everyone]))


def test_gather_bags(pool):
    pool.run(check_gather_bags)


# ---------------------------------------------------------------- bad inputs
def _bad_cases(rows: int) -> list[tuple[type[Exception], str, dict]]:
    ids, off = torch.tensor([0, 1, 2]), torch.tensor([0, 1])
    return [
        (TypeError, "input must be a Tensor", {"input": [0, 1]}),
        (ValueError, "got 3 dims", {"input": torch.zeros(1, 1, 1, dtype=torch.long)}),
        (ValueError, "1-D input needs offsets", {"input": ids}),
        (ValueError, "offsets must be None when input is 2-D", {"input": ids.view(1, 3), "offsets": off}),
        (ValueError, f"outside [0, num_embeddings={rows})", {"input": torch.tensor([0, rows]), "offsets": off}),
        (ValueError, "outside", {"input": torch.tensor([-1, 0]), "offsets": off}),
        (ValueError, "per_sample_weights must have the shape", {"input": ids, "offsets": off, "mode": "sum",
                                                                "per_sample_weights": torch.ones(2)}),
        (NotImplementedError, "only supported for mode='sum'", {"input": ids, "offsets": off, "mode": "mean",
                                                                 "per_sample_weights": torch.ones(3)}),
        (ValueError, "mode must be one of", {"input": ids, "offsets": off, "mode": "median"}),
        (ValueError, "include_last_offset=True needs offsets", {"input": ids.view(1, 3), "include_last_offset": True}),
        (ValueError, "last offset must be the input length 3", {"input": ids, "offsets": off,
                                                                 "include_last_offset": True}),
        (ValueError, "max_norm must be > 0", {"input": ids, "offsets": off, "max_norm": 0.0}),
        (NotImplementedError, "scale_grad_by_freq", {"input": ids, "offsets": off, "scale_grad_by_freq": True}),
        (NotImplementedError, "sparse=True", {"input": ids, "offsets": off, "sparse": True}),
        (ValueError, "offsets[0] must be 0", {"input": ids, "offsets": torch.tensor([1, 2])}),
        (ValueError, "padding_idx must be within", {"input": ids, "offsets": off, "padding_idx": rows}),
    ]



def check_bad_inputs(rank: int, world_size: int, layout: ShardLayout) -> int:
    """Each bad input on every rank, then on ONE rank only: every rank raises; lookups still work after."""
    from torchrec_dtensor_bridge.lookup import sharded_embedding, sharded_embedding_bag

    rows = layout.global_shape[0]
    weight = _weight(layout, _table(layout.global_shape, 0), rank)
    good = {"input": torch.tensor([[0, 1]])}
    n = 0
    for exc, match, kw in _bad_cases(rows):
        args = dict(kw)
        expect_raises(exc, match, lambda: sharded_embedding_bag(args.pop("input"), weight, **args))
        args = dict(kw) if rank == world_size - 1 else dict(good)
        # only the last rank is wrong: the others raise the same kind, naming that rank
        want = match if rank == world_size - 1 else f"rank {world_size - 1} rejected its arguments"
        expect_raises(exc, want, lambda: sharded_embedding_bag(args.pop("input"), weight, **args))
        n += 1
    expect_raises(TypeError, "weight must be a DTensor", lambda: sharded_embedding_bag(good["input"], torch.ones(3, 2)))
    expect_raises(ValueError, "ranks disagree on mode",
                  lambda: sharded_embedding_bag(good["input"], weight, mode="sum" if rank else "mean"))
    bad_ids = torch.tensor([rows + 5]) if rank == 0 else torch.tensor([0])
    expect_raises(ValueError, "outside" if rank == 0 else "rank 0 rejected", lambda: sharded_embedding(bad_ids, weight))
    out = sharded_embedding_bag(good["input"], weight, mode="sum")  # the group is still in step
    assert out.shape == (1, layout.global_shape[1])
    return n


@pytest.mark.parametrize("name", ["row_wise_two_per_rank", "column_wise"])
def test_bad_inputs_raise_on_every_rank(pool, name):
    counts = pool.run(check_bad_inputs, LAYOUTS_W2[name].with_name(name))
    assert counts[0] == len(_bad_cases(LAYOUTS_W2[name].global_shape[0]))
