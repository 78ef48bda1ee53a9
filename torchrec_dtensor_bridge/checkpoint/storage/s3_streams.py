"""The streams of :mod:`.s3`'s objects: ranged reads (:class:`Reader`, ``open_read``) and multipart uploads
(:class:`Upload`, ``create``); what they promise is in :mod:`.s3`'s docstring."""

from __future__ import annotations

import base64
import concurrent.futures
import io
import threading
from collections.abc import Callable
from typing import Any

import torch

from ...kernels import native
from .base import Handle

__all__ = ["Reader", "Transfers", "Upload", "crc32c_header"]

_PIECE = 16 << 20  # bytes a ranged read fetches per request when it splits a large range
MAX_PARTS = 10_000  # S3's most parts in one multipart upload
MAX_PART_BYTES = 5 << 30  # S3's largest part


def crc32c_header() -> Callable[[memoryview], str] | None:
    """The value of an ``x-amz-checksum-crc32c`` header for a body (base64 of its CRC-32C, big-endian), computed
    by this package's extension without the GIL; ``None`` when the extension is not loaded or the CPU has no
    CRC-32C instruction (botocore's CRC32 is used then)."""
    k = native.kernel()
    if k is None or not k.crc32c_hardware:
        return None

    def header(body: memoryview) -> str:
        data = torch.frombuffer(body, dtype=torch.uint8) if len(body) else torch.empty(0, dtype=torch.uint8)
        return base64.b64encode(k.crc32c(data).to_bytes(4, "big")).decode()

    return header


class Transfers:
    """What the streams of one bucket share: its boto3 client, a thread pool for parts and ranges in flight,
    the part sizes, and the part buffers uploads reuse.

    An upload's parts are ``part_bytes`` for the first ``parts_per_size`` parts and double every
    ``parts_per_size`` parts after (at most 5 GiB a part): S3 takes at most 10,000 parts in one upload, and an
    upload does not know its object's size beforehand. With the defaults (32 MiB, 1,000) the first 31 GiB of an
    object go in parts of 32 MiB and 10,000 parts hold 7.8 TiB, more than S3's largest object (5 TiB).

    ``part_checksum`` (:func:`crc32c_header`): each part is sent with it as its ``x-amz-checksum-crc32c`` and
    the upload is created with ``ChecksumAlgorithm=CRC32C``; ``None``: botocore checksums the parts."""

    def __init__(self, client: Any, bucket: str, part_bytes: int, max_concurrency: int,
                 parts_per_size: int = 1000, part_checksum: Callable[[memoryview], str] | None = None) -> None:
        self.client, self.bucket = client, bucket
        self.part_checksum = part_checksum
        self.part_bytes, self.max_concurrency = part_bytes, max_concurrency
        self.parts_per_size = parts_per_size
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=max_concurrency * 2, thread_name_prefix="tdb-s3")
        self._free: list[bytearray] = []  # part buffers to reuse (part_buffer)
        self._free_lock = threading.Lock()

    def part_size(self, number: int) -> int:
        """The size of part ``number`` (from 1) of an upload (see the class docstring)."""
        return min(self.part_bytes << ((number - 1) // self.parts_per_size), MAX_PART_BYTES)

    def part_buffer(self, size: int) -> bytearray:
        """A buffer for an upload's next part, of ``size`` bytes: of ``part_bytes``, a free one if any."""
        if size == self.part_bytes:
            with self._free_lock:
                if self._free:
                    return self._free.pop()
        return bytearray(size)

    def give_back(self, buf: bytearray) -> None:
        """A part buffer done with; up to ``max_concurrency + 2`` of ``part_bytes`` are kept for reuse, the rest
        freed."""
        with self._free_lock:
            if len(buf) == self.part_bytes and len(self._free) < self.max_concurrency + 2:
                self._free.append(buf)


class Reader(Handle):
    """Ranged reads of one object, each with If-Match on the ETag seen at open (see :mod:`.s3`)."""

    def __init__(self, store: Transfers, key: str) -> None:
        self._store = store
        self._key = key
        head = store.client.head_object(Bucket=store.bucket, Key=key)
        self.size = int(head["ContentLength"])
        self.version = str(head["ETag"])

    def _range(self, buf: memoryview, offset: int) -> int:
        end = min(offset + len(buf), self.size) - 1
        if end < offset:
            return 0
        r = self._store.client.get_object(Bucket=self._store.bucket, Key=self._key, IfMatch=self.version,
                                          Range=f"bytes={offset}-{end}")
        body = r["Body"]
        done = 0
        try:
            while done < end - offset + 1:
                chunk = body.read(min(8 << 20, end - offset + 1 - done))
                if not chunk:
                    break
                buf[done : done + len(chunk)] = chunk
                done += len(chunk)
        finally:
            body.close()
        return done

    def readinto(self, buf: memoryview, offset: int) -> int:
        n = min(len(buf), max(self.size - offset, 0))
        if n <= _PIECE:
            return self._range(buf[:n], offset)
        starts = range(0, n, _PIECE)
        got = list(self._store.pool.map(lambda s: self._range(buf[s : min(s + _PIECE, n)], offset + s), starts))
        return sum(got)


class Upload(io.RawIOBase):
    """A write-only stream uploading ``part_bytes`` parts as they fill (see the module docstring).

    Bytes written are copied once, into a part buffer of the store's (:meth:`Transfers.part_buffer`: reused
    from part to part, so its pages are not faulted in again), which is sent as it is when full."""

    def __init__(self, store: Transfers, key: str) -> None:
        super().__init__()
        self._store, self._key = store, key
        self._buf: bytearray | None = None
        self._fill = 0
        self._written = 0
        self._upload_id: str | None = None
        self._parts: list[concurrent.futures.Future[dict[str, Any]]] = []
        self._slots = threading.BoundedSemaphore(store.max_concurrency)
        self.version: str | None = None  # the object's ETag, once finished

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._written

    def write(self, b: Any) -> int:
        mv = memoryview(b).cast("B")
        size = len(mv)
        done = 0
        while done < size:
            if self._buf is None:
                if len(self._parts) == MAX_PARTS:
                    raise ValueError(f"s3://{self._store.bucket}/{self._key}: more than {self._written + done} bytes "
                                     f"need more than S3's {MAX_PARTS} parts of one upload")
                self._buf, self._fill = self._store.part_buffer(self._store.part_size(len(self._parts) + 1)), 0
            n = min(size - done, len(self._buf) - self._fill)
            self._buf[self._fill : self._fill + n] = mv[done : done + n]
            self._fill += n
            done += n
            if self._fill == len(self._buf):
                self._send()
        self._written += size
        return size

    def _send(self) -> None:
        """Upload the part buffer (then back to the store's free buffers); at most ``max_concurrency`` at once."""
        c, s = self._store.client, self._store
        buf, size = self._buf, self._fill
        assert buf is not None
        self._buf, self._fill = None, 0
        if self._upload_id is None:
            algorithm = {} if s.part_checksum is None else {"ChecksumAlgorithm": "CRC32C"}
            self._upload_id = c.create_multipart_upload(Bucket=s.bucket, Key=self._key, **algorithm)["UploadId"]
        number = len(self._parts) + 1
        self._slots.acquire()

        def send() -> dict[str, Any]:
            try:
                # A whole buffer goes as it is: it is checksummed in one call and urllib3 sends it in one
                # sendall. A file-like body is read, copied and sent 16 KiB at a time: 0.35 CPU seconds per GiB
                # more here (BENCHMARKS.md). The last, shorter part of an object is copied once.
                filled = memoryview(buf)[:size]
                check = {} if s.part_checksum is None else {"ChecksumCRC32C": s.part_checksum(filled)}
                body = buf if size == len(buf) else bytes(filled)
                r = c.upload_part(Bucket=s.bucket, Key=self._key, UploadId=self._upload_id, PartNumber=number,
                                  Body=body, **check)
                return {"PartNumber": number, "ETag": r["ETag"], **check}
            finally:
                s.give_back(buf)
                self._slots.release()

        self._parts.append(s.pool.submit(send))

    def finish(self) -> None:
        c, s = self._store.client, self._store
        if self._upload_id is None:
            data = bytes(memoryview(self._buf)[: self._fill]) if self._buf is not None else b""
            if self._buf is not None:
                s.give_back(self._buf)
            self._buf = None
            self.version = str(c.put_object(Bucket=s.bucket, Key=self._key, Body=data)["ETag"])
            return
        if self._buf is not None:
            self._send()
        parts = [f.result() for f in self._parts]
        done = c.complete_multipart_upload(Bucket=s.bucket, Key=self._key, UploadId=self._upload_id,
                                           MultipartUpload={"Parts": parts})
        self.version = str(done["ETag"])

    def abort(self) -> None:
        for f in self._parts:
            f.cancel()
        concurrent.futures.wait(self._parts)
        if self._buf is not None:
            self._store.give_back(self._buf)
            self._buf = None
        if self._upload_id is not None:
            try:
                self._store.client.abort_multipart_upload(Bucket=self._store.bucket, Key=self._key,
                                                          UploadId=self._upload_id)
            except Exception:  # noqa: BLE001 - the store expires abandoned uploads; the first error is reported
                pass
