"""A resharded load on paper: what every rank of a load reads, from layouts alone.

Runs the loader's own planning code (:mod:`torchrec_dtensor_bridge.checkpoint.format.plan`:
DCP's read requests, the reader's byte ranges, zip records, checksum blocks and
staging choice) on a checkpoint that exists only as layouts — no tensors, no
files, no processes — and prints per load rank: bytes needed, bytes read
(checksum blocks included), files opened, peak staging memory, and the time at
the sequential read rate measured on this machine's disk.

Default: 1 TiB of TorchRec tables (128 tables of 16M x 128 float32) saved
row-wise on 64 ranks, loaded row-wise and table-wise on 96 ranks::

    python scripts/simulate_reshard.py
    python scripts/simulate_reshard.py --tables 128 --rows 16777216 --dim 128 --save-ranks 64 \\
        --load-ranks 96 --load table_wise --disk-dir /tmp
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.distributed.checkpoint.metadata import (  # noqa: E402
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from torchrec_dtensor_bridge.checkpoint.api import DEFAULT_STAGING_BYTES  # noqa: E402
from torchrec_dtensor_bridge.checkpoint.format.manifest import BLOCK  # noqa: E402
from torchrec_dtensor_bridge.checkpoint.format.plan import (  # noqa: E402
    ItemPlace,
    block_span,
    read_requests,
    request_span,
    staged_bytes,
    zip_spans,
)
from torchrec_dtensor_bridge.checkpoint.format.reader import _SCRATCH  # noqa: E402
from torchrec_dtensor_bridge.checkpoint.format.savedtensor import parse_layout  # noqa: E402
from torchrec_dtensor_bridge.layout import ShardLayout  # noqa: E402


@dataclass(frozen=True)
class SavedCheckpoint:
    """A checkpoint on paper: every tensor's DCP metadata and where each chunk's zip lies."""

    tensors: dict[str, TensorStorageMetadata]
    places: dict[MetadataIndex, ItemPlace]
    file_sizes: dict[str, int]


@dataclass(frozen=True)
class RankReads:
    """What one load rank reads."""

    rank: int
    needed: int
    read: int
    files: int
    staged: bool
    staging_peak: int


def zip_template(dtype: torch.dtype, row_shape: tuple[int, ...]) -> tuple[int, int]:
    """(bytes before the elements, bytes after them) in ``torch.save``'s zip of a tensor of ``row_shape`` rows,
    measured on a real ``torch.save`` of one row (the records do not grow with the row count)."""
    buf = io.BytesIO()
    torch.save(torch.zeros((1, *row_shape), dtype=dtype), buf)
    lay = parse_layout(io.BytesIO(buf.getvalue()), dtype, (1, *row_shape))
    nbytes = torch.zeros((), dtype=dtype).element_size() * max(1, int(torch.Size(row_shape).numel()))
    return lay.data_start, len(buf.getvalue()) - lay.data_start - nbytes


def saved_row_wise(tables: dict[str, tuple[int, int]], ranks: int, dtype: torch.dtype = torch.float32
                   ) -> SavedCheckpoint:
    """Tables ``{name: (rows, dim)}`` saved row-wise on ``ranks`` ranks by DCP: one file per rank, each holding
    that rank's chunk of every table, one after another."""
    tensors: dict[str, TensorStorageMetadata] = {}
    places: dict[MetadataIndex, ItemPlace] = {}
    ends = {f"__{r}_0.distcp": 0 for r in range(ranks)}
    itemsize = torch.zeros((), dtype=dtype).element_size()
    for name, (rows, dim) in tables.items():
        head, tail = zip_template(dtype, (dim,))
        lay = ShardLayout.row_wise((rows, dim), ranks, name=name)
        chunks = []
        for r, spec in enumerate(lay.shards):
            chunk = ChunkStorageMetadata(torch.Size(spec.offsets), torch.Size(spec.sizes))
            chunks.append(chunk)
            f = f"__{spec.rank if spec.rank is not None else r}_0.distcp"
            length = head + spec.numel * itemsize + tail
            places[MetadataIndex(name, spec.offsets)] = ItemPlace(f, ends[f], length, head, tuple(spec.sizes),
                                                                  itemsize)
            ends[f] += length
        tensors[name] = TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size((rows, dim)), chunks)
    return SavedCheckpoint(tensors, places, ends)


def saved_from_checkpoint(root: str | Path) -> SavedCheckpoint:
    """The layout of a real checkpoint directory: its metadata (read safely) and each chunk's zip layout."""
    from torchrec_dtensor_bridge.checkpoint.format.manifest import read_manifest
    from torchrec_dtensor_bridge.checkpoint.format.validate import read_metadata

    root = Path(root)
    md = read_metadata(root, read_manifest(root))
    tensors = {k: m for k, m in md.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)}
    places = {}
    for fqn, m in tensors.items():
        for c in m.chunks:
            idx = MetadataIndex(fqn, c.offsets)
            info = md.storage_data[idx]
            with open(root / info.relative_path, "rb") as f:
                f.seek(info.offset)
                item = io.BytesIO(f.read(info.length))
            lay = parse_layout(item, m.properties.dtype, tuple(c.sizes))
            places[idx] = ItemPlace(info.relative_path, info.offset, info.length, lay.data_start, tuple(c.sizes),
                                    m.properties.dtype.itemsize)
    sizes = {p.file: (root / p.file).stat().st_size for p in places.values()}
    return SavedCheckpoint(tensors, places, sizes)


def _merge(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def rank_reads(saved: SavedCheckpoint, boxes: dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]],
               rank: int = 0, staging_bytes: int | None = DEFAULT_STAGING_BYTES, block: int = BLOCK) -> RankReads:
    """What a load rank holding ``boxes`` (per tensor, its (offsets, sizes)) reads, by the loader's own planning:
    DCP's requests, the reader's zip records and row ranges, expanded to checksum blocks; a staged load reads each
    block once, a verify-first load reads each item's blocks twice."""
    per_file: dict[str, list[tuple[int, int]]] = {}
    per_item_blocks = 0
    estimate = needed = 0
    for fqn, bxs in boxes.items():
        md = saved.tensors[fqn]
        needed += sum(int(torch.Size(s).numel()) for _, s in bxs) * md.properties.dtype.itemsize
        by_item: dict[MetadataIndex, list] = {}
        for req in read_requests(fqn, md, bxs):
            by_item.setdefault(req.storage_index, []).append(req)
        for idx, reqs in by_item.items():
            place = saved.places[MetadataIndex(idx.fqn, idx.offset)]
            estimate += staged_bytes(place.itemsize, place.sizes, (r.lengths[0] if place.sizes else 1 for r in reqs))
            spans = [s for s in zip_spans(place) if s[1] > s[0]]
            spans += [request_span(place, r.storage_offsets[0] if place.sizes else 0,
                                   r.lengths[0] if place.sizes else 1) for r in reqs]
            blocks = _merge([(block_span(a, b, block)[0], block_span(a, b, block)[-1] + 1) for a, b in spans])
            per_item_blocks += sum(_block_bytes(k0, k1, block, saved.file_sizes[place.file]) for k0, k1 in blocks)
            per_file.setdefault(place.file, []).extend(blocks)
    once = sum(_block_bytes(k0, k1, block, saved.file_sizes[f]) for f, b in per_file.items() for k0, k1 in _merge(b))
    staged = staging_bytes is None or estimate <= staging_bytes
    if staged:
        return RankReads(rank, needed, once, len(per_file), True, once)
    return RankReads(rank, needed, 2 * per_item_blocks, 2 * len(per_file), False, _SCRATCH + 3 * block)


def _block_bytes(k0: int, k1: int, block: int, size: int) -> int:
    return max(0, min(k1 * block, size) - k0 * block)


def load_boxes(tables: dict[str, tuple[int, int]], ranks: int, how: str
               ) -> list[dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]]]:
    """Per load rank, the boxes of each table it holds: ``row_wise`` (every table cut in ``ranks``) or
    ``table_wise`` (table ``i`` whole on rank ``i % ranks``)."""
    out: list[dict[str, list]] = [{} for _ in range(ranks)]
    for i, (name, (rows, dim)) in enumerate(tables.items()):
        lay = (ShardLayout.row_wise((rows, dim), ranks, name=name) if how == "row_wise"
               else ShardLayout.table_wise((rows, dim), i % ranks, name=name))
        for spec in lay.shards:
            if spec.numel and spec.rank is not None:
                out[spec.rank].setdefault(name, []).append((tuple(spec.offsets), tuple(spec.sizes)))
    return out


def measure_disk_rate(directory: str, mib: int = 256) -> float:
    """Sequential read rate (bytes/s) of a freshly written file in ``directory``, evicted from the page cache."""
    p = Path(directory) / f".simulate_reshard_{os.getpid()}"
    chunk = os.urandom(8 << 20)
    try:
        with open(p, "wb") as f:
            for _ in range(max(1, mib // 8)):
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            t0 = time.perf_counter()
            total = 0
            while n := len(os.read(fd, 8 << 20)):
                total += n
            return total / (time.perf_counter() - t0)
        finally:
            os.close(fd)
    finally:
        p.unlink(missing_ok=True)


def simulate(tables: dict[str, tuple[int, int]], save_ranks: int, load_ranks: int, how: str,
             staging_bytes: int | None = DEFAULT_STAGING_BYTES) -> list[RankReads]:
    """Every load rank's reads for the tables saved row-wise on ``save_ranks`` and loaded ``how`` on ``load_ranks``."""
    saved = saved_row_wise(tables, save_ranks)
    return [rank_reads(saved, boxes, r, staging_bytes) for r, boxes in enumerate(load_boxes(tables, load_ranks, how))]


def _fmt(n: float) -> str:
    return f"{n / 2**30:8.2f} GiB" if n >= 2**30 else f"{n / 2**20:8.2f} MiB"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tables", type=int, default=128)
    ap.add_argument("--rows", type=int, default=16 << 20)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--save-ranks", type=int, default=64)
    ap.add_argument("--load-ranks", type=int, default=96)
    ap.add_argument("--load", choices=["row_wise", "table_wise", "both"], default="both")
    ap.add_argument("--staging-bytes", type=int, default=DEFAULT_STAGING_BYTES, help="-1: no limit (always stage)")
    ap.add_argument("--disk-dir", default="/tmp", help="where to measure the disk's sequential read rate")
    ap.add_argument("--disk-mib", type=int, default=256)
    ap.add_argument("--per-rank", action="store_true", help="print every rank (default: first 4, last 2)")
    args = ap.parse_args(argv)
    tables = {f"t{i}": (args.rows, args.dim) for i in range(args.tables)}
    total = args.tables * args.rows * args.dim * 4
    rate = measure_disk_rate(args.disk_dir, args.disk_mib)
    print(f"{args.tables} tables x {args.rows} x {args.dim} float32 = {_fmt(total).strip()}, saved row-wise on "
          f"{args.save_ranks} ranks; disk read rate measured in {args.disk_dir}: {rate / 2**20:.0f} MiB/s")
    staging = None if args.staging_bytes < 0 else args.staging_bytes
    for how in (["row_wise", "table_wise"] if args.load == "both" else [args.load]):
        t0 = time.perf_counter()
        ranks = simulate(tables, args.save_ranks, args.load_ranks, how, staging)
        planned = time.perf_counter() - t0
        print(f"\nload {how} on {args.load_ranks} ranks (planned in {planned:.1f} s)")
        print("rank      needed         read   read/needed  files  staged  staging peak   time at disk rate")
        shown = ranks if args.per_rank or len(ranks) <= 6 else ranks[:4] + ranks[-2:]
        for r in shown:
            print(f"{r.rank:4d} {_fmt(r.needed)} {_fmt(r.read)} {r.read / max(r.needed, 1):10.3f}x {r.files:6d} "
                  f"{'yes' if r.staged else 'no':>6}  {_fmt(r.staging_peak)} {r.read / rate:12.1f} s")
        ratios = [r.read / max(r.needed, 1) for r in ranks]
        times = [r.read / rate for r in ranks]
        print(f"all {len(ranks)} ranks: read/needed min {min(ratios):.3f}x median {statistics.median(ratios):.3f}x "
              f"max {max(ratios):.3f}x; files opened max {max(r.files for r in ranks)}; slowest rank "
              f"{max(times):.1f} s at {rate / 2**20:.0f} MiB/s (one disk per rank)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
