"""``load``: one committed generation, agreed by every rank, validated before anything is read; see :mod:`.api`."""

from __future__ import annotations

import io
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.tensor import DTensor

from .._compat import ShardedTensor
from ..convert import layout_of
from ..wrapper import LocalShardsWrapper
from ..agreement import gather_objects
from ..convert.groups import CommGroup
from .agree import Kind, Problem, from_rank0, member_group, problem_from, raise_gathered
from .commit import CheckpointError, CorruptCheckpointError, DirLock, committed_name, lock_generation
from .common import default_process_group, global_shape, leaves, run_dcp
from .manifest import Checksums, item_key, read_manifest
from .plan import needed_chunks
from .reader import ReadStats, VerifiedReader
from .validate import item_record, read_metadata

__all__ = ["DEFAULT_STAGING_BYTES", "load"]

DEFAULT_STAGING_BYTES = 256 << 20
"""Default ``load(..., staging_bytes=)``: above it a rank verifies first and reads again."""
_RESOLVE_ATTEMPTS = 50


def _local_boxes(value: torch.Tensor, rank: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """This rank's blocks of ``value`` as (offsets, sizes), without communication."""
    if isinstance(value, ShardedTensor):
        return [(tuple(s.metadata.shard_offsets), tuple(s.metadata.shard_sizes)) for s in value.local_shards()]
    local: Any = value._local_tensor if isinstance(value, DTensor) else value
    if isinstance(local, LocalShardsWrapper) or callable(getattr(local, "local_offsets", None)):
        return [(tuple(o), tuple(s.shape)) for o, s in zip(local.local_offsets(), local.local_shards())]
    if isinstance(value, DTensor):
        return [(s.offsets, s.sizes) for s in layout_of(value).shards_on(dist.get_rank())]
    return [((0,) * value.dim(), tuple(value.shape))]


def _check_keys(sd: Mapping[str, Any], md: Metadata, strict: bool) -> tuple[list[Problem], list[tuple[str, Any]]]:
    problems: list[Problem] = []
    flat = list(leaves(sd))
    saved = md.state_dict_metadata
    for fqn, value in flat:
        m = saved.get(fqn)
        if m is None:
            problems.append(Problem(Kind.VALUE, f"key {fqn!r} is not in the checkpoint"))
            continue
        if isinstance(value, torch.Tensor):
            if not isinstance(m, TensorStorageMetadata):
                problems.append(Problem(Kind.VALUE, f"key {fqn!r} was saved as an object, the destination is a tensor"))
                continue
            if tuple(m.size) != global_shape(value):
                problems.append(Problem(
                    Kind.VALUE, f"key {fqn!r}: saved shape {list(m.size)}, destination shape {list(global_shape(value))}"))
            if m.properties.dtype != value.dtype:
                problems.append(Problem(
                    Kind.VALUE, f"key {fqn!r}: saved dtype {m.properties.dtype}, destination dtype {value.dtype}"))
    if strict:
        extra = sorted(set(saved) - {fqn for fqn, _ in flat})
        if extra:
            problems.append(Problem(Kind.VALUE, f"unexpected keys in the checkpoint {extra} (load(..., strict=False) "
                                                "ignores them)"))
    return problems, flat


def _needed_items(flat: list[tuple[str, Any]], md: Metadata, rank: int) -> list[MetadataIndex]:
    out = []
    for fqn, value in flat:
        m = md.state_dict_metadata.get(fqn)
        if m is None:
            continue
        if not isinstance(m, TensorStorageMetadata):
            out.append(MetadataIndex(fqn))
            continue
        boxes = _local_boxes(value, rank) if isinstance(value, torch.Tensor) else []
        out += [MetadataIndex(fqn, c.offsets) for c in needed_chunks(m.chunks, boxes)]
    return out


def _check_items(root: Path, manifest: dict[str, Any], md: Metadata, needed: list[MetadataIndex]) -> list[Problem]:
    """What the manifest and the files' sizes say about the items this rank will read (no data is read)."""
    problems = []
    where = str(root / "tdb_manifest.json")
    by_file: dict[str, list[MetadataIndex]] = {}
    for idx in needed:
        by_file.setdefault(md.storage_data[idx].relative_path, []).append(idx)
    for rel, idxs in sorted(by_file.items()):
        p = root / rel
        if p.is_symlink() or not p.is_file():
            problems.append(Problem(Kind.CORRUPT, f"data file {rel} is missing or not a regular file (needed for "
                                                  f"{sorted({i.fqn for i in idxs})})"))
            continue
        size = p.stat().st_size
        for idx in idxs:
            key, info = item_key(idx), md.storage_data[idx]
            try:
                rec = item_record(manifest, key, where) if manifest["format"] != 1 else (
                    manifest["items"][key]["file"], manifest["items"][key]["offset"], manifest["items"][key]["length"]
                ) if key in manifest["items"] else None
            except CorruptCheckpointError as e:
                problems.append(Problem(Kind.CORRUPT, str(e)))
                continue
            if rec is None:
                problems.append(Problem(Kind.CORRUPT, f"{key}: not in the checkpoint's manifest {where}"))
            elif rec != (rel, info.offset, info.length):
                problems.append(Problem(Kind.CORRUPT, f"{key}: .metadata and the manifest {where} disagree on where "
                                                      f"its bytes are in {rel}"))
            elif info.offset + info.length > size:
                problems.append(Problem(Kind.CORRUPT, f"data file {rel} is truncated: {size} bytes, key {idx.fqn!r} "
                                                      f"needs bytes up to {info.offset + info.length}"))
    return problems


@dataclass(frozen=True)
class _Opened:
    """What every rank agreed to read: the generation (held under a shared lock), its manifest and metadata."""

    root: Path
    lock: DirLock
    manifest: dict[str, Any] | None
    metadata: Metadata


def _examine(path: Path, name: str, state_dict: Mapping[str, Any], strict: bool, verify: bool, rank: int,
             ) -> tuple[DirLock | None, dict[str, Any] | None, Metadata | None, list[Problem], str | None]:
    """One rank's look at generation ``name``: lock it, read and check everything short of the data."""
    try:
        lock = lock_generation(path, name)
    except Exception as e:  # every rank must reach the agreement
        return None, None, None, [problem_from(e, f"cannot open {name or path}")], None
    if lock is None:
        return None, None, None, [], None
    root = path.parent / name if name else path
    problems: list[Problem] = []
    manifest = md = None
    ident = None
    try:
        manifest = read_manifest(root)
        if name and manifest is not None and manifest["format"] >= 3 and not name.endswith(manifest["save_id"]):
            raise CorruptCheckpointError(f"manifest {root / 'tdb_manifest.json'} is from save {manifest['save_id']}, "
                                         f"not from the generation {name}")
        md = read_metadata(root, manifest)
        key_problems, flat = _check_keys(state_dict, md, strict)
        problems += key_problems
        if verify and not key_problems:
            if manifest is None:
                problems.append(Problem(Kind.CORRUPT, f"{root} has no checksum manifest (not written by "
                                                      "checkpoint.save); pass verify=False to load it unchecked"))
            else:
                saved_id = md.storage_meta.save_id if md.storage_meta is not None else None
                if saved_id != manifest.get("dcp_save_id"):
                    problems.append(Problem(Kind.CORRUPT, f"{root}: .metadata is from save {saved_id}, the manifest "
                                                          f"from {manifest.get('dcp_save_id')}"))
                problems += _check_items(root, manifest, md, _needed_items(flat, md, rank))
        ident = (manifest or {}).get("save_id") or (md.storage_meta.save_id if md.storage_meta is not None else "")
    except Exception as e:  # every rank must reach the agreement
        problems.append(problem_from(e))
    return lock, manifest, md, problems, ident


def _open_agreed(path: Path, state_dict: Mapping[str, Any], strict: bool, verify: bool,
                 g: CommGroup, what: str, extra: list[Problem]) -> _Opened:
    """Resolve ``path`` once (rank 0), lock and examine that generation on every rank, agree; *collective*."""
    rank = g.rank
    assert rank is not None, "member_group checked it"
    for _ in range(_RESOLVE_ATTEMPTS):
        name: str | None = None
        first: Problem | None = None
        if rank == 0:
            try:
                name = committed_name(path)
            except Exception as e:  # told to every rank
                first = problem_from(e)
        name, first = from_rank0((name, first), g)
        if first is not None:
            raise first.error(f"{what} refused, nothing was modified:\n  {first.message} (rank {g.members[0]})")
        assert name is not None
        lock, manifest, md, problems, ident = _examine(path, name, state_dict, strict, verify, rank)
        everyone = gather_objects((lock is None and not problems, problems + extra, ident), g)
        if any(moved for moved, _, _ in everyone):
            if lock is not None:
                lock.release()
            time.sleep(0.005)
            continue  # the generation was superseded and reused under a rank: resolve again
        idents = [i for _, _, i in everyone]
        mixed = [] if len(set(idents)) == 1 or None in idents else [
            Problem(Kind.CORRUPT, f"ranks read different saves of {path}: {idents} (rank order)")]
        if mixed or any(p for _, p, _ in everyone):
            if lock is not None:
                lock.release()
            raise_gathered(what + " refused, nothing was modified", [p for _, p, _ in everyone], g, mixed)
        assert lock is not None and md is not None
        return _Opened(path.parent / name if name else path, lock, manifest, md)
    raise CheckpointError(f"{what}: {path} changed under the load {_RESOLVE_ATTEMPTS} times in a row")


class _GlobalView:
    """A bare ``LocalShardsWrapper`` as DCP's load planning should see it: the whole table's size, its chunks."""

    def __init__(self, wrapper: LocalShardsWrapper) -> None:
        self._w = wrapper

    def size(self) -> torch.Size:
        return self._w.global_shape

    def __create_chunk_list__(self) -> Any:
        return self._w.__create_chunk_list__()


class _SafeObjectPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` whose non-tensor items are unpickled with ``weights_only=True`` unless trusted,
    and which plans a bare ``LocalShardsWrapper`` by its global shape (DCP's planner compares local sizes)."""

    def __init__(self, trusted: bool) -> None:
        super().__init__()
        self._trusted = trusted
        self._bare: dict[str, LocalShardsWrapper] = {}

    def set_up_planner(self, state_dict: Any, metadata: Metadata | None = None, is_coordinator: bool = False) -> None:
        super().set_up_planner(state_dict, metadata, is_coordinator)
        for fqn, v in list(self.state_dict.items()):
            if isinstance(v, LocalShardsWrapper):
                self._bare[fqn] = v
                self.state_dict[fqn] = _GlobalView(v)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        bare = self._bare.get(index.fqn)
        return bare.__get_tensor_shard__(index) if bare is not None else super().lookup_tensor(index)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        if not self._trusted:  # re-serialised from allow-listed types only, then handed to DCP
            obj = torch.load(value, weights_only=True)
            value = io.BytesIO()
            torch.save(obj, value)
            value.seek(0)
        super().load_bytes(read_item, value)


def load(
    state_dict: Mapping[str, Any],
    path: str | Path,
    *,
    strict: bool = False,
    verify: bool = True,
    staging_bytes: int | None = DEFAULT_STAGING_BYTES,
    trusted_pickles: bool = False,
    process_group: dist.ProcessGroup | None = None,
) -> ReadStats:
    """Load the checkpoint at ``path`` in place into ``state_dict``; *collective*.

    Destinations may be DTensors, ShardedTensors, bare ``LocalShardsWrapper``\\ s
    or plain tensors of any layout and world size: each rank reads only the rows
    of the saved chunks that overlap its shards. The state_dict decides what is
    loaded: every key it holds must be in the checkpoint; keys only in the
    checkpoint are ignored unless ``strict``. Every rank reads the same committed
    save, even while other jobs save to ``path``. Every key, shape and dtype is
    checked first, then every checksum block a rank reads; on any problem every
    rank raises the same error and nothing is written. Verification covers
    exactly the bytes read: a corrupt block that no rank needs does not stop a load.

    Args:
        state_dict: the destination, as returned by ``state_dict()`` (nested dicts allowed).
        path: a checkpoint written by :func:`save` (or, with ``verify=False``, any DCP directory).
        strict: refuse a checkpoint holding keys absent from ``state_dict``.
        verify: check checksums (requires a checkpoint written by :func:`save`).
        staging_bytes: the most memory a rank spends holding verified bytes until every
            rank has verified its own (about the bytes it reads; 256 MiB by default). A
            rank that would read more verifies first and reads again to copy: no extra
            memory, and the second pass is served by the page cache while the rank's
            share fits in it (BENCHMARKS.md: 0.2 s vs 0.9 s for 1 GiB a rank here, where
            fresh staging memory costs ~0.3 s/GiB to map). Should a file change between
            the two passes, the second pass's checksums catch it and the load raises
            (destinations may then be partly written). ``None``: no limit (read each
            byte once; the choice for cold or remote storage with memory to spare).
        trusted_pickles: unpickle non-tensor items with ``weights_only=False`` (they can
            run code: only for checkpoints you trust). By default they load with
            ``weights_only=True`` (tensors, containers, numbers, strings).
        process_group: the group to load over; ``None``: see :func:`.common.default_process_group`.

    Returns:
        What this rank read: ``bytes_read`` from data files (every pass) and ``files_opened``.

    Example::

        >>> tdb.checkpoint.load(tdb.state_dict_to_dtensor(model.state_dict()), "/ckpt/step100")
    """
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict must be a mapping, got {type(state_dict).__name__}")
    group = process_group if process_group is not None else default_process_group(state_dict)
    path = Path(path).absolute()
    what = f"checkpoint.load({path})"
    extra: list[Problem] = []
    if staging_bytes is not None and (not isinstance(staging_bytes, int) or staging_bytes < 0):
        extra.append(Problem(Kind.VALUE, f"staging_bytes must be a non-negative int or None, got {staging_bytes!r}"))
    opened = _open_agreed(path, state_dict, strict, verify, member_group(group, what), what, extra)
    try:
        checksums = Checksums(opened.manifest) if verify and opened.manifest is not None else None
        reader = VerifiedReader(opened.root, checksums=checksums, process_group=group, staging_bytes=staging_bytes,
                                what=what, metadata=opened.metadata, trusted_pickles=trusted_pickles)
        run_dcp(dcp.load, state_dict, storage_reader=reader, planner=_SafeObjectPlanner(trusted_pickles),
                 process_group=group)
    finally:
        opened.lock.release()
    return reader.stats
