"""What S3 transfers carry and how often bytes cross, against the real S3 server of the test session (SeaweedFS).

Uploads: bodies sent with a checksum (a multipart upload's parts the CRC-32C of the extension, declared when
the upload is created; other uploads, and parts without the extension, botocore's CRC32) and without a SHA-256
signature over them by default, signed where the user asks or where no checksum goes; a body damaged on its way
is refused by the store, whole object or part, so that a save fails whole and the previous commit stays as it
was.

Loads above ``staging_bytes``: the rows of an object whose ETag is the one its save recorded are read once,
(a local disk's are read twice, the second time from the page cache); an object replaced since its save, or one
of a checkpoint that recorded no ETags, is read in both passes, so that damage is refused before anything is
written; bytes damaged on their way in the copy pass still raise. The same for an incremental chain's links."""

from __future__ import annotations

import uuid

import pytest
import torch
import torch.distributed.checkpoint as dcp

import torchrec_dtensor_bridge as tdb
from torchrec_dtensor_bridge.checkpoint import commit as protocol
from torchrec_dtensor_bridge.checkpoint.format import manifest as mf
from torchrec_dtensor_bridge.checkpoint.storage import locate

_UPLOADS = ("PutObject", "UploadPart")


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"t": torch.randn(3000, 64, generator=g), "step": seed}


def _headers_of_uploads(loc, sent: list[dict], ops=_UPLOADS) -> None:
    """Record the headers of every request of ``ops`` ``loc``'s client sends, as they go on the wire (after
    signing), each with the operation's name under ``"op"``."""
    for op in ops:
        loc.storage.client.meta.events.register_last(
            f"before-send.s3.{op}", lambda request, _op=op, **kw: sent.append({**dict(request.headers), "op": _op}))


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
        if not signed:  # parts with the extension's CRC-32C, whole objects with botocore's CRC32
            name = "x-amz-checksum-crc32c" if h["op"] == "UploadPart" else "x-amz-checksum-crc32"
            assert _header(h, name) is not None, h
    assert any(h["op"] == "UploadPart" for h in sent)
    dest = {"t": torch.zeros_like(big["t"]), "step": 0}
    tdb.checkpoint.load(dest, path, storage_options=dict(options or {}, part_bytes=5 << 20))
    assert torch.equal(dest["t"], big["t"]) and dest["step"] == 1


def test_parts_carry_the_extensions_crc32c_declared_at_creation_and_botocores_crc32_without_it(s3_bucket,
                                                                                                   monkeypatch):
    """With the extension: the upload is created with ChecksumAlgorithm CRC32C and every part carries a
    CRC-32C (that it is each part's, the store checks: the test below, and every save here would fail
    otherwise). Without it (``TDB_NATIVE_KERNELS=0``): botocore's CRC32, and the checkpoint loads the same."""
    from torchrec_dtensor_bridge.kernels import native

    big = {"t": torch.randn(3 << 20, dtype=torch.float32), "step": 1}  # 12 MiB: three parts of 5 MiB
    try:
        for with_extension in (True, False):
            if not with_extension:
                monkeypatch.setenv("TDB_NATIVE_KERNELS", "0")
                native.kernel.cache_clear()
                assert native.kernel() is None
            # a client per round: clients are kept per bucket and options
            opts = {"part_bytes": 5 << 20, "max_concurrency": 2 if with_extension else 3}
            path = f"s3://{s3_bucket}/{uuid.uuid4().hex[:8]}/ck"
            loc = locate(path, opts)
            sent: list[dict] = []
            _headers_of_uploads(loc, sent, ("CreateMultipartUpload", "UploadPart", "CompleteMultipartUpload"))
            tdb.checkpoint.save(big, path, storage_options=opts)
            created = [h for h in sent if h["op"] == "CreateMultipartUpload"]
            parts = [h for h in sent if h["op"] == "UploadPart"]
            assert created and len(parts) >= 3, [h["op"] for h in sent]
            for h in created:
                assert (_header(h, "x-amz-checksum-algorithm") == "CRC32C") == with_extension, h
            for h in parts:
                assert (_header(h, "x-amz-checksum-crc32c") is not None) == with_extension, h
                assert (_header(h, "x-amz-checksum-crc32") is not None) != with_extension, h
            dest = {"t": torch.zeros_like(big["t"]), "step": 0}
            tdb.checkpoint.load(dest, path, storage_options=opts)
            assert torch.equal(dest["t"], big["t"]) and dest["step"] == 1
    finally:
        monkeypatch.delenv("TDB_NATIVE_KERNELS", raising=False)
        native.kernel.cache_clear()


@pytest.mark.parametrize("part_bytes", [None, 5 << 20], ids=["whole-objects", "parts"])
def test_a_body_damaged_on_its_way_is_refused_by_the_store_and_the_previous_commit_stands(s3_bucket, part_bytes):
    """One byte of every data-object upload changed after the request was signed (as a faulty link or proxy
    would), whole objects (CRC32) or the parts of multipart uploads (the extension's CRC-32C): the store
    refuses it (the checksum header no longer matches), the save raises, and the commit before it loads
    bit-exact with no trace of the failed save among the checkpoint's names."""
    path = f"s3://{s3_bucket}/damaged-{uuid.uuid4().hex[:6]}/ck"
    opts = None if part_bytes is None else {"part_bytes": part_bytes}
    rows = 3000 if part_bytes is None else 30_000  # 0.7 MiB: one PutObject; 7.3 MiB: two parts
    state = {i: {"t": torch.randn(rows, 64, generator=torch.Generator().manual_seed(i)), "step": i} for i in (1, 2, 3)}
    tdb.checkpoint.save(state[1], path, storage_options=opts)
    loc = locate(path, opts)
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
            tdb.checkpoint.save(state[2], path, storage_options=opts)
    finally:
        for op in _UPLOADS:
            loc.storage.client.meta.events.unregister(f"before-send.s3.{op}", damage)
    assert damaged, "no data object was uploaded"
    assert all(("partNumber=" in u) == (part_bytes is not None) for u in damaged), damaged
    dest = {"t": torch.zeros(rows, 64), "step": 0}
    tdb.checkpoint.load(dest, path, storage_options=opts)
    assert torch.equal(dest["t"], state[1]["t"]) and dest["step"] == 1
    assert protocol.resolve(loc).name in names_before
    tdb.checkpoint.save(state[3], path, storage_options=opts)  # and the next save goes through
    tdb.checkpoint.load(dest, path, storage_options=opts)
    assert torch.equal(dest["t"], state[3]["t"]) and dest["step"] == 3


# ------------------------------------------------------------------ loads above staging_bytes
_ROWS, _DIM = 40_000, 64  # 3 tables of 10 MiB


def _tables(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {f"t{i}": torch.randn(_ROWS, _DIM, generator=g) for i in range(3)}


def _blank_tables() -> dict:
    return {f"t{i}": torch.full((_ROWS, _DIM), -1.0) for i in range(3)}


_DATA = 3 * _ROWS * _DIM * 4
_STAGING = 1 << 20  # below a rank's share: the verify-first load


@pytest.fixture(params=["local", "s3"])
def where(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "ckpts")
    return f"s3://{request.getfixturevalue('s3_bucket')}/run-{uuid.uuid4().hex[:8]}"


def test_a_verify_first_load_reads_the_rows_of_objects_certified_unchanged_once(where):
    path = f"{where}/ck"
    tdb.checkpoint.save(_tables(1), path)
    dest = _blank_tables()
    stats = tdb.checkpoint.load(dest, path, staging_bytes=_STAGING)
    assert all(torch.equal(dest[k], v) for k, v in _tables(1).items())
    if where.startswith("s3://"):
        # the rows once; each table's zip records (at most 4 checksum blocks) in both passes
        assert _DATA <= stats.bytes_read <= _DATA + 3 * 2 * 4 * mf.BLOCK, stats
    else:
        assert stats.bytes_read >= 2 * _DATA, stats  # twice: the second from the page cache


def _damage_in_store(obj, bit: int) -> None:
    """Write the object again through the store with one bit of its middle byte flipped (a new ETag)."""
    raw = bytearray(obj.get(1 << 30))
    raw[len(raw) // 2] ^= bit
    obj.put(bytes(raw))


def _chain(where: str, seed: int) -> tuple[str, dict]:
    """A full checkpoint and a link with the first third of every table's rows changed: (the link, the state)."""
    base, path = f"{where}/full", f"{where}/link"
    state = _tables(seed)
    tdb.checkpoint.save(state, base)
    for t in state.values():
        t[: _ROWS // 3] += 1.0
    tdb.checkpoint.save(state, path, base=base)
    return path, state


def _data_object(path: str):
    gen = protocol.resolve(locate(path))
    return gen / next(n for n in gen.list() if n.endswith(".distcp"))


def test_an_object_replaced_since_its_save_is_read_in_both_passes_and_its_damage_refused(s3_bucket):
    """The same bytes but one, written again through the store (a new ETag): the first pass reads and checks
    its rows, so the load is refused naming it before any destination byte is written."""
    path = f"s3://{s3_bucket}/replaced/ck"
    tdb.checkpoint.save(_tables(1), path)
    obj = _data_object(path)
    _damage_in_store(obj, 0x20)  # inside the middle table's rows
    dest = _blank_tables()
    with pytest.raises(tdb.checkpoint.CorruptCheckpointError, match=obj.name):
        tdb.checkpoint.load(dest, path, staging_bytes=_STAGING)
    assert all(torch.equal(dest[k], v) for k, v in _blank_tables().items())


def test_a_checkpoint_that_recorded_no_etags_is_read_in_both_passes(s3_bucket):
    """As saved before ETags were recorded (or copied by a tool that gave its objects other ETags)."""
    path = f"s3://{s3_bucket}/older/ck"
    tdb.checkpoint.save(_tables(2), path)
    gen = protocol.resolve(locate(path))
    body = mf.read_manifest(gen)
    data = {rel: rec for rel, rec in body["files"].items() if rel.endswith(".distcp")} if body else {}
    assert data and all("version" in rec for rec in data.values()), body
    for rec in data.values():
        del rec["version"]
    (gen / mf.MANIFEST).put(mf.encode_manifest(body))
    dest = _blank_tables()
    stats = tdb.checkpoint.load(dest, path, staging_bytes=_STAGING)
    assert all(torch.equal(dest[k], v) for k, v in _tables(2).items())
    assert stats.bytes_read >= 2 * _DATA, stats


def test_bytes_damaged_on_their_way_in_the_copy_pass_raise(s3_bucket, monkeypatch):
    """An object certified unchanged whose bytes arrive damaged (a faulty link) in the only pass that reads its
    rows: the load raises, saying destinations may be partly written; a load after it gets every value."""
    from torchrec_dtensor_bridge.checkpoint.storage import s3_streams

    path = f"s3://{s3_bucket}/inflight/ck"
    tdb.checkpoint.save(_tables(3), path)
    real = s3_streams.Reader._range

    def damaged(self, buf, offset):
        n = real(self, buf, offset)
        if offset + n > _DATA // 2 > offset:  # the range holding the middle of the object
            buf[_DATA // 2 - offset] ^= 0x01
        return n

    monkeypatch.setattr(s3_streams.Reader, "_range", damaged)
    with pytest.raises(tdb.checkpoint.CheckpointError, match="partly written"):
        tdb.checkpoint.load(_blank_tables(), path, staging_bytes=_STAGING)
    monkeypatch.setattr(s3_streams.Reader, "_range", real)
    dest = _blank_tables()
    tdb.checkpoint.load(dest, path, staging_bytes=_STAGING)
    assert all(torch.equal(dest[k], v) for k, v in _tables(3).items())


def test_a_chain_above_staging_reads_the_rows_of_certified_objects_once(where):
    """A full checkpoint and a link with a third of its rows changed, loaded above ``staging_bytes``: on S3 each
    needed row is read once (from the newest link holding it), on a local disk twice."""
    path, state = _chain(where, 4)
    dest = _blank_tables()
    stats = tdb.checkpoint.load(dest, path, staging_bytes=_STAGING)
    assert all(torch.equal(dest[k], v) for k, v in state.items())
    if where.startswith("s3://"):
        assert stats.bytes_read <= _DATA + 3 * 2 * 8 * mf.BLOCK + (1 << 20), stats  # rows once, records twice
    else:
        assert stats.bytes_read >= 2 * _DATA, stats


def test_a_replaced_object_of_a_chain_is_read_in_both_passes_and_its_damage_refused(s3_bucket):
    path, _ = _chain(f"s3://{s3_bucket}/chain", 5)
    gen = protocol.resolve(locate(path))
    body = mf.read_manifest(gen)
    assert body is not None
    name = max(body["files"], key=lambda rel: body["files"][rel]["size"])  # the link's changed rows
    _damage_in_store(gen / name, 0x04)
    dest = _blank_tables()
    with pytest.raises(tdb.checkpoint.CorruptCheckpointError, match=name):
        tdb.checkpoint.load(dest, path, staging_bytes=_STAGING)
    assert all(torch.equal(dest[k], v) for k, v in _blank_tables().items())


def test_a_checkpoint_migrated_to_s3_records_etags_and_its_rows_are_read_once(s3_bucket, tmp_path):
    plain = tmp_path / "plain"
    dcp.save(_tables(6), checkpoint_id=str(plain))
    path = f"s3://{s3_bucket}/migrated/ck"
    tdb.checkpoint.migrate(str(plain), path, progress=False)
    body = mf.read_manifest(protocol.resolve(locate(path)))
    assert body and all("version" in rec for rel, rec in body["files"].items() if rel.endswith(".distcp")), body
    dest = _blank_tables()
    stats = tdb.checkpoint.load(dest, path, staging_bytes=_STAGING)
    assert all(torch.equal(dest[k], v) for k, v in _tables(6).items())
    assert _DATA <= stats.bytes_read <= _DATA + 3 * 2 * 4 * mf.BLOCK, stats
