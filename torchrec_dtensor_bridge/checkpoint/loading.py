"""What :func:`~.api.load` runs before ``dcp.load``, and the planner it runs with.

:func:`open_agreed` settles, on every rank, one committed generation to read and
checks everything short of the data (*collective*):

1. rank 0 resolves ``path`` to its committed generation and tells every rank;
2. each rank takes a shared lock on that generation (held for the whole load:
   a save never rewrites nor removes a generation being read), reads its
   manifest (:func:`~.manifest.read_manifest`) and ``.metadata``
   (:func:`~.validate.read_metadata`), checks every key, shape and dtype of the
   destination (an optional key, state an optimizer created for the load, may be
   absent from the checkpoint: then it is not loaded), and that the manifest
   describes exactly the items this rank will read (no data is read);
3. every rank gathers every rank's save id and problems: if the generation was
   renamed or reused under a rank before it was locked, every rank resolves
   again (step 1); if any rank found a problem, or ranks read different saves,
   every rank raises the same error — nothing was written.

:class:`SafeObjectPlanner` is the ``dcp.load`` planner: non-tensor items are
unpickled with ``weights_only=True`` unless trusted, a bare
``LocalShardsWrapper`` is planned by its global shape, and the keys planned are
the keys step 2 checked (never DCP's second guess for checkpoints written before
torch 2.4).
"""

from __future__ import annotations

import io
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, create_default_local_load_plan
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem
from torch.distributed.tensor import DTensor

from .._compat import ShardedTensor
from ..agreement import gather_objects
from ..convert import layout_of
from ..groups import CommGroup
from ..wrapper import LocalShardsWrapper
from .agree import Kind, Problem, from_rank0, problem_from, raise_gathered
from .incremental.chain import Chain, is_incremental, metadata_for_checks, open_chain
from .commit import committed_name, lock_generation, root_of
from .common import dtype_of, global_shape, leaves
from .errors import CheckpointError, CorruptCheckpointError
from .format.manifest import MANIFEST, item_key, item_record, read_manifest
from .format.plan import needed_chunks
from .keyed import Hint, RowConversion, recorded_widths
from .agree import Wording, key_problems
from .stateful import unloadable
from .storage import Loc, Lock, NotAnObject
from .format.validate import read_metadata

__all__ = ["Opened", "SafeObjectPlanner", "open_agreed"]

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


def _absent(md: Metadata, optional: tuple[str, ...]) -> frozenset[str]:
    """The keys of ``optional`` under which the checkpoint holds nothing (a key counts with everything below it)."""
    if not optional:
        return frozenset()
    held: set[str] = set()
    for key in md.state_dict_metadata:
        parts = key.split(".")
        held.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return frozenset(k for k in optional if k not in held)


def _under(fqn: str, keys: frozenset[str]) -> bool:
    return any(fqn == k or fqn.startswith(k + ".") for k in keys)


def row_state_conversions(flat: list[tuple[str, Any]], md: Metadata, manifest: dict[str, Any] | None,
                          hints: Mapping[str, Hint] | None, *, split: bool = False,
                          ) -> dict[str, RowConversion | str]:
    """Per key of ``flat`` that ``hints`` names (a keyed optimizer's per-row state), how its saved state
    converts (:meth:`.keyed.Hint.conversion`; only the column blocks' widths the manifest recorded count,
    :func:`recorded_widths`), or why it does not (the key's refusal); keys loaded as they are are left out."""
    out: dict[str, RowConversion | str] = {}
    for fqn, value in flat:
        m = md.state_dict_metadata.get(fqn)
        if not hints or fqn not in hints or not isinstance(value, torch.Tensor) or not isinstance(
                m, TensorStorageMetadata):
            continue
        how = hints[fqn].conversion(tuple(m.size), global_shape(value), recorded_widths(manifest, fqn), split)
        if how is not None:
            out[fqn] = how
    return out


def _group_count_problems(md: Metadata, param_groups: Mapping[str, int]) -> list[Problem]:
    """A checkpoint holding another number of parameter groups under a ``torch.optim`` optimizer's
    ``param_groups`` key than the optimizer has (``param_groups``: that key -> its number of groups);
    a checkpoint holding none there is left to the missing keys' problems."""
    problems = []
    for prefix, n in param_groups.items():
        held: dict[int, str] = {}
        for key in sorted(md.state_dict_metadata):
            index = key[len(prefix) + 1:].split(".", 1)[0] if key.startswith(prefix + ".") else ""
            if index.isdigit():
                held.setdefault(int(index), key)
        if held and sorted(held) != list(range(n)):
            only = [k for i, k in held.items() if i >= n] or [f"{prefix}.{i}" for i in range(n) if i not in held]
            side = "the checkpoint" if any(i >= n for i in held) else "the destination"
            problems.append(Problem(Kind.VALUE, f"key {only[0]!r} is only in {side}: the checkpoint holds "
                                                f"{len(held)} parameter groups under {prefix!r}, the optimizer has "
                                                f"{n} (a resumed optimizer needs its groups as saved)"))
    return problems


KEYS = Wording(missing="of the state_dict are not in the checkpoint",
               unexpected="of the checkpoint are not in the state_dict (load(..., strict=False) ignores them)",
               mismatched="have another shape or dtype in the checkpoint",
               unnamed="the checkpoint holds {n} keys the state_dict does not name: {keys}")
"""How a load's refusal counts its keys past the first few (:func:`.keylists.key_problems`)."""


def _check_keys(sd: Mapping[str, Any], md: Metadata, strict: bool, hints: Mapping[str, Hint] | None = None,
                absent: frozenset[str] = frozenset(), *, convert_dtypes: bool = False,
                manifest: dict[str, Any] | None = None, split_row_states: bool = False,
                param_groups: Mapping[str, int] | None = None, where: str | None = None,
                ) -> tuple[list[Problem], list[tuple[str, Any]], dict[str, RowConversion]]:
    """This rank's problems with ``sd`` against the checkpoint (at ``where``), its leaves, and the per-row states
    it converts (:func:`row_state_conversions`); ``param_groups``: per ``torch.optim`` optimizer's
    ``param_groups`` key, its number of groups (:func:`_group_count_problems`). Keys that do not match are told
    as :func:`.keylists.key_problems` tells them: a few by name, all on the exception."""
    problems: list[Problem] = _group_count_problems(md, param_groups or {})
    flat = [(fqn, v) for fqn, v in leaves(sd) if not (absent and _under(fqn, absent))]
    rows = row_state_conversions(flat, md, manifest, hints, split=split_row_states)
    combined = {fqn: how for fqn, how in rows.items() if not isinstance(how, str)}
    saved = md.state_dict_metadata
    missing: list[tuple[str, str]] = []
    mismatched: list[tuple[str, str]] = []
    for fqn, value in flat:
        m = saved.get(fqn)
        if m is None:
            missing.append((fqn, f"key {fqn!r} is not in the checkpoint"))
            continue
        if not isinstance(value, torch.Tensor):
            continue
        if not isinstance(m, TensorStorageMetadata):
            mismatched.append((fqn, f"key {fqn!r} was saved as an object, the destination is a tensor"))
            continue
        shape, dtype, was = global_shape(value), dtype_of(value), m.properties.dtype
        differ = []
        refused = rows.get(fqn)
        if isinstance(refused, str):
            differ.append(refused)
        elif tuple(m.size) != shape and fqn not in combined:
            differ.append(f"saved shape {list(m.size)}, destination shape {list(shape)}")
        convertible = was.is_floating_point and dtype.is_floating_point  # fp32 <-> fp16 / bf16 / fp64
        if was != dtype and not (convert_dtypes and convertible):
            how = "; load(..., convert_dtypes=True) converts it" if convertible else ""
            differ.append(f"saved dtype {was}, destination dtype {dtype}{how}")
        if differ:
            mismatched.append((fqn, f"key {fqn!r}: {'; '.join(differ)}"))
    others = sorted(set(saved) - {fqn for fqn, _ in flat})
    unexpected = [(k, f"key {k!r} is in the checkpoint, not in the state_dict (load(..., strict=False) ignores "
                      "it)") for k in others] if strict else []
    problems += key_problems(KEYS, where, missing=missing, unexpected=unexpected, mismatched=mismatched,
                             unnamed=[] if strict else others)
    return problems, flat, combined


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


def _check_items(root: Loc, manifest: dict[str, Any], md: Metadata, needed: list[MetadataIndex]) -> list[Problem]:
    """What the manifest and the files' sizes say about the items this rank will read (no data is read)."""
    problems = []
    where = str(root / "tdb_manifest.json")
    by_file: dict[str, list[MetadataIndex]] = {}
    for idx in needed:
        by_file.setdefault(md.storage_data[idx].relative_path, []).append(idx)
    for rel, idxs in sorted(by_file.items()):
        try:
            size = (root / rel).size()
        except NotAnObject:
            size = None
        if size is None:
            problems.append(Problem(Kind.CORRUPT, f"data file {rel} is missing or not a regular file (needed for "
                                                  f"{sorted({i.fqn for i in idxs})})"))
            continue
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


def _no_manifest(root: Loc, plain: bool) -> str:
    """Why a verified load of ``root`` (without a manifest) is refused, and what to do instead."""
    if plain:
        return (f"{root} is a plain DCP directory: it has no checksum manifest ({MANIFEST}; not written by "
                "tdb.checkpoint.save), so there is nothing to verify it against. Load it unverified with "
                "tdb.checkpoint.load(..., verify=False), or convert it once into a checksummed checkpoint with "
                f"`python -m torchrec_dtensor_bridge migrate {root} NEW_PATH` (or tdb.checkpoint.migrate) and load "
                "NEW_PATH")
    return (f"{root} has no checksum manifest ({MANIFEST}), which every checkpoint written by tdb.checkpoint.save "
            "has: it was removed or the checkpoint is damaged; tdb.checkpoint.load(..., verify=False) loads it "
            "unverified")


@dataclass(frozen=True)
class Opened:
    """What every rank agreed to read: the generation (held under a shared lock), its manifest and metadata."""

    root: Loc
    lock: Lock
    manifest: dict[str, Any] | None
    metadata: Metadata
    absent: frozenset[str] = frozenset()  # the optional keys the checkpoint holds nothing under
    row_states: dict[str, RowConversion] = field(default_factory=dict)  # converted on load (keyed.py)
    chain: Chain | None = None  # an incremental checkpoint's links, newest first (locked below the head)

    def release(self) -> None:
        """Release the locks of the generation and of its chain's links."""
        if self.chain is not None:
            self.chain.release()
        self.lock.release()


def _examine(path: Loc, name: str, state_dict: Mapping[str, Any], strict: bool, verify: bool, rank: int,
             optional: tuple[str, ...], hints: Mapping[str, Hint] | None, convert_dtypes: bool = False,
             split_row_states: bool = False, param_groups: Mapping[str, int] | None = None,
             ) -> tuple[Lock | None, dict[str, Any] | None, Metadata | None, list[Problem], str | None,
                        dict[str, RowConversion], Chain | None]:
    """One rank's look at generation ``name``: lock it, read and check everything short of the data."""
    try:
        lock = lock_generation(path, name)
    except Exception as e:  # every rank must reach the agreement
        return None, None, None, [problem_from(e, f"cannot open {name or path}")], None, {}, None
    if lock is None:
        return None, None, None, [], None, {}, None
    root = root_of(path, name)
    problems: list[Problem] = []
    manifest = md = None
    ident = None
    combined: dict[str, RowConversion] = {}
    chain: Chain | None = None
    try:
        manifest = read_manifest(root)
        if name and manifest is not None and manifest["format"] >= 3 and not name.endswith(manifest["save_id"]):
            raise CorruptCheckpointError(f"manifest {root / 'tdb_manifest.json'} is from save {manifest['save_id']}, "
                                         f"not from the generation {name}")
        md = read_metadata(root, manifest)
        checked = md
        if is_incremental(manifest):
            assert manifest is not None
            chain = open_chain(root, manifest, md, path.name)
            checked = metadata_for_checks(chain)
        keys_found, flat, combined = _check_keys(state_dict, checked, strict, hints, _absent(checked, optional),
                                                 convert_dtypes=convert_dtypes, manifest=manifest,
                                                 split_row_states=split_row_states, param_groups=param_groups,
                                                 where=str(path))
        if chain is not None:  # the data: the chain's reads check it (chainread); the head's objects here
            flat = [(fqn, v) for fqn, v in flat if not isinstance(v, torch.Tensor)]
        problems += keys_found
        if verify and not keys_found:
            if manifest is None:
                problems.append(Problem(Kind.CORRUPT, _no_manifest(root, plain=not name)))
            else:
                saved_id = md.storage_meta.save_id if md.storage_meta is not None else None
                if saved_id != manifest.get("dcp_save_id"):
                    problems.append(Problem(Kind.CORRUPT, f"{root}: .metadata is from save {saved_id}, the manifest "
                                                          f"from {manifest.get('dcp_save_id')}"))
                problems += _check_items(root, manifest, md, _needed_items(flat, md, rank))
        ident = (manifest or {}).get("save_id") or (md.storage_meta.save_id if md.storage_meta is not None else "")
    except Exception as e:  # every rank must reach the agreement
        problems.append(problem_from(e))
    return lock, manifest, md, problems, ident, combined, chain


def open_agreed(path: Loc, state_dict: Mapping[str, Any], strict: bool, verify: bool,
                g: CommGroup, what: str, extra: list[Problem], *, optional: tuple[str, ...] = (),
                hints: Mapping[str, Hint] | None = None, convert_dtypes: bool = False,
                split_row_states: bool = False, param_groups: Mapping[str, int] | None = None,
                stateless: Mapping[str, str] | None = None) -> Opened:
    """Resolve ``path`` once (rank 0), lock and examine that generation on every rank, agree; *collective*.

    Steps 1-3 of the module docstring. On success every rank holds a shared lock on the same generation
    (release ``Opened.lock`` after the load); on any problem every rank raises the same error.

    Args:
        path: the checkpoint path (absolute).
        state_dict: the destination; its keys, shapes and dtypes are checked against ``.metadata``.
        strict: refuse a checkpoint holding keys absent from ``state_dict``.
        verify: check that the manifest describes every item this rank reads.
        g: the group the load runs on (see :func:`~.agree.member_group`).
        what: how error messages name the load.
        extra: problems the caller found (e.g. in its arguments), raised with the rest after the agreement.
        optional: keys of ``state_dict`` (with everything below them) that the checkpoint need not hold:
            those it holds nothing under are not checked, and are listed in ``Opened.absent``.
        hints: per key of a keyed optimizer's per-row state, how it converts or why not (:class:`.keyed.Hint`).
        convert_dtypes: accept a floating-point destination of another floating-point dtype than the saved one.
        split_row_states: convert a per-row state into another column cut of several blocks (:mod:`.keyed`).
        param_groups: per key of a ``torch.optim`` optimizer's ``param_groups``, its number of groups: a
            checkpoint holding another number there is refused.
        stateless: per key of an optimizer's state for a parameter no state can be created for, the
            parameter's type: a checkpoint holding that state is refused (it would not be loaded).

    Returns:
        The generation every rank agreed to read, its lock, manifest and metadata, and the absent optional keys.
    """
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
        lock, manifest, md, problems, ident, combined, chain = _examine(path, name, state_dict, strict, verify, rank,
                                                                        optional, hints, convert_dtypes,
                                                                        split_row_states, param_groups)
        if md is not None and stateless:
            checked = metadata_for_checks(chain) if chain is not None else md
            problems = problems + unloadable(stateless, _absent(checked, tuple(stateless)))
        everyone = gather_objects((lock is None and not problems, problems + extra, ident), g)
        if any(moved for moved, _, _ in everyone):
            if chain is not None:
                chain.release()
            if lock is not None:
                lock.release()
            time.sleep(0.005)
            continue  # the generation was superseded and reused under a rank: resolve again
        idents = [i for _, _, i in everyone]
        mixed = [] if len(set(idents)) == 1 or None in idents else [
            Problem(Kind.CORRUPT, f"ranks read different saves of {path}: {idents} (rank order)")]
        if mixed or any(p for _, p, _ in everyone):
            if chain is not None:
                chain.release()
            if lock is not None:
                lock.release()
            raise_gathered(what + " refused, nothing was modified", [p for _, p, _ in everyone], g, mixed)
        assert lock is not None and md is not None
        checked = metadata_for_checks(chain) if chain is not None else md
        return Opened(root_of(path, name), lock, manifest, checked, _absent(checked, optional),
                      combined, chain)
    raise CheckpointError(f"{what}: {path} changed under the load {_RESOLVE_ATTEMPTS} times in a row")


class _GlobalView:
    """A bare ``LocalShardsWrapper`` as DCP's load planning should see it: the whole table's size, its chunks."""

    def __init__(self, wrapper: LocalShardsWrapper) -> None:
        self._w = wrapper

    def size(self) -> torch.Size:
        return self._w.global_shape

    def __create_chunk_list__(self) -> Any:
        return self._w.__create_chunk_list__()


class SafeObjectPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` whose non-tensor items are unpickled with ``weights_only=True`` unless trusted,
    which plans a bare ``LocalShardsWrapper`` by its global shape (DCP's planner compares local sizes), and
    which plans the state_dict's keys as :func:`open_agreed` checked them (:meth:`create_local_plan`)."""

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

    def create_local_plan(self) -> LoadPlan:
        """DCP's plan of the state_dict flattened as torch >= 2.4 flattens it, without DCP's retry for
        checkpoints written before torch 2.4.

        DCP retries whenever the checkpoint holds a key that this rank's state_dict lacks and that the old
        flattening produces - as on a rank that holds no shard of a table - and then plans the old flattening,
        in which a container holding no tensor (a ``torch.optim`` optimizer's ``param_groups``, a dict of plain
        values, an optimizer that has no state yet) is one key that the checkpoint does not hold: the
        load fails with "Missing key in checkpoint state_dict". Here every key of the state_dict, flattened the
        new way, was checked against the checkpoint before the load (:func:`_check_keys`; a checkpoint whose
        keys are flattened otherwise was refused there), so the retry could only misfire.
        """
        assert self.metadata is not None, "set_up_planner sets it"
        return create_default_local_load_plan(self.state_dict, self.metadata, not self.allow_partial_load)

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
