"""The writing half of a save: files into a generation, gathered checksums, the commit; also asynchronously.

:func:`~.api.save` settles everything that can be refused (on every rank,
nothing written), then hands a :class:`Job` its state: the generation, its locks,
and what to write. :meth:`Job.run` does, on every rank (*collective* on the job's
group):

1. ``dcp.save`` into the generation through :class:`~.writer.ChecksummingWriter`:
   each rank's data files, then its row digest (and, incremental, changed-row)
   file, each hashed as written and durable when closed;
2. every rank's checksums and records reach rank 0 with DCP's own write results
   (no collective of the save's own);
3. rank 0, inside DCP's ``finish``: :func:`commit_generation`: the manifest,
   the commit record replaced (the commit point, :mod:`.commit`), older
   generations swept;
4. every rank learns the outcome from DCP's own last step (an error on rank 0
   is every rank's); the locks are released.

An asynchronous save (:func:`start`) runs the same job on a thread, on a gloo
group of the same ranks of its own (created once per set of ranks, by those
ranks only), so its collectives never interleave with the caller's on the
caller's group; the caller's next save waits for it first. What the job writes
was copied before :func:`~.api.save` returned (an incremental save's changed rows
and digests, its non-tensor values; a full save's every value, :func:`staged_copy`),
so training may change the tables at once.
The commit stays rank 0's one atomic step: a process killed while the job runs
leaves the previous checkpoint in force, as for a synchronous save.
"""

from __future__ import annotations

import concurrent.futures
import copy
import dataclasses
import pickle
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata

from .._compat import ShardedTensor
from ..convert import to_dtensor
from ..groups import CommGroup, of_group
from .agree import problem_from, raise_gathered
from .commit import SaveTarget, commit, prune, sweep
from .common import dcp_quietly
from .errors import CheckpointBusyError, CheckpointError
from .incremental.base import BaseCheckpoint
from .incremental.rows import Rows, manifest_records
from .format.manifest import write_manifest
from .storage import Loc, Lock
from .format.validate import MAX_METADATA_BYTES, parse_metadata
from .format.writer import ChecksummingWriter

__all__ = ["Job", "commit_generation", "side_group", "staged_copy", "start", "wait_pending"]

_side_groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
_pending: concurrent.futures.Future[str] | None = None
_pending_lock = threading.Lock()


def commit_generation(path: Loc, gen: Loc, sums: list[Any], world: int, keep_spare: bool, target: SaveTarget,
                      gen_lock: Lock | None, records: dict[str, Any], stage: Callable[[str], None]) -> None:
    """Rank 0: manifest, commit, sweep (steps 3-5 of :mod:`.commit`); raises :class:`.CheckpointError` (its
    subclass :class:`.CheckpointBusyError` for a lost race to commit), the generation removed unless committed.
    Releases ``gen_lock`` once committed."""
    committed = False
    try:
        md_bytes = (gen / ".metadata").get(MAX_METADATA_BYTES + 1)
        md = parse_metadata(md_bytes, str(gen / ".metadata"))
        files = sorted({info.relative_path for info in md.storage_data.values()}
                       | {rel for part in sums for rel in part if rel.endswith(".tdb")})
        prune(gen, {".metadata", *files})  # leftovers of a reused generation (e.g. more ranks)
        merged = {rel: fs for part in sums for rel, fs in part.items() if rel in files}
        dcp_id = md.storage_meta.save_id if md.storage_meta is not None else None
        write_manifest(gen, gen.name[len("gen-"):], md, merged,
                       {"world_size": world, "dcp_save_id": dcp_id, **records}, metadata=md_bytes)
        stage("manifest_written")
        previous = commit(path, gen, target)
        committed = True
        if gen_lock is not None:
            gen_lock.release()
        stage("committed")
        _plain_metadata(path, gen, md)
        sweep(path, keep=gen.name, spare=previous if keep_spare else None)
    except CheckpointBusyError as e:
        gen.delete_tree()
        raise CheckpointBusyError(f"{e}; the previous checkpoint is intact") from None
    except Exception as e:
        p = problem_from(e)
        if not committed:
            gen.delete_tree()
            raise CheckpointError(f"commit of {gen} as {path} failed, the previous checkpoint is intact: "
                                  f"{p.message}") from None
        raise CheckpointError(f"{path} was committed, but removing older generations failed: {p.message}") from None
    finally:
        if gen_lock is not None:
            gen_lock.release()


def _plain_metadata(path: Loc, gen: Loc, md: Metadata) -> None:
    """``path/.metadata``: the committed generation's, its items' files named under ``gen``, so that plain
    ``dcp.load(checkpoint_id=path)`` reads the checkpoint. Written after the commit (the commit record decides
    what is committed; this package's loads never read it)."""
    moved = {idx: dataclasses.replace(info, relative_path=f"{gen.name}/{info.relative_path}")
             for idx, info in md.storage_data.items()}
    (path / ".metadata").put(pickle.dumps(dataclasses.replace(md, storage_data=moved)))


@dataclass
class Job:
    """What is left of a save once nothing can be refused: write, gather, commit (see the module docstring)."""

    path: Loc
    gen: Loc
    save_id: str
    group: CommGroup
    what: str
    state: Mapping[str, Any]  # what dcp.save writes
    rows: Rows
    base: BaseCheckpoint | None
    signatures: list[Any]
    records: dict[str, Any]  # the manifest's other records
    keep_spare: bool
    lock: SaveTarget | None
    gen_lock: Lock | None

    def run(self, stage: Callable[[str], None]) -> str:
        """Steps 1-4 of the module docstring; the save id. Releases the locks however it ends."""
        g = self.group
        committed: list[bool] = []

        def finish(parts: list[Any]) -> None:  # rank 0, inside dcp.save, holding every rank's part
            stage("checksummed")
            assert self.lock is not None, "rank 0 holds the save lock"
            records = manifest_records(self.base, self.signatures, [(p["digests"], p["pieces"]) for p in parts])
            commit_generation(self.path, self.gen, [p["sums"] for p in parts], g.size, self.keep_spare,
                              self.lock, self.gen_lock, {**self.records, **records}, stage)
            self.gen_lock = None
            committed.append(True)

        writer = ChecksummingWriter(self.gen, rows=self.rows, rank=g.rank or 0, stage=stage,
                                    finisher=finish if g.rank == 0 else None)
        try:
            stage("prepared")
            try:
                with dcp_quietly():
                    dcp.save(self.state, storage_writer=writer, process_group=g.group)
            except CheckpointException as e:
                if g.rank == 0 and not committed:
                    self.gen.delete_tree()
                raise self._failure(e) from None
            except BaseException:
                if g.rank == 0 and not committed:
                    self.gen.delete_tree()
                raise
            stage("checksummed")  # the other ranks: every part reached rank 0, which committed
            return self.save_id
        finally:
            self.release()

    def _failure(self, e: CheckpointException) -> BaseException:
        """What every rank raises for a failed ``dcp.save``: a commit's own error as itself, else every rank's
        error (the OS's, errno named) in one message."""
        failures = {r: (f[0] if isinstance(f, tuple) else f) for r, f in e.failures.items()}
        ours = [f for f in failures.values() if isinstance(f, CheckpointError)]
        if ours:
            return type(ours[0])(*ours[0].args)
        everyone = [[problem_from(failures[r], "writing")] if r in failures else [] for r in range(self.group.size)]
        try:
            raise_gathered(f"{self.what} failed, the previous checkpoint is intact and {self.gen.name} was removed",
                           everyone, self.group)
        except CheckpointError as err:
            return err
        return CheckpointError(f"{self.what} failed: {e}")

    def release(self) -> None:
        self.rows.close()
        if self.gen_lock is not None:
            self.gen_lock.release()
            self.gen_lock = None
        if self.lock is not None:
            self.lock.release()
            self.lock = None


def staged_copy(sd: Any) -> Any:
    """What an asynchronous full save writes, copied: tensors cloned (a ShardedTensor as the DTensor over its
    shards, :func:`~..convert.to_dtensor`: the same chunks), other values deep-copied, containers rebuilt."""
    if isinstance(sd, Mapping):
        return {k: staged_copy(v) for k, v in sd.items()}
    if isinstance(sd, (list, tuple)):
        return type(sd)(staged_copy(v) for v in sd)
    if isinstance(sd, ShardedTensor):
        return to_dtensor(sd).detach().clone()
    if isinstance(sd, torch.Tensor):
        return sd.detach().clone()
    return copy.deepcopy(sd)


def side_group(g: CommGroup) -> CommGroup:
    """A gloo group of ``g``'s ranks for asynchronous saves, created once (*collective* on ``g``'s ranks only,
    the first time)."""
    if not dist.is_initialized() or g.size == 1:
        return g
    pg = _side_groups.get(g.members)
    if pg is None:
        pg = _side_groups[g.members] = dist.new_group(list(g.members), backend="gloo", use_local_synchronization=True)
    return of_group(pg)


def wait_pending() -> None:
    """Wait for this process's asynchronous save, if one is running (its outcome is its future's)."""
    with _pending_lock:
        pending = _pending
    if pending is not None:
        concurrent.futures.wait([pending])


def start(job: Job, stage: Callable[[str], None]) -> concurrent.futures.Future[str]:
    """Run ``job`` on a thread; its future (the save id, or the exception every rank raises)."""
    global _pending
    future: concurrent.futures.Future[str] = concurrent.futures.Future()

    def work() -> None:
        try:
            future.set_result(job.run(stage))
        except BaseException as e:  # noqa: BLE001 - handed to the future
            future.set_exception(e)

    with _pending_lock:
        _pending = future
    threading.Thread(target=work, name=f"tdb-save-{job.save_id[:8]}", daemon=False).start()
    return future
