"""What an upload to S3 carries, against the real S3 server of the test session (SeaweedFS): bodies sent with a
CRC32 checksum and without a SHA-256 signature over them by default, signed where the user asks or where no
checksum goes; and a body damaged on its way refused by the store, so that a save fails whole and the
previous commit stays as it was."""

from __future__ import annotations

import uuid

import pytest
import torch

import torchrec_dtensor_bridge as tdb
from torchrec_dtensor_bridge.checkpoint import commit as protocol
from torchrec_dtensor_bridge.checkpoint.storage import locate

_UPLOADS = ("PutObject", "UploadPart")


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"t": torch.randn(3000, 64, generator=g), "step": seed}


def _headers_of_uploads(loc, sent: list[dict]) -> None:
    """Record the headers of every upload ``loc``'s client sends, as they go on the wire (after signing)."""
    for op in _UPLOADS:
        loc.storage.client.meta.events.register_last(f"before-send.s3.{op}",
                                                     lambda request, **kw: sent.append(dict(request.headers)))


def _header(headers: dict, name: str) -> str | None:
    found = [v for k, v in headers.items() if k.lower() == name]
    return None if not found else (found[0].decode() if isinstance(found[0], bytes) else found[0])


@pytest.mark.parametrize("options, signed", [
    (None, False),
    ({"config_kwargs": {"s3": {"payload_signing_enabled": True}}}, True),  # asked for: kept
    ({"config_kwargs": {"request_checksum_calculation": "when_required"}}, True),  # no checksum sent: signed
])
def test_upload_bodies_carry_a_checksum_and_are_signed_only_where_asked_or_unchecked(s3_bucket, options, signed):
    path = f"s3://{s3_bucket}/{uuid.uuid4().hex[:8]}/ck"
    loc = locate(path, dict(options or {}, part_bytes=5 << 20))
    sent: list[dict] = []
    _headers_of_uploads(loc, sent)
    big = {"t": torch.randn(3 << 20, dtype=torch.float32), "step": 1}  # 12 MiB: a multipart upload
    tdb.checkpoint.save(big, path, storage_options=dict(options or {}, part_bytes=5 << 20))
    assert len(sent) >= 4, len(sent)  # parts of the data object, records, the commit record
    for h in sent:
        content = _header(h, "x-amz-content-sha256")
        assert content is not None, h
        assert (content != "UNSIGNED-PAYLOAD") == signed, content
        if not signed:
            assert _header(h, "x-amz-checksum-crc32") is not None, h
    dest = {"t": torch.zeros_like(big["t"]), "step": 0}
    tdb.checkpoint.load(dest, path, storage_options=dict(options or {}, part_bytes=5 << 20))
    assert torch.equal(dest["t"], big["t"]) and dest["step"] == 1


def test_a_body_damaged_on_its_way_is_refused_by_the_store_and_the_previous_commit_stands(s3_bucket):
    """One byte of every data-object upload changed after the request was signed (as a faulty link or proxy
    would): the store refuses it (the CRC32 header no longer matches), the save raises, and the commit before
    it loads bit-exact with no trace of the failed save among the checkpoint's names."""
    path = f"s3://{s3_bucket}/damaged/ck"
    tdb.checkpoint.save(_state(1), path)
    loc = locate(path)
    names_before = sorted(loc.list())
    damaged: list[str] = []

    def damage(request, **kw):
        if ".distcp" not in request.url:
            return
        body = request.body
        data = bytearray(body if isinstance(body, (bytes, bytearray)) else body.read())
        if hasattr(body, "seek"):
            body.seek(0)
        data[len(data) // 2] ^= 0x01
        request.body = bytes(data)
        damaged.append(request.url)

    for op in _UPLOADS:
        loc.storage.client.meta.events.register_last(f"before-send.s3.{op}", damage)
    try:
        with pytest.raises(Exception, match="BadDigest|did not match|checksum"):
            tdb.checkpoint.save(_state(2), path)
    finally:
        for op in _UPLOADS:
            loc.storage.client.meta.events.unregister(f"before-send.s3.{op}", damage)
    assert damaged, "no data object was uploaded"
    dest = {"t": torch.zeros(3000, 64), "step": 0}
    tdb.checkpoint.load(dest, path)
    assert torch.equal(dest["t"], _state(1)["t"]) and dest["step"] == 1
    assert protocol.resolve(loc).name in names_before
    tdb.checkpoint.save(_state(3), path)  # and the next save goes through
    tdb.checkpoint.load(dest, path)
    assert torch.equal(dest["t"], _state(3)["t"]) and dest["step"] == 3
