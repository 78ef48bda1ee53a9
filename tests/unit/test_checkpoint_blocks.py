"""Block checksums and the restricted data.pkl reader, in one process (no files beyond tmp_path)."""

import io
import os
import pickle
import random

import pytest
import torch
import xxhash

from torchrec_dtensor_bridge.checkpoint.format import manifest, savedtensor

from ..checkpoint_writers import file_sums


def test_block_hasher_is_independent_of_write_sizes(tmp_path):
    data = os.urandom(3 * manifest.BLOCK + 12345)
    (tmp_path / "f").write_bytes(data)
    h = manifest.BlockHasher()
    rng, pos = random.Random(0), 0
    while pos < len(data):
        n = rng.choice([1, 17, 4096, manifest.BLOCK + 3])
        h.update(memoryview(data)[pos : pos + n])
        pos += n
    sums = h.finish()
    assert sums == file_sums(tmp_path / "f")
    assert sums.size == len(data) and len(sums.blocks) == 16 * 4
    assert sums.digest(3) == xxhash.xxh3_64(data[3 * manifest.BLOCK :]).intdigest()


def test_checksums_blocks_cover_a_range():
    b = manifest.BLOCK
    body = {"format": 2, "block": b, "files": {"f": {"size": 3 * b + 10, "blocks": "0" * 64}}}
    cs = manifest.Checksums(body)
    assert [(x.start, x.end) for x in cs.blocks("f", b - 1, b + 1)] == [(0, b), (b, 2 * b)]
    assert [(x.start, x.end) for x in cs.blocks("f", 3 * b, 3 * b + 10)] == [(3 * b, 3 * b + 10)]
    with pytest.raises(KeyError):
        cs.blocks("f", 0, 3 * b + 11)
    with pytest.raises(KeyError):
        cs.blocks("g", 0, 1)
    v1 = manifest.Checksums({"format": 1, "items": {
        "a": {"file": "f", "offset": 0, "length": 10, "digest": 1},
        "b": {"file": "f", "offset": 10, "length": 5, "digest": 2},
    }})
    assert [(x.start, x.end, x.digest) for x in v1.blocks("f", 11, 12)] == [(10, 15, 2)]  # whole items only


def test_tensor_record_unpickler():
    buf = io.BytesIO()
    torch.save(torch.arange(12.0).reshape(3, 4)[1:], buf)
    import zipfile

    zf = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    pkl = next(n for n in zf.namelist() if n.endswith("data.pkl"))
    rec = savedtensor.TensorRecordUnpickler(io.BytesIO(zf.read(pkl))).load()
    assert rec.storage.dtype == torch.float32 and rec.storage.numel == 12
    assert (rec.storage_offset, rec.size, rec.stride) == (4, (2, 4), (4, 1))


def test_tensor_record_unpickler_resolves_no_other_global():
    payload = pickle.dumps(os.system)  # a GLOBAL opcode for posix.system
    with pytest.raises(savedtensor.Unreadable, match="system"):
        savedtensor.TensorRecordUnpickler(io.BytesIO(payload)).load()
