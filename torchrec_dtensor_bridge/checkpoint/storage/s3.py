"""An S3-compatible object store as checkpoint storage, through boto3.

Configured the way the ecosystem does: the standard AWS variables
(``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
``AWS_REGION``) and ``storage_options`` in fsspec's (s3fs's) spelling for the
rest: ``endpoint_url``, ``key``, ``secret``, ``token``, ``region``,
``client_kwargs`` and ``config_kwargs`` (passed to boto3), and this module's
own: ``part_bytes`` (multipart part size, 32 MiB), ``max_concurrency`` (parts
and ranges in flight per object; by default this rank's share of the machine's
cores, 2 to 8: :func:`default_concurrency`), ``lease_seconds`` (a save lock's lease,
60) and ``grace_seconds`` (how long a superseded generation stays readable, 600).

How the operations of :mod:`.` are kept on a store without rename or locks:

* every upload carries a checksum header, which the store checks against the body it received: a
  multipart upload's parts the CRC-32C of each part (``x-amz-checksum-crc32c``, computed by this package's
  extension on the CPU's CRC-32C instruction, 3-4x faster here than the CRC32 botocore computes with
  ``zlib``; the upload is created with ``ChecksumAlgorithm=CRC32C`` and completed with every part's), other
  uploads (and parts, without the extension or the instruction) botocore's CRC32; the body itself is not
  hashed for the request's signature (:func:`_unsigned_payloads`);
* ``put`` is one ``PutObject``: S3 objects appear whole or not at all;
* ``create`` uploads parts of ``part_bytes`` as they fill, ``max_concurrency``
  at a time (a multipart upload, completed when the stream closes, aborted on
  error: nothing is visible until then); small objects are one ``PutObject``.
  Bytes written are copied once, into part buffers reused from part to part
  (a fresh buffer per part cost a page fault per 4 KiB: a second of system
  time per GiB here);
* ``open_read`` reads ranges with ``If-Match`` on the ETag seen at open, large
  ranges in parallel pieces: an object replaced or removed while it is read
  fails the read instead of mixing two versions;
* ``swap_pointer`` is a conditional ``PutObject``: ``If-None-Match: *`` for the
  first commit, ``If-Match: <ETag read>`` after; a 412 is a :class:`.Conflict`;
* an exclusive ``lock`` is a lease object created with ``If-None-Match: *``,
  renewed every third of ``lease_seconds`` while held, and taken over (with
  ``If-Match`` on its ETag) once the store's clock says it expired: a killed
  saver's lock frees itself;
* a shared ``lock`` is granted at once; readers are protected by the grace
  period the commit protocol keeps superseded generations for (:mod:`..commit`).
"""

from __future__ import annotations

import json
import os
import threading
import uuid
from collections.abc import Generator, Mapping
from contextlib import contextmanager
from datetime import datetime, timezone
from email.utils import parsedate_to_datetime
from typing import Any, BinaryIO

from .base import Conflict, Handle, Loc, Lock, Storage
from .s3_streams import Reader, Transfers, Upload, crc32c_header

__all__ = ["S3Storage", "default_concurrency", "s3_location"]

_OWN = ("part_bytes", "max_concurrency", "lease_seconds", "grace_seconds")


def default_concurrency() -> int:
    """Parts and ranges in flight per object when ``storage_options`` does not set ``max_concurrency``.

    This rank's share of the CPUs it may run on: the CPUs over ``LOCAL_WORLD_SIZE`` (the ranks torchrun starts on
    the node; 1 when unset), at least 2 and at most 8. Every part in flight costs the client CPU (hashing,
    signing, sending), and more transfers than cores only take turns: measured on a 2-core machine with 2 ranks
    and the store on the same machine (BENCHMARKS.md, "Checkpoints on an object store"), 8 parts in flight per
    rank cost the ranks ~50 % and the store ~35 % more CPU seconds per save than 2, for no more throughput.
    """
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    try:
        ranks = max(int(os.environ.get("LOCAL_WORLD_SIZE") or 1), 1)
    except ValueError:
        ranks = 1
    return max(2, min(8, cpus // ranks))


def _unsigned_payloads(s3_config: dict[str, Any], config_kwargs: Mapping[str, Any], session: Any) -> dict[str, Any]:
    """botocore's ``s3`` settings with request bodies sent unsigned where their checksum is sent instead.

    Over ``https`` botocore already sends bodies unsigned (``UNSIGNED-PAYLOAD``), relying on TLS and the
    checksum header (CRC32) it adds to every upload; over plain ``http`` it also hashes every body with SHA-256
    for the signature, 0.7-0.8 CPU seconds per GiB here (BENCHMARKS.md), a third of an upload's client CPU. The
    signature over a body guards against changes in transit by someone on the path; over plain ``http`` the
    same someone can read every object and change every download, whose bytes no signature covers, so it buys
    no protection a checkpoint can rely on. Accidental damage stays caught: the CRC32 header is signed and the
    store refuses a body that does not match it (tested against SeaweedFS), and every byte loaded is verified
    against the manifest's checksums. Bodies stay signed where the user says so
    (``config_kwargs={"s3": {"payload_signing_enabled": True}}``) and where no checksum is sent
    (``request_checksum_calculation`` "when_required", by ``config_kwargs``, ``AWS_REQUEST_CHECKSUM_CALCULATION``
    or the AWS config file)."""
    if "payload_signing_enabled" not in s3_config and _checksums(config_kwargs, session):
        s3_config["payload_signing_enabled"] = False
    return s3_config


def _checksums(config_kwargs: Mapping[str, Any], session: Any) -> bool:
    """Whether uploads carry a checksum: botocore's ``request_checksum_calculation`` is "when_supported" (its
    default; ``config_kwargs``, ``AWS_REQUEST_CHECKSUM_CALCULATION`` or the AWS config file may say
    "when_required")."""
    checksums = config_kwargs.get("request_checksum_calculation") or session.get_config_variable(
        "request_checksum_calculation") or "when_supported"
    return str(checksums).lower() == "when_supported"


def _code(e: Exception) -> str:
    resp = getattr(e, "response", None) or {}
    return str(resp.get("Error", {}).get("Code", "")) or str(resp.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))


def _missing(e: Exception) -> bool:
    return _code(e) in ("404", "NoSuchKey", "NotFound")


def _precondition(e: Exception) -> bool:
    return _code(e) in ("412", "PreconditionFailed", "409", "ConditionalRequestConflict")


class _Lease(Lock):
    """An exclusive lease object, renewed on a thread while held."""

    def __init__(self, store: S3Storage, key: str, etag: str) -> None:
        self._store, self._key, self._etag = store, key, etag
        self._stop = threading.Event()
        self._lost = False
        self._thread = threading.Thread(target=self._renew, name="tdb-s3-lease", daemon=True)
        self._thread.start()

    def _renew(self) -> None:
        s = self._store
        while not self._stop.wait(s.lease_seconds / 3):
            try:
                r = s.client.put_object(Bucket=s.bucket, Key=self._key, Body=s.lease_body(), IfMatch=self._etag)
                self._etag = r["ETag"]
            except Exception:  # noqa: BLE001 - taken over or unreachable: the commit's conditional put decides
                self._lost = True
                return

    def still_holds(self) -> bool:
        return not self._lost

    def release(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join()
        if not self._lost:
            try:
                self._store.client.delete_object(Bucket=self._store.bucket, Key=self._key)
            except Exception:  # noqa: BLE001 - an unreleased lease expires by itself
                pass


class _Granted(Lock):
    def release(self) -> None:
        pass


class S3Storage(Storage):
    """One bucket of an S3-compatible store (see the module docstring)."""

    scheme = "s3"

    def __init__(self, bucket: str, options: Mapping[str, Any] | None = None) -> None:
        import boto3
        import botocore.session
        from botocore.config import Config

        opts = dict(options or {})
        own = {k: opts.pop(k) for k in _OWN if k in opts}
        self.part_bytes = int(own.get("part_bytes", 32 << 20))
        self.max_concurrency = int(own["max_concurrency"]) if "max_concurrency" in own else default_concurrency()
        self.lease_seconds = float(own.get("lease_seconds", 60.0))
        self.grace_seconds = float(own.get("grace_seconds", 600.0))
        if self.part_bytes < 5 << 20:
            raise ValueError(f"storage_options part_bytes={self.part_bytes}: S3 parts are at least 5 MiB")
        if self.max_concurrency < 1:
            raise ValueError(f"storage_options max_concurrency={self.max_concurrency}: at least 1 transfer at a time")
        client_kwargs = dict(opts.pop("client_kwargs", {}) or {})
        config_kwargs = dict(opts.pop("config_kwargs", {}) or {})
        for ours, theirs in (("endpoint_url", "endpoint_url"), ("key", "aws_access_key_id"),
                             ("secret", "aws_secret_access_key"), ("token", "aws_session_token"),
                             ("region", "region_name")):
            if ours in opts:
                client_kwargs[theirs] = opts.pop(ours)
        if opts:
            raise ValueError(f"storage_options: unknown keys {sorted(opts)} (known: endpoint_url, key, secret, token, "
                             f"region, client_kwargs, config_kwargs, {', '.join(_OWN)})")
        client_kwargs.setdefault("region_name", os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
                                 or "us-east-1")
        config_kwargs.setdefault("max_pool_connections", max(10, 2 * self.max_concurrency))
        config_kwargs.setdefault("retries", {"max_attempts": 5, "mode": "standard"})
        session = botocore.session.get_session()
        config_kwargs["s3"] = _unsigned_payloads(dict(config_kwargs.get("s3") or {}), config_kwargs, session)
        self.bucket = bucket
        self.client = boto3.session.Session(botocore_session=session).client(
            "s3", config=Config(**config_kwargs), **client_kwargs)
        self.transfers = Transfers(self.client, bucket, self.part_bytes, self.max_concurrency,
                                   part_checksum=crc32c_header() if _checksums(config_kwargs, session) else None)
        self._owner = uuid.uuid4().hex

    def show(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    # 1-5: objects
    def size(self, key: str) -> int | None:
        try:
            return int(self.client.head_object(Bucket=self.bucket, Key=key)["ContentLength"])
        except Exception as e:
            if _missing(e):
                return None
            raise

    def open_read(self, key: str) -> Handle:
        try:
            return Reader(self.transfers, key)
        except Exception as e:
            if _missing(e):
                raise FileNotFoundError(f"{self.show(key)} does not exist") from None
            raise

    def get(self, key: str, limit: int) -> bytes:
        try:
            r = self.client.get_object(Bucket=self.bucket, Key=key, Range=f"bytes=0-{max(limit - 1, 0)}")
        except Exception as e:
            if _missing(e):
                raise FileNotFoundError(f"{self.show(key)} does not exist") from None
            if _code(e) in ("416", "InvalidRange"):
                return b""
            raise
        return bytes(r["Body"].read())

    def put(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=key, Body=data)

    @contextmanager
    def create(self, key: str) -> Generator[BinaryIO, None, None]:
        up = Upload(self.transfers, key)
        try:
            yield up  # type: ignore[misc]
            up.finish()
        except BaseException:
            up.abort()
            raise

    # 6-8: names
    def _keys(self, prefix: str, delimiter: str | None) -> Generator[tuple[str, bool], None, None]:
        kw: dict[str, Any] = {"Bucket": self.bucket, "Prefix": prefix}
        if delimiter:
            kw["Delimiter"] = delimiter
        for page in self.client.get_paginator("list_objects_v2").paginate(**kw):
            for p in page.get("CommonPrefixes", []):
                yield p["Prefix"], True
            for o in page.get("Contents", []):
                yield o["Key"], False

    def list(self, key: str) -> list[str]:
        prefix = f"{key.rstrip('/')}/" if key else ""
        names = set()
        for k, folder in self._keys(prefix, "/"):
            if folder and not self._holds_objects(k):
                continue  # a folder some stores keep after its last object went
            names.add(k[len(prefix):].rstrip("/"))
        return sorted(names - {""})

    def _holds_objects(self, prefix: str) -> bool:
        r = self.client.list_objects_v2(Bucket=self.bucket, Prefix=prefix, MaxKeys=1)
        return bool(r.get("KeyCount", 0))

    def kind(self, key: str) -> str | None:
        if self.size(key) is not None:
            return "object"
        r = self.client.list_objects_v2(Bucket=self.bucket, Prefix=f"{key.rstrip('/')}/", MaxKeys=1)
        return "dir" if r.get("KeyCount", 0) else None

    def delete(self, key: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=key)

    def delete_tree(self, key: str) -> None:
        keys = [k for k, _ in self._keys(f"{key.rstrip('/')}/", None)] + [f"{key.rstrip('/')}/"]  # and its folder
        for i in range(0, len(keys), 1000):
            self.client.delete_objects(Bucket=self.bucket,
                                       Delete={"Objects": [{"Key": k} for k in keys[i : i + 1000]], "Quiet": True})

    def rename(self, src: str, dst: str) -> None:
        """An object copied then deleted (not atomic): DCP's ``.metadata`` in an uncommitted generation only."""
        self.client.copy_object(Bucket=self.bucket, Key=dst, CopySource={"Bucket": self.bucket, "Key": src})
        self.delete(src)

    # 9: the atomic step
    def read_pointer(self, key: str) -> tuple[bytes, Any] | None:
        try:
            r = self.client.get_object(Bucket=self.bucket, Key=key)
        except Exception as e:
            if _missing(e):
                return None
            raise
        return bytes(r["Body"].read(1 << 20)), r["ETag"]

    def swap_pointer(self, key: str, data: bytes, expected: Any) -> None:
        cond = {"IfNoneMatch": "*"} if expected is None else {"IfMatch": expected}
        try:
            self.client.put_object(Bucket=self.bucket, Key=key, Body=data, **cond)
        except Exception as e:
            if _precondition(e):
                raise Conflict(f"{self.show(key)} changed since it was read") from None
            raise

    # 10: locks
    def lease_body(self) -> bytes:
        return json.dumps({"owner": self._owner, "lease_seconds": self.lease_seconds}).encode()

    def server_age(self, key: str) -> tuple[float, str] | None:
        """Seconds since ``key`` was last written by the store's clock, and its ETag; ``None`` if absent."""
        try:
            h = self.client.head_object(Bucket=self.bucket, Key=key)
        except Exception as e:
            if _missing(e):
                return None
            raise
        date = h.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
        now = parsedate_to_datetime(date) if date else datetime.now(timezone.utc)
        return (now - h["LastModified"]).total_seconds(), h["ETag"]

    def _holders_lease(self, key: str) -> float:
        """The lease its holder took (recorded in the lease object; this store's own if unreadable)."""
        try:
            body = json.loads(self.get(key, 4096))
            return float(body["lease_seconds"])
        except Exception:  # noqa: BLE001 - gone or damaged: judged by this store's lease
            return self.lease_seconds

    def lock(self, key: str, *, exclusive: bool) -> Lock | None:
        if not exclusive:
            return _Granted()
        try:
            r = self.client.put_object(Bucket=self.bucket, Key=key, Body=self.lease_body(), IfNoneMatch="*")
            return _Lease(self, key, r["ETag"])
        except Exception as e:
            if not _precondition(e):
                raise
        held = self.server_age(key)
        if held is None or held[0] < self._holders_lease(key):
            return None
        try:  # expired: its holder died; take it over unless someone else just did
            r = self.client.put_object(Bucket=self.bucket, Key=key, Body=self.lease_body(), IfMatch=held[1])
        except Exception as e:
            if _precondition(e):
                return None
            raise
        return _Lease(self, key, r["ETag"])


_STORES: dict[tuple[str, str], S3Storage] = {}
_STORES_LOCK = threading.Lock()


def s3_location(url: str, options: Mapping[str, Any] | None) -> Loc:
    """The :class:`Loc` of ``s3://bucket/key`` (one client per bucket and options, kept for the process)."""
    rest = url[len("s3://"):]
    bucket, _, key = rest.partition("/")
    key = key.strip("/")
    if not bucket or not key:
        raise ValueError(f"{url!r} is not an object URL: expected s3://bucket/prefix/name")
    if any(part in ("", ".", "..") for part in key.split("/")):
        raise ValueError(f"{url!r}: the key {key!r} has an empty, '.' or '..' part")
    ident = (bucket, json.dumps(dict(options or {}), sort_keys=True, default=str))
    with _STORES_LOCK:
        store = _STORES.get(ident)
        if store is None:
            store = _STORES[ident] = S3Storage(bucket, options)
    return Loc(store, key)
