"""Migrate ShardedTensor-era checkpoints to committed, checksummed DTensor-layout DCP checkpoints.

Two kinds of source are accepted:

* a DCP directory (``dcp.save`` of ShardedTensor state_dicts, or any DCP
  checkpoint): every tensor's chunks are checked to cover it exactly, the
  data files are streamed into a new generation, checksummed as they are
  copied, and committed.
  DCP stores ShardedTensor and DTensor chunks identically, so no tensor is
  ever materialised: memory stays flat whatever the table sizes.
* per-rank ``torch.save`` files of state_dicts holding ShardedTensors (one
  file per rank, named ``...rank<N>...``): unpickling a ShardedTensor needs its
  process group, so one local gloo process per file loads its file, converts
  it to DTensors (zero-copy) and joins a collective :func:`save`.

The source is untrusted input. ``migrate`` reads only regular files inside
``src`` (data file names must be plain names: no absolute path, no ``..``, no
symlink), parses ``.metadata`` with the restricted unpickler of
:mod:`.validate` (no code runs; every tensor's chunks must tile it exactly,
0-d and 1-D tensors included), loads per-rank files with
``torch.load(weights_only=True)`` and an allow-list of the ShardedTensor
classes they need, and writes only inside ``dst``'s new generation.
``trusted_pickles=True`` unpickles per-rank files without that restriction
(they can run code: only for files you trust).
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import pickle
import queue
import re
import socket
import traceback
import uuid
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..._compat import (
    ChunkShardingSpec,
    EnumerableShardingSpec,
    RemoteDevice,
    ShardedTensor,
    ShardedTensorMemFormat,
    ShardedTensorMetadata,
    ShardedTensorProperties,
    ShardedTensorShard,
    ShardMetadata,
)
from ...convert import state_dict_to_dtensor
from ..api import save
from ..commit import check_target, commit, generation, resolve, save_lock, sweep, writable_parent
from ..common import progress_bar, tensor_bytes
from ..errors import CheckpointError, CorruptCheckpointError
from ..format.manifest import BlockHasher, FileSums, check_file_name, read_manifest, write_manifest
from ..storage import Loc, NotAnObject, locate
from ..format.validate import read_metadata

__all__ = ["migrate", "rank_files"]

_RANK = re.compile(r"rank[_\-]?(\d+)", re.IGNORECASE)
_COPY_BLOCK = 8 << 20


def rank_files(src: Loc) -> list[Loc]:
    """The per-rank ``torch.save`` files in ``src``, ordered by rank; checks ranks 0..N-1 are all there."""
    found: dict[int, Loc] = {}
    for name in src.list():
        p = src / name
        m = _RANK.search(name)
        if not (m and name.endswith((".pt", ".pth", ".bin"))):
            continue
        kind = p.kind()
        if kind == "link":
            raise ValueError(f"{src}: per-rank file {name} is a symlink; migrate reads only regular files "
                             f"inside the source directory")
        if kind == "object":
            r = int(m.group(1))
            if r in found:
                raise ValueError(f"{src}: two files for rank {r}: {found[r].name} and {name}")
            found[r] = p
    if not found:
        raise ValueError(f"{src}: no per-rank files (*rank<N>*.pt) and no DCP .metadata")
    missing = sorted(set(range(max(found) + 1)) - set(found))
    if missing:
        raise ValueError(f"{src}: per-rank files for ranks {missing} are missing (have {sorted(found)})")
    return [found[r] for r in range(len(found))]


def migrate(src: str | Path, dst: str | Path, *, progress: bool = True, trusted_pickles: bool = False,
            storage_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Convert the checkpoint at ``src`` into a committed checkpoint at ``dst`` (paths or ``s3://`` URLs).

    Returns a summary: ``{"source": kind, "keys": n, "bytes": n, "save_id": id}``, where
    ``bytes`` counts the tensors as :func:`~.inspect.inspect` does (:func:`~.common.tensor_bytes`).
    Raises ``ValueError`` or :class:`.CorruptCheckpointError` (naming the key or
    file) for an incomplete, inconsistent or hostile source, ``NotADirectoryError``
    if an existing parent of ``dst`` is a file; ``dst`` is untouched unless the
    migration completes. Reads only inside ``src``, writes only inside ``dst``,
    runs no code from the source unless ``trusted_pickles`` (per-rank
    files loaded with ``weights_only=False``).

    Example::

        >>> tdb.checkpoint.migrate("/old/step100", "/ckpt/step100")["keys"]
        12
    """
    src_loc, dst_loc = locate(src, storage_options), locate(dst, storage_options)
    check_target(dst_loc)
    writable_parent(dst_loc)
    if not src_loc.exists():
        raise ValueError(f"migrate: source {src_loc} does not exist")
    try:
        root = resolve(src_loc)  # a checkpoint of this package: its committed generation
    except CheckpointError:
        root = src_loc  # a directory of per-rank files
    if (root / ".metadata").exists():
        return _migrate_dcp(root, dst_loc, progress)
    if root.kind() == "dir":
        files = rank_files(root)
        return _migrate_rank_files([str(f) for f in files], str(dst_loc), progress, trusted_pickles, storage_options)
    raise ValueError(f"migrate: {src_loc} is neither a DCP directory nor a directory of per-rank files")


def _migrate_dcp(root: Loc, dst: Loc, progress: bool) -> dict[str, Any]:
    # restricted unpickler, tiling of every tensor (a checkpoint missing rows is an error), plain file names
    md = read_metadata(root, read_manifest(root))
    files = sorted({check_file_name(info.relative_path, str(root / ".metadata"))
                    for info in md.storage_data.values()})
    sizes = {}
    for rel in files:
        kind = (root / rel).kind()
        if kind == "link":
            raise CorruptCheckpointError(f"migrate: {root} references data file {rel}, which is a symlink; migrate "
                                         "reads only regular files inside the source")
        if kind != "object":
            raise ValueError(f"migrate: {root} references data file {rel}, which is missing")
        sizes[rel] = (root / rel).size() or 0
    save_id = uuid.uuid4().hex
    gen = generation(dst, save_id)
    target = save_lock(dst)
    try:
        gen.make_dir()
        try:
            sums: dict[str, FileSums] = {}
            with progress_bar(sum(sizes.values()), "copy", progress) as bar:
                _copy_durably(root, ".metadata", gen, bar)
                for rel in files:
                    sums[rel] = _copy_durably(root, rel, gen, bar)
            dcp_id = md.storage_meta.save_id if md.storage_meta is not None else None
            write_manifest(gen, save_id, md, sums, {"world_size": None, "dcp_save_id": dcp_id,
                                                    "migrated_from": str(root)})
            commit(dst, gen, target)
        except BaseException:
            gen.delete_tree()
            raise
        sweep(dst, keep=gen.name, spare=None)
    finally:
        target.release()
    return {"source": "dcp", "keys": len(md.state_dict_metadata), "bytes": tensor_bytes(md), "save_id": save_id}


def _copy_durably(root: Loc, rel: str, gen: Loc, bar: Any) -> FileSums:
    """Copy the object ``root/rel`` to a new one ``gen/rel``, durably; the block checksums of the bytes written
    (no read back)."""
    hasher = BlockHasher()
    try:
        src = (root / rel).open_read()
    except NotAnObject:
        raise CorruptCheckpointError(f"migrate: {root / rel} is not a regular file") from None
    buf = memoryview(bytearray(_COPY_BLOCK))
    try:
        with (gen / rel).create() as out:
            at = 0
            while n := src.readinto(buf, at):
                out.write(buf[:n])
                hasher.update(buf[:n])
                at += n
                if rel != ".metadata":
                    bar.update(n)
    finally:
        src.close()
    return hasher.finish(getattr(out, "version", None))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _safe_sharded_globals() -> list[Any]:
    """The classes a ``torch.save`` of a state_dict of ShardedTensors refers to, for ``weights_only`` loads."""
    st = ShardedTensor

    def nested_class(owner: Any, name: str) -> Any:  # the pickles name ShardedTensor.ProcessGroupState so
        if owner is st and name == "ProcessGroupState":
            return st.ProcessGroupState
        raise pickle.UnpicklingError(f"getattr({owner!r}, {name!r}) is not allowed")

    return [st, st.ProcessGroupState, ShardedTensorShard, ShardMetadata, ShardedTensorMetadata,
            ShardedTensorProperties, EnumerableShardingSpec, RemoteDevice,
            ChunkShardingSpec, ShardedTensorMemFormat, (nested_class, "builtins.getattr")]


def _rank_worker(rank: int, world: int, port: int, files: list[str], dst: str, progress: bool, out: Any,
                 trusted: bool, options: Mapping[str, Any] | None) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=300))
        with progress_bar(3, "migrate", progress and rank == 0, unit="step") as bar:
            mine = locate(files[rank], options)
            raw = io.BytesIO(mine.get(mine.size() or 0))
            if trusted:
                sd = torch.load(raw, weights_only=False, map_location="cpu")
            else:
                try:
                    with torch.serialization.safe_globals(_safe_sharded_globals()):
                        sd = torch.load(raw, weights_only=True, map_location="cpu")
                except Exception as e:  # a hostile or unusual pickle: named, and nothing of it ran
                    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
                    why = [ln for ln in lines if "Unsupported" in ln or "GLOBAL" in ln] or lines[-1:]
                    raise CorruptCheckpointError(
                        f"{files[rank]} cannot be loaded with weights_only=True ({type(e).__name__}: "
                        f"{' '.join(why[:2])}); migrate(..., trusted_pickles=True) or --trusted-pickles "
                        "unpickles files you trust"
                    ) from None
            bar.update(1)
            dts = state_dict_to_dtensor(sd)
            bar.update(1)
            save_id = save(dts, dst, storage_options=options)
            bar.update(1)
        out.put((rank, "ok", {"source": "per-rank torch.save", "keys": len(dts), "save_id": save_id}))
        dist.destroy_process_group()
    except BaseException:  # reported to the parent, which raises
        out.put((rank, "error", traceback.format_exc()))


def _migrate_rank_files(files: list[str], dst: str, progress: bool, trusted: bool,
                        options: Mapping[str, Any] | None) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_rank_worker, args=(r, len(files), port, files, dst, progress, out, trusted, options))
        for r in range(len(files))
    ]
    for p in procs:
        p.start()
    results: list[tuple[int, str, Any]] = []
    while len(results) < len(procs):
        try:
            results.append(out.get(timeout=2))
        except queue.Empty:
            dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            reported = {r for r, _, _ in results}
            if any(r not in reported for r in dead):
                for p in procs:
                    p.kill()
                raise CheckpointError(f"migrate: rank processes {dead} died without a report") from None
    for p in procs:
        p.join()
    errors = sorted((r, msg) for r, status, msg in results if status == "error")
    if errors:
        raise CheckpointError("migrate failed:\n" + "\n".join(
            f"--- rank {r} ({files[r].rsplit('/', 1)[-1]}) ---\n{m}" for r, m in errors))
    summary = next(msg for r, status, msg in results if r == 0)
    committed = resolve(locate(dst, options))
    summary["bytes"] = tensor_bytes(read_metadata(committed, read_manifest(committed)))
    return summary
