"""``save`` and ``load``: DCP with atomic commits, validation before any write, and checksums.

Save, on every rank (*collective*):

1. rank 0 takes the path's save lock (a second job saving to the same path
   gets :class:`.CheckpointBusyError` at once), every rank's keys, shapes and
   dtypes are compared, and every rank receives the save id;
2. ``dcp.save`` into a fresh generation directory beside ``path``, hashing
   each data file's blocks as it is written (:mod:`.writer`: no read back);
3. gather every rank's block checksums on every rank;
4. rank 0 writes the manifest durably and swaps ``path`` to the new generation
   (one atomic rename), then removes older and interrupted generations;
5. every rank learns the outcome; a failure anywhere raises everywhere, the
   OS's error (errno named) kept in the message, and the failed generation
   is removed.

Rank 0's rename is the commit point. A save that dies before it leaves the
previous checkpoint in force; once rank 0 holds every rank's checksums it may
commit even if a peer dies afterwards (then the survivors raise, but the new
checkpoint is complete and verified). Either way a load returns one whole
checkpoint, never a mix.

Load, on every rank (*collective*):

1. rank 0 resolves ``path`` to its committed generation once and tells every
   rank; each rank holds a shared lock on that generation for the whole load
   (a save never rewrites nor removes a generation being read), reads the
   manifest and ``.metadata`` (verified, parsed safely: :mod:`.validate`),
   checks every key, shape and dtype of the destination, and that the
   manifest describes exactly the items this rank will read (no data yet);
2. agree: every rank compares the save id every rank read; if the generation
   moved under a rank before it was locked, every rank resolves again; if any
   rank found a problem, every rank raises the same error — nothing was written;
4. ``dcp.load`` through :class:`.reader.VerifiedReader`: each rank reads only
   the rows of the saved chunks that overlap its shards, verifies their
   checksum blocks, agrees with every rank, and only then copies into place.
"""

from __future__ import annotations

import io
import shutil
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.tensor import DTensor

from .._compat import ShardedTensor
from ..convert import layout_of
from ..wrapper import LocalShardsWrapper
from .agree import Kind, Problem, problem_from, problems_text, raise_for
from .agree import dist_info as _dist
from .agree import from_rank0 as _from_rank0
from .agree import gather as _gather
from .agree import raise_if_any as _raise_if_any
from .commit import (
    CheckpointError,
    CorruptCheckpointError,
    DirLock,
    SaveLock,
    commit,
    committed_name,
    generation_dir,
    lock_generation,
    prepare_generation,
    prune,
    sweep,
)
from .manifest import Checksums, item_key, read_manifest, write_manifest
from .plan import needed_chunks
from .reader import ReadStats, VerifiedReader
from .validate import item_record, parse_metadata, read_metadata
from .writer import ChecksummingWriter

__all__ = ["DEFAULT_STAGING_BYTES", "default_process_group", "load", "save"]

DEFAULT_STAGING_BYTES = 256 << 20
"""Default ``load(..., staging_bytes=)``: above it a rank verifies first and reads again."""
_RESOLVE_ATTEMPTS = 50

# Fault injection for the crash tests: called with the name of each save stage.
_fault_hook: Callable[[str], None] | None = None


def _stage(name: str) -> None:
    if _fault_hook is not None:
        _fault_hook(name)


def _dcp_failure(e: CheckpointException) -> list[BaseException]:
    return [f[0] if isinstance(f, tuple) else f for f in e.failures.values()]


def _run_dcp(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Call a DCP entry point; its ``CheckpointException`` (a ``BaseException``) becomes a ``CheckpointError``.

    An error our own storage reader raised on every rank (a refused load) comes
    out as itself, not wrapped in DCP's per-rank report.
    """
    try:
        return fn(*args, **kwargs)
    except CheckpointException as e:
        ours = _dcp_failure(e)
        if ours and all(isinstance(x, CheckpointError) for x in ours):
            first = ours[0]
            raise type(first)(*first.args) from e
        raise CheckpointError(f"{fn.__module__}.{fn.__name__} failed: {e}") from e


# -------------------------------------------------------------------- process group
def default_process_group(state_dict: Mapping[str, Any]) -> dist.ProcessGroup | None:
    """The group a save or load of ``state_dict`` runs on when none is given.

    The group of the DTensors' device mesh when every DTensor on more than one
    rank shares one one-dimensional mesh (DTensors on a one-rank mesh, such as
    table-wise tables, do not count); for one n-dimensional mesh spanning every
    rank, or no such DTensor, or DTensors on different meshes, the default
    group. DTensors on a submesh of a larger mesh: pass ``process_group``.

    Example::

        >>> default_process_group({"t": dtensor_on_ranks_0_1})  # that mesh's group
    """
    meshes: list[Any] = []
    for _, v in _leaves(state_dict):
        if isinstance(v, DTensor) and v.device_mesh.size() > 1 and not any(v.device_mesh == m for m in meshes):
            meshes.append(v.device_mesh)
    if len(meshes) != 1 or not dist.is_initialized():
        return None
    mesh = meshes[0]
    if mesh.ndim == 1:
        return mesh.get_group()
    if mesh.size() != dist.get_world_size():
        raise ValueError(f"the state_dict's DTensors live on a {mesh.ndim}-d mesh of {mesh.size()} of the "
                         f"{dist.get_world_size()} ranks; pass process_group= (the group spanning that mesh)")
    return None


# -------------------------------------------------------------------- save
def _global_shape(v: torch.Tensor) -> tuple[int, ...]:
    return tuple(v.global_shape) if isinstance(v, LocalShardsWrapper) else tuple(v.shape)


def _signature(state_dict: Mapping[str, Any]) -> dict[str, tuple[str, tuple[int, ...], str]]:
    out = {}
    for fqn, v in _leaves(state_dict):
        if isinstance(v, torch.Tensor):
            out[fqn] = (type(v).__name__, _global_shape(v), str(v.dtype))
    return out


def _disagreements(signatures: list[dict[str, tuple[str, tuple[int, ...], str]]]) -> list[Problem]:
    problems = []
    keys = sorted({k for sig in signatures for k in sig})
    for key in keys:
        seen = {r: sig[key][1:] for r, sig in enumerate(signatures) if key in sig}
        if len(set(seen.values())) > 1:
            per = ", ".join(f"rank {r}: shape {list(s)} {d}" for r, (s, d) in seen.items())
            problems.append(Problem(Kind.VALUE, f"key {key!r}: ranks disagree on its shape or dtype ({per})"))
    return problems


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
    it. Every rank must hold the same shape and dtype for each key (checked
    before anything is written). One save per path at a time: a second job
    saving to the same path raises :class:`.CheckpointBusyError` at once.
    Returns the save id.

    Args:
        state_dict: what to save (nested dicts allowed).
        path: the checkpoint path (a symlink to its committed generation).
        keep_spare: keep the superseded generation so the next save rewrites its
            files in place (2-3x faster on the disks measured) instead of
            allocating new ones; ``False`` keeps only the committed generation.
            A spare that a load is reading is left alone (the save allocates).
        process_group: the group to save over; ``None``: see :func:`default_process_group`
            (the DTensors' mesh's group, else the default group).

    Example::

        >>> tdb.checkpoint.save(tdb.state_dict_to_dtensor(model.state_dict()), "/ckpt/step100")
    """
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict must be a mapping, got {type(state_dict).__name__}")
    group = process_group if process_group is not None else default_process_group(state_dict)
    rank, world, _ = _dist(group)
    path = Path(path).absolute()
    what = f"checkpoint.save({path})"
    problems: list[Problem] = []
    lock: SaveLock | None = None
    gen_lock: DirLock | None = None
    save_id = uuid.uuid4().hex
    gen = generation_dir(path, save_id)
    if rank == 0:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            if path.exists() and not path.is_symlink():
                raise CheckpointError(
                    f"{path} exists and is not a torchrec_dtensor_bridge checkpoint; refusing to overwrite it"
                )
            lock = SaveLock(path)
            _, gen_lock = prepare_generation(path, gen, reuse=keep_spare)
        except Exception as e:  # reported to every rank
            problems.append(problem_from(e, f"cannot prepare {gen.name}"))
    everyone = _gather((save_id, problems, _signature(state_dict)), group)
    save_id = everyone[0][0]
    gen = generation_dir(path, save_id)
    kind, text = problems_text([p for _, p, _ in everyone], common=_disagreements([s for _, _, s in everyone]))
    try:
        if kind is not None:
            if rank == 0 and gen_lock is not None:
                shutil.rmtree(gen, ignore_errors=True)
            raise_for(kind, text, what + " refused, nothing was written")
        _stage("prepared")
        local_sums = _write_generation(state_dict, gen, group, what)
        _stage("dcp_saved")
        sums = _gather(local_sums, group)
        _stage("checksummed")
        outcome: str | None = None
        if rank == 0:
            outcome = _commit(path, gen, sums, world, keep_spare, gen_lock)
            gen_lock = None
        outcome = _from_rank0(outcome, group)
        if outcome:
            raise CheckpointError(outcome)
    finally:
        if gen_lock is not None:
            gen_lock.release()
        if lock is not None:
            lock.release()
    return save_id


def _write_generation(state_dict: Mapping[str, Any], gen: Path, group: dist.ProcessGroup | None,
                      what: str) -> dict[str, Any]:
    """``dcp.save`` into ``gen``; on failure every rank raises with every rank's OS errors (errno named) and rank 0
    removes ``gen``."""
    rank, _, _ = _dist(group)
    writer = ChecksummingWriter(gen, sync_files=True)
    problems: list[Problem] = []
    try:
        dcp.save(state_dict, storage_writer=writer, process_group=group)
    except CheckpointException as e:
        local = writer.os_errors
        problems += [problem_from(err, f"writing {name}") for name, err in local]
        if not local:
            failures = _dcp_failure(e)
            oserr = [f for f in failures if isinstance(f, OSError)]
            problems.append(problem_from(oserr[0]) if oserr else Problem(Kind.IO, f"dcp.save failed: {e}"))
    kind, text = problems_text(_gather(problems, group))
    if kind is not None:
        if rank == 0:
            shutil.rmtree(gen, ignore_errors=True)
        raise_for(kind, text, f"{what} failed, the previous checkpoint is intact and {gen.name} was removed")
    return writer.file_sums


def _commit(path: Path, gen: Path, sums: list[Any], world: int, keep_spare: bool, gen_lock: DirLock | None) -> str | None:
    """Rank 0: manifest, rename, sweep; the failure message or ``None``. Releases ``gen_lock`` once committed."""
    committed = False
    try:
        md_bytes = (gen / ".metadata").read_bytes()
        md = parse_metadata(md_bytes, str(gen / ".metadata"))
        files = sorted({info.relative_path for info in md.storage_data.values()})
        prune(gen, {".metadata", *files})  # leftovers of a reused generation (e.g. more ranks)
        merged = {rel: fs for part in sums for rel, fs in part.items() if rel in files}
        dcp_id = md.storage_meta.save_id if md.storage_meta is not None else None
        write_manifest(gen, gen.name.rsplit(".tdb-", 1)[1], md, merged, {"world_size": world, "dcp_save_id": dcp_id},
                       metadata=md_bytes)
        _stage("manifest_written")
        previous = commit(path, gen)
        committed = True
        if gen_lock is not None:
            gen_lock.release()
        _stage("committed")
        sweep(path, keep=gen, spare=previous if keep_spare else None)
        return None
    except Exception as e:  # reported to every rank
        p = problem_from(e)
        if not committed:
            shutil.rmtree(gen, ignore_errors=True)
            return f"commit of {gen} as {path} failed, the previous checkpoint is intact: {p.message}"
        return f"{path} was committed, but removing older generations failed: {p.message}"
    finally:
        if gen_lock is not None:
            gen_lock.release()


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
    local: Any = value._local_tensor if isinstance(value, DTensor) else value
    if isinstance(local, LocalShardsWrapper) or callable(getattr(local, "local_offsets", None)):
        return [(tuple(o), tuple(s.shape)) for o, s in zip(local.local_offsets(), local.local_shards())]
    if isinstance(value, DTensor):
        return [(s.offsets, s.sizes) for s in layout_of(value).shards_on(dist.get_rank())]
    return [((0,) * value.dim(), tuple(value.shape))]


def _check_keys(sd: Mapping[str, Any], md: Metadata, strict: bool) -> tuple[list[Problem], list[tuple[str, Any]]]:
    problems: list[Problem] = []
    leaves = list(_leaves(sd))
    saved = md.state_dict_metadata
    for fqn, value in leaves:
        m = saved.get(fqn)
        if m is None:
            problems.append(Problem(Kind.VALUE, f"key {fqn!r} is not in the checkpoint"))
            continue
        if isinstance(value, torch.Tensor):
            if not isinstance(m, TensorStorageMetadata):
                problems.append(Problem(Kind.VALUE, f"key {fqn!r} was saved as an object, the destination is a tensor"))
                continue
            if tuple(m.size) != _global_shape(value):
                problems.append(Problem(
                    Kind.VALUE, f"key {fqn!r}: saved shape {list(m.size)}, destination shape {list(_global_shape(value))}"))
            if m.properties.dtype != value.dtype:
                problems.append(Problem(
                    Kind.VALUE, f"key {fqn!r}: saved dtype {m.properties.dtype}, destination dtype {value.dtype}"))
    if strict:
        extra = sorted(set(saved) - {fqn for fqn, _ in leaves})
        if extra:
            problems.append(Problem(Kind.VALUE, f"unexpected keys in the checkpoint {extra} (load(..., strict=False) "
                                                "ignores them)"))
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
        key_problems, leaves = _check_keys(state_dict, md, strict)
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
                problems += _check_items(root, manifest, md, _needed_items(leaves, md, rank))
        ident = (manifest or {}).get("save_id") or (md.storage_meta.save_id if md.storage_meta is not None else "")
    except Exception as e:  # every rank must reach the agreement
        problems.append(problem_from(e))
    return lock, manifest, md, problems, ident


def _open_agreed(path: Path, state_dict: Mapping[str, Any], strict: bool, verify: bool,
                 group: dist.ProcessGroup | None, what: str, extra: list[Problem]) -> _Opened:
    """Resolve ``path`` once (rank 0), lock and examine that generation on every rank, agree; *collective*."""
    rank, _, _ = _dist(group)
    for _ in range(_RESOLVE_ATTEMPTS):
        name: str | None = None
        first: Problem | None = None
        if rank == 0:
            try:
                name = committed_name(path)
            except Exception as e:  # told to every rank
                first = problem_from(e)
        name, first = _from_rank0((name, first), group)
        if first is not None:
            raise_for(first.kind, first.message, what + " refused, nothing was modified")
        assert name is not None
        lock, manifest, md, problems, ident = _examine(path, name, state_dict, strict, verify, rank)
        everyone = _gather((lock is None and not problems, problems + extra, ident), group)
        if any(moved for moved, _, _ in everyone):
            if lock is not None:
                lock.release()
            time.sleep(0.005)
            continue  # the generation was superseded and reused under a rank: resolve again
        idents = [i for _, _, i in everyone]
        mixed = [] if len(set(idents)) == 1 or None in idents else [
            Problem(Kind.CORRUPT, f"ranks read different saves of {path}: {idents} (rank order)")]
        kind, text = problems_text([p for _, p, _ in everyone], common=mixed)
        if kind is not None:
            if lock is not None:
                lock.release()
            raise_for(kind, text, what + " refused, nothing was modified")
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
        process_group: the group to load over; ``None``: see :func:`default_process_group`.

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
    opened = _open_agreed(path, state_dict, strict, verify, group, what, extra)
    try:
        checksums = Checksums(opened.manifest) if verify and opened.manifest is not None else None
        reader = VerifiedReader(opened.root, checksums=checksums, process_group=group, staging_bytes=staging_bytes,
                                what=what, metadata=opened.metadata, trusted_pickles=trusted_pickles)
        _run_dcp(dcp.load, state_dict, storage_reader=reader, planner=_SafeObjectPlanner(trusted_pickles),
                 process_group=group)
    finally:
        opened.lock.release()
    return reader.stats
