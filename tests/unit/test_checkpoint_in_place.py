"""Rows read straight into their destinations (the copy step of a verify-first load), in one process on real files.

``VerifiedFile.read_into`` reads a byte range into caller memory and verifies the checksum blocks it touches,
the parts of the first and last block outside the range read beside it or taken from the block cache; a load
that is not staged reads whole rows bound for contiguous CPU tensors that way, and copies the rest.
"""

import random

import pytest
import torch

import torchrec_dtensor_bridge as tdb
from torchrec_dtensor_bridge.checkpoint.commit import resolve
from torchrec_dtensor_bridge.checkpoint.format import verified
from torchrec_dtensor_bridge.checkpoint.format.manifest import BLOCK, Checksums, read_manifest


def _saved(tmp_path, rows=9000, cols=37):  # rows of 148 bytes: row and block boundaries do not meet
    t = torch.randn(rows, cols)
    tdb.checkpoint.save({"t": t}, tmp_path / "ck")
    gen = resolve(tmp_path / "ck")
    body = read_manifest(gen)
    (rel,) = [f for f in body["files"] if f.endswith(".distcp")]
    return t, gen, rel, Checksums(body)


def _into(vf, a, b, **kw):
    dest = memoryview(bytearray(b - a))
    vf.read_into(a, b, dest, "key 't'", **kw)
    return bytes(dest)


@pytest.mark.parametrize("run", [BLOCK + 1000, 8 << 20])
def test_consecutive_ranges_read_in_place_are_the_files_bytes(tmp_path, run):
    _, gen, rel, sums = _saved(tmp_path)
    raw = (gen / rel).get(1 << 30)
    assert len(raw) > 5 * BLOCK
    rng = random.Random(run)
    for trial in range(4):
        vf = verified.VerifiedFile(gen, rel, sums)
        pos = rng.randrange(0, BLOCK)
        while pos < len(raw):
            # in one block, across a boundary, whole blocks, many blocks: each next range starts in the block
            # the last one ended in (served from the cache)
            n = min(rng.choice([1, 100, 444, BLOCK - 5, BLOCK, 2 * BLOCK + 7, 5 * BLOCK]), len(raw) - pos)
            assert _into(vf, pos, pos + n, run=run) == raw[pos : pos + n], (trial, pos, n)
            if rng.random() < 0.2:
                vf.drop_cache()
            pos += n
        vf.close()


@pytest.mark.parametrize("where", ["before the range", "in the range", "after the range"])
def test_a_damaged_byte_of_a_block_the_range_touches_is_refused(tmp_path, where):
    _, gen, rel, sums = _saved(tmp_path)
    raw = bytearray((gen / rel).get(1 << 30))
    a, b = 2 * BLOCK + 1000, 4 * BLOCK + 2000  # the first and last blocks reach past both ends
    bad = {"before the range": a - 10, "in the range": 3 * BLOCK + 5, "after the range": b + 10}[where]
    raw[bad] ^= 0x40
    (gen / rel).put(bytes(raw))
    vf = verified.VerifiedFile(gen, rel, sums)
    with pytest.raises(verified.BadData, match=rf"data file {rel} is corrupt .*key 't'.*bytes {bad // BLOCK * BLOCK}-"):
        _into(vf, a, b)
    vf.close()


def test_a_verify_first_load_reads_rows_into_contiguous_tensors_and_copies_the_rest(tmp_path, monkeypatch):
    t, gen, _, _ = _saved(tmp_path)
    calls = []
    read_into = verified.VerifiedFile.read_into
    monkeypatch.setattr(verified.VerifiedFile, "read_into",
                        lambda self, a, b, *args, **kw: (calls.append(b - a), read_into(self, a, b, *args, **kw))[1])
    dest = torch.full_like(t, -1.0)
    tdb.checkpoint.load({"t": dest}, tmp_path / "ck", staging_bytes=0)
    assert torch.equal(dest, t)
    assert calls == [t.numel() * 4]  # straight into ``dest``, once
    calls.clear()
    strided = torch.full((t.shape[1], t.shape[0]), -1.0).t()  # not contiguous: read, verified, copied
    tdb.checkpoint.load({"t": strided}, tmp_path / "ck", staging_bytes=0)
    assert torch.equal(strided, t) and calls == []
    staged = torch.full_like(t, -1.0)
    tdb.checkpoint.load({"t": staged}, tmp_path / "ck")  # staged: nothing written before every rank agrees
    assert torch.equal(staged, t) and calls == []
