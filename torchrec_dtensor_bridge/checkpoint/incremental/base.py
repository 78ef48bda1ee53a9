"""The base of an incremental save: its committed generation, locked, and the row digests its chain records.

:func:`open_base` opens it (step 1 of :mod:`.rows`); :meth:`BaseCheckpoint.digests_of` reads the digests of a
block's rows down the base's chain, newest link first over older ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..commit import committed_name, lock_generation, root_of
from ..errors import CheckpointError, IncompleteCheckpointError, NotACheckpointError
from ..format.manifest import LINK, ROW_DIGESTS, Checksums, read_manifest
from ..format.reader import BadData, VerifiedFile
from ..format.validate import read_metadata
from ..storage import Loc, Lock
from .chain import Chain, Link, open_chain
from .digests import DIGEST_BYTES, digest_width

__all__ = ["BaseCheckpoint", "open_base"]


@dataclass
class BaseCheckpoint:
    """A base opened for an incremental save: its generation (locked), manifest and recorded row digests."""

    path: Loc
    root: Loc
    lock: Lock
    manifest: dict[str, Any]
    tensors: dict[str, tuple[list[int], str]]
    chain: Chain  # the base and its own bases, newest first (locked below the base, whose lock is ``lock``)
    depth: int
    _files: dict[tuple[int, str], VerifiedFile] = field(default_factory=dict)

    @property
    def save_id(self) -> str:
        return str(self.manifest["save_id"])

    def record(self) -> dict[str, Any]:
        """What the new checkpoint's manifest says of its base."""
        gen = self.root.name if self.root != self.path else ""  # "": the base's directory holds it itself
        return {"name": self.path.name, "generation": gen, "save_id": self.save_id}

    def _read(self, i: int, link: Link, rel: str, start: int, end: int, who: str) -> torch.Tensor:
        vf = self._files.get((i, rel))
        if vf is None:
            vf = self._files[(i, rel)] = VerifiedFile(link.root, rel, Checksums(link.manifest))
        return torch.frombuffer(bytearray(vf.read(start, end, who)), dtype=torch.uint8)

    def digests_of(self, fqn: str, offsets: tuple[int, ...], sizes: tuple[int, ...], row_bytes: int,
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """The base's digests of rows ``offsets[0] .. + sizes[0]`` of the block (the same columns), and which
        rows it has one for (a base saved under another column cut has none: those rows count as changed).

        The chain's links are read oldest first, each newer one's digests over the older ones': a full
        checkpoint holds every row's, an incremental link those of the rows it wrote (:data:`ROW_DIGESTS`)."""
        n = sizes[0] if sizes else 1
        r0 = offsets[0] if offsets else 0
        known = torch.zeros(n, dtype=torch.bool)
        raw, width = row_bytes <= DIGEST_BYTES, digest_width(row_bytes)
        out = torch.zeros((n, width) if raw else n, dtype=torch.uint8 if raw else torch.int64)
        who = f"row digests of key {fqn!r} in {self.path}"
        for i in reversed(range(len(self.chain.links))):
            link = self.chain.links[i]
            for rec in link.manifest[ROW_DIGESTS]["blocks"].get(fqn, []):
                e_off, e_sizes, rel, at, w = rec[:5]
                if tuple(e_off[1:]) != offsets[1:] or tuple(e_sizes[1:]) != sizes[1:] or w != width:
                    continue
                e0, en = (e_off[0], e_sizes[0]) if e_off else (0, 1)
                if len(rec) > 5 and rec[5] != en:  # the digests of the rows the link's piece holds
                    ids = self._piece_ids(i, link, fqn, tuple(e_off), tuple(e_sizes), rec[5], who)
                    inside = (ids >= r0 - e0) & (ids < r0 + n - e0)
                    if not bool(inside.any()):
                        continue
                    got = self._read(i, link, rel, at, at + rec[5] * w, who)
                    got = got.view(rec[5], w) if raw else got.view(torch.int64)
                    out[ids[inside] + e0 - r0] = got[inside]
                    known[ids[inside] + e0 - r0] = True
                    continue
                a, b = max(r0, e0), min(r0 + n, e0 + en)
                if a >= b:
                    continue
                got = self._read(i, link, rel, at + (a - e0) * w, at + (b - e0) * w, who)
                out[a - r0 : b - r0] = got.view(b - a, w) if raw else got.view(torch.int64)
                known[a - r0 : b - r0] = True
        return out, known

    def _piece_ids(self, i: int, link: Link, fqn: str, offsets: tuple[int, ...], sizes: tuple[int, ...],
                   count: int, who: str) -> torch.Tensor:
        """The rows (of the block) whose digests an incremental link's record holds: its piece's ids."""
        for p in link.pieces.get(fqn, []):
            if p.offsets == offsets and p.sizes == sizes and p.count == count and not p.every:
                ids = self._read(i, link, p.file, p.at, p.at + 8 * count, who).view(torch.int64)
                if bool(((ids < 0) | (ids >= (sizes[0] if sizes else 1))).any()):
                    raise BadData(f"{who}: row ids outside the block in {link.label}")
                return ids
        raise BadData(f"{who}: {link.label} records digests of {count} rows of the block at {list(offsets)} "
                      "without a piece holding them")

    def close(self) -> None:
        for vf in self._files.values():
            vf.close()
        self._files.clear()
        self.chain.release()
        self.lock.release()


def open_base(base: Loc, path: Loc) -> BaseCheckpoint:
    """The committed generation of ``base``, locked (shared) and its manifest read; this rank alone.

    Raises:
        ValueError: ``base`` is ``path`` itself, lies in another directory, is no checkpoint, or records no
            row digests (written before they were, or by ``migrate``).
        CorruptCheckpointError: its manifest is damaged.
    """
    b = base
    if b == path:
        raise ValueError(f"base={str(base)!r} is the path being saved: an incremental checkpoint needs its base "
                         "to stay, save it to a new path")
    if b.parent != path.parent:
        raise ValueError(f"base={str(base)!r} is in {b.parent}, not beside {path} in {path.parent}: the links of "
                         "a chain live in one directory")
    for _ in range(50):
        try:
            name = committed_name(b)
        except (IncompleteCheckpointError, NotACheckpointError) as e:
            raise ValueError(f"base={str(base)!r} is not a checkpoint: {e}") from None
        lock = lock_generation(b, name)  # name "": a directory holding the checkpoint itself (a copy made with cp -rL)
        if lock is not None:
            break
    else:
        raise CheckpointError(f"base {b} kept changing while it was opened")
    try:
        root = root_of(b, name)
        manifest = read_manifest(root)
        rec = manifest.get(ROW_DIGESTS) if manifest is not None else None
        if manifest is None:
            raise ValueError(f"base={str(base)!r} is a plain DCP directory, not a checkpoint written by "
                             "tdb.checkpoint.save (it records no row digests)")
        if not isinstance(rec, dict):
            raise ValueError(f"base={str(base)!r} records no row digests (written by migrate or an older "
                             "version): save a full checkpoint first and use it as the base")
        link = manifest.get(LINK)
        depth = int(link.get("depth", 1)) if isinstance(link, dict) else 0
        tensors = {k: (list(v[0]), str(v[1])) for k, v in rec["tensors"].items()}
        chain = open_chain(root, manifest, read_metadata(root, manifest), b.name)  # the links below, locked
        return BaseCheckpoint(b, root, lock, manifest, tensors, chain, depth)
    except BaseException:
        lock.release()
        raise
