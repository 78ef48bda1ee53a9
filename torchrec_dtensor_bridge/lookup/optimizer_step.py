"""The fused updates one kernel pass cannot make: those that need other ranks' gradients, or the torch math.

Part of the lookups' backward (:func:`.function.fused_update` makes the one-pass updates first: blocks whose
update needs nothing from other ranks, through the kernel layer); :mod:`..optim` holds the optimizer, its
state and the update math. For the other blocks of the tables it is given, in this order on every rank:

1. Every block turns its output gradient into a sparse
   gradient: its touched rows (sorted unique ids, padding excluded) and one
   summed gradient row each - O(batch), no dense gradient; a weight listed for
   several features of the call sums its listings' (:func:`.function.by_weight`): one update.
2. ONE exchange for all tables that need one (an ``all_gather`` of the sizes,
   then an ``all_to_all`` of the float64 payloads): replicated tables publish each rank's sparse
   gradient (every replica applies the sum of all ranks'), replicated blocks
   their computing copy's (the other copies apply the same), and row-wise
   Adagrad on column-cut tables every block's per-row partial sums of
   squares (the whole row's statistic is their sum).
3. Every shard (replicas included) applies the update (:mod:`..optim.update`) to its
   touched rows.
"""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..optim.state import Binding
from ..collectives import share_flat
from ..optim.update import apply_elementwise, apply_rowwise, row_square_sums
from .plan import Block, LookupPlan

__all__ = ["Sharing", "apply_optimizers", "sparse_grad"]


class _What(enum.IntEnum):
    GRAD = 0  # a sparse gradient (rows x block width)
    ROW_SQUARES = 1  # per-row partial sums of squared gradients (rows x 1)


@dataclass(frozen=True)
class _Segment:
    table: int
    box: int  # index into the layout's unique_shards(); -1: the whole (replicated) table
    what: _What
    rows: torch.Tensor  # global row numbers
    values: torch.Tensor  # (rows, width)


_HEADER = 5


def sparse_grad(
    plan: LookupPlan, block: Block, grad: torch.Tensor, win: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's touched rows (local, sorted, unique) and their summed gradient rows."""
    if win is not None:
        grad = grad * win
    dtype = plan.table.layout.dtype or grad.dtype
    ids, width = block.ids, block.cols[1]
    if ids.numel() == 0:
        return ids.new_empty(0), grad.new_zeros(0, width, dtype=dtype)
    rows, inverse = torch.unique(ids, sorted=True, return_inverse=True)
    out = torch.zeros(rows.numel(), width, dtype=grad.dtype, device=grad.device)
    if block.argmax is not None:
        valid = block.argmax >= 0
        pos = torch.searchsorted(rows, block.argmax.clamp(min=0)).clamp(max=rows.numel() - 1)
        out.scatter_add_(0, pos, torch.where(valid, grad, torch.zeros((), dtype=grad.dtype, device=grad.device)))
    else:
        counts = block.offsets[1:] - block.offsets[:-1]
        bag = torch.repeat_interleave(torch.arange(counts.numel(), device=ids.device), counts,
                                      output_size=ids.numel())
        per_id = grad.index_select(0, bag)
        if block.weights is not None:
            per_id = per_id * block.weights.unsqueeze(1).to(per_id.dtype)
        out.index_add_(0, inverse, per_id)
    if not plan.pooling.skip_padding and plan.pooling.padding_idx is not None:  # an un-pooled lookup never trains its padding row
        keep = rows != plan.pooling.padding_idx - plan.mine[block.index].offsets[0]
        rows, out = rows[keep], out[keep]
    return rows, out.to(dtype)


@dataclass
class _Table:
    t: int
    plan: LookupPlan
    bind: Binding
    local: dict[int, tuple[torch.Tensor, torch.Tensor]]  # local shard index -> (rows, grad)
    everyone: bool  # replicated on every rank: all ranks' gradients are summed
    copies: Counter
    keys: dict[tuple, int]
    column_cut: bool


def _prepare(plans: list[LookupPlan], ts: list[int], blocks: list[list[Block]], pieces: list[list[torch.Tensor]],
             wins: list[list[torch.Tensor] | None], sharing: Sharing, done: set[int]) -> tuple[_Table, list[_Segment]]:
    """One weight's sparse gradients, from every listing ``ts`` of it in the call (a weight looked up for several
    features is updated once, with their gradients summed), and the segments it publishes."""
    t, plan = ts[0], plans[ts[0]]
    bind = plan.optimizer
    assert isinstance(bind, Binding)
    keys = {s.box: k for k, s in enumerate(plan.table.layout.unique_shards()) if s.numel}
    everyone, column_cut, copies = sharing
    table = _Table(t, plan, bind, {}, everyone, copies, keys, column_cut)
    for u in ts:
        win = wins[u]
        for k, b in enumerate(blocks[u]):
            if b.index in done:  # updated in one kernel pass
                continue
            got = sparse_grad(plans[u], b, pieces[u][k], None if win is None else win[k])
            have = table.local.get(b.index)
            table.local[b.index] = got if have is None else _add_sparse(have, got)
    segments = []
    for i, (rows, grad) in table.local.items():
        spec = plan.mine[i]
        r0 = spec.offsets[0]
        if everyone:
            segments.append(_Segment(t, -1, _What.GRAD, rows + r0, grad))
        elif copies[spec.box] > 1:
            segments.append(_Segment(t, keys[spec.box], _What.GRAD, rows + r0, grad))
        if column_cut:
            sq = row_square_sums(bind.hyper, plan.table.shards[i], rows, grad)
            segments.append(_Segment(t, keys[spec.box], _What.ROW_SQUARES, rows + r0, sq.unsqueeze(1)))
    return table, segments


def _add_sparse(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor],
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The sum of two sparse gradients of one block (touched rows sorted and unique, one gradient row each)."""
    rows, inverse = torch.unique(torch.cat([a[0], b[0]]), sorted=True, return_inverse=True)
    values = torch.cat([a[1], b[1]])
    return rows, values.new_zeros(rows.numel(), values.shape[1]).index_add_(0, inverse, values)


def _exchange(segments: list[_Segment], group: dist.ProcessGroup | None, device: torch.device) -> list[_Segment]:
    """Every rank's segments, in rank order; *collective*. Every tensor of it lives on ``device`` (the
    tables' and the group's: NCCL takes CUDA tensors only)."""
    head = [float(len(segments))]
    body: list[torch.Tensor] = []
    for s in segments:
        head += [float(s.table), float(s.box), float(s.what), float(s.rows.numel()), float(s.values.shape[1])]
        body += [s.rows.to(torch.float64), s.values.reshape(-1).to(torch.float64)]
    mine = torch.cat([torch.tensor(head, dtype=torch.float64, device=device)] + body)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, torch.tensor([mine.numel()], dtype=torch.int64, device=device), group=group)
    out = []
    for flat in share_flat(mine, [int(n) for n in sizes], group):
        n = int(flat[0])
        heads = flat[1 : 1 + _HEADER * n].view(n, _HEADER).to(torch.int64).tolist()
        at = 1 + _HEADER * n
        for t, box, what, u, w in heads:
            rows = flat[at : at + u].to(torch.int64)
            values = flat[at + u : at + u + u * w].view(u, w)
            at += u + u * w
            out.append(_Segment(t, box, _What(what), rows, values))
    return out


def _summed(table: _Table, got: list[_Segment]) -> tuple[torch.Tensor, torch.Tensor]:
    """A replicated table's gradient: every rank's sparse gradient summed (the same order on every rank)."""
    dtype = table.plan.table.layout.dtype
    mine = [s for s in got if s.table == table.t and s.what is _What.GRAD]
    rows = torch.cat([s.rows for s in mine])
    values = torch.cat([s.values.to(dtype) for s in mine])
    unique, inverse = torch.unique(rows, sorted=True, return_inverse=True)
    return unique, torch.zeros(unique.numel(), values.shape[1], dtype=dtype, device=values.device).index_add_(
        0, inverse, values)


def _gradients(table: _Table, got: list[_Segment]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Per local shard index, its touched rows (local) and gradient."""
    plan = table.plan
    if table.everyone:
        whole = _summed(table, got)
        return {i: whole for i, s in enumerate(plan.mine) if s.sizes == plan.table.layout.global_shape}
    out = dict(table.local)
    for i, spec in enumerate(plan.mine):
        if i in out or not spec.numel or table.copies[spec.box] < 2:
            continue
        key = table.keys[spec.box]
        seg = next(s for s in got if s.table == table.t and s.box == key and s.what is _What.GRAD)
        out[i] = (seg.rows - spec.offsets[0], seg.values.to(plan.table.layout.dtype))
    return out


def _row_squares(table: _Table, got: list[_Segment], rows: torch.Tensor) -> torch.Tensor:
    """Whole-row sums of squared gradients at global ``rows`` (sorted), from every block's partial sums."""
    mine = [s for s in got if s.table == table.t and s.what is _What.ROW_SQUARES]
    at = torch.cat([s.rows for s in mine])
    values = torch.cat([s.values.reshape(-1) for s in mine])
    pos = torch.searchsorted(rows, at).clamp(max=max(rows.numel() - 1, 0))
    hit = rows.index_select(0, pos) == at if rows.numel() else torch.zeros_like(at, dtype=torch.bool)
    return torch.zeros(rows.numel(), dtype=torch.float64, device=rows.device).index_add_(0, pos[hit], values[hit])


def _apply(table: _Table, got: list[_Segment]) -> None:
    plan, hyper, state = table.plan, table.bind.hyper, table.bind.table
    grads = _gradients(table, got)
    if not hyper.kind.row_wise:
        for i, (rows, grad) in grads.items():
            apply_elementwise(hyper, plan.table.shards[i], rows, grad, state.elements[i], int(state.step))
        return
    groups: dict[int, list[int]] = {}
    for i in grads:
        groups.setdefault(state.local_row_index(i), []).append(i)
    dim = plan.table.layout.global_shape[1]
    for r, members in groups.items():
        rows = grads[members[0]][0]
        assert all(torch.equal(grads[i][0], rows) for i in members), "column pieces of a row see the same ids"
        if table.column_cut:
            squares = _row_squares(table, got, rows + plan.mine[members[0]].offsets[0])
        else:  # every piece spans the whole row: one of them has the row's statistic
            i = members[0]
            squares = row_square_sums(hyper, plan.table.shards[i], rows, grads[i][1])
        pieces = [(plan.table.shards[i], grads[i][1]) for i in members]
        apply_rowwise(hyper, pieces, rows, squares, state.row_states[r], dim)


Sharing = tuple[bool, bool, Counter]
"""What a table's update needs from other ranks: whether it sums every rank's gradient (a whole table on
every rank), whether a row-wise kind's rows are cut into column pieces, and each box's number of copies."""


def apply_optimizers(
    plans: list[LookupPlan], blocks: list[list[Block]], pieces: list[list[torch.Tensor]],
    wins: list[list[torch.Tensor] | None], tables: dict[int, Sharing], groups: list[list[int]],
    done: dict[int, set[int]], *, exchange: bool,
) -> None:
    """Update the blocks of ``tables`` (each with its :data:`Sharing`; ``groups``: ``tables`` by the weight they
    update, :func:`.function.by_weight`) not ``done`` (per table, the block
    indices updated in one kernel pass) in place from their output gradients; *collective* when ``exchange``
    (some table needs other ranks' gradients: one exchange for all tables, entered by every rank, since the
    tables' sharing is the same on every rank)."""
    prepared, segments = [], []
    for ts in groups:
        table, segs = _prepare(plans, ts, blocks, pieces, wins, tables[ts[0]], done.get(ts[0], set()))
        prepared.append(table)
        segments += segs
    p0 = plans[next(iter(tables))]
    got = _exchange(segments, p0.group, p0.batch.bags.ids.device) if exchange else []
    for table in prepared:
        _apply(table, got)
