"""A device-free description of how one table is sharded.

:class:`ShardLayout` is the single source of truth the rest of the package
derives from: DTensor placements, DCP chunk metadata, ShardedTensor metadata,
sharding pictures and gather plans. It holds no tensors and needs no process
group, so it can be built, compared and validated anywhere.

Example::

    >>> lay = ShardLayout.row_wise((8, 16), [1, 3, 1, 3], name="t0")
    >>> [s.offsets for s in lay.shards]
    [(0, 0), (1, 0), (4, 0), (5, 0)]
"""

from __future__ import annotations

import enum
import hashlib
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property

import torch

__all__ = [
    "LayoutKind", "ShardLayout", "ShardSpec", "box_intersection", "boxes_overlap", "chunk_span", "chunk_sizes",
    "contiguous_strides",
]


@dataclass(frozen=True)
class ShardSpec:
    """One rectangular block of a table and the rank that stores it.

    Attributes:
        rank: global rank holding the block; ``None`` when unknown (a checkpoint's
            chunk list records no ranks).
        offsets: index of the block's first element in the table, one per dim.
        sizes: extent of the block, one per dim (zero allowed).
        device: placement device recorded by a ShardedTensor (``"cpu"``,
            ``"cuda:1"``); informative only, not part of equality.
    """

    rank: int | None
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    device: str | None = field(default=None, compare=False)

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    @property
    def box(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return self.offsets, self.sizes

    def slices(self) -> tuple[slice, ...]:
        """Index of this block inside the full table."""
        return tuple(slice(o, o + s) for o, s in zip(self.offsets, self.sizes))


class LayoutKind(enum.Enum):
    """Shape of the cut, as TorchRec names its sharding types."""

    REPLICATED = "replicated"  # data parallel: every listed rank holds the whole table
    TABLE_WISE = "table_wise"  # one rank holds the whole table
    ROW_WISE = "row_wise"  # cut along dim 0 only
    COLUMN_WISE = "column_wise"  # cut along dim 1 only
    GRID = "grid"  # cut along several dims


def box_intersection(
    a_offsets: Sequence[int], a_sizes: Sequence[int], b_offsets: Sequence[int], b_sizes: Sequence[int]
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(offsets, sizes) of the elements two blocks share, or ``None`` when they share none."""
    lo = tuple(max(x, y) for x, y in zip(a_offsets, b_offsets))
    hi = tuple(min(x + xs, y + ys) for x, xs, y, ys in zip(a_offsets, a_sizes, b_offsets, b_sizes))
    if any(h <= low for low, h in zip(lo, hi)):
        return None
    return lo, tuple(h - low for low, h in zip(lo, hi))


def boxes_overlap(
    a_offsets: Sequence[int], a_sizes: Sequence[int], b_offsets: Sequence[int], b_sizes: Sequence[int]
) -> bool:
    """Whether two blocks share an element (an empty block shares none)."""
    return box_intersection(a_offsets, a_sizes, b_offsets, b_sizes) is not None


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major strides of ``shape`` (as ``torch.empty(shape).stride()``)."""
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= max(int(d), 1)
    return tuple(reversed(strides))


@dataclass(frozen=True)
class ShardLayout:
    """Global shape and the blocks of one table, in a fixed order.

    Blocks with identical offsets and sizes on different ranks are replicas
    (data parallel, or hybrid replication); any other overlap is invalid.
    The order of ``shards`` is meaningful: it is the order of a ShardedTensor's
    metadata and of a rank's local shards.

    Attributes:
        global_shape: shape of the whole table.
        shards: every block on every rank.
        dtype: element type, when known.
        name: table name used in error messages and pictures.
    """

    global_shape: tuple[int, ...]
    shards: tuple[ShardSpec, ...]
    dtype: torch.dtype | None = None
    name: str = "table"

    # ----------------------------------------------------------------- builders
    @classmethod
    def from_shards(
        cls,
        global_shape: Sequence[int],
        shards: Iterable[ShardSpec | tuple[int | None, Sequence[int], Sequence[int]]],
        *,
        dtype: torch.dtype | None = None,
        name: str = "table",
        validate: bool = True,
    ) -> ShardLayout:
        """Build from ``(rank, offsets, sizes)`` triples or :class:`ShardSpec`s."""
        specs = tuple(
            s
            if isinstance(s, ShardSpec)
            else ShardSpec(s[0], tuple(int(v) for v in s[1]), tuple(int(v) for v in s[2]))
            for s in shards
        )
        lay = cls(tuple(int(d) for d in global_shape), specs, dtype, name)
        if validate:
            lay.validate()
        return lay

    @classmethod
    def row_wise(
        cls,
        global_shape: Sequence[int],
        rows: Sequence[int] | int,
        *,
        ranks: Sequence[int] | None = None,
        dtype: torch.dtype | None = None,
        name: str = "table",
    ) -> ShardLayout:
        """Row-wise cut. ``rows`` is the height of each shard, or a world size for
        TorchRec's even split (``ceil(n / world)`` rows each, the last ones shorter)."""
        n = int(global_shape[0])
        heights = _even_split(n, rows) if isinstance(rows, int) else [int(r) for r in rows]
        ranks = list(range(len(heights))) if ranks is None else list(ranks)
        starts = _prefix(heights)
        rest = tuple(int(d) for d in global_shape[1:])
        shards = [
            (r, (s,) + (0,) * len(rest), (h,) + rest) for r, s, h in zip(ranks, starts, heights)
        ]
        return cls.from_shards(global_shape, shards, dtype=dtype, name=name)

    @classmethod
    def column_wise(
        cls,
        global_shape: Sequence[int],
        cols: Sequence[int] | int,
        *,
        ranks: Sequence[int] | None = None,
        dtype: torch.dtype | None = None,
        name: str = "table",
    ) -> ShardLayout:
        """Column-wise cut of a 2-D table; ``cols`` widths or a shard count."""
        n, d = (int(v) for v in global_shape)
        widths = _even_split(d, cols) if isinstance(cols, int) else [int(c) for c in cols]
        ranks = list(range(len(widths))) if ranks is None else list(ranks)
        starts = _prefix(widths)
        shards = [(r, (0, s), (n, w)) for r, s, w in zip(ranks, starts, widths)]
        return cls.from_shards(global_shape, shards, dtype=dtype, name=name)

    @classmethod
    def grid(
        cls,
        global_shape: Sequence[int],
        rows: Sequence[int],
        cols: Sequence[int],
        ranks: Sequence[int],
        *,
        dtype: torch.dtype | None = None,
        name: str = "table",
    ) -> ShardLayout:
        """Grid cut: ``len(rows) x len(cols)`` blocks, row-major, on ``ranks``."""
        blocks = [
            ((r0, c0), (h, w))
            for r0, h in zip(_prefix(rows), rows)
            for c0, w in zip(_prefix(cols), cols)
        ]
        if len(ranks) != len(blocks):
            raise ValueError(
                f"table {name!r}: grid of {len(rows)}x{len(cols)} blocks needs "
                f"{len(blocks)} ranks, got {len(ranks)}"
            )
        shards = [(r, o, s) for r, (o, s) in zip(ranks, blocks)]
        return cls.from_shards(global_shape, shards, dtype=dtype, name=name)

    @classmethod
    def table_wise(
        cls,
        global_shape: Sequence[int],
        rank: int,
        *,
        dtype: torch.dtype | None = None,
        name: str = "table",
    ) -> ShardLayout:
        """The whole table on one rank."""
        shape = tuple(int(d) for d in global_shape)
        return cls.from_shards(shape, [(rank, (0,) * len(shape), shape)], dtype=dtype, name=name)

    @classmethod
    def replicated(
        cls,
        global_shape: Sequence[int],
        ranks: Sequence[int],
        *,
        dtype: torch.dtype | None = None,
        name: str = "table",
    ) -> ShardLayout:
        """Data parallel: a full copy on each of ``ranks``."""
        shape = tuple(int(d) for d in global_shape)
        zero = (0,) * len(shape)
        return cls.from_shards(shape, [(r, zero, shape) for r in ranks], dtype=dtype, name=name)

    # ----------------------------------------------------------------- queries
    @property
    def ndim(self) -> int:
        return len(self.global_shape)

    @property
    def numel(self) -> int:
        return math.prod(self.global_shape)

    def ranks(self) -> tuple[int, ...]:
        """Sorted ranks holding at least one block (zero-size blocks included)."""
        return tuple(sorted({s.rank for s in self.shards if s.rank is not None}))

    def shards_on(self, rank: int) -> tuple[ShardSpec, ...]:
        """This rank's blocks, in layout order."""
        return tuple(s for s in self.shards if s.rank == rank)

    def unique_shards(self) -> tuple[ShardSpec, ...]:
        """One block per distinct non-empty box (its first replica) plus every
        empty block, in layout order."""
        return self._unique

    @property
    def has_copies(self) -> bool:
        """Whether some non-empty box is held more than once (by several ranks, or twice by one)."""
        return len(self._unique) != len(self.shards)

    def first_copies(self, rank: int, members: Sequence[int]) -> tuple[bool, ...]:
        """For each of ``rank``'s blocks (in :meth:`shards_on` order), whether it is the first copy of its box
        among the blocks of ``members`` (in layout order): the one copy a reduction over those ranks counts.
        Only reductions of layouts that :attr:`has_copies` ask."""
        among, first = set(members), dict[tuple[tuple[int, ...], tuple[int, ...]], int]()
        for i, s in enumerate(self.shards):
            if s.rank in among:
                first.setdefault(s.box, i)
        return tuple(first[s.box] == i for i, s in enumerate(self.shards) if s.rank == rank)

    @cached_property
    def _unique(self) -> tuple[ShardSpec, ...]:
        seen: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()
        out = []
        for s in self.shards:
            if s.numel and s.box in seen:
                continue
            seen.add(s.box)
            out.append(s)
        return tuple(out)

    def owner(self) -> int | None:
        """The rank holding the whole table when exactly one rank holds all its data."""
        holders = {s.rank for s in self.shards if s.numel}
        if len(holders) == 1 and len([s for s in self.shards if s.numel]) == 1:
            return holders.pop()
        return None

    @cached_property
    def kind(self) -> LayoutKind:
        """The cut's shape (computed once; layouts are immutable)."""
        full = [s for s in self.shards if s.numel]
        boxes = {s.box for s in full}
        if len(boxes) == 1 and len(full) > 1:
            return LayoutKind.REPLICATED
        if len(boxes) <= 1:
            return LayoutKind.TABLE_WISE
        cut_dims = {d for d in range(self.ndim) if any(s.sizes[d] != self.global_shape[d] for s in full)}
        if cut_dims == {0}:
            return LayoutKind.ROW_WISE
        if cut_dims == {1}:
            return LayoutKind.COLUMN_WISE
        return LayoutKind.GRID

    @cached_property
    def cut_dims(self) -> frozenset[int]:
        """The dims in which some non-empty block does not span the whole table."""
        full = [s for s in self.shards if s.numel]
        return frozenset(d for d in range(self.ndim) if any(s.sizes[d] != self.global_shape[d] for s in full))

    @property
    def nearest_shard_dim(self) -> int | None:
        """The dim of the one ``Shard`` placement a DTensor of this layout carries when its placements cannot
        describe it alone (its local tensor a :class:`LocalShardsWrapper`): 1 for a column cut, none for
        replicas, else 0. DTensor reduces across ranks exactly along this dim."""
        kind = self.kind
        if kind is LayoutKind.REPLICATED:
            return None
        return 1 if kind is LayoutKind.COLUMN_WISE else 0

    def with_name(self, name: str) -> ShardLayout:
        return ShardLayout(self.global_shape, self.shards, self.dtype, name)

    def on_ranks(self, ranks: Sequence[int]) -> ShardLayout:
        """The blocks held by ``ranks`` (global ranks), renumbered to their positions in ``ranks``.

        A process group's part of a layout in the group's own rank numbers: on a
        2-D mesh ``(replica, shard)`` the shard axis' group holds one copy of the
        table, and its blocks become ranks ``0 .. len(ranks) - 1``. Not validated
        (the caller checks coverage).

        Example::

            >>> lay = ShardLayout.row_wise((4, 2), [2, 2], ranks=[2, 3])
            >>> [s.rank for s in lay.on_ranks([2, 3]).shards]
            [0, 1]
        """
        where = {r: i for i, r in enumerate(ranks)}
        shards = tuple(
            ShardSpec(where[s.rank], s.offsets, s.sizes, s.device) for s in self.shards if s.rank in where
        )
        return ShardLayout(self.global_shape, shards, self.dtype, self.name)

    def digest(self) -> int:
        """A 62-bit digest of the geometry (shape, dtype, every block and its rank), equal on every
        process for equal layouts: what ranks compare to agree they see one layout (computed once)."""
        return self._digest

    @cached_property
    def _digest(self) -> int:
        text = repr((self.global_shape, str(self.dtype), [(s.rank, s.offsets, s.sizes) for s in self.shards]))
        return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 2

    # -------------------------------------------------------------- validation
    def validate(self, *, require_full_coverage: bool = True) -> None:
        """Raise ``ValueError`` unless every block is in bounds, no two distinct
        blocks overlap and (by default) the blocks cover the whole table."""
        where = f"table {self.name!r} of shape {list(self.global_shape)}"
        if any(d < 0 for d in self.global_shape):
            raise ValueError(f"{where}: negative dimension")
        if not self.shards:
            if self.numel and require_full_coverage:
                raise ValueError(f"{where}: layout has no shards")
            return
        for i, s in enumerate(self.shards):
            if len(s.offsets) != self.ndim or len(s.sizes) != self.ndim:
                raise ValueError(
                    f"{where}: shard {i} has offsets {list(s.offsets)} and sizes "
                    f"{list(s.sizes)}, expected {self.ndim} values each"
                )
            if s.rank is not None and s.rank < 0:
                raise ValueError(f"{where}: shard {i} has negative rank {s.rank}")
            for d, (o, z, g) in enumerate(zip(s.offsets, s.sizes, self.global_shape)):
                if o < 0 or z < 0 or o + z > g:
                    raise ValueError(
                        f"{where}: shard {i} (rank {s.rank}) at offsets {list(s.offsets)} "
                        f"with sizes {list(s.sizes)} is out of bounds in dim {d} "
                        f"({o} + {z} > {g})"
                        if o + z > g
                        else f"{where}: shard {i} (rank {s.rank}) has negative offset "
                        f"or size in dim {d}: offsets {list(s.offsets)}, sizes {list(s.sizes)}"
                    )
        self._check_overlap(where)
        if require_full_coverage:
            covered = sum(s.numel for s in self.unique_shards())
            if covered != self.numel:
                raise ValueError(
                    f"{where}: shards cover {covered} of {self.numel} elements; "
                    f"a layout must cover the whole table"
                )

    def _check_overlap(self, where: str) -> None:
        # Sweep along dim 0: only blocks whose row ranges intersect are compared.
        order = sorted(
            (i for i, s in enumerate(self.shards) if s.numel), key=lambda i: self.shards[i].offsets[0]
        )
        active: list[int] = []
        for i in order:
            s = self.shards[i]
            active = [j for j in active if self.shards[j].offsets[0] + self.shards[j].sizes[0] > s.offsets[0]]
            for j in active:
                t = self.shards[j]
                if t.box == s.box:
                    if t.rank == s.rank:
                        raise ValueError(
                            f"{where}: shards {min(i, j)} and {max(i, j)} are the same block "
                            f"{list(s.offsets)}+{list(s.sizes)} twice on rank {s.rank}"
                        )
                    continue  # replicas on different ranks
                if boxes_overlap(s.offsets, s.sizes, t.offsets, t.sizes):
                    a, b = sorted((i, j))
                    sa, sb = self.shards[a], self.shards[b]
                    raise ValueError(
                        f"{where}: shard {a} (rank {sa.rank}, offsets {list(sa.offsets)}, "
                        f"sizes {list(sa.sizes)}) overlaps shard {b} (rank {sb.rank}, "
                        f"offsets {list(sb.offsets)}, sizes {list(sb.sizes)})"
                    )
            active.append(i)


def _prefix(sizes: Sequence[int]) -> list[int]:
    out, acc = [], 0
    for s in sizes:
        out.append(acc)
        acc += int(s)
    return out


def chunk_span(extent: int, parts: int, index: int) -> tuple[int, int]:
    """(start, length) of piece ``index`` of ``torch.chunk``'s split of ``extent`` into ``parts``
    (``ceil(extent / parts)`` each, the last ones shorter or empty): DTensor's ``Shard`` and
    TorchRec's even row-wise split."""
    block = -(-extent // parts) if parts else 0
    start = min(index * block, extent)
    return start, max(0, min(block, extent - start))


def chunk_sizes(extent: int, parts: int) -> list[int]:
    """Every piece's length of :func:`chunk_span`'s split."""
    return [chunk_span(extent, parts, i)[1] for i in range(parts)]


def _even_split(n: int, parts: int) -> list[int]:
    """TorchRec's and torch.chunk's split: ``ceil(n / parts)`` each, the rest shorter."""
    if parts <= 0:
        raise ValueError(f"number of shards must be positive, got {parts}")
    return chunk_sizes(n, parts)
