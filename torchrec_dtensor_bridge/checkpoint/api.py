"""``save`` and ``load``: DCP with atomic commits, validation before any write, and checksums.

Save, on every rank (*collective*):

1. agree on a save id (rank 0 draws it, everyone receives it);
2. ``dcp.save`` into a fresh generation directory beside ``path``, hashing
   each data file's blocks as it is written (:mod:`.writer`: no read back);
3. gather every rank's block checksums on every rank;
4. rank 0 writes the manifest durably and swaps ``path`` to the new generation
   (one atomic rename), then removes older and interrupted generations;
5. every rank learns the outcome; a failure anywhere raises everywhere.

Rank 0's rename is the commit point. A save that dies before it leaves the
previous checkpoint in force; once rank 0 holds every rank's checksums it may
commit even if a peer dies afterwards (then the survivors raise, but the new
checkpoint is complete and verified). Either way a load returns one whole
checkpoint, never a mix.

Load, on every rank (*collective*):

1. resolve ``path`` to its committed generation (never an uncommitted one);
2. check every key, shape and dtype of the destination against the metadata,
   and that the manifest describes exactly the files and items this rank
   will read (no data is read yet);
3. agree: if any rank found a problem, every rank raises — nothing was written;
4. ``dcp.load`` through :class:`.reader.VerifiedReader`: each rank reads only
   the rows of the saved chunks that overlap its shards, verifies their
   checksum blocks, agrees with every rank, and only then copies into place.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.tensor import DTensor

from .._compat import ShardedTensor
from ..convert import layout_of
from ..layout import boxes_overlap
from .commit import (
    CheckpointError,
    IncompleteCheckpointError,
    commit,
    generation_dir,
    prepare_generation,
    prune,
    resolve,
    sweep,
)
from .agree import dist_info as _dist
from .agree import from_rank0 as _from_rank0
from .agree import gather as _gather
from .agree import raise_if_any as _raise_if_any
from .manifest import Checksums, item_key, read_manifest, write_manifest
from .reader import VerifiedReader
from .writer import ChecksummingWriter

__all__ = ["DEFAULT_STAGING_BYTES", "load", "save"]

DEFAULT_STAGING_BYTES = 256 << 20
"""Default ``load(..., staging_bytes=)``: above it a rank verifies first and reads again."""

# Fault injection for the crash tests: called with the name of each save stage.
_fault_hook: Callable[[str], None] | None = None


def _stage(name: str) -> None:
    if _fault_hook is not None:
        _fault_hook(name)


def _run_dcp(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Call a DCP entry point; its ``CheckpointException`` (a ``BaseException``) becomes a ``CheckpointError``.

    An error our own storage reader raised on every rank (a refused load) comes
    out as itself, not wrapped in DCP's per-rank report.
    """
    try:
        return fn(*args, **kwargs)
    except CheckpointException as e:
        ours = [f[0] if isinstance(f, tuple) else f for f in e.failures.values()]
        if ours and all(isinstance(x, CheckpointError) for x in ours):
            first = ours[0]
            raise type(first)(*first.args) from e
        raise CheckpointError(f"{fn.__module__}.{fn.__name__} failed: {e}") from e


# -------------------------------------------------------------------- save
def save(
    state_dict: Mapping[str, Any],
    path: str | Path,
    *,
    keep_spare: bool = True,
    process_group: dist.ProcessGroup | None = None,
) -> str:
    """Save ``state_dict`` (DTensors, ShardedTensors, tensors, objects) to ``path``; *collective*.

    Atomic: until the final rename, a load of ``path`` returns the previous
    checkpoint; a save interrupted at any point (a rank killed) never damages
    it. Returns the save id.

    Args:
        state_dict: what to save (nested dicts allowed).
        path: the checkpoint path (a symlink to its committed generation).
        keep_spare: keep the superseded generation so the next save rewrites its
            files in place (2-3x faster on the disks measured) instead of
            allocating new ones; ``False`` keeps only the committed generation.
        process_group: the group to save over (default: every rank).

    Example::

        >>> tdb.checkpoint.save(tdb.state_dict_to_dtensor(model.state_dict()), "/ckpt/step100")
    """
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict must be a mapping, got {type(state_dict).__name__}")
    rank, world, _ = _dist(process_group)
    path = Path(path).absolute()
    save_id = _from_rank0(uuid.uuid4().hex, process_group)
    gen = generation_dir(path, save_id)
    problems: list[tuple[str, str]] = []
    if rank == 0:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            if path.exists() and not path.is_symlink():
                raise CheckpointError(
                    f"{path} exists and is not a torchrec_dtensor_bridge checkpoint; refusing to overwrite it"
                )
            prepare_generation(path, gen, reuse=keep_spare)
        except (OSError, CheckpointError) as e:
            problems.append(("io", f"cannot prepare {gen}: {e}"))
    _raise_if_any(problems, process_group, f"checkpoint.save({path})")
    _stage("prepared")
    writer = ChecksummingWriter(gen, sync_files=True)
    _run_dcp(dcp.save, state_dict, storage_writer=writer, process_group=process_group)

    _stage("dcp_saved")
    sums = _gather(writer.file_sums, process_group)
    _stage("checksummed")
    outcome = None
    if rank == 0:
        try:
            md = dcp.FileSystemReader(gen).read_metadata()
            files = sorted({info.relative_path for info in md.storage_data.values()})
            prune(gen, {".metadata", *files})  # leftovers of a reused generation (e.g. more ranks)
            merged = {rel: fs for part in sums for rel, fs in part.items() if rel in files}
            dcp_id = md.storage_meta.save_id if md.storage_meta is not None else None
            write_manifest(gen, save_id, md, merged, {"world_size": world, "dcp_save_id": dcp_id})
            _stage("manifest_written")
            previous = commit(path, gen)
            _stage("committed")
            sweep(path, keep=gen, spare=previous if keep_spare else None)
        except Exception as e:  # reported to every rank below
            outcome = f"commit of {gen} as {path} failed: {e}"
    outcome = _from_rank0(outcome, process_group)
    if outcome:
        raise CheckpointError(outcome)
    return save_id


# -------------------------------------------------------------------- load
def _leaves(sd: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(fqn, value) of every leaf, with keys flattened as DCP flattens them."""
    if isinstance(sd, Mapping):
        for k, v in sd.items():
            yield from _leaves(v, f"{prefix}{k}.")
    elif isinstance(sd, (list, tuple)) and any(isinstance(v, (torch.Tensor, Mapping)) for v in sd):
        for i, v in enumerate(sd):
            yield from _leaves(v, f"{prefix}{i}.")
    else:
        yield prefix[:-1], sd


def _local_boxes(value: torch.Tensor, rank: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """This rank's blocks of ``value`` as (offsets, sizes), without communication."""
    if isinstance(value, ShardedTensor):
        return [(tuple(s.metadata.shard_offsets), tuple(s.metadata.shard_sizes)) for s in value.local_shards()]
    if isinstance(value, DTensor):
        local: Any = value._local_tensor
        if callable(getattr(local, "local_offsets", None)):
            return [(tuple(o), tuple(s.shape)) for o, s in zip(local.local_offsets(), local.local_shards())]
        return [(s.offsets, s.sizes) for s in layout_of(value).shards_on(dist.get_rank())]
    return [((0,) * value.dim(), tuple(value.shape))]


def _check_keys(sd: Mapping[str, Any], md: Metadata, strict: bool) -> tuple[list[tuple[str, str]], list[tuple[str, Any]]]:
    problems: list[tuple[str, str]] = []
    leaves = list(_leaves(sd))
    saved = md.state_dict_metadata
    for fqn, value in leaves:
        m = saved.get(fqn)
        if m is None:
            problems.append(("value", f"key {fqn!r} is not in the checkpoint"))
            continue
        if isinstance(value, torch.Tensor):
            if not isinstance(m, TensorStorageMetadata):
                problems.append(("value", f"key {fqn!r} was saved as an object, the destination is a tensor"))
                continue
            if tuple(m.size) != tuple(value.shape):
                problems.append(
                    ("value", f"key {fqn!r}: saved shape {list(m.size)}, destination shape {list(value.shape)}")
                )
            if m.properties.dtype != value.dtype:
                problems.append(
                    ("value", f"key {fqn!r}: saved dtype {m.properties.dtype}, destination dtype {value.dtype}")
                )
    if strict:
        extra = sorted(set(saved) - {fqn for fqn, _ in leaves})
        if extra:
            problems.append(("value", f"unexpected keys in the checkpoint {extra} (load(..., strict=False) ignores them)"))
    return problems, leaves


def _needed_items(leaves: list[tuple[str, Any]], md: Metadata, rank: int) -> list[MetadataIndex]:
    out = []
    for fqn, value in leaves:
        m = md.state_dict_metadata.get(fqn)
        if m is None:
            continue
        if not isinstance(m, TensorStorageMetadata):
            out.append(MetadataIndex(fqn))
            continue
        boxes = _local_boxes(value, rank) if isinstance(value, torch.Tensor) else []
        for chunk in m.chunks:
            if any(boxes_overlap(chunk.offsets, chunk.sizes, o, s) for o, s in boxes):
                out.append(MetadataIndex(fqn, chunk.offsets))
    return out


def _check_items(root: Path, manifest: dict[str, Any], md: Metadata, needed: list[MetadataIndex]) -> list[str]:
    """What the manifest and the files' sizes say about the items this rank will read (no data is read)."""
    problems = []
    want = manifest["items"]
    by_file: dict[str, list[MetadataIndex]] = {}
    for idx in needed:
        by_file.setdefault(md.storage_data[idx].relative_path, []).append(idx)
    for rel, idxs in sorted(by_file.items()):
        p = root / rel
        if not p.is_file():
            problems.append(f"data file {rel} is missing (needed for {sorted({i.fqn for i in idxs})})")
            continue
        size = p.stat().st_size
        for idx in idxs:
            key, info = item_key(idx), md.storage_data[idx]
            rec = want.get(key)
            if rec is None:
                problems.append(f"{key}: not in the checkpoint's manifest")
            elif (rec["file"], rec["offset"], rec["length"]) != (rel, info.offset, info.length):
                problems.append(f"{key}: metadata and manifest disagree on where its bytes are in {rel}")
            elif info.offset + info.length > size:
                problems.append(f"data file {rel} is truncated: {size} bytes, key {idx.fqn!r} needs bytes up to "
                                f"{info.offset + info.length}")
    return problems


def load(
    state_dict: Mapping[str, Any],
    path: str | Path,
    *,
    strict: bool = True,
    verify: bool = True,
    staging_bytes: int | None = DEFAULT_STAGING_BYTES,
    process_group: dist.ProcessGroup | None = None,
) -> None:
    """Load the checkpoint at ``path`` in place into ``state_dict``; *collective*.

    Destinations may be DTensors, ShardedTensors or plain tensors of any layout
    and world size: each rank reads only the rows of the saved chunks that
    overlap its shards. Every key, shape and dtype is checked first, then every
    checksum block a rank reads; on any problem every rank raises and nothing is
    written. Verification covers exactly the bytes read: a corrupt block that
    no rank needs does not stop a load.

    Args:
        state_dict: the destination, as returned by ``state_dict()`` (nested dicts allowed).
        path: a checkpoint written by :func:`save` (or, with ``verify=False``, any DCP directory).
        strict: report keys present in the checkpoint but absent from ``state_dict``.
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
        process_group: the group to load over (default: every rank).

    Example::

        >>> tdb.checkpoint.load(tdb.state_dict_to_dtensor(model.state_dict()), "/ckpt/step100")
    """
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict must be a mapping, got {type(state_dict).__name__}")
    rank, _, _ = _dist(process_group)
    path = Path(path).absolute()
    problems: list[tuple[str, str]] = []
    if staging_bytes is not None and (not isinstance(staging_bytes, int) or staging_bytes < 0):
        problems.append(("value", f"staging_bytes must be a non-negative int or None, got {staging_bytes!r}"))
    root: Path | None = None
    md: Metadata | None = None
    manifest: dict[str, Any] | None = None
    try:
        root = resolve(path)
        md = dcp.FileSystemReader(root).read_metadata()
        manifest = read_manifest(root)
    except IncompleteCheckpointError as e:
        problems.append(("incomplete", str(e)))
    except (OSError, CheckpointError, ValueError) as e:
        problems.append(("io", f"{type(e).__name__}: {e}"))
    if md is not None and root is not None:
        key_problems, leaves = _check_keys(state_dict, md, strict)
        problems += key_problems
        if verify and not key_problems:
            if manifest is None:
                problems.append(("io", f"{root} has no checksum manifest (not written by checkpoint.save); "
                                       "pass verify=False to load it unchecked"))
            else:
                saved_id = md.storage_meta.save_id if md.storage_meta is not None else None
                if saved_id != manifest.get("dcp_save_id"):
                    problems.append(
                        ("io", f"{root}: .metadata is from save {saved_id}, the manifest from {manifest.get('dcp_save_id')}")
                    )
                problems += [("io", p) for p in _check_items(root, manifest, md, _needed_items(leaves, md, rank))]
    what = f"checkpoint.load({path})"
    _raise_if_any(problems, process_group, f"{what} refused, nothing was modified")
    assert root is not None
    checksums = Checksums(manifest) if verify and manifest is not None else None
    reader = VerifiedReader(root, checksums=checksums, process_group=process_group, staging_bytes=staging_bytes,
                            what=what)
    _run_dcp(dcp.load, state_dict, storage_reader=reader, process_group=process_group)
