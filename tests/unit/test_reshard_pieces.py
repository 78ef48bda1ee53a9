"""The pieces two layouts of a table exchange, and the rounds they travel in, from the layouts alone.

Checked against every element's owner before and after (a plain tensor per layout): the pieces cover
each new block exactly once, a piece travels only where the element's new rank did not hold it, and the
rounds keep every round's buffers within the staging bytes while covering every travelling element once.
"""

from __future__ import annotations

import pytest
import torch

from torchrec_dtensor_bridge.convert.reshard import Move, _rounds, _staged, pieces
from torchrec_dtensor_bridge.layout import ShardLayout

SHAPE = (12, 8)
LAYOUTS = {
    "row_wise": ShardLayout.row_wise(SHAPE, 3),
    "row_wise_uneven": ShardLayout.row_wise(SHAPE, [5, 0, 7]),
    "table_wise": ShardLayout.table_wise(SHAPE, 2),
    "column_wise": ShardLayout.column_wise(SHAPE, [3, 5], ranks=[1, 0]),
    "grid": ShardLayout.grid(SHAPE, [6, 6], [4, 4], [0, 1, 2, 0]),
    "replicated": ShardLayout.replicated(SHAPE, [0, 1, 2]),
}
PAIRS = [(a, b) for a in LAYOUTS for b in LAYOUTS if a != b]


def _holders(layout: ShardLayout) -> list[list[set[int]]]:
    """For every element, the ranks holding it."""
    out = [[set() for _ in range(SHAPE[1])] for _ in range(SHAPE[0])]
    for s in layout.shards:
        for r in range(s.offsets[0], s.offsets[0] + s.sizes[0]):
            for c in range(s.offsets[1], s.offsets[1] + s.sizes[1]):
                out[r][c].add(s.rank)
    return out


@pytest.mark.parametrize("src,dst", PAIRS, ids=[f"{a}-{b}" for a, b in PAIRS])
def test_pieces_fill_every_new_block_once_and_move_only_what_changes_rank(src, dst):
    old, new = LAYOUTS[src], LAYOUTS[dst]
    held = _holders(old)
    filled = [torch.zeros(s.sizes, dtype=torch.int64) for s in new.shards]
    for p in pieces(old, new):
        d = new.shards[p.dst]
        assert p.dst_rank == d.rank and p.src_rank == old.shards[p.src].rank
        rows = slice(p.offsets[0] - d.offsets[0], p.offsets[0] - d.offsets[0] + p.sizes[0])
        cols = slice(p.offsets[1] - d.offsets[1], p.offsets[1] - d.offsets[1] + p.sizes[1])
        filled[p.dst][rows, cols] += 1
        for r in range(p.offsets[0], p.offsets[0] + p.sizes[0]):
            for c in range(p.offsets[1], p.offsets[1] + p.sizes[1]):
                assert p.src_rank in held[r][c], (p, r, c)
                assert p.moves == (p.dst_rank not in held[r][c]), (p, r, c, held[r][c])
    for s, f in zip(new.shards, filled):
        assert bool((f == 1).all()), (s, f)


def _per_rank(batch) -> dict[int, int]:
    out: dict[int, int] = {}
    for m, p in batch:
        for r, c in _staged(m, p).items():
            out[r] = out.get(r, 0) + c
    return out


def _named(layout: ShardLayout, name: str = "t") -> ShardLayout:
    return ShardLayout(layout.global_shape, layout.shards, torch.float32, name)


@pytest.mark.parametrize("budget", [None, 4 * 8, 4 * 20, 4 * 1000])
def test_rounds_keep_their_buffers_within_the_budget_and_cover_every_moving_element(budget):
    old, new = _named(LAYOUTS["row_wise"]), _named(ShardLayout.column_wise(SHAPE, [3, 5], ranks=[2, 0]))
    move = Move(pieces(old, new), old, [], new, [])
    rounds = _rounds([move], budget)
    per_row = max(max(_staged(move, p).values(), default=0) // p.sizes[0] for p in move.pieces)
    covered = torch.zeros(SHAPE, dtype=torch.int64)
    for batch in rounds:
        assert batch
        assert budget is None or max(_per_rank(batch).values(), default=0) <= max(budget, per_row), budget
        for _, p in batch:
            covered[p.offsets[0]:p.offsets[0] + p.sizes[0], p.offsets[1]:p.offsets[1] + p.sizes[1]] += 1
    want = torch.zeros(SHAPE, dtype=torch.int64)
    for p in move.pieces:
        if p.moves:
            want[p.offsets[0]:p.offsets[0] + p.sizes[0], p.offsets[1]:p.offsets[1] + p.sizes[1]] += 1
    assert torch.equal(covered, want)
    assert (len(rounds) == 1) == (budget is None or budget >= 4 * 1000)


def test_one_round_carries_pieces_both_ways_each_rank_within_the_budget():
    """Two column-cut tables going table-wise, one to each rank: each rank receives one table's other half
    through a buffer; a budget of one half a rank fits both halves in one round (one on each rank), where a
    budget counted over both ranks would need two."""
    cut = _named(ShardLayout.column_wise(SHAPE, [4, 4], ranks=[0, 1]))
    moves = [Move(pieces(cut, _named(ShardLayout.table_wise(SHAPE, r))), cut, [], _named(
        ShardLayout.table_wise(SHAPE, r)), []) for r in (0, 1)]
    half = SHAPE[0] * 4 * 4
    rounds = _rounds(moves, half)
    assert len(rounds) == 1 and _per_rank(rounds[0]) == {0: half, 1: half}
    quarter = _rounds(moves, half // 2)  # each half cut in two: two rounds, each with a quarter on each rank
    assert [_per_rank(r) for r in quarter] == [{0: half // 2, 1: half // 2}] * 2
