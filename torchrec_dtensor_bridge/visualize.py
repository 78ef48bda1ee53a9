"""Pictures of a table's sharding, drawn from its :class:`ShardLayout`."""

from __future__ import annotations

import builtins

import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ._compat import ShardedTensor
from .convert import layout_of
from .layout import ShardLayout

__all__ = ["render_layout", "visualize_sharding"]


def _span(offset: int, size: int) -> str:
    return f"{offset}:{offset + size}" if size else "-"


def render_layout(layout: ShardLayout) -> str:
    """A plain-text table of which rank holds which rows and columns.

    One line per shard (``rows a:b`` is half-open, as Python slices), then a
    block map of the table for 1-D and 2-D layouts: each character cell is the
    rank holding that part (``*`` where several replicas hold it).
    """
    shape = "x".join(str(d) for d in layout.global_shape)
    dtype = f" {layout.dtype}" if layout.dtype is not None else ""
    lines = [f"{layout.name}: {shape}{dtype}, {layout.kind.value}, {len(layout.shards)} shard(s)"]
    header = ["rank", "rows", "cols", "shape"] if layout.ndim == 2 else ["rank", "index", "shape"]
    rows = []
    for s in sorted(layout.shards, key=lambda s: (s.rank if s.rank is not None else -1, s.offsets)):
        dims = [_span(o, z) for o, z in zip(s.offsets, s.sizes)]
        cells = [("?" if s.rank is None else str(s.rank))]
        cells += dims if layout.ndim == 2 else [", ".join(dims)]
        cells.append("x".join(str(z) for z in s.sizes))
        rows.append(cells)
    widths = [max(len(c) for c in col) for col in zip(header, *rows)]
    fmt = "  ".join("{:<%d}" % w for w in widths)
    lines.append(fmt.format(*header).rstrip())
    lines += [fmt.format(*r).rstrip() for r in rows]
    if layout.ndim in (1, 2) and layout.numel:
        lines += _block_map(layout)
    return "\n".join(lines)


def _block_map(layout: ShardLayout, max_cols: int = 32) -> list[str]:
    """One line per band of rows between cuts; each cell a column range's owner."""
    n = layout.global_shape[0]
    d = layout.global_shape[1] if layout.ndim == 2 else 1
    cuts = sorted({0, n} | {s.offsets[0] for s in layout.shards} | {s.offsets[0] + s.sizes[0] for s in layout.shards})
    nc = min(d, max_cols)
    width = len(str(n))
    out = []
    for lo, hi in zip(cuts, cuts[1:]):
        if lo == hi:
            continue
        line = []
        for j in range(nc):
            c = j * d // nc
            owners = {
                s.rank
                for s in layout.shards
                if s.numel
                and s.offsets[0] <= lo < s.offsets[0] + s.sizes[0]
                and (layout.ndim == 1 or s.offsets[1] <= c < s.offsets[1] + s.sizes[1])
            }
            line.append("." if not owners else ("*" if len(owners) > 1 else _glyph(owners.pop())))
        out.append(f"  rows {lo:>{width}}:{hi:<{width}} |{''.join(line)}|")
    return out


def _glyph(rank: int | None) -> str:
    if rank is None:
        return "?"
    return "0123456789abcdefghijklmnopqrstuvwxyz"[rank] if rank < 36 else "#"


def visualize_sharding(
    t: DTensor | ShardedTensor | ShardLayout, *, name: str = "table", print: bool | str = False
) -> str:
    """The rank-to-rows/columns picture of ``t``; correct for uneven and multi-shard layouts.

    Ranks are global ranks. Collective-free, except for a DTensor over a shards
    wrapper without a layout (TorchRec's) on several ranks: then, as
    :func:`~torchrec_dtensor_bridge.layout_of`, every rank of the DTensor's group
    (its mesh's sharding axis) calls it. A table on a one-rank mesh never
    communicates and every rank draws it, whatever its form of "nothing on
    this rank" (an empty plain tensor, an empty ``LocalShardsWrapper`` with or
    without a layout). A DTensor on a 2-D mesh shows every replica's blocks.

    Args:
        t: a DTensor, ShardedTensor or layout.
        name: the table's name, drawn in the picture's first line.
        print: also print the picture: ``True`` on global rank 0 only (every rank draws the same
            picture), ``"all"`` on every rank.

    Returns:
        The picture.

    Example::

        >>> tdb.visualize_sharding(dt, name="t0", print=True)
    """
    if print is not True and print is not False and print != "all":
        raise ValueError(f"visualize_sharding: print must be True, False or 'all', got {print!r}")
    layout = t.with_name(name) if isinstance(t, ShardLayout) else layout_of(t, name=name)
    text = render_layout(layout)
    if print == "all" or (print is True and (not dist.is_initialized() or dist.get_rank() == 0)):
        builtins.print(text)
    return text
