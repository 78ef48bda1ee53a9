"""Checkpoint writers the tests need and the package does not: old manifest formats, damaged records.

The package writes only format-3 manifests (:func:`~torchrec_dtensor_bridge.checkpoint.format.manifest.write_manifest`)
and hashes data files as it writes them. The tests also write what older
releases wrote (format 1: one checksum per storage item, plain JSON), rewrite
a manifest's body with its header checksum recomputed (as a faulty or hostile
writer would), and hash a whole file from disk to check the streaming hasher.

Example::

    >>> body = read_manifest(root)
    >>> del body["items"]["t@0,0"]["offset"]
    >>> rewrite_manifest(root, body)  # a well-formed header over a damaged record
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

from torchrec_dtensor_bridge.checkpoint.format.manifest import (
    BLOCK,
    MANIFEST,
    BlockHasher,
    FileSums,
    encode_manifest,
    item_key,
)

__all__ = ["ItemSum", "checksum_items", "file_sums", "rewrite_manifest", "write_manifest_v1"]

_READ = 16 << 20


@dataclass(frozen=True)
class ItemSum:
    """Format 1: where one storage item lives and what its bytes hash to."""

    file: str
    offset: int
    length: int
    digest: int


def file_sums(path: Path, block: int = BLOCK) -> FileSums:
    """Block checksums of a whole file, read from disk (the reference for :class:`BlockHasher`)."""
    h = BlockHasher(block)
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(_READ):
            h.update(chunk)
    return h.finish()


def checksum_items(root: Path, md: Metadata, indexes: list[MetadataIndex]) -> dict[str, ItemSum]:
    """Format 1: the xxh3-64 of each storage item in ``indexes``, read from the files under ``root``."""
    out = {}
    for idx in indexes:
        info = md.storage_data[idx]
        with open(root / info.relative_path, "rb") as f:
            f.seek(info.offset)
            data = f.read(info.length)
        out[item_key(idx)] = ItemSum(info.relative_path, info.offset, info.length, xxhash.xxh3_64(data).intdigest())
    return out


def write_manifest_v1(root: Path, save_id: str, items: dict[str, ItemSum], extra: dict[str, Any]) -> None:
    """Write a format-1 manifest (one checksum per item, plain JSON), as releases before block checksums did."""
    body = {
        "format": 1,
        "checksum": "xxh3_64",
        "save_id": save_id,
        "items": {k: vars(v) for k, v in sorted(items.items())},
        **extra,
    }
    (root / MANIFEST).write_bytes(json.dumps(body).encode())


def rewrite_manifest(root: Path, body: dict[str, Any]) -> None:
    """Replace ``root``'s manifest by ``body`` under a header whose length and checksum match it."""
    (root / MANIFEST).write_bytes(encode_manifest(body))
