"""The save side of incremental checkpoints: row digests, the rows that changed since a base, their files.

Every save (full or incremental) records one digest per row of every block it
saves (:mod:`.digests`), in a file per rank beside DCP's (``digests_<rank>.tdb``), listed in
the manifest (``row_digests``). A save given ``base=`` (an earlier checkpoint
of the same keys, full or incremental) writes, per block, only the rows whose
digest differs from the base's, before the digests in ``rows_<rank>.tdb`` (the manifest's
``link``: the base's name, generation and save id, and where each block's rows
lie); DCP then saves the non-tensor values only. Nothing of the base's data is
read: only its manifest and the digests of the blocks this rank saves.

The steps :func:`~.api.save` runs, on every rank (*collective* around them):

1. :func:`open_base`: the base resolved to its committed generation (a shared
   lock held for the save: a later save to the base's path cannot rewrite it
   meanwhile), its manifest verified, every key, shape and dtype compared with
   the state_dict's (:meth:`Rows.check`); problems are agreed on before anything
   is written;
2. :meth:`Rows.own`: of blocks several ranks hold (replicas), the first rank in
   the group's order digests and writes them;
3. :meth:`Rows.compute`: the digests of this rank's blocks, compared with the
   base's; the changed rows copied out (what the save writes: also what an
   asynchronous save holds). Where the rows written since the base are known
   (:mod:`..tracking`: a ``FusedOptimizer(..., track_changed_rows=True)``'s
   steps, or those of TorchRec's fused kernel under ``track_changed_rows(dmp)``,
   nothing else having written), only those are digested, the others keep the
   base's digests as this process kept them;
4. :meth:`Rows.write`: the files, each block's bytes hashed as written (the
   manifest's block checksums) and fsynced; the records for the manifest.

File layout: each piece starts at a multiple of 64 bytes; a block's piece in a
rows file is its changed rows' ids (int64, ascending; left out when every row
changed), then those rows, row-major.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ... import tracking
from ..._compat import ShardedTensor
from ...convert import layout_of
from ...wrapper import LocalShardsWrapper
from ..agree import Problem, problem_from
from ..common import Flat, flat, memory_of
from .base import BaseCheckpoint
from .digests import row_digests
from ..errors import CheckpointError
from ..agree import Wording, key_problems
from ..format.manifest import LINK, ROW_DIGESTS, BlockHasher, FileSums
from ..format.reader import BadData
from ..storage import Loc

__all__ = ["ALIGN", "LINK", "ROW_DIGESTS", "Rows", "local_blocks", "manifest_records", "without_tensors"]

ALIGN = 64

Box = tuple[tuple[int, ...], tuple[int, ...]]


def local_blocks(value: Any, rank: int) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    """This rank's blocks of ``value`` as (global offsets, the tensor holding them), without communication.

    A plain tensor is one block at offset 0; a DTensor or ShardedTensor its local shards (a rank holding none
    of it: none). ``rank`` is the global rank.
    """
    if isinstance(value, ShardedTensor):
        return [(tuple(s.metadata.shard_offsets), s.tensor) for s in value.local_shards()]
    if isinstance(value, DTensor):
        local: Any = value._local_tensor
        if isinstance(local, LocalShardsWrapper) or callable(getattr(local, "local_offsets", None)):
            return [(tuple(o), s) for o, s in zip(local.local_offsets(), local.local_shards())]
        if value.device_mesh.get_coordinate() is None:
            return []
        specs = layout_of(value).shards_on(rank)
        return [(tuple(specs[0].offsets), local)] if specs else []
    if isinstance(value, LocalShardsWrapper):
        return [(tuple(o), s) for o, s in zip(value.local_offsets(), value.local_shards())]
    return [((0,) * value.dim(), value)]


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` with rows along dim 0 (a 0-d tensor: one row of one value)."""
    return t.reshape(1) if t.dim() == 0 else t


def _differ(now: torch.Tensor, was: torch.Tensor) -> torch.Tensor:
    """Per row, whether its digests differ (a digest per row, or rows of at most 8 bytes that are their own)."""
    differ = now != was
    return differ.any(1) if differ.dim() > 1 else differ


def _first_holders(value: torch.Tensor, members: tuple[int, ...]) -> dict[Box, int]:
    """Of the boxes several ranks of the group (``members``, global ranks in group order) hold, the rank
    holding each first, as far as ``value``'s layout tells without communication (a plain tensor: every rank
    holds it, the first member digests it); :meth:`Rows.own` settles the rest after the agreement."""
    if len(members) < 2:
        return {}
    if not isinstance(value, (DTensor, ShardedTensor)):
        whole = ((0,) * value.dim(), tuple(value.shape))
        return {whole: members[0]}
    try:
        lay = layout_of(value)
    except Exception:  # noqa: BLE001 - no layout to tell: every block is digested, own() keeps the first
        return {}
    order = {m: i for i, m in enumerate(members)}
    first: dict[Box, int] = {}
    for s in lay.shards:
        if s.rank in order and (s.box not in first or order[s.rank] < order[first[s.box]]):
            first[s.box] = s.rank
    return first


@dataclass
class _Block:
    fqn: str
    offsets: tuple[int, ...]
    tensor: torch.Tensor
    digests: torch.Tensor | None = None
    ids: torch.Tensor | None = None  # changed rows (local), None: every row
    rows: torch.Tensor | None = None  # their copy

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape)


class Rows:
    """One rank's row records of a save (the steps of the module docstring)."""

    def __init__(self, state_dict: Mapping[str, Any] | Flat, rank: int, base: BaseCheckpoint | None,
                 members: tuple[int, ...] = ()) -> None:
        self.base = base
        self.blocks: list[_Block] = []
        for fqn, v in flat(state_dict):
            if isinstance(v, torch.Tensor):
                first = _first_holders(v, members)
                self.blocks += [_Block(fqn, o, t) for o, t in local_blocks(v, rank) if (t.numel() or not t.dim())
                                and first.get((o, tuple(t.shape)), rank) == rank]

    def check(self, signature: Mapping[str, tuple[str, tuple[int, ...], str]]) -> list[Problem]:
        """This rank's tensors against the base's: the same keys, shapes and dtypes (``signature``: key ->
        (type, global shape, dtype))."""
        if self.base is None:
            return []
        b = self.base
        mine = {k: (list(s), d) for k, (_, s, d) in signature.items()}
        wording = Wording(missing=f"of the state_dict are not in base {b.path} (an incremental save holds the "
                                  "base's keys)", unexpected=f"of base {b.path} are not in the state_dict being saved",
                          mismatched=f"have another shape or dtype in base {b.path}", other="the base")
        return key_problems(
            wording, str(b.path),
            missing=[(k, f"key {k!r} is not in base {b.path} (an incremental save holds the base's keys)")
                     for k in sorted(set(mine) - set(b.tensors))],
            unexpected=[(k, f"key {k!r} of base {b.path} is not in the state_dict being saved")
                        for k in sorted(set(b.tensors) - set(mine))],
            mismatched=[(k, f"key {k!r}: shape {mine[k][0]} {mine[k][1]}, base {b.path} holds shape "
                            f"{b.tensors[k][0]} {b.tensors[k][1]}")
                        for k in sorted(set(mine) & set(b.tensors)) if mine[k] != b.tensors[k]])

    def describe(self) -> list[tuple[str, tuple[int, ...], tuple[int, ...]]]:
        return [(b.fqn, b.offsets, b.sizes) for b in self.blocks]

    def own(self, everyone: list[list[tuple[str, tuple[int, ...], tuple[int, ...]]]], me: int) -> None:
        """Keep the blocks this rank (group rank ``me``) is the first to hold."""
        first: dict[tuple[str, tuple[int, ...], tuple[int, ...]], int] = {}
        for r, blocks in enumerate(everyone):
            for key in blocks:
                first.setdefault(tuple(key), r)  # type: ignore[arg-type]
        self.blocks = [b for b in self.blocks if first.get((b.fqn, b.offsets, b.sizes)) == me]

    def compute(self) -> list[Problem]:
        """Digests of this rank's blocks; with a base, the rows that differ from it, copied out. A block whose
        writes were reported since its base was saved (:mod:`..tracking`) digests only the rows written. Runs
        before :meth:`own` (so that a save agrees once): a block several ranks hold is digested by each."""
        problems: list[Problem] = []
        for blk in self.blocks:
            t = _rows(blk.tensor.detach())
            key = (blk.fqn, blk.offsets, blk.sizes)
            known = tracking.written_since(blk.tensor, self.base.save_id, key) if self.base is not None else None
            if known is not None:
                self._from_written(blk, t, known)
            else:
                try:
                    self._from_scan(blk, t)
                except (BadData, CheckpointError, OSError) as e:
                    assert self.base is not None
                    problems.append(problem_from(e, f"base {self.base.path}"))
                    continue
        return problems

    def mark(self, save_id: str) -> None:
        """Every tracked block of this rank is marked as saved by ``save_id`` (:mod:`..tracking`)."""
        for blk in self.blocks:
            if tracking.is_tracked(blk.tensor) and blk.digests is not None:
                tracking.mark(blk.tensor, save_id, (blk.fqn, blk.offsets, blk.sizes), blk.digests)

    def _from_scan(self, blk: _Block, t: torch.Tensor) -> None:
        """Every row digested; with a base, compared with its digests (read from its files)."""
        blk.digests = row_digests(t)
        if self.base is None:
            return
        row_bytes = (t[0].numel() if t.shape[0] else 0) * t.element_size()
        was, known = self.base.digests_of(blk.fqn, blk.offsets, blk.sizes, row_bytes)
        changed = ~known | _differ(blk.digests, was)
        if bool(changed.all()):
            blk.ids, blk.rows = None, t.cpu().clone() if t.device.type == "cpu" else t.cpu()
        else:
            blk.ids = changed.nonzero().flatten()
            blk.rows = t.index_select(0, blk.ids.to(t.device)).cpu()

    @staticmethod
    def _from_written(blk: _Block, t: torch.Tensor, known: tracking.Known) -> None:
        """Only the rows written since the base digested; every other row keeps the base's digest."""
        rows = known.rows
        picked = t.index_select(0, rows.to(t.device))
        fresh = row_digests(picked)
        was = known.digests[rows]
        known.digests[rows] = fresh  # the tracker's copy, updated in place (it is marked again below)
        blk.digests = known.digests
        changed = _differ(fresh, was)
        if rows.numel() == t.shape[0] and bool(changed.all()):
            blk.ids, blk.rows = None, picked.cpu()
        else:
            blk.ids = rows[changed]
            blk.rows = picked[changed.to(picked.device)].cpu()

    def write(self, gen: Loc, rank: int) -> tuple[dict[str, FileSums], dict[str, list[list[Any]]],
                                                   dict[str, list[list[Any]]]]:
        """Write this rank's file into ``gen`` (a full save's digests; an incremental save's changed rows, then
        its digests: one file, one fsync): its block checksums, and the digest and piece records."""
        digests: dict[str, list[list[Any]]] = {}
        pieces: dict[str, list[list[Any]]] = {}
        rel = f"rows_{rank}.tdb" if self.base is not None else f"digests_{rank}.tdb"
        with _File(gen / rel) as f:
            for blk in self.blocks if self.base is not None else []:
                assert blk.rows is not None
                count = blk.rows.shape[0]
                if count == 0:
                    continue
                at = f.put(blk.ids) if blk.ids is not None else f.put(blk.rows)
                if blk.ids is not None:
                    f.put(blk.rows)
                pieces.setdefault(blk.fqn, []).append([list(blk.offsets), list(blk.sizes), rel, at, count,
                                                       blk.ids is None])
            for blk in self.blocks:
                assert blk.digests is not None
                width = blk.digests.shape[1] if blk.digests.dim() > 1 else 8
                rec = [list(blk.offsets), list(blk.sizes), rel]
                if self.base is None or blk.ids is None:  # every row's
                    digests.setdefault(blk.fqn, []).append([*rec, f.put(blk.digests), width])
                elif blk.ids.numel():  # a link: those of the rows it writes (the chain holds the others')
                    picked = blk.digests.index_select(0, blk.ids.to(blk.digests.device))
                    digests.setdefault(blk.fqn, []).append([*rec, f.put(picked), width, int(blk.ids.numel())])
        return {rel: f.sums}, digests, pieces

    def written_bytes(self) -> int:
        """Bytes of rows (and their ids) this rank writes."""
        return sum((b.rows.numel() * b.rows.element_size() if b.rows is not None else 0)
                   + (b.ids.numel() * 8 if b.ids is not None else 0) for b in self.blocks)

    def close(self) -> None:
        if self.base is not None:
            self.base.close()


class _File:
    """An object written from its start, each piece at a multiple of :data:`ALIGN`, hashed as written, durable
    when closed (the storage's ``create``)."""

    def __init__(self, loc: Loc) -> None:
        self._cm = loc.create()
        self._h = BlockHasher()
        self.sums = FileSums(0, 0, "")

    def put(self, t: torch.Tensor) -> int:
        pad = -self._h.size % ALIGN
        if pad:
            self._write(memoryview(bytes(pad)))
        at = self._h.size
        self._write(memory_of(t))
        return at

    def _write(self, data: memoryview) -> None:
        self._f.write(data)
        self._h.update(data)

    def __enter__(self) -> _File:
        self._f = self._cm.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._cm.__exit__(*exc)
        self.sums = self._h.finish(getattr(self._f, "version", None))


def manifest_records(base: BaseCheckpoint | None, signatures: list[Mapping[str, tuple[str, tuple[int, ...], str]]],
                     parts: list[tuple[dict[str, list[list[Any]]], dict[str, list[list[Any]]]]]) -> dict[str, Any]:
    """The manifest's ``row_digests`` (and, with a base, ``link``) records from every rank's parts."""
    tensors = {k: [list(s), d] for sig in signatures for k, (_, s, d) in sig.items()}
    digests: dict[str, list[list[Any]]] = {}
    pieces: dict[str, list[list[Any]]] = {}
    for dg, pc in parts:
        for k, v in dg.items():
            digests.setdefault(k, []).extend(v)
        for k, v in pc.items():
            pieces.setdefault(k, []).extend(v)
    out: dict[str, Any] = {ROW_DIGESTS: {"tensors": dict(sorted(tensors.items())), "blocks": digests}}
    if base is not None:
        out[LINK] = {"base": base.record(), "depth": base.depth + 1, "pieces": pieces}
    return out


def without_tensors(sd: Any) -> Any:
    """``sd`` (nested) without its tensors: what DCP saves of an incremental checkpoint (a tensor inside a list
    becomes ``None``, keeping the other entries' keys)."""
    if isinstance(sd, Mapping):
        return {k: without_tensors(v) for k, v in sd.items() if not isinstance(v, torch.Tensor)}
    if isinstance(sd, (list, tuple)) and any(isinstance(v, (torch.Tensor, Mapping, list, tuple)) for v in sd):
        return type(sd)(None if isinstance(v, torch.Tensor) else without_tensors(v) for v in sd)
    return sd


def current_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
