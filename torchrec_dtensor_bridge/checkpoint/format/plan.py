"""What a load reads, computed from layouts alone: chunks needed, byte ranges, checksum blocks, staging.

The loader calls these functions to decide what to read (:mod:`.loading`
picks the chunks, :class:`~.reader.VerifiedReader` turns requests into byte
ranges and checksum blocks and chooses staging, :class:`~.manifest.Checksums`
finds the blocks of a byte range), and
``scripts/simulate_reshard.py`` calls the same functions on layouts that exist
only on paper — no tensors, no files, no processes — to predict what a load of
a terabyte-scale checkpoint reads on every rank.

The requests themselves are DCP's: :func:`read_requests` calls
``create_read_items_for_chunk_list``, the function DCP's default load planner
calls for every tensor.

Example::

    >>> reqs = read_requests("t", saved_md, [((0, 0), (10, 4))])
    >>> item_spans(place, reqs[0])  # byte ranges of the file read for it
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from math import prod

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from ...layout import boxes_overlap

__all__ = [
    "ItemPlace",
    "block_span",
    "needed_chunks",
    "read_requests",
    "request_span",
    "staged_bytes",
    "zip_spans",
]

Box = tuple[Sequence[int], Sequence[int]]


@dataclass(frozen=True)
class ItemPlace:
    """Where one saved chunk lies: its file, its ``torch.save`` zip's ``[offset, offset + length)`` in that file,
    where its elements start inside the zip (``data_start``), and its shape and element size."""

    file: str
    offset: int
    length: int
    data_start: int
    sizes: tuple[int, ...]
    itemsize: int

    @property
    def row_bytes(self) -> int:
        return prod(self.sizes[1:]) * self.itemsize

    @property
    def nbytes(self) -> int:
        return prod(self.sizes) * self.itemsize


def needed_chunks(chunks: Iterable[ChunkStorageMetadata], boxes: Sequence[Box]) -> list[ChunkStorageMetadata]:
    """The saved chunks a rank holding ``boxes`` (offsets, sizes) reads: those overlapping a box (0-d: all)."""
    return [c for c in chunks if not c.sizes or any(boxes_overlap(c.offsets, c.sizes, o, s) for o, s in boxes)]


def read_requests(fqn: str, md: TensorStorageMetadata, boxes: Sequence[Box]) -> list[ReadItem]:
    """DCP's read requests for destination ``boxes`` of tensor ``fqn`` saved as ``md`` (its own planner function)."""
    local = [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s in boxes if all(s)]
    return create_read_items_for_chunk_list(fqn, md, local)


def request_span(place: ItemPlace, first_row: int, nrows: int) -> tuple[int, int]:
    """File bytes ``[start, end)`` holding rows ``first_row .. first_row + nrows`` of the item (whole rows)."""
    if not place.sizes:
        a = place.offset + place.data_start
        return a, a + place.itemsize
    a = place.offset + place.data_start + first_row * place.row_bytes
    return a, a + nrows * place.row_bytes


def zip_spans(place: ItemPlace) -> list[tuple[int, int]]:
    """The item's zip records before and after its elements (``data.pkl``, headers, central directory), which
    a ranged read parses; the reader reads them first."""
    start, data_end = place.offset + place.data_start, place.offset + place.data_start + place.nbytes
    return [(place.offset, start), (data_end, place.offset + place.length)]


def block_span(start: int, end: int, block: int) -> range:
    """Indices of the checksum blocks covering bytes ``[start, end)`` (``end > start``)."""
    return range(start // block, -(-end // block))


def staged_bytes(itemsize: int, sizes: Sequence[int], row_counts: Iterable[int]) -> int:
    """Bytes of rows a rank reads from one chunk for requests of ``row_counts`` rows each: what it would stage."""
    row = prod(sizes[1:]) * itemsize
    return sum(n * row if sizes else itemsize for n in row_counts)
