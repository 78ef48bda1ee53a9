"""The writing half of a save: files into a generation, gathered checksums, the commit; also asynchronously.

:func:`~.api.save` settles everything that can be refused (on every rank,
nothing written), then hands a :class:`Job` its state: the generation, its locks,
and what to write. :meth:`Job.run` does, on every rank (*collective* on the job's
group):

1. :func:`write_generation`: ``dcp.save`` into the generation, then this rank's
   row digest (and, incremental, changed-row) files, each hashed as written and
   fsynced;
2. gather every rank's checksums and records;
3. rank 0: :func:`commit_generation`: the manifest written durably, the path's
   link swapped to the generation (the commit point), older generations swept;
4. every rank learns the outcome; the locks are released.

An asynchronous save (:func:`start`) runs the same job on a thread, on a gloo
group of the same ranks of its own (created once per set of ranks, by those
ranks only), so its collectives never interleave with the caller's on the
caller's group; the caller's next save waits for it first. What the job writes
was copied before :func:`~.api.save` returned (an incremental save's changed rows
and digests, its non-tensor values; a full save's every value, :func:`staged_copy`),
so training may change the tables at once.
The commit stays the one rename by rank 0: a process killed while the job runs
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
from ..agreement import gather_objects
from ..convert import to_dtensor
from ..groups import CommGroup, of_group
from .agree import Kind, Problem, from_rank0, problem_from, raise_gathered
from .commit import SaveTarget, commit, prune, sweep
from .common import dcp_failures, dcp_quietly
from .errors import CheckpointBusyError, CheckpointError
from .incremental import BaseCheckpoint, Rows, manifest_records
from .manifest import write_manifest
from .storage import Loc, Lock
from .validate import MAX_METADATA_BYTES, parse_metadata
from .writer import ChecksummingWriter

__all__ = ["Job", "commit_generation", "side_group", "staged_copy", "start", "wait_pending", "write_generation"]

_BUSY = "busy: "  # an outcome that is a lost race to commit, raised as CheckpointBusyError
_side_groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
_pending: concurrent.futures.Future[str] | None = None
_pending_lock = threading.Lock()


def write_generation(state_dict: Mapping[str, Any], gen: Loc, g: CommGroup, what: str, rows: Rows,
                      ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """``dcp.save`` into ``gen``, then this rank's row files (:meth:`.incremental.Rows.write`); on failure every
    rank raises with every rank's OS errors (errno named) and rank 0 removes ``gen``. Returns this rank's file
    checksums and its row digest and piece records."""
    writer = ChecksummingWriter(gen)
    problems: list[Problem] = []
    out: tuple[dict[str, Any], dict[str, Any], dict[str, Any]] = ({}, {}, {})
    try:
        with dcp_quietly():
            dcp.save(state_dict, storage_writer=writer, process_group=g.group)
        sums, digests, pieces = rows.write(gen, g.rank or 0)
        out = ({**writer.file_sums, **sums}, digests, pieces)
    except CheckpointException as e:
        local = writer.os_errors
        problems += [problem_from(err, f"writing {name}") for name, err in local]
        if not local:
            failures = dcp_failures(e)
            oserr = [f for f in failures if isinstance(f, OSError)]
            problems.append(problem_from(oserr[0]) if oserr else Problem(Kind.IO, f"dcp.save failed: {e}"))
    except Exception as e:  # the row files: reported to every rank
        problems.append(problem_from(e, "writing row files"))
    everyone = gather_objects(problems, g)
    if any(everyone):
        if g.rank == 0:
            gen.delete_tree()
        raise_gathered(f"{what} failed, the previous checkpoint is intact and {gen.name} was removed", everyone, g)
    return out


def commit_generation(path: Loc, gen: Loc, sums: list[Any], world: int, keep_spare: bool, target: SaveTarget,
                      gen_lock: Lock | None, records: dict[str, Any], stage: Callable[[str], None]) -> str | None:
    """Rank 0: manifest, commit, sweep (steps 3-5 of :mod:`.commit`); the failure message or ``None``. Releases
    ``gen_lock`` once committed."""
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
        return None
    except Exception as e:  # reported to every rank
        p = problem_from(e)
        if not committed:
            gen.delete_tree()
            if isinstance(e, CheckpointBusyError):
                return f"{_BUSY}{p.message}; the previous checkpoint is intact"
            return f"commit of {gen} as {path} failed, the previous checkpoint is intact: {p.message}"
        return f"{path} was committed, but removing older generations failed: {p.message}"
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
        try:
            stage("prepared")
            local = write_generation(self.state, self.gen, g, self.what, self.rows)
            stage("dcp_saved")
            sums = gather_objects(local, g)
            stage("checksummed")
            outcome: str | None = None
            if g.rank == 0:
                records = manifest_records(self.base, self.signatures, [(d, p) for _, d, p in sums])
                assert self.lock is not None, "rank 0 holds the save lock"
                outcome = commit_generation(self.path, self.gen, [s for s, _, _ in sums], g.size, self.keep_spare,
                                            self.lock, self.gen_lock, {**self.records, **records}, stage)
                self.gen_lock = None
            outcome = from_rank0(outcome, g)
            if outcome and outcome.startswith(_BUSY):
                raise CheckpointBusyError(outcome[len(_BUSY):])
            if outcome:
                raise CheckpointError(outcome)
            return self.save_id
        finally:
            self.release()

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
