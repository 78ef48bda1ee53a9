"""Checkpoint regressions, in one process on real DCP files: each test fails on a bug that every other test let
through, and holds the behaviour that bug broke.

- A chain read unstaged (``staging_bytes=0``) takes each row from the newest link that holds it, also a row that
  two links changed.
- A link whose manifest records another dtype for a tensor than the chain's head (re-checksummed: only its
  meaning is wrong) is refused, naming the key and the link.
- A block large enough to be digested by several threads (64 MiB and more) is digested to its last row: an
  incremental save finds a change in that row alone.
- ``compact`` keeps every tensor's dtype and bits (fp16, bf16, int64 beyond fp32's integers).
- ``export`` to safetensors ends the file at the last tensor's last byte, whatever the size of the last key and of
  the last run of rows it copies: the file is read by the format's own rules (and by the ``safetensors`` package
  where it is installed).
"""

from __future__ import annotations

import copy
import json
import struct
from pathlib import Path

import pytest
import torch

import torchrec_dtensor_bridge as tdb
from tests.layout import committed

from ..checkpoint_writers import rewrite_manifest
from ..distributed.checks import reference_table

try:
    from safetensors.torch import load_file as safetensors_load_file
except ImportError:  # not installed: the format's rules are checked by the reader below alone
    safetensors_load_file = None

# -- a chain read unstaged


def _chain_states() -> list[dict[str, torch.Tensor]]:
    """The values of links l0 (full), l1 and l2. Rows 4 and 9 of ``a`` change in both links, rows 3 and 5 (either
    side of row 4: read through when l1 is read) in l1 only, row 20 in l2 only; ``h`` changes whole in l1 (a piece
    of every row), one row in l2; the 0-d ``s`` in both."""
    state = {"a": reference_table((40, 6)), "m": reference_table((40,), seed=1),
             "h": reference_table((12, 3), torch.float16, seed=2), "s": torch.tensor(0.25)}
    states = [copy.deepcopy(state)]
    state["a"][[3, 4, 5, 9]] += 1.0
    state["m"][[4, 9]] += 1.0
    state["h"] += 1.0
    state["s"] += 1.0
    states.append(copy.deepcopy(state))
    state["a"][[4, 9, 20]] += 10.0
    state["m"][4] += 10.0
    state["h"][7] += 10.0
    state["s"] += 10.0
    states.append(copy.deepcopy(state))
    return states


def _save_chain(root: Path) -> list[dict[str, torch.Tensor]]:
    states = _chain_states()
    for i, state in enumerate(states):
        tdb.checkpoint.save(dict(state), root / f"l{i}", base=root / f"l{i - 1}" if i else None)
    return states


def _blank(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.full_like(v, -1.0) for k, v in state.items()}


def _differ(got: torch.Tensor, want: torch.Tensor) -> list[int]:
    """The rows (dim-0 slices) where ``got`` and ``want`` differ."""
    d = got != want
    return d.reshape(d.shape[0], -1).any(1).nonzero().flatten().tolist() if d.dim() else [0] if bool(d) else []


@pytest.mark.parametrize("staging_bytes", [0, None])  # every read done twice (verified, then copied); staged
def test_a_chain_loads_each_row_from_the_newest_link_holding_it(tmp_path, staging_bytes):
    states = _save_chain(tmp_path)
    info = tdb.checkpoint.inspect(tmp_path / "l2")
    assert [link["rows"] for link in info["a"]["links"]] == [3, 4, 40]  # rows 4 and 9 in both links
    assert [link["rows"] for link in info["h"]["links"]] == [1, 12, 12]
    for link in (2, 1):
        dest = _blank(states[link])
        tdb.checkpoint.load(dest, tmp_path / f"l{link}", staging_bytes=staging_bytes)
        for k, want in states[link].items():
            assert torch.equal(dest[k], want), (link, k, _differ(dest[k], want))


# -- a link recording another dtype


def _manifest_body(root: Path) -> dict:
    """The JSON body of the manifest of the generation ``root`` (format 3: after its header line)."""
    data = (root / "tdb_manifest.json").read_bytes()
    assert data.startswith(b"TDBMANIFEST "), data[:40]
    return json.loads(data.split(b"\n", 1)[1])


@pytest.mark.parametrize("link", ["l1", "l0"])  # the middle link; the full checkpoint the chain ends in
def test_a_link_recording_another_dtype_is_refused_naming_the_key_and_the_link(tmp_path, link):
    states = _save_chain(tmp_path)
    root = committed(tmp_path / link)
    body = _manifest_body(root)
    assert body["row_digests"]["tensors"]["a"] == [[40, 6], "torch.float32"], body["row_digests"]["tensors"]["a"]
    body["row_digests"]["tensors"]["a"][1] = "torch.int32"  # as many bytes a row: only the dtype check sees it
    rewrite_manifest(root, body)
    dest = _blank(states[2])
    with pytest.raises(tdb.checkpoint.CorruptCheckpointError, match=rf"link {link} \(.*'a'"):
        tdb.checkpoint.load(dest, tmp_path / "l2")
    for k, v in dest.items():  # nothing modified
        assert torch.equal(v, torch.full_like(v, -1.0)), k


# -- a block digested by several threads


def test_a_change_in_the_last_row_of_a_block_of_64_mib_is_saved(tmp_path):
    """One table of 66 MiB, digested by two threads at least: only its last value changes between the base and
    the incremental save, and the link holds that row, alone."""
    rows, width = 270_000, 64
    assert rows * width * 4 >= 64 << 20
    t = (torch.arange(rows * width, dtype=torch.int64) % 1_000_003).to(torch.float32).reshape(rows, width)
    threads = torch.get_num_threads()
    torch.set_num_threads(max(2, threads))
    try:
        tdb.checkpoint.save({"t": t}, tmp_path / "l0")
        t[-1, -1] = -0.5
        tdb.checkpoint.save({"t": t}, tmp_path / "l1", base=tmp_path / "l0")
    finally:
        torch.set_num_threads(threads)
    assert tdb.checkpoint.inspect(tmp_path / "l1")["t"]["links"][0]["rows"] == 1
    dest = {"t": torch.zeros_like(t)}
    tdb.checkpoint.load(dest, tmp_path / "l1")
    assert torch.equal(dest["t"][-1], t[-1]), dest["t"][-1, -4:]
    assert torch.equal(dest["t"], t)


# -- compact of every dtype


def _dtype_states() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    big = torch.tensor([2**24 + 1, -(2**53) - 3, 2**62 + 7, -1], dtype=torch.int64)  # not fp32 (nor fp64) values
    state = {
        "half": (torch.randn(30, 5, generator=g) * 100).to(torch.float16),
        "bf16": (torch.randn(16, 8, generator=g) * 1e30).to(torch.bfloat16),
        "ids": big.repeat(12).reshape(16, 3) + torch.arange(48).reshape(16, 3),
        "count": torch.tensor(2**62 + 1),
        "f32": torch.randn(9, 4, generator=g),
    }
    state["half"][0, 0] = -0.0
    states = [copy.deepcopy(state)]
    for n in (1, 2):
        state["half"][[2, 7 * n]] += n
        state["bf16"][3 * n] *= -2
        state["ids"][n] += 2**40 + n
        state["count"] += n
        state["f32"][n] -= n
        states.append(copy.deepcopy(state))
    return states


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def test_compact_keeps_every_dtype_bit_exact(tmp_path):
    states = _dtype_states()
    for i, state in enumerate(states):
        tdb.checkpoint.save({**state, "epoch": i}, tmp_path / f"l{i}", base=tmp_path / f"l{i - 1}" if i else None)
    tdb.checkpoint.compact(tmp_path / "l2", tmp_path / "flat")
    info = tdb.checkpoint.inspect(tmp_path / "flat")
    assert {k: info[k]["dtype"] for k in states[2]} == {k: str(v.dtype).removeprefix("torch.")
                                                        for k, v in states[2].items()}
    assert not any("links" in rec for rec in info.values())
    dest = {**{k: torch.zeros_like(v) for k, v in states[2].items()}, "epoch": -1}
    tdb.checkpoint.load(dest, tmp_path / "flat", strict=True)
    assert dest["epoch"] == 2
    for k, want in states[2].items():
        assert dest[k].dtype == want.dtype and torch.equal(_bits(dest[k]), _bits(want)), k


# -- export to safetensors


SAFE_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I64": torch.int64}
EXPORTED = {"a.f32": ((13, 6), torch.float32), "b.bf16": ((7, 10), torch.bfloat16), "c.i64": ((11, 2), torch.int64)}
TAILS = {  # the keys export writes last (it writes keys in sorted order)
    "five fp16 values": {"z.tail": ((5,), torch.float16)},
    "rows of 6 bytes": {"z.tail": ((7, 3), torch.float16)},
    "no rows after rows of 6 bytes": {"y.odd": ((7, 3), torch.float16), "z.tail": ((0, 4), torch.float32)},
}


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """``path`` read by the safetensors format's rules, as its own reader checks them: an 8-byte little-endian
    header size, a JSON object, then a byte buffer that the tensors' ``data_offsets`` cover exactly, in order,
    with no gap, no overlap and nothing after the last tensor."""
    data = path.read_bytes()
    (size,) = struct.unpack("<Q", data[:8])
    assert data[8:9] == b"{", data[8:16]
    header = json.loads(data[8 : 8 + size].decode("utf-8"))
    header.pop("__metadata__", None)
    buffer = data[8 + size :]
    out, at = {}, 0
    for key, rec in sorted(header.items(), key=lambda kv: tuple(kv[1]["data_offsets"])):
        begin, end = rec["data_offsets"]
        dtype = SAFE_DTYPES[rec["dtype"]]
        assert begin == at, f"{key}: its bytes start at {begin}, the previous tensor's end at {at}"
        assert end - begin == torch.Size(rec["shape"]).numel() * dtype.itemsize, (key, rec)
        raw = bytearray(buffer[begin:end])
        out[key] = torch.frombuffer(raw, dtype=dtype).reshape(rec["shape"]) if raw else \
            torch.empty(rec["shape"], dtype=dtype)
        at = end
    trailing = len(buffer) - at
    assert trailing == 0, f"{trailing} bytes after the last tensor's"
    assert len(data) == 8 + size + at
    return out


def _value(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 1000).to(dtype)


@pytest.mark.parametrize("tail", sorted(TAILS))
def test_export_to_safetensors_ends_at_the_last_tensor(tmp_path, tail):
    specs = {**EXPORTED, **TAILS[tail]}
    state = {k: _value(shape, dtype, i) for i, (k, (shape, dtype)) in enumerate(specs.items())}
    tdb.checkpoint.save({**state, "epoch": 3}, tmp_path / "ck")
    for buffer_bytes in (1 << 20, 8, 24, 40):  # whole tables; runs of a few rows, the last one short
        dst = tmp_path / f"out{buffer_bytes}.safetensors"
        done = tdb.checkpoint.export(tmp_path / "ck", dst, progress=False, buffer_bytes=buffer_bytes)
        assert done.keys == sorted(specs) and done.keys[-1] == "z.tail"
        readers = [_read_safetensors] + ([safetensors_load_file] if safetensors_load_file is not None else [])
        for read in readers:
            got = read(dst)
            assert sorted(got) == sorted(state), (buffer_bytes, sorted(got))
            for k, want in state.items():
                assert got[k].dtype == want.dtype and torch.equal(got[k], want), (buffer_bytes, k)
