"""The collectives of the sharded lookups, for batches of different sizes per rank.

Ranks pass batches of different sizes (as in TorchRec), while ``all_gather``
on gloo needs equal sizes: every gather here pads to the largest rank's size
(known to all ranks from the agreement step) and strips the padding after.
Bags of all ranks are concatenated in rank order: rank ``r``'s bags occupy
rows ``starts[r] : starts[r] + num_bags[r]`` of a gathered batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from .validate import Bags, RankInfo

__all__ = ["all_to_all_rows", "gather_bags", "gather_rows", "reduce_scatter_rows", "row_starts"]


def row_starts(counts: Sequence[int]) -> list[int]:
    out, acc = [], 0
    for c in counts:
        out.append(acc)
        acc += c
    return out


def _gather_padded(t: torch.Tensor, counts: Sequence[int], group: dist.ProcessGroup | None) -> list[torch.Tensor]:
    """Each rank's ``t`` (first dim ``counts[rank]``), via one padded all_gather."""
    width = max(counts, default=0)
    send = t.new_zeros((width,) + tuple(t.shape[1:]))
    send[: t.shape[0]] = t
    recv = [torch.empty_like(send) for _ in counts]
    dist.all_gather(recv, send, group=group)
    return [buf[:c] for buf, c in zip(recv, counts)]


def gather_bags(
    bags: Bags, infos: Sequence[RankInfo], group: dist.ProcessGroup | None, *, float_dtype: torch.dtype
) -> Bags:
    """Every rank's batch, concatenated in rank order; *collective*.

    Ids and bag lengths travel in one int64 gather; per-sample weights in a
    second one only when some rank passed them (ranks that did not send ones).
    """
    n_ids = [i.num_ids for i in infos]
    n_bags = [i.num_bags for i in infos]
    wid, wbag = max(n_ids, default=0), max(n_bags, default=0)
    packed = bags.ids.new_zeros(wid + wbag)
    packed[: bags.ids.numel()] = bags.ids
    packed[wid : wid + bags.num_bags] = bags.lengths
    parts = _gather_padded(packed.unsqueeze(1), [wid + wbag] * len(infos), group)
    ids = torch.cat([p[:n, 0] for p, n in zip(parts, n_ids)])
    lengths = torch.cat([p[wid : wid + b, 0] for p, b in zip(parts, n_bags)])
    weights = None
    if any(i.has_weights for i in infos):
        mine = bags.weights if bags.weights is not None else torch.ones(
            bags.ids.numel(), dtype=float_dtype, device=bags.ids.device
        )
        weights = torch.cat(_gather_padded(mine, n_ids, group))
    return Bags(ids, lengths, weights)


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
