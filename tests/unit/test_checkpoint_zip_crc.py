"""A save's data files are ``torch.save`` zips written without CRC-32s (the manifest's block checksums cover every
byte): plain DCP and ``torch.load`` still read them, the ranged reader parses them as before, and ``torch.save``
on any other thread, or on the saving thread outside the save, writes its CRC-32s as torch's setting says."""

from __future__ import annotations

import io
import threading
import zipfile

import torch
import torch.distributed.checkpoint as dcp

import torchrec_dtensor_bridge as tdb
from torchrec_dtensor_bridge.checkpoint import commit as protocol
from torchrec_dtensor_bridge.checkpoint.format.savedtensor import parse_layout, without_zip_crc
from torchrec_dtensor_bridge.checkpoint.storage import locate


def _crcs(data: bytes) -> list[int]:
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        return [i.CRC for i in zf.infolist() if i.file_size]


def _saved(t: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    torch.save(t, buf)
    return buf.getvalue()


def test_a_saves_zips_carry_no_crc_and_plain_dcp_and_the_ranged_reader_load_them(tmp_path):
    g = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(4096, 64, generator=g), "b": torch.randn(64, generator=g)}
    path = tmp_path / "ck"
    tdb.checkpoint.save(state, path)
    gen = protocol.resolve(locate(path))
    data = (gen / "__0_0.distcp").get(1 << 30)
    first = data[: data.index(b"PK\x05\x06") + 22]  # the first item's zip: up to its end record
    assert _crcs(first) and not any(_crcs(first)), _crcs(first)
    plain = {"w": torch.zeros(4096, 64), "b": torch.zeros(64)}
    dcp.load(plain, checkpoint_id=str(gen.key))  # DCP's own reader: torch.load of each item
    assert all(torch.equal(plain[k], state[k]) for k in state)
    shape = next(tuple(v.shape) for v in state.values() if len(first) > v.numel() * 4 >= len(first) - 4096)
    lay = parse_layout(io.BytesIO(first), torch.float32, shape)  # the ranged path understands it: no Unreadable
    assert first[lay.data_start : lay.data_start + 8] == next(
        v for v in state.values() if tuple(v.shape) == shape).numpy().tobytes()[:8]
    dest = {"w": torch.zeros(4096, 64), "b": torch.zeros(64)}
    tdb.checkpoint.load(dest, path)
    assert all(torch.equal(dest[k], state[k]) for k in state)


def test_other_threads_and_the_saving_thread_outside_the_save_keep_torchs_crc_setting():
    t = torch.arange(10_000, dtype=torch.float32)
    outside: list[bytes] = []
    entered, done = threading.Event(), threading.Event()

    def other() -> None:
        entered.wait()
        outside.append(_saved(t))  # while the main thread is inside the context
        done.set()

    th = threading.Thread(target=other)
    th.start()
    with without_zip_crc():
        entered.set()
        inside = _saved(t)
        with without_zip_crc():  # nested
            nested = _saved(t)
        done.wait(30)
    th.join()
    after = _saved(t)
    assert not any(_crcs(inside)) and not any(_crcs(nested))
    assert all(_crcs(outside[0])) and all(_crcs(after))
    with zipfile.ZipFile(io.BytesIO(after)) as zf:
        assert zf.testzip() is None
    for blob in (inside, outside[0], after):
        assert torch.equal(torch.load(io.BytesIO(blob)), t)
    torch.serialization.set_crc32_options(False)  # torch's own setting still rules outside the context
    try:
        assert not any(_crcs(_saved(t)))
    finally:
        torch.serialization.set_crc32_options(True)
    assert all(_crcs(_saved(t)))
