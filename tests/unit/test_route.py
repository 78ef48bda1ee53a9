"""The id routing of the sharded lookups (:mod:`torchrec_dtensor_bridge.lookup.strategies.rows`) and the per-destination
pieces built from it, against a plain per-id reference, and the exchanges' test for a kernel result sent in
place (no collectives: one process)."""

from __future__ import annotations

import pytest
import torch

from torchrec_dtensor_bridge.layout import ShardLayout
from torchrec_dtensor_bridge.collectives import side_by_side
from torchrec_dtensor_bridge.lookup.arguments import Bags
from torchrec_dtensor_bridge.lookup.entry import _pick_all, resolve_routes
from torchrec_dtensor_bridge.lookup.strategies.rows import plan_route


def route_for(layout, bags, world, everyone=False):
    """This rank's route of one row-cut table (no ``max_norm``), its counts read at once."""
    assert not everyone
    return resolve_routes([plan_route(layout, bags, world)])[0]

from .host_reads import count_host_reads


def _bags(rows: int, seed: int) -> Bags:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 6, (37,), generator=g)
    lengths[3] = 0  # an empty bag
    ids = torch.randint(0, rows, (int(lengths.sum()),), generator=g)
    ids[:2] = torch.tensor([0, rows - 1])  # both ends of the table
    return Bags(ids, lengths, None)


def _reference(bags: Bags, ranges: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, per-bag counts) of ``bags`` inside any of ``ranges``, in batch order."""
    keep = [any(a <= int(i) < b for a, b in ranges) for i in bags.ids]
    ids = bags.ids[torch.tensor(keep, dtype=torch.bool)]
    counts, at = [], 0
    for n in bags.lengths.tolist():
        counts.append(sum(keep[at : at + n]))
        at += n
    return ids, torch.tensor(counts, dtype=torch.int64)


LAYOUTS = {
    # rank: list of row ranges it computes; a partition of the ids when every rank has ranges
    "row_wise_uneven": (ShardLayout.row_wise((50, 4), [7, 30, 13]), {0: [(0, 7)], 1: [(7, 37)], 2: [(37, 50)]}),
    "row_wise_permuted_two_per_rank": (
        ShardLayout.row_wise((50, 4), [5, 10, 15, 20], ranks=[1, 0, 1, 0]),
        {0: [(5, 15), (30, 50)], 1: [(0, 5), (15, 30)]},
    ),
    "row_wise_empty_shard": (ShardLayout.row_wise((50, 4), [20, 0, 30]), {0: [(0, 20)], 1: [], 2: [(20, 50)]}),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_row_cuts_partition_the_ids(name: str) -> None:
    layout, ranges = LAYOUTS[name]
    world = 3 if name != "row_wise_permuted_two_per_rank" else 2
    bags = _bags(50, seed=len(name))
    route = route_for(layout, bags, world, everyone=False)
    assert route.partition
    picked = _pick_all([bags], [route], [None], world, torch.int32)
    for q in range(world):
        want_ids, want_counts = _reference(bags, ranges[q])
        assert route.counts[q] == want_ids.numel()
        if not ranges[q]:
            assert route.masks[q] is False
            continue
        ids, counts, weights = picked[q][0]
        assert ids.dtype == torch.int32 and weights is None
        assert torch.equal(ids.to(torch.int64), want_ids)
        assert torch.equal(counts, want_counts), (q, counts, want_counts)
        # where the ids were in the batch (per-sample weights' gradients go back there)
        assert torch.equal(bags.ids[route.positions[q]], want_ids)


@pytest.mark.parametrize("world,sizes,ranks", [
    (2, [30, 20], None),  # two runs: the prefix-sum grouping
    (2, [30, 20], [1, 0]),
    (3, [10, 15, 25], [2, 0, 1]),  # three runs: the stable sort
    (4, [5, 5, 20, 20], [3, 3, 0, 1]),  # adjacent blocks of one rank make one run
])
@pytest.mark.parametrize("low_only", [False, True])
def test_partition_routes_every_id_once_in_batch_order(world, sizes, ranks, low_only) -> None:
    layout = ShardLayout.row_wise((50, 4), sizes, ranks=ranks)
    bags = _bags(50, seed=world + len(sizes))
    if low_only:  # every id in the first block: the other ranks read, but get nothing
        bags = Bags(bags.ids % sizes[0], bags.lengths, None)
    route = route_for(layout, bags, world, everyone=False)
    assert route.partition and sum(route.counts) == bags.ids.numel()
    picked = _pick_all([bags], [route], [None], world, torch.int64)
    owner = ranks or list(range(len(sizes)))
    for q in range(world):
        ranges = [(sum(sizes[:k]), sum(sizes[: k + 1])) for k, r in enumerate(owner) if r == q]
        want_ids, want_counts = _reference(bags, ranges)
        assert (route.masks[q] is not False) == bool(ranges)
        assert route.counts[q] == want_ids.numel()
        if ranges:
            assert torch.equal(picked[q][0][0], want_ids)
            assert torch.equal(picked[q][0][1], want_counts)
            assert torch.equal(bags.ids[route.positions[q]], want_ids)


def test_grid_sends_an_id_to_every_rank_holding_its_rows() -> None:
    # rows 0-24 cut in two column blocks on ranks 0 and 1; rows 25-49 whole on rank 2
    layout = ShardLayout.from_shards((50, 4), [(0, (0, 0), (25, 2)), (1, (0, 2), (25, 2)), (2, (25, 0), (25, 4))])
    bags = _bags(50, seed=5)
    route = route_for(layout, bags, 3, everyone=False)
    assert not route.partition
    picked = _pick_all([bags], [route], [None], 3, torch.int64)
    for q, ranges in enumerate([[(0, 25)], [(0, 25)], [(25, 50)]]):
        want_ids, want_counts = _reference(bags, ranges)
        assert torch.equal(picked[q][0][0], want_ids)
        assert torch.equal(picked[q][0][1], want_counts)


def test_a_rank_holding_whole_rows_takes_every_id_and_no_partition() -> None:
    # table-row-wise style: rank 0 holds the whole table's rows in its columns 0-1, ranks 1 and 2 cut rows of 2-3
    layout = ShardLayout.from_shards((50, 4), [(0, (0, 0), (50, 2)), (1, (0, 2), (20, 2)), (2, (20, 2), (30, 2))])
    bags = _bags(50, seed=9)
    route = route_for(layout, bags, 3, everyone=False)
    assert route.masks[0] is True and not route.partition
    picked = _pick_all([bags], [route], [None], 3, torch.int64)
    assert torch.equal(picked[0][0][0], bags.ids) and torch.equal(picked[0][0][1], bags.lengths)
    for q, ranges in ((1, [(0, 20)]), (2, [(20, 50)])):
        want_ids, want_counts = _reference(bags, ranges)
        assert torch.equal(picked[q][0][0], want_ids)
        assert torch.equal(picked[q][0][1], want_counts)


def test_side_by_side_finds_only_the_whole_result():
    """The forward sends a kernel result in place only when the blocks' outputs ARE its columns, in order."""
    res = torch.arange(6 * 10, dtype=torch.float32).view(6, 10)
    parts = [res[:, 0:3], res[:, 3:7], res[:, 7:10]]
    whole = side_by_side(parts)
    assert whole is not None and whole.data_ptr() == res.data_ptr() and torch.equal(whole, res)
    assert side_by_side([res]) is not None
    refused = {
        "out of order": [res[:, 3:7], res[:, 0:3], res[:, 7:10]],
        "a gap": [res[:, 0:3], res[:, 4:7]],
        "columns left over": [res[:, 0:3], res[:, 3:7]],  # rows are 10 apart, the parts 7 wide
        "another tensor": [res[:, 0:3], res.clone()[:, 3:10]],
        "rows apart": [res[:3, 0:5], res[3:, 5:10]],
        "another dtype": [res[:, 0:5], res.double()[:, 5:10]],
        "a transposed piece": [res.t()[:, 0:3]],
    }
    for why, ps in refused.items():
        assert side_by_side(ps) is None, why


def test_the_routes_of_several_row_wise_tables_read_their_counts_once(monkeypatch) -> None:
    """The row partitions of several tables (two runs and more) read how many ids go where in ONE host read
    (one synchronisation on an accelerator, not one per table), and route exactly as one table alone."""

    cases = [(ShardLayout.row_wise((50, 4), [30, 20]), 2), (ShardLayout.row_wise((50, 4), [10, 15, 25],
                                                                                  ranks=[2, 0, 1]), 3)] * 4
    batches = [_bags(50, seed=k) for k in range(len(cases))]
    alone = [route_for(layout, bags, world, everyone=False) for (layout, world), bags in zip(cases, batches)]
    reads = count_host_reads(monkeypatch)
    planned = [plan_route(layout, bags, world) for (layout, world), bags in zip(cases, batches)]
    assert reads == [], reads
    together = resolve_routes(planned)
    assert reads == ["tolist"], reads
    monkeypatch.undo()
    for a, b in zip(alone, together):
        assert b is not None and a.counts == b.counts and a.partition and b.partition
        for x, y in zip(a.positions, b.positions):
            assert (x is None) == (y is None) and (x is None or torch.equal(x, y))
        for x, y in zip(a.per_bag, b.per_bag):
            assert (x is None) == (y is None) and (x is None or torch.equal(x, y))
