"""The links of an incremental checkpoint, opened and checked before a load reads any data.

An incremental checkpoint's manifest names its base (:data:`~.incremental.LINK`:
the base's name, the generation directory it was and that save's id). A load of
it opens, on every rank, newest first (*no collective*; the caller agrees):

1. each base's generation, beside the checkpoint, under a shared lock held for
   the whole load (a save to the base's path never rewrites nor removes it
   meanwhile);
2. its manifest (verified) and ``.metadata`` (verified, parsed safely): a link
   whose generation is gone, or whose save id is not the recorded one (the
   base's path was saved to again and its generation reused), is refused with
   :class:`~.errors.BrokenChainError` naming the link;
3. every record the reads will rely on, checked for shape (the manifest is
   untrusted input): plain file names inside the link, generations of the named
   link only (a manifest cannot point a load outside the checkpoint's
   directory), non-negative offsets and counts, the blocks inside the tensors,
   and the same keys, shapes and dtypes in every link;

down to a full checkpoint. :func:`metadata_for_checks` then gives the load's
validation the chain's tensors as if one checkpoint held them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)

from ..errors import BrokenChainError, CorruptCheckpointError
from ..format.manifest import LINK, ROW_DIGESTS, check_file_name, read_manifest
from ..storage import Loc, Lock
from ..format.validate import read_metadata

__all__ = ["MAX_LINKS", "Chain", "Link", "Piece", "is_incremental", "metadata_for_checks", "open_chain"]

MAX_LINKS = 10_000
"""Longer chains are refused (a cycle in hostile manifests ends here too)."""


def is_incremental(manifest: dict[str, Any] | None) -> bool:
    """Whether a checkpoint's manifest is that of an incremental checkpoint (it names a base)."""
    return manifest is not None and isinstance(manifest.get(LINK), dict)


@dataclass(frozen=True)
class Piece:
    """The changed rows of one saved block in one link: ``count`` rows at byte ``at`` of ``file`` (after their
    ids, unless ``every`` row of the block changed)."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    at: int
    count: int
    every: bool


@dataclass
class Link:
    """One checkpoint of a chain: where it is, its manifest and metadata, and (incremental) its pieces."""

    name: str
    root: Loc
    manifest: dict[str, Any]
    metadata: Metadata
    lock: Lock | None = None
    pieces: dict[str, list[Piece]] = field(default_factory=dict)

    @property
    def full(self) -> bool:
        return not is_incremental(self.manifest)

    @property
    def label(self) -> str:
        """How messages name the link."""
        return f"link {self.name} (generation {self.root.name}, save {self.manifest.get('save_id')})"


@dataclass
class Chain:
    """The links, newest first, and the tensors every link holds (key -> (shape, dtype))."""

    links: list[Link]
    tensors: dict[str, tuple[tuple[int, ...], torch.dtype]]

    def release(self) -> None:
        """Release the locks of the links below the head (the head's is the load's own)."""
        for link in self.links[1:]:
            if link.lock is not None:
                link.lock.release()


def _bad(where: str, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"manifest {where} is malformed: {what}")


def _ints(v: Any, n: int | None, where: str, what: str) -> tuple[int, ...]:
    if not isinstance(v, list) or not all(type(x) is int and x >= 0 for x in v) or (n is not None and len(v) != n):
        raise _bad(where, f"{what} {v!r}")
    return tuple(v)


def _dtype(name: Any, where: str) -> torch.dtype:
    short = name.removeprefix("torch.") if isinstance(name, str) else ""
    dt = getattr(torch, short, None) if short.isidentifier() else None
    if not isinstance(dt, torch.dtype):
        raise _bad(where, f"dtype {name!r}")
    return dt


def _tensors(manifest: dict[str, Any], where: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    rec = manifest.get(ROW_DIGESTS)
    if not isinstance(rec, dict) or not isinstance(rec.get("tensors"), dict):
        raise _bad(where, "no row digest record")
    out = {}
    for k, v in rec["tensors"].items():
        if not (isinstance(v, list) and len(v) == 2):
            raise _bad(where, f"tensor {k!r}: {v!r}")
        out[k] = (_ints(v[0], None, where, f"tensor {k!r}: shape"), _dtype(v[1], where))
    return out


def _pieces(manifest: dict[str, Any], tensors: dict[str, tuple[tuple[int, ...], torch.dtype]],
            where: str) -> dict[str, list[Piece]]:
    recs = manifest[LINK].get("pieces")
    files = manifest.get("files")
    if not isinstance(recs, dict) or not isinstance(files, dict):
        raise _bad(where, "no pieces")
    out: dict[str, list[Piece]] = {}
    for fqn, lst in recs.items():
        if fqn not in tensors or not isinstance(lst, list):
            raise _bad(where, f"pieces of key {fqn!r}, which it does not hold")
        shape = tensors[fqn][0]
        for rec in lst:
            if not (isinstance(rec, list) and len(rec) == 6 and isinstance(rec[5], bool)):
                raise _bad(where, f"key {fqn!r}: piece {rec!r}")
            o, s = _ints(rec[0], len(shape), where, "offsets"), _ints(rec[1], len(shape), where, "sizes")
            rel = check_file_name(rec[2], f"manifest {where}")
            at, count = _ints([rec[3], rec[4]], 2, where, f"key {fqn!r}: offset and count")
            rows = s[0] if s else 1
            if any(a + b > g for a, b, g in zip(o, s, shape)) or count > rows or (rec[5] and count != rows):
                raise _bad(where, f"key {fqn!r}: piece at offsets {list(o)} sizes {list(s)} of {count} rows lies "
                                  f"outside shape {list(shape)}")
            if rel not in files:
                raise _bad(where, f"key {fqn!r}: file {rel} has no checksums")
            out.setdefault(fqn, []).append(Piece(o, s, rel, at, count, rec[5]))
    return out


def _base_of(link: Link, where: str) -> tuple[str, str, str]:
    rec = link.manifest[LINK].get("base")
    if not (isinstance(rec, dict) and all(isinstance(rec.get(k), str) for k in ("name", "generation", "save_id"))):
        raise _bad(where, f"base record {rec!r}")
    name = check_file_name(rec["name"], where)
    gen = check_file_name(rec["generation"], where) if rec["generation"] else ""
    if gen and not (gen.startswith(f".{name}.tdb-") or re.fullmatch(r"gen-[0-9a-f]{32}", gen)):
        raise _bad(where, f"base generation {gen!r} is not one of {name!r}'s")
    return name, gen, rec["save_id"]


def _link_root(parent: Loc, name: str, gen: str) -> Loc:
    """Where the link ``name`` (generation ``gen``) lies: under its name (this layout), beside it (earlier
    releases), or its name itself (a copy with links dereferenced, ``cp -rL``, or a base that held itself)."""
    here = parent / name
    if not gen:
        return here
    if not gen.startswith("."):
        return here / gen
    old = parent / gen  # beside it; gone when the link was copied with cp -rL: the copy holds it itself
    return old if old.kind() == "dir" or here.kind() != "dir" else here


def _open_link(parent: Loc, name: str, gen: str, save_id: str, child: Link) -> Link:
    """The base ``name`` of ``child``, generation ``gen`` of save ``save_id``, locked and read."""
    what = f"link {name} (generation {gen or name}, save {save_id}), the base of {child.label}"
    root = _link_root(parent, name, gen)
    if root.kind() != "dir":
        raise BrokenChainError(f"{what} is gone: {root} does not exist (it was deleted, or a later save to "
                               f"{parent / name} replaced it); the chain cannot be loaded")
    lock = root.lock(exclusive=False)
    if lock is None:
        raise BrokenChainError(f"{what} is being rewritten by a save to {parent / name}: the chain cannot be loaded")
    try:
        manifest = read_manifest(root)
        if manifest is None:
            raise BrokenChainError(f"{what} has no manifest: it is not a checkpoint written by "
                                   "tdb.checkpoint.save")
        if manifest.get("save_id") != save_id or (gen and root.name == gen and not gen.endswith(save_id)):
            raise BrokenChainError(f"{what} was replaced: {root} now holds save {manifest.get('save_id')} (a "
                                   "checkpoint of another job or a later save); the chain cannot be loaded")
        md = read_metadata(root, manifest)
        return Link(name, root, manifest, md, lock)
    except BaseException:
        lock.release()
        raise


def open_chain(root: Loc, manifest: dict[str, Any], md: Metadata, name: str) -> Chain:
    """Open the chain whose newest link (the head, already locked by the caller) is the generation ``root`` of
    the checkpoint ``name``; this rank alone (steps 1-3 of the module docstring).

    Raises:
        BrokenChainError: a link is missing or was replaced.
        CorruptCheckpointError: a link's manifest or metadata is damaged or malformed, or links disagree on a
            tensor's shape or dtype.
    """
    head = Link(name, root, manifest, md)
    links = [head]
    chain_dir = root.parent.parent if root.name.startswith("gen-") else root.parent  # where the links' names are
    try:
        where = str(root / "tdb_manifest.json")
        tensors = _tensors(manifest, where)
        link = head
        while not link.full:
            where = str(link.root / "tdb_manifest.json")
            link.pieces = _pieces(link.manifest, tensors, where)
            if len(links) > MAX_LINKS:
                raise CorruptCheckpointError(f"{head.label}: the chain has more than {MAX_LINKS} links (a cycle?)")
            base_name, gen, save_id = _base_of(link, where)
            link = _open_link(chain_dir, base_name, gen, save_id, link)
            links.append(link)
            mine = _tensors(link.manifest, str(link.root / "tdb_manifest.json"))
            if mine != tensors:
                diff = sorted(k for k in set(mine) | set(tensors) if mine.get(k) != tensors.get(k))
                raise CorruptCheckpointError(f"{link.label} holds other tensors than {head.label}: keys {diff[:10]} "
                                             "differ in presence, shape or dtype")
        for fqn, (shape, dtype) in tensors.items():
            m = link.metadata.state_dict_metadata.get(fqn)
            if not isinstance(m, TensorStorageMetadata) or tuple(m.size) != shape or m.properties.dtype != dtype:
                raise CorruptCheckpointError(f"{link.label}: key {fqn!r} is not saved as a {list(shape)} {dtype} "
                                             "tensor, as its manifest records")
    except BaseException:
        Chain(links, {}).release()
        raise
    return Chain(links, tensors)


def metadata_for_checks(chain: Chain) -> Metadata:
    """The head's metadata, with every tensor of the chain as one whole chunk: what the load's key, shape and
    dtype checks compare the destination with (the head's ``.metadata`` holds its objects only)."""
    head = chain.links[0].metadata
    entries: dict[str, Any] = dict(head.state_dict_metadata)
    for fqn, (shape, dtype) in chain.tensors.items():
        entries[fqn] = TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(shape),
                                             [ChunkStorageMetadata(torch.Size([0] * len(shape)), torch.Size(shape))])
    return Metadata(state_dict_metadata=entries, storage_meta=head.storage_meta, storage_data=head.storage_data)


def link_name(root: Loc) -> str:
    """The checkpoint name of a generation (``name/gen-<id>``, or ``.<name>.tdb-<id>`` of earlier releases)."""
    base = root.name
    if base.startswith("gen-"):
        return root.parent.name
    return base[1:].rsplit(".tdb-", 1)[0] if base.startswith(".") and ".tdb-" in base else base


def describe(chain: Chain) -> list[dict[str, Any]]:
    """Per link, newest first: ``name``, ``save_id``, ``base`` (``None`` for the full checkpoint), ``rows`` (per
    key, the rows the link holds: every block's rows counted, so a row cut into column blocks counts once per
    block) and ``bytes`` (its data files)."""
    out = []
    for link in chain.links:
        files = link.manifest.get("files")
        recs = files.values() if isinstance(files, dict) else []
        size = sum(rec.get("size", 0) for rec in recs if isinstance(rec, dict))
        if link.full:
            rows = {k: (shape[0] if shape else 1) for k, (shape, _) in chain.tensors.items()}
            base = None
        else:
            rows = {k: sum(p.count for p in ps) for k, ps in sorted(link.pieces.items())}
            base = link.manifest[LINK]["base"]["name"]
        out.append({"name": link.name, "save_id": link.manifest.get("save_id"), "base": base, "rows": rows,
                    "bytes": size})
    return out
