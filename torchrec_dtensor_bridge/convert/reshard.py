"""Copy a table from any layout into the local shards of another: in memory, point to point.

Each rank sends exactly the overlaps its blocks have with other ranks' blocks
and receives exactly what its own blocks need; no rank ever holds the whole
table. A full (unsharded) source tensor needs no communication at all.

In the order a caller uses it:

1. :func:`pieces` - from the two layouts alone (no tensor, no process group), every overlap of a
   destination block with a distinct source block, the same list on every rank. A destination
   block whose rank holds a copy of the source box takes it from there (a local copy);
2. :func:`move_pieces` - the pieces of any number of tensors (a table and its optimizer states):
   local copies while the first round travels, sends and receives in ``batch_isend_irecv`` rounds (straight from the
   source and into the destination where the piece is contiguous, else through buffers whose
   bytes a round may bound); returns the bytes this rank sent;
3. :func:`copy_into` - both for one tensor, with its shape and dtype checked first.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .._compat import ShardedTensor, shape_and_dtype
from ..layout import ShardLayout, ShardSpec, box_intersection
from .dtensor import layout_of, local_shards_of

__all__ = ["Piece", "copy_into", "move_pieces", "pieces"]


@dataclass(frozen=True)
class Piece:
    """The elements one destination block takes from one source block.

    Attributes:
        src: index of the source block in its layout's ``shards``.
        dst: index of the destination block in its layout's ``shards``.
        src_rank: the rank sending (the source block's).
        dst_rank: the rank receiving (the destination block's).
        offsets: the piece's first element in the table.
        sizes: the piece's extent.
    """

    src: int
    dst: int
    src_rank: int
    dst_rank: int
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for s in self.sizes:
            n *= s
        return n

    @property
    def moves(self) -> bool:
        """Whether the piece travels between two ranks (else a local copy)."""
        return self.src_rank != self.dst_rank


def pieces(src: ShardLayout, dst: ShardLayout) -> list[Piece]:
    """Every overlap of a block of ``dst`` with a distinct box of ``src``, in ``dst``'s block order.

    Computed from the layouts alone, so every rank gets the same list (what lets sends and
    receives pair up). Of a source box held by several ranks (replicas) the piece comes
    from the destination block's own rank when it holds one, else from the box's first copy.
    """
    holders: dict[tuple[tuple[int, ...], tuple[int, ...]], list[int]] = {}
    for i, s in enumerate(src.shards):
        if s.numel:
            holders.setdefault(s.box, []).append(i)
    out = []
    for j, d in enumerate(dst.shards):
        if not d.numel:
            continue
        for box, where in holders.items():
            overlap = box_intersection(d.offsets, d.sizes, *box)
            if overlap is None:
                continue
            i = next((k for k in where if src.shards[k].rank == d.rank), where[0])
            out.append(Piece(i, j, _rank_of(src.shards[i]), _rank_of(d), overlap[0], overlap[1]))
    return out


def _rank_of(spec: ShardSpec) -> int:
    if spec.rank is None:
        raise ValueError(f"block at offsets {list(spec.offsets)} has no rank; a copy between ranks needs one")
    return spec.rank


def _view(t: torch.Tensor, owner: ShardSpec, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
    """The part of ``t`` (the block ``owner``) covered by the global box ``offsets``, ``sizes``."""
    return t[tuple(slice(o - base, o - base + s) for o, base, s in zip(offsets, owner.offsets, sizes))]


@dataclass(frozen=True)
class Move:
    """One tensor's pieces and this rank's tensors on both sides.

    Attributes:
        pieces: :func:`pieces` of the two layouts.
        src_layout: the layout the values are in.
        src_local: this rank's blocks of it, in ``src_layout.shards_on(rank)`` order.
        dst_layout: the layout they go to.
        dst_local: this rank's blocks of it (written), in ``dst_layout.shards_on(rank)`` order.
    """

    pieces: Sequence[Piece]
    src_layout: ShardLayout
    src_local: Sequence[torch.Tensor]
    dst_layout: ShardLayout
    dst_local: Sequence[torch.Tensor]


def _by_index(layout: ShardLayout, local: Sequence[torch.Tensor], rank: int) -> dict[int, torch.Tensor]:
    mine = [i for i, s in enumerate(layout.shards) if s.rank == rank]
    if len(mine) != len(local):
        raise ValueError(f"table {layout.name!r}: rank {rank} holds {len(mine)} blocks in the layout but "
                         f"{len(local)} tensors were given")
    return dict(zip(mine, local))


def _contiguous_in(block: ShardSpec, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> bool:
    """Whether the box is one run of a (row-major) block's memory: every dim after its first longer than one
    spans the block."""
    long = [d for d, n in enumerate(sizes) if n != 1]
    return not long or all(sizes[d] == block.sizes[d] for d in range(long[0] + 1, len(sizes)))


def _itemsize(m: Move) -> int:
    dtype = m.dst_layout.dtype or m.src_layout.dtype
    return dtype.itemsize if dtype is not None else 4


def _staged(m: Move, p: Piece) -> dict[int, int]:
    """The bytes of buffers a piece costs each of its two ranks: a copy on the sending rank where it is not
    contiguous in its source block, a receiving buffer on the other where it is not contiguous in its
    destination block."""
    nbytes = p.numel * _itemsize(m)
    cost: dict[int, int] = {}
    if not _contiguous_in(m.src_layout.shards[p.src], p.offsets, p.sizes):
        cost[p.src_rank] = nbytes
    if not _contiguous_in(m.dst_layout.shards[p.dst], p.offsets, p.sizes):
        cost[p.dst_rank] = cost.get(p.dst_rank, 0) + nbytes
    return cost


def _split(m: Move, p: Piece, budget: int) -> list[Piece]:
    """``p`` cut along dim 0 into pieces whose buffers fit in ``budget`` bytes on each rank (one row at
    least)."""
    per_row = max(_staged(m, p).values(), default=0) // max(p.sizes[0], 1)
    if not per_row or per_row * p.sizes[0] <= budget:
        return [p]
    rows = max(1, budget // per_row)
    lo, n = p.offsets[0], p.sizes[0]
    return [dataclasses.replace(p, offsets=(o, *p.offsets[1:]), sizes=(min(rows, lo + n - o), *p.sizes[1:]))
            for o in range(lo, lo + n, rows)]


def _rounds(moves: Sequence[Move], budget: int | None) -> list[list[tuple[Move, Piece]]]:
    """The travelling pieces in rounds whose buffers fit in ``budget`` bytes on every rank (``None``: one
    round), each piece in the first round with room on both its ranks (so that one round carries pieces
    between other pairs of ranks, and both ways), from the layouts alone: the same rounds on every rank,
    so every round's sends and receives pair up."""
    travelling = [(m, p) for m in moves for p in m.pieces if p.moves]
    if budget is None:
        return [travelling] if travelling else []
    rounds: list[list[tuple[Move, Piece]]] = []
    used: list[dict[int, int]] = []
    for m, whole in travelling:
        for p in _split(m, whole, budget):
            cost = _staged(m, p)
            k = next((k for k, u in enumerate(used) if all(u.get(r, 0) + c <= budget for r, c in cost.items())),
                     None)
            if k is None:
                rounds.append([])
                used.append({})
                k = len(rounds) - 1
            rounds[k].append((m, p))
            for r, c in cost.items():
                used[k][r] = used[k].get(r, 0) + c
    return rounds


class _Arena:
    """The buffers of one call of :func:`move_pieces`: one allocation per device, sized for the largest round
    on this rank and reused round after round (a fresh buffer a round would be mapped and faulted in anew)."""

    ALIGN = 64

    def __init__(self, rounds: Sequence[Sequence[tuple[str, torch.Tensor, int]]]) -> None:
        need: dict[torch.device, int] = {}
        for ends in rounds:
            used: dict[torch.device, int] = {}
            for _, view, _ in ends:
                if not view.is_contiguous():
                    used[view.device] = used.get(view.device, 0) + self._aligned(view)
            for device, n in used.items():
                need[device] = max(need.get(device, 0), n)
        self._buffers = {d: torch.empty(n, dtype=torch.uint8, device=d) for d, n in need.items()}
        self._at: dict[torch.device, int] = {}

    def _aligned(self, view: torch.Tensor) -> int:
        n = view.numel() * view.element_size()
        return -(-n // self.ALIGN) * self.ALIGN

    def reset(self) -> None:
        """The next round's buffers start again at the arena's beginning."""
        self._at.clear()

    def like(self, view: torch.Tensor) -> torch.Tensor:
        """A contiguous buffer of ``view``'s sizes and dtype, carved from the arena."""
        at = self._at.get(view.device, 0)
        self._at[view.device] = at + self._aligned(view)
        nbytes = view.numel() * view.element_size()
        return self._buffers[view.device][at:at + nbytes].view(view.dtype).view(view.shape)


def _ends(batch: Sequence[tuple[Move, Piece]], which: dict[int, int], src: list[dict[int, torch.Tensor]],
          dst: list[dict[int, torch.Tensor]], me: int) -> list[tuple[str, torch.Tensor, int]]:
    """This rank's side of each travelling piece of a round: ``("send" | "recv", its view, the peer)``."""
    out = []
    for m, p in batch:
        i = which[id(m)]
        if p.src_rank == me:
            out.append(("send", _view(src[i][p.src], m.src_layout.shards[p.src], p.offsets, p.sizes), p.dst_rank))
        elif p.dst_rank == me:
            out.append(("recv", _view(dst[i][p.dst], m.dst_layout.shards[p.dst], p.offsets, p.sizes), p.src_rank))
    return out


def _post(ends: Sequence[tuple[str, torch.Tensor, int]], arena: _Arena, group: dist.ProcessGroup | None
          ) -> tuple[list[dist.Work], list[tuple[torch.Tensor, torch.Tensor]], int]:
    """Start one round's sends and receives; returns its works, the (view, buffer) pairs to copy out once
    they are done, and the bytes sent."""
    arena.reset()
    ops: list[dist.P2POp] = []
    later: list[tuple[torch.Tensor, torch.Tensor]] = []
    sent = 0
    for kind, view, peer in ends:
        buf = view if view.is_contiguous() else arena.like(view)
        if kind == "send":
            if buf is not view:
                buf.copy_(view)
            ops.append(dist.P2POp(dist.isend, buf, peer, group))
            sent += buf.numel() * buf.element_size()
        else:
            ops.append(dist.P2POp(dist.irecv, buf, peer, group))
            if buf is not view:
                later.append((view, buf))
    return (dist.batch_isend_irecv(ops) if ops else []), later, sent


def move_pieces(moves: Sequence[Move], *, group: dist.ProcessGroup | None = None, rank: int | None = None,
                staging_bytes: int | None = None) -> int:
    """Copy every move's pieces into its destination tensors; *collective* over the ranks of the pieces.

    Every rank taking part passes the same moves (the same layouts, in the same order). Pieces that stay
    on a rank are copied locally while the first round of the others travels point to point on ``group``
    (peers named by global rank), a contiguous piece straight from its source and into its destination,
    any other through a buffer. With ``staging_bytes`` they go in rounds (one ``batch_isend_irecv`` each)
    whose buffers take at most that many bytes on any rank (one allocation, reused by every round), a
    piece cut by rows where it needs more; without, in one batch.

    Returns:
        The bytes this rank sent.
    """
    me = dist.get_rank() if rank is None else rank
    src = [_by_index(m.src_layout, m.src_local, me) for m in moves]
    dst = [_by_index(m.dst_layout, m.dst_local, me) for m in moves]
    which = {id(m): i for i, m in enumerate(moves)}
    rounds = [_ends(batch, which, src, dst, me) for batch in _rounds(moves, staging_bytes)]
    arena = _Arena(rounds)
    pending = _post(rounds[0], arena, group) if rounds else None
    for i, m in enumerate(moves):  # the local copies, while the first round travels
        for p in m.pieces:
            if p.src_rank == me and p.dst_rank == me:
                _view(dst[i][p.dst], m.dst_layout.shards[p.dst], p.offsets, p.sizes).copy_(
                    _view(src[i][p.src], m.src_layout.shards[p.src], p.offsets, p.sizes))
    sent = 0
    for k, ends in enumerate(rounds):
        works, later, n = pending if k == 0 and pending is not None else _post(ends, arena, group)
        for work in works:
            work.wait()
        for into, buf in later:
            into.copy_(buf)
        sent += n
    return sent


def copy_into(
    dst_layout: ShardLayout,
    dst_shards: list[torch.Tensor],
    src: torch.Tensor,
    *,
    name: str = "table",
) -> None:
    """Fill this rank's ``dst_shards`` (blocks of ``dst_layout`` on this rank) from ``src``.

    ``src`` is a full tensor (no communication), or a DTensor / ShardedTensor of
    any layout: then *collective* — every rank calls it for the same table,
    and only overlapping pieces travel (:func:`move_pieces`, one batch).
    Shapes and dtypes are checked first and raise ``ValueError`` naming ``name``.
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    mine = dst_layout.shards_on(rank)
    shape, dtype = shape_and_dtype(src)
    if shape != dst_layout.global_shape:
        raise ValueError(f"{name}: source shape {list(shape)} != destination shape {list(dst_layout.global_shape)}")
    if dst_shards and dtype != dst_shards[0].dtype:
        raise ValueError(f"{name}: source dtype {dtype} != destination dtype {dst_shards[0].dtype}")
    if not isinstance(src, (DTensor, ShardedTensor)):
        for spec, t in zip(mine, dst_shards):
            t.copy_(src[spec.slices()])
        return
    src_layout = layout_of(src, name=name)
    move = Move(pieces(src_layout, dst_layout), src_layout, local_shards_of(src), dst_layout, dst_shards)
    move_pieces([move], rank=rank)
