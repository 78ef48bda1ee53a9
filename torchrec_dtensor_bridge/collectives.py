"""The collectives the sharded lookups and sharded modules share, for pieces of different sizes per rank.

Ranks pass batches of different sizes (as in TorchRec), while ``all_gather`` on gloo needs equal sizes:
every gather here either pads to the largest rank's size (known to all ranks from an agreement step) and
strips the padding after, or moves the pieces through one ``all_to_all_single``, which takes uneven pieces
as they are and costs about half of gloo's staged ``all_gather`` / ``reduce_scatter`` (``BENCHMARKS.md``).
Pieces of all ranks are concatenated in rank order: rank ``r``'s rows occupy
``starts[r] : starts[r] + counts[r]`` (:func:`row_starts`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Optional

import torch
import torch.distributed as dist

__all__ = [
    "all_to_all_flat", "all_to_all_jagged", "all_to_all_parts", "all_to_all_rows", "common_dtype", "gather_rows",
    "reduce_rows", "reduce_scatter_rows", "row_starts", "share_flat", "share_rows", "side_by_side", "sum_into",
]


def row_starts(counts: Sequence[int]) -> list[int]:
    out, acc = [], 0
    for c in counts:
        out.append(acc)
        acc += c
    return out


def side_by_side(parts: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The one row-major 2-D tensor whose adjacent column slices ``parts`` are, in order and spanning all its
    columns (a kernel result shared by several tables), or ``None`` when they are not."""
    base = parts[0]
    rows, width = base.shape[0], sum(p.shape[1] for p in parts)
    at = base.storage_offset()
    for p in parts:
        if (p.dim() != 2 or p.shape[0] != rows or p.dtype != base.dtype or p.device != base.device
                or (rows > 1 and p.stride(0) != width) or (p.shape[1] > 1 and p.stride(1) != 1)
                or p.untyped_storage().data_ptr() != base.untyped_storage().data_ptr()
                or p.storage_offset() != at):
            return None
        at += p.shape[1]
    return torch.as_strided(base, (rows, width), (width, 1), base.storage_offset())


def _gather_padded(t: torch.Tensor, counts: Sequence[int], group: dist.ProcessGroup | None) -> list[torch.Tensor]:
    """Each rank's ``t`` (first dim ``counts[rank]``), via one padded all_gather."""
    width = max(counts, default=0)
    if t.shape[0] == width and t.is_contiguous():
        send = t  # the largest batch: no padded copy
    else:
        send = t.new_zeros((width,) + tuple(t.shape[1:]))
        send[: t.shape[0]] = t
    recv = [torch.empty_like(send) for _ in counts]
    dist.all_gather(recv, send, group=group)
    return [buf[:c] for buf, c in zip(recv, counts)]


def share_flat(t: torch.Tensor, counts: Sequence[int], group: dist.ProcessGroup | None) -> list[torch.Tensor]:
    """Every rank's 1-D ``t`` (``counts[r]`` elements each), in rank order, through ONE ``all_to_all_single``:
    this rank's own entry is ``t`` itself; *collective*.

    An all-gather of uneven sizes with no padding: gloo's ``all_gather``
    copies the input and every output through staging buffers, slower than an
    ``all_to_all_single`` moving the same bytes (``BENCHMARKS.md``). With two ranks ``t`` is sent as it is; with
    more it is repeated once per other rank (one copy).
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if world == 1:
        return [t]
    n = t.numel()
    send = t if world == 2 else t.repeat(world - 1)
    recv_splits = [0 if p == rank else counts[p] for p in range(world)]
    recv = t.new_empty(sum(recv_splits))
    dist.all_to_all_single(recv, send, recv_splits, [0 if q == rank else n for q in range(world)], group=group)
    parts = list(recv.split(recv_splits))
    parts[rank] = t
    return parts


def share_rows(full: torch.Tensor, counts: Sequence[int], group: dist.ProcessGroup | None) -> torch.Tensor:
    """An all-gather in place: ``full`` (contiguous) holds every rank's rows in rank order (``counts[r]``
    rows each), this rank's own already written; every other rank's are filled in through ONE
    ``all_to_all_single`` (see :func:`share_flat`); *collective*. Returns ``full``.

    With two ranks this rank's rows are sent from where they are and the other's received in place:
    no copy at all; with more, the own rows are repeated once per rank (one copy).
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if world == 1:
        return full
    per_row = full[0].numel() if full.shape[0] else 0
    starts = row_starts(counts)
    flat = full.view(-1)
    own = flat[starts[rank] * per_row : (starts[rank] + counts[rank]) * per_row]
    if world == 2:
        other = 1 - rank
        into = flat[starts[other] * per_row : (starts[other] + counts[other]) * per_row]
        recv = [0, 0]
        recv[other] = into.numel()
        send = [0, 0]
        send[other] = own.numel()
        dist.all_to_all_single(into, own, recv, send, group=group)
        return full
    dist.all_to_all_single(flat, own.repeat(world), [c * per_row for c in counts], [own.numel()] * world,
                           group=group)
    return full


def sum_into(own: torch.Tensor, others: torch.Tensor, sizes: Sequence[int],
             group: dist.ProcessGroup | None) -> torch.Tensor:
    """A reduce-scatter (sum) through ONE ``all_to_all_single``: ``own`` (this rank's own piece) plus the
    piece every other rank sends for it, added in place in rank order; *collective*.

    ``others`` holds this rank's pieces for every other rank, back to back in rank order
    (``sizes[q]`` elements for rank ``q``; its own is not in it); every rank's ``own`` has
    ``sizes[rank]`` elements. Moves the bytes of a ``reduce_scatter`` in about half of gloo's time
    (it stages every input and output; ``BENCHMARKS.md``).
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if world == 1:
        return own
    mine = sizes[rank]
    recv_splits = [0 if p == rank else mine for p in range(world)]
    recv = own.new_empty(sum(recv_splits))
    send_splits = [0 if q == rank else sizes[q] for q in range(world)]
    dist.all_to_all_single(recv, others, recv_splits, send_splits, group=group)
    flat = own.view(-1)
    for piece in recv.split(mine) if mine else ():
        flat += piece
    return own


def reduce_rows(full: torch.Tensor, counts: Sequence[int], group: dist.ProcessGroup | None) -> torch.Tensor:
    """A reduce-scatter (sum) of rows through ONE ``all_to_all_single``, sent from where they lie: ``full``
    (contiguous) holds this rank's partial rows for every rank in rank order (``counts[q]`` rows for ``q``);
    returns this rank's summed rows, a new tensor (with one rank, ``full`` itself): its own rows plus every
    other rank's for it, added in rank order (as :func:`sum_into`); *collective*.

    ``full`` is only read (it may be a kernel's output, shared): with this rank's rows at either end of it
    (always, with two ranks) only the other ranks' rows travel; otherwise all of ``full`` is sent, its own
    rows to itself too (one copy of them).
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if world == 1:
        return full
    per_row = full[0].numel() if full.shape[0] else 0
    sizes = [c * per_row for c in counts]
    lo = row_starts(counts)[rank] * per_row
    hi = lo + sizes[rank]
    flat = full.view(-1)
    own = flat[lo:hi]
    if rank in (0, world - 1):
        send = flat[hi:] if rank == 0 else flat[:lo]
        send_splits = [0 if q == rank else sizes[q] for q in range(world)]
        recv_splits = [0 if p == rank else sizes[rank] for p in range(world)]
    else:
        send, send_splits, recv_splits = flat, sizes, [sizes[rank]] * world
    recv = full.new_empty(sum(recv_splits))
    dist.all_to_all_single(recv, send, recv_splits, send_splits, group=group)
    senders = [p for p in range(world) if recv_splits[p]]  # none when this rank has no rows
    pieces = [piece for p, piece in zip(senders, recv.split(sizes[rank]) if senders else ()) if p != rank]
    out = torch.add(own, pieces[0]) if pieces else own.clone()
    for piece in pieces[1:]:
        out += piece
    return out.view(counts[rank], *full.shape[1:])


def gather_rows(t: torch.Tensor, counts: Sequence[int], group: dist.ProcessGroup | None) -> torch.Tensor:
    """Concatenate every rank's ``t`` (``counts[r]`` rows each) in rank order; *collective*."""
    return torch.cat(_gather_padded(t, counts, group))


def reduce_scatter_rows(
    partial: torch.Tensor, counts: Sequence[int], group: dist.ProcessGroup | None, op: dist.ReduceOp.RedOpType
) -> torch.Tensor:
    """Reduce ``partial`` (all ranks' bags) across ranks; return this rank's rows; *collective*."""
    rank = dist.get_rank(group)
    pieces = list(partial.split(list(counts)))
    out = torch.empty_like(pieces[rank])
    dist.reduce_scatter(out, [p.contiguous() for p in pieces], op=op, group=group)
    return out


def all_to_all_parts(
    parts: Sequence[Sequence[torch.Tensor]], recv_sizes: Sequence[int], group: dist.ProcessGroup | None,
    *, dtype: torch.dtype, device: torch.device,
) -> list[torch.Tensor]:
    """Send ``parts[q]`` (tensors of any shape, flattened back to back, cast to ``dtype``) to rank ``q``;
    receive ``recv_sizes[p]`` elements from each ``p``; *collective*. The parts are copied once, straight
    into the one flat send buffer of ONE ``all_to_all_single``."""
    send_sizes = [sum(x.numel() for x in ps) for ps in parts]
    flat_in = torch.empty(sum(send_sizes), dtype=dtype, device=device)
    at = 0
    for ps in parts:
        for x in ps:
            flat_in[at : at + x.numel()].view(x.shape).copy_(x)
            at += x.numel()
    flat_out = torch.empty(sum(recv_sizes), dtype=dtype, device=device)
    dist.all_to_all_single(flat_out, flat_in, list(recv_sizes), send_sizes, group=group)
    return list(flat_out.split(list(recv_sizes)))


def all_to_all_flat(
    send: Sequence[torch.Tensor], recv_sizes: Sequence[int], group: dist.ProcessGroup | None,
    *, dtype: torch.dtype, device: torch.device,
) -> list[torch.Tensor]:
    """Send the flat ``send[q]`` to rank ``q``; receive ``recv_sizes[p]`` elements from each ``p``; *collective*."""
    return all_to_all_rows([s.reshape(-1) for s in send], [(n,) for n in recv_sizes], group,
                           dtype=dtype, device=device)


def all_to_all_rows(
    send: Sequence[torch.Tensor], recv_shapes: Sequence[tuple[int, ...]], group: dist.ProcessGroup | None,
    *, dtype: torch.dtype, device: torch.device,
) -> list[torch.Tensor]:
    """Send ``send[q]`` to rank ``q``, receive a tensor of ``recv_shapes[p]`` from each ``p``; *collective*.

    One flat ``all_to_all_single`` with uneven splits (empty pieces allowed).
    """
    flat_in = torch.cat([s.reshape(-1) for s in send]) if send else torch.empty(0, dtype=dtype, device=device)
    in_splits = [s.numel() for s in send]
    out_splits = [int(torch.Size(s).numel()) for s in recv_shapes]
    flat_out = torch.empty(sum(out_splits), dtype=dtype, device=device)
    dist.all_to_all_single(flat_out, flat_in.to(dtype), out_splits, in_splits, group=group)
    return [p.view(s) for p, s in zip(flat_out.split(out_splits), recv_shapes)]


Jagged = tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]
"""A jagged batch: ids (or any values) back to back, one length per bag, optional per-id weights."""


def all_to_all_jagged(
    send: Sequence[Sequence[Jagged | None]], recv: Sequence[Sequence[tuple[int, int] | None]],
    weighted: Sequence[bool], group: dist.ProcessGroup | None, *, dtype: torch.dtype, float_dtype: torch.dtype,
    device: torch.device,
) -> list[list[Jagged]]:
    """Send jagged batches of several tables to every rank in ONE ``all_to_all`` (ids and lengths, of one
    integer dtype), and their weights in a second one only when some table is ``weighted``; *collective*.

    ``send[q][t]``: what this rank sends rank ``q`` of table ``t`` (``None``: nothing, ``q`` does not take
    ``t``); ``recv[p][t]``: how many ids and bags rank ``p`` sends this one of ``t`` (``None``: this rank does
    not take ``t``), known beforehand (an agreement step); ``weighted[t]``: table ``t``'s batches carry
    weights (on every rank that sends it some; sent as ``float_dtype``); ids and lengths travel as ``dtype``.
    Returns ``out[p][t]``: what ``p`` sent of each table this rank takes (empty for the others).
    """
    dev = device
    # ONE flat message, written in place: per destination, per table it takes: ids, then bag lengths
    send_sizes = [sum(x.numel() for j in per if j is not None for x in j[:2]) for per in send]
    flat_in = torch.empty(sum(send_sizes), dtype=dtype, device=dev)
    at = 0
    for per in send:
        for j in per:
            for x in j[:2] if j is not None else ():
                flat_in[at : at + x.numel()].copy_(x)
                at += x.numel()
    sizes = [sum(n + nb for n, nb in (r for r in per if r is not None)) for per in recv]
    flat_out = torch.empty(sum(sizes), dtype=dtype, device=dev)
    dist.all_to_all_single(flat_out, flat_in, sizes, send_sizes, group=group)
    del flat_in
    empty = flat_out.new_empty(0)
    out: list[list[Jagged]] = []
    for sizes_from, part in zip(recv, flat_out.split(sizes)):
        at, got = 0, []
        for size in sizes_from:
            n, nb = size if size is not None else (0, 0)
            piece: Jagged = (part[at : at + n], part[at + n : at + n + nb], None) if size else (empty, empty, None)
            got.append(piece)
            at += n + nb
        out.append(got)
    if any(weighted):
        wsend = [torch.cat([w.to(float_dtype) for jag in per if jag is not None and (w := jag[2]) is not None]
                           + [torch.empty(0, dtype=float_dtype, device=dev)]) for per in send]
        wsizes = [sum(size[0] for t, size in enumerate(per) if size is not None and weighted[t]) for per in recv]
        for p, wpart in enumerate(all_to_all_flat(wsend, wsizes, group, dtype=float_dtype, device=dev)):
            w_at = 0
            for t, size in enumerate(recv[p]):
                if size is not None and weighted[t]:
                    ids, lengths, _ = out[p][t]
                    out[p][t] = (ids, lengths, wpart[w_at : w_at + size[0]])
                    w_at += size[0]
    return out


def common_dtype(dtypes: Iterable[torch.dtype | None]) -> torch.dtype:
    """One dtype fused messages of tables of ``dtypes`` travel in (exact for each table's own dtype)."""
    found = set(dtypes)
    dtype = found.pop() if len(found) == 1 else torch.float64
    assert dtype is not None, "layout_of(DTensor) always records the dtype"
    return dtype
