"""Read a checkpoint's tables, shapes, dtypes and shard layouts; no process group needed."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

from ..incremental.chain import Chain, describe, is_incremental, metadata_for_checks, open_chain
from ..commit import resolve
from ..common import format_bytes, format_mib, tensor_bytes
from ..format.manifest import ROW_DIGESTS, read_manifest
from ..storage import Loc, locate
from ..format.validate import read_metadata

__all__ = ["format_report", "inspect"]


def inspect(path: str | Path | Loc, *, storage_options: Mapping[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    """Per saved key: ``type`` (``"tensor"`` or ``"object"``), ``shape``, ``dtype``, ``shards`` (``offsets``,
    ``sizes``) and ``bytes``.

    A non-tensor entry has ``shape`` and ``dtype`` ``None``, no shards, the bytes of its pickle, and, where
    :func:`save` recorded them, ``object_type`` (its Python type's name) and ``value`` (the ``repr`` of a
    plain scalar or short string). Works on checkpoints
    written by :func:`save` and on plain DCP directories. Read-only and safe on
    untrusted checkpoints: the manifest and ``.metadata`` are verified and parsed
    without running code (:mod:`.manifest`, :mod:`.validate`); nothing else is read.

    For an incremental checkpoint (:func:`~.api.save` with ``base=``) every link of its chain is opened and
    checked (:mod:`.chain`), the tensors' ``shards`` are the blocks the newest link was saved from, and each
    tensor has ``links``: per link, newest first, its ``name``, ``save_id``, ``base``, ``rows`` (of this
    tensor: the rows the link holds, every block counted) and ``bytes`` (the link's data files).

    Example::

        >>> tdb.checkpoint.inspect("/ckpt/step100")["ebc.embedding_bags.t0.weight"]["shape"]
        [1000, 64]
    """
    loc = locate(path, storage_options)
    root = resolve(loc)
    manifest = read_manifest(root)
    md = read_metadata(root, manifest)
    links = None
    if is_incremental(manifest):
        assert manifest is not None
        chain = _open(loc, root, manifest, md)
        md, links = metadata_for_checks(chain), describe(chain)
    objects = _recorded_objects(manifest)
    out: dict[str, dict[str, Any]] = {}
    for fqn in sorted(md.state_dict_metadata):
        m = md.state_dict_metadata[fqn]
        if not isinstance(m, TensorStorageMetadata):
            stored = md.storage_data.get(MetadataIndex(fqn)) if isinstance(md.storage_data, dict) else None
            out[fqn] = {"type": "object", "shape": None, "dtype": None, "shards": [],
                        "bytes": getattr(stored, "length", 0), **objects.get(fqn, {})}
            continue
        chunks = [(list(c.offsets), list(c.sizes)) for c in m.chunks]
        if links is not None and manifest is not None:
            chunks = [(b[0], b[1]) for b in manifest[ROW_DIGESTS]["blocks"].get(fqn, [])]
        shards = sorted(({"offsets": o, "sizes": s} for o, s in chunks), key=lambda s: s["offsets"])
        out[fqn] = {
            "type": "tensor",
            "shape": list(m.size),
            "dtype": str(m.properties.dtype).replace("torch.", ""),
            "shards": shards,
            "bytes": tensor_bytes(md, fqn),
        }
        if links is not None:
            out[fqn]["links"] = [{**{k: v for k, v in link.items() if k != "rows"}, "rows": link["rows"].get(fqn, 0)}
                                 for link in links]
    return out


def _open(path: Loc, root: Loc, manifest: dict[str, Any], md: Any) -> Chain:
    """The chain of the incremental checkpoint ``root`` (its links checked, their locks released again)."""
    head = root.lock(exclusive=False)
    try:
        chain = open_chain(root, manifest, md, path.name)
        chain.release()
        return chain
    finally:
        if head is not None:
            head.release()


def _recorded_objects(manifest: dict[str, Any] | None) -> dict[str, dict[str, str]]:
    """What :func:`save` recorded of the non-tensor entries (``object_type``, ``value``); entries of any
    other shape are ignored (the manifest may come from elsewhere: nothing here is trusted)."""
    recorded = manifest.get("objects") if manifest is not None else None
    if not isinstance(recorded, dict):
        return {}
    out = {}
    for fqn, rec in recorded.items():
        if isinstance(rec, dict) and isinstance(rec.get("type"), str):
            entry = {"object_type": rec["type"][:200]}
            if isinstance(rec.get("value"), str):
                entry["value"] = rec["value"][:200]
            out[fqn] = entry
    return out


def format_report(path: str | Path | Loc, *, storage_options: Mapping[str, Any] | None = None) -> str:
    """``inspect(path)`` as a table a person reads, with totals (MiB = 2**20 bytes) and the commit state."""
    root = resolve(locate(path, storage_options))
    info = inspect(path, storage_options=storage_options)
    manifest = read_manifest(root)
    head = ["key", "dtype", "shape", "shards", "MiB"]
    rows = []
    total = 0
    for fqn, rec in info.items():
        if rec["type"] != "tensor":
            kind = f"object ({rec['object_type']})" if "object_type" in rec else "object"
            rows.append([fqn, kind, "-", f"= {rec['value']}" if "value" in rec else "-", "-"])
            continue
        total += rec["bytes"]
        cuts = _describe_cuts(rec)
        rows.append([fqn, rec["dtype"], "x".join(map(str, rec["shape"])), cuts, format_mib(rec["bytes"])])
    widths = [max(len(str(c)) for c in col) for col in zip(head, *rows)]
    fmt = "  ".join("{:<%d}" % w for w in widths)
    lines = [f"checkpoint {root}"]
    if manifest is not None:
        lines.append(f"save id {manifest['save_id']}, {_writers(manifest)}, {len(manifest['items'])} checksummed items")
    else:
        lines.append("plain DCP directory (no checksum manifest)")
    lines.append(fmt.format(*head).rstrip())
    lines += [fmt.format(*r).rstrip() for r in rows]
    lines.append(f"{len(rows)} keys, {format_mib(total)} MiB of tensors")
    links = next((rec["links"] for rec in info.values() if "links" in rec), None)
    if links is not None:
        lines.append(f"incremental: a chain of {len(links)} links, newest first (rows: those each link holds)")
        for i, link in enumerate(links):
            held = {k: rec["links"][i]["rows"] for k, rec in info.items() if "links" in rec}
            what = "full checkpoint" if link["base"] is None else f"base {link['base']}, rows " + (
                ", ".join(f"{k} {n}" for k, n in held.items() if n) or "none")
            lines.append(f"  {link['name']}  save {link['save_id']}  {format_bytes(link['bytes'])}  {what}")
    return "\n".join(lines)


def _writers(manifest: dict[str, Any]) -> str:
    """Who wrote the checkpoint, as far as its manifest records it."""
    world = manifest.get("world_size")
    if type(world) is int:
        return f"written by {world} rank(s)"
    source = manifest.get("migrated_from")
    if isinstance(source, str):
        return f"migrated from {source} (the number of ranks that wrote the source is not recorded)"
    return "written by an unrecorded number of ranks"


def _describe_cuts(rec: dict[str, Any]) -> str:
    shards = rec["shards"]
    if len(shards) == 1:
        return "1 (whole)"
    parts = []
    for d in range(len(rec["shape"])):
        starts = sorted({s["offsets"][d] for s in shards})
        if len(starts) > 1:
            parts.append(f"dim{d}@" + ",".join(map(str, starts)))
    return f"{len(shards)} ({'; '.join(parts)})"
