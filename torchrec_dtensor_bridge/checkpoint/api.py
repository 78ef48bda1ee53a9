"""The public entry points, ``save`` and ``load``: DCP with atomic commits, validation first, and checksums.

This module holds the two collective calls and the order of their steps; the
machinery they call lives beside it: :mod:`.commit` (generations, locks,
the atomic rename), :mod:`.writer` and :mod:`.manifest` (checksums as files
are written), :mod:`.loading` (the generation every rank agrees to read),
:mod:`.reader` (ranged, verified reads), :mod:`.agree` (every rank raises the
same error).

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
   manifest (:mod:`.manifest`) and ``.metadata`` (:mod:`.validate`), both
   verified and parsed safely, checks every key, shape and dtype of the
   destination, and that the manifest describes exactly the items this rank
   will read (no data yet);
2. agree: every rank compares the save id every rank read; if the generation
   moved under a rank before it was locked, every rank resolves again; if any
   rank found a problem, every rank raises the same error — nothing was written
   (steps 1-2: :func:`.loading.open_agreed`);
3. ``dcp.load`` through :class:`.reader.VerifiedReader`: each rank reads only
   the rows of the saved chunks that overlap its shards, verifies their
   checksum blocks, agrees with every rank, and only then copies into place.

Both first replace every DCP ``Stateful`` value of the state_dict by its state
(:mod:`.stateful`), so steps 1-3 see tensors only; after a load each Stateful's
``load_state_dict()`` gets its loaded state.
"""

from __future__ import annotations

import copy
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from ..agreement import gather_objects
from ..groups import CommGroup
from .agree import Kind, Problem, member_group, problem_from, raise_gathered
from .incremental.chainread import load_chain
from .commit import SaveTarget, check_target, generation, prepare_generation, save_lock, writable_parent
from .common import Flat, default_process_group, dtype_of, flat, global_shape, object_summary, run_dcp
from .errors import CheckpointError
from .incremental.base import BaseCheckpoint, open_base
from .incremental.rows import Rows, without_tensors
from .keyed import ROW_STATE_COLUMNS, combine_row_states
from .agree import Wording, key_problems
from .loading import SafeObjectPlanner, open_agreed
from .format.manifest import Checksums
from .format.reader import ReadStats, VerifiedReader
from .saving import Job, side_group, staged_copy, start, wait_pending
from .stateful import Expanded, expand
from .storage import Loc, Lock, locate

__all__ = ["DEFAULT_STAGING_BYTES", "default_process_group", "load", "save"]

DEFAULT_STAGING_BYTES = 256 << 20
"""Default ``load(..., staging_bytes=)``: above it a rank verifies first and reads again."""

# Fault injection for the crash tests: called with the name of each save stage.
_fault_hook: Callable[[str], None] | None = None


def _call(verb: str, state_dict: object, path: str | Path | Loc, process_group: dist.ProcessGroup | None,
          storage_options: Mapping[str, Any] | None = None) -> tuple[Expanded, dist.ProcessGroup | None, Loc, str]:
    """What ``save`` and ``load`` start from: the state_dict with its Statefuls expanded (:mod:`.stateful`),
    the group, the absolute path, and how messages name the call."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict must be a mapping, got {type(state_dict).__name__}")
    loc = locate(path, storage_options)  # a bad URL or option: raised before anything else
    expanded = expand(state_dict, for_load=verb == "load")
    try:
        group = process_group if process_group is not None else default_process_group(expanded.leaves())
    except BaseException:
        expanded.rollback()
        raise
    return expanded, group, loc, f"checkpoint.{verb}({loc})"


def _stage(name: str) -> None:
    if _fault_hook is not None:
        _fault_hook(name)


# -------------------------------------------------------------------- save
def _discard(path: Loc, gen: Loc, target: SaveTarget | None) -> None:
    """What a refused save made: its generation, and the checkpoint's directory if the save created it."""
    (path if target is not None and target.created else gen).delete_tree()


def _signature(state_dict: Mapping[str, Any] | Flat) -> dict[str, tuple[str, tuple[int, ...], str]]:
    out = {}
    for fqn, v in flat(state_dict):
        if isinstance(v, torch.Tensor):
            out[fqn] = (type(v).__name__, global_shape(v), str(dtype_of(v)))
    return out


_DISAGREE = Wording(missing="", unexpected="", mismatched="on which ranks disagree in shape or dtype")


def _disagreements(signatures: list[dict[str, tuple[str, tuple[int, ...], str]]], g: CommGroup) -> list[Problem]:
    differ = []
    keys = sorted({k for sig in signatures for k in sig})
    for key in keys:
        seen = {g.members[r]: sig[key][1:] for r, sig in enumerate(signatures) if key in sig}
        if len(set(seen.values())) > 1:
            per = ", ".join(f"rank {r}: shape {list(s)} {d}" for r, (s, d) in seen.items())
            differ.append((key, f"key {key!r}: ranks disagree on its shape or dtype ({per})"))
    return key_problems(_DISAGREE, None, mismatched=differ)


def save(
    state_dict: Mapping[str, Any],
    path: str | Path | Loc,
    *,
    base: str | Path | Loc | None = None,
    asynchronous: bool = False,
    keep_spare: bool = True,
    process_group: dist.ProcessGroup | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> Any:
    """Save ``state_dict`` (DTensors, ShardedTensors, tensors, objects) to ``path``; *collective*.

    Values may be DCP ``Stateful`` objects (with ``state_dict()`` / ``load_state_dict()``): a
    TorchRec ``DistributedModelParallel``, its ``fused_optimizer``, a ``torch.optim`` optimizer
    (keyed by its parameters' names in a module of the same state_dict), a ``FusedOptimizer``;
    each is saved as its ``state_dict()`` (see :mod:`.stateful`).

    Returns the save id (asynchronous: a future of it). Atomic: until the final rename, a load of ``path``
    returns the previous
    checkpoint; a save interrupted at any point (a rank killed) never damages
    it. Every rank must hold the same shape and dtype for each key (checked
    before anything is written). One save per path at a time: a second job
    saving to the same path raises :class:`.CheckpointBusyError` at once.

    A full save records a digest of every row (8 bytes a row; rows of at most 8 bytes are their own digest).
    With ``base``, the save is *incremental*: per tensor block, only the rows whose digest differs from the
    base's (the newest in its chain) are written, with their digests; the rest refer to the base (see
    :mod:`.incremental`); a load follows the
    chain of bases back to a full checkpoint (:mod:`.chain`), and :func:`~.compact.compact` makes a chain one
    self-contained checkpoint again.

    Args:
        state_dict: what to save (nested dicts allowed, Stateful values expanded).
        path: the checkpoint's path (a directory holding its commit record and generations: :mod:`.commit`), or
            an ``s3://bucket/prefix/name`` URL.
        base: an earlier checkpoint of the same tensor keys, shapes and dtypes, written by this function (full
            or incremental), in the same directory as ``path`` and not ``path`` itself: save only what changed
            since it. The base's generation must stay: a later save to the base's path may replace it, and a
            load of this checkpoint then refuses, naming the missing link.
        asynchronous: return once what the save writes is copied - with ``base``, the changed rows, their
            digests and the non-tensor values; without, every value (memory for a second copy of the
            state) - and write and commit on a thread (:mod:`.saving`): the call returns
            a ``concurrent.futures.Future`` of the save id (its exception: what a synchronous save would raise,
            on every rank). Everything that can be refused is refused before it returns. The commit stays
            atomic: a process killed meanwhile leaves the previous checkpoint in force. This process's next
            save waits for it first; wait for the future before exiting or loading the checkpoint.
        keep_spare: keep the superseded generation so the next save rewrites its
            files in place (faster: BENCHMARKS.md, "Checkpoints") instead of
            allocating new ones; ``False`` keeps only the committed generation.
            A spare that a load is reading is left alone (the save allocates).
        process_group: the group to save over; ``None``: see :func:`.common.default_process_group`
            (the DTensors' mesh's group, else the default group).
        storage_options: for an ``s3://bucket/prefix/name`` path, the object store's settings in fsspec's
            spelling (``endpoint_url``, ``key``, ``secret``, ``region``, ``client_kwargs``, ...;
            :mod:`.storage.s3`); the standard AWS variables apply where they say nothing. ``None`` for local paths.

    Raises:
        NotADirectoryError: an existing parent of ``path`` is a file (on every rank, nothing written).
        TypeError: a Stateful's ``state_dict()`` is not a mapping (on every rank, nothing written).
        CheckpointBusyError: another save to ``path`` is in progress.
        ValueError: ranks disagree on a key's shape or dtype, or ``base`` is not a checkpoint of the same keys,
            shapes and dtypes (on every rank, nothing written).
        CheckpointError: ``path`` exists and is not a checkpoint of ours, or writing or committing failed (the
            previous checkpoint stays in force).

    Example::

        >>> tdb.checkpoint.save(tdb.state_dict_to_dtensor(model.state_dict()), "/ckpt/step100")
        >>> state = {"model": dmp, "fused": dmp.fused_optimizer, "dense": adam, "step": 100}
        >>> tdb.checkpoint.save(state, "/ckpt/latest")  # Statefuls: each object's state_dict()
    """
    wait_pending()  # this process's asynchronous save, if one runs, first
    expanded, group, loc, what = _call("save", state_dict, path, process_group, storage_options)
    state_dict = expanded.view
    g = member_group(group, what)
    rank, world = g.rank, g.size
    problems: list[Problem] = list(expanded.problems)
    lock: SaveTarget | None = None
    gen_lock: Lock | None = None
    save_id = uuid.uuid4().hex
    gen = generation(loc, save_id)
    if rank == 0:
        try:
            writable_parent(loc)
        except NotADirectoryError as e:  # before anything is written; raised as itself on every rank
            problems.append(Problem(Kind.NOT_A_DIRECTORY, str(e)))
    prepared = False
    base_ck: BaseCheckpoint | None = None
    if base is not None:
        try:
            base_ck = open_base(locate(base, storage_options), loc)
        except ValueError as e:
            problems.append(Problem(Kind.VALUE, str(e)))
        except Exception as e:  # reported to every rank
            problems.append(problem_from(e, f"base {base}"))
    rows = Rows(expanded.leaves(), dist.get_rank() if dist.is_initialized() else 0, base_ck, tuple(g.members))
    signature = _signature(expanded.leaves())
    if not problems:  # before the agreement, so that it is the save's only one of its own
        try:
            problems += rows.compute()
        except Exception as e:  # reported to every rank
            problems.append(problem_from(e, "row digests"))
    if rank == 0 and not problems:
        try:
            check_target(loc)
            lock = save_lock(loc)
            committed = lock.record["generation"] if lock.record else None
            _, gen_lock = prepare_generation(loc, gen, committed, reuse=keep_spare)
            prepared = True
        except Exception as e:  # reported to every rank
            problems.append(problem_from(e, f"cannot prepare {gen.name}"))
    everyone = gather_objects((save_id, problems, signature, expanded.local_records(),
                               expanded.column_widths, rows.describe(), base_ck and base_ck.save_id), g)
    save_id = everyone[0][0]
    gen = generation(loc, save_id)
    disagree = _disagreements([e[2] for e in everyone], g)
    if not disagree:  # every rank compares every rank's keys with the base's: the same verdict everywhere
        disagree += rows.check({k: v for e in everyone for k, v in e[2].items()})
    if base_ck is not None and len({e[6] for e in everyone}) > 1:
        disagree.append(Problem(Kind.VALUE, f"base {base}: ranks found different saves {[e[6] for e in everyone]} "
                                            "(it was saved to while this save began); save again"))
    if not disagree:
        expanded.merge_records([e[3] for e in everyone])
    widths = {k: list(v) for e in everyone for k, v in e[4].items()}  # each rank knows its own tables
    job: Job | None = None
    try:
        if disagree or any(e[1] for e in everyone):
            if rank == 0 and prepared:
                _discard(loc, gen, lock)
            raise_gathered(what + " refused, nothing was written", [e[1] for e in everyone], g, disagree)
        rows.own([e[5] for e in everyone], rank or 0)
        rows.mark(save_id)
        state: Mapping[str, Any] = state_dict
        if base_ck is not None:  # the tensors go to row files; what DCP writes is a copy when asynchronous
            state = without_tensors(state_dict)
            state = copy.deepcopy(state) if asynchronous else state
        elif asynchronous:  # a full save writes every tensor: all of it is copied
            state = staged_copy(state_dict)
        side = side_group(g) if asynchronous else g
        job = Job(loc, gen, save_id, g, what, state, rows, base_ck, [e[2] for e in everyone],
                  {"objects": object_summary(expanded.leaves()), ROW_STATE_COLUMNS: widths}, keep_spare, lock, gen_lock)
    finally:
        if job is None:
            rows.close()
            if gen_lock is not None:
                gen_lock.release()
            if lock is not None:
                lock.release()
    if not asynchronous:
        return job.run(_stage)
    job.group = side
    return start(job, _stage)


# -------------------------------------------------------------------- load
def load(
    state_dict: Mapping[str, Any],
    path: str | Path | Loc,
    *,
    strict: bool = False,
    verify: bool = True,
    staging_bytes: int | None = DEFAULT_STAGING_BYTES,
    trusted_pickles: bool = False,
    process_group: dist.ProcessGroup | None = None,
    convert_dtypes: bool = False,
    split_row_states: bool = False,
    storage_options: Mapping[str, Any] | None = None,
) -> ReadStats:
    """Load the checkpoint at ``path`` in place into ``state_dict``; *collective*.

    Destinations may be DTensors, ShardedTensors, bare ``LocalShardsWrapper``\\ s
    or plain tensors of any layout and world size: each rank reads only the rows
    of the saved chunks that overlap its shards. Stateful values (a TorchRec DMP,
    its ``fused_optimizer``, a ``torch.optim`` optimizer, a ``FusedOptimizer``)
    load in the same all-or-nothing step: every object's state is checked with
    the rest, loaded in place, then handed to its ``load_state_dict()``; an
    optimizer without state yet (before its first step) takes the checkpoint's
    (see :mod:`.stateful`). Plain values the load replaces are written back into
    ``state_dict``. The state_dict decides what is loaded: every key it holds must
    be in the checkpoint; keys only in the checkpoint are ignored unless
    ``strict``. Every rank reads the same committed save, even while other jobs
    save to ``path``. Every key, shape and dtype is checked first, then every
    checksum block a rank reads; on any problem every rank raises the same error
    and nothing is written. Verification covers exactly the bytes read: a corrupt
    block that no rank needs does not stop a load.

    Args:
        state_dict: the destination, as returned by ``state_dict()`` (nested dicts allowed, Stateful values).
        path: a checkpoint written by :func:`save` (or, with ``verify=False``, any DCP directory).
        strict: refuse a checkpoint holding keys absent from ``state_dict``.
        verify: check checksums (requires a checkpoint written by :func:`save` or
            :func:`~.migrate.migrate`: a plain DCP directory loads with ``verify=False``, or migrate it once).
        staging_bytes: the most memory a rank spends holding verified bytes until every
            rank has verified its own (about the bytes it reads; 256 MiB by default). A
            rank that would read more verifies first and reads again to copy (rows bound
            for a contiguous CPU tensor of their dtype straight into it): no extra
            memory, and the second pass is served by the page cache while the rank's
            share fits in it (BENCHMARKS.md: 0.2 s vs 0.9 s for 1 GiB a rank here, where
            fresh staging memory costs ~0.3 s/GiB to map). Should a file change between
            the two passes, the second pass's checksums catch it and the load raises
            (destinations may then be partly written). On an object store, the rows of
            an object whose ETag is the one its save recorded are read once, in the
            second pass (:mod:`.format.reader`). ``None``: no limit (read each byte
            once; the choice for cold storage with memory to spare).
        trusted_pickles: unpickle non-tensor items with ``weights_only=False`` (they can
            run code: only for checkpoints you trust). By default they load with
            ``weights_only=True`` (tensors, containers, numbers, strings).
        process_group: the group to load over; ``None``: see :func:`.common.default_process_group`.
        convert_dtypes: load a floating-point tensor saved in another floating-point dtype (an fp32
            checkpoint into fp16 tables: a routine memory saving), rounding as ``Tensor.copy_`` does. Off by
            default: a dtype mismatch is refused (plain DCP converts silently).
        split_row_states: load a per-row optimizer state (TorchRec's row-wise Adagrad: one value per row and
            column block) into another column cut of several blocks than the checkpoint's: each row's saved
            values are combined, weighted by their blocks' widths (one value per row, a table saved uncut or by
            a ``FusedOptimizer``: as it is), and every new block takes that value. An approximation, hence asked
            for: a block's own statistic (the mean of its columns' squared gradients) was never saved. The same
            blocks load block for block, and into one block the combination is exact: neither needs the flag
            (:mod:`.keyed`; ``tdb.reshard`` follows the same rule).
        storage_options: for an ``s3://bucket/prefix/name`` path, the object store's settings in fsspec's
            spelling (``endpoint_url``, ``key``, ``secret``, ``region``, ``client_kwargs``, ...;
            :mod:`.storage.s3`); the standard AWS variables apply where they say nothing. ``None`` for local paths.

    Returns:
        What this rank read (:class:`.reader.ReadStats`): ``bytes_read`` from data files (every pass),
        ``files_opened``, and whether the bytes were ``verified``.

    Raises:
        IncompleteCheckpointError: nothing was committed at ``path`` (never saved, or every save interrupted).
        NotACheckpointError: ``path`` is a file, or a directory holding neither ``.metadata`` nor a manifest.
        CorruptCheckpointError: the checkpoint's files are damaged, inconsistent or hostile (or, with
            ``verify``, it has no manifest to verify against).
        ValueError: a key, shape or dtype of ``state_dict`` does not match the checkpoint.
        TypeError: a Stateful's ``state_dict()`` is not a mapping.

        Every rank raises the same exception, and nothing was modified (see :mod:`.errors`).

    Example::

        >>> tdb.checkpoint.load(tdb.state_dict_to_dtensor(model.state_dict()), "/ckpt/step100")
        >>> state = {"model": dmp, "fused": dmp.fused_optimizer, "dense": adam, "step": 0}
        >>> tdb.checkpoint.load(state, "/ckpt/latest")  # another plan or world size; state["step"] == 100
    """
    expanded, group, loc, what = _call("load", state_dict, path, process_group, storage_options)
    extra: list[Problem] = list(expanded.problems)
    if staging_bytes is not None and (not isinstance(staging_bytes, int) or staging_bytes < 0):
        extra.append(Problem(Kind.VALUE, f"staging_bytes must be a non-negative int or None, got {staging_bytes!r}"))
    try:
        opened = open_agreed(loc, expanded.view, strict, verify, member_group(group, what), what, extra,
                             optional=expanded.optional, hints=expanded.hints, convert_dtypes=convert_dtypes,
                             split_row_states=split_row_states, param_groups=expanded.param_groups,
                             stateless=expanded.stateless)
        try:
            expanded.drop(opened.absent)
            combine, undo = combine_row_states(expanded.row_states, opened.row_states, opened.metadata)
            checksums = Checksums(opened.manifest) if verify and opened.manifest is not None else None
            head = opened.chain.links[0].metadata if opened.chain is not None else opened.metadata
            reader = VerifiedReader(opened.root, checksums=checksums, process_group=group,
                                    staging_bytes=staging_bytes, what=what, metadata=head,
                                    trusted_pickles=trusted_pickles)
            try:
                if opened.chain is None:
                    run_dcp(dcp.load, expanded.view, storage_reader=reader,
                            planner=SafeObjectPlanner(trusted_pickles), process_group=group)
                else:  # an incremental checkpoint
                    load_chain(opened.chain, expanded.view, reader, group, what, verify=verify,
                               staging_bytes=staging_bytes, trusted_pickles=trusted_pickles)
            except BaseException:
                undo()
                raise
            combine()
        finally:
            opened.release()
    except BaseException:
        expanded.rollback()
        raise
    expanded.restore()
    return reader.stats
