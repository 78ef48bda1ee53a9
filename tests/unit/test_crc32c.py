"""The extension's CRC-32C (csrc/crc32c.c through kernels/native.py), the checksum of every part an S3 upload
sends: the check values published with the polynomial (RFC 3720, B.4, and the catalogue's "123456789"), and
random bytes of every length around the three-lane runs, at odd addresses and chained, against a table-driven
reference written here from the polynomial."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from torchrec_dtensor_bridge.kernels import native

_POLY = 0x82F63B78  # CRC-32C, reflected
_TABLE = []
for _i in range(256):
    _c = _i
    for _ in range(8):
        _c = (_c >> 1) ^ (_POLY if _c & 1 else 0)
    _TABLE.append(_c)


def _reference(data: bytes, prev: int = 0) -> int:
    c = prev ^ 0xFFFFFFFF
    for b in data:
        c = _TABLE[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


@pytest.fixture(scope="module")
def kernel() -> native.NativeKernel:
    k = native.kernel()
    assert k is not None, "the extension must be built on this project's machines (make setup builds it)"
    return k


def _u8(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


@pytest.mark.parametrize("data, expected", [
    (b"123456789", 0xE3069283),
    (bytes(32), 0x8A9136AA),
    (b"\xff" * 32, 0x62A8AB43),
    (bytes(range(32)), 0x46DD794E),
    (bytes(range(31, -1, -1)), 0x113FDB5C),
    (b"", 0),
])
def test_published_check_values(kernel, data, expected):
    assert kernel.crc32c(_u8(data)) == expected
    assert _reference(data) == expected  # the reference below is right too


def test_the_instruction_is_used_where_the_cpu_has_it(kernel):
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if " sse4_2" in flags:
        assert kernel.crc32c_hardware
    elif not flags:
        pytest.skip("no /proc/cpuinfo to tell")


@pytest.mark.parametrize("seed", range(3))
def test_random_lengths_offsets_and_chaining_match_the_reference(kernel, seed):
    rng = random.Random(seed)
    lane = 8192
    lengths = [rng.randrange(0, 64), rng.randrange(8, 3 * lane), 3 * lane - 1, 3 * lane, 3 * lane + 1,
               6 * lane + rng.randrange(1, 4096), rng.randrange(3 * lane, 10 * lane)]
    for n in lengths:
        raw = rng.randbytes(n + 8)
        off = rng.randrange(0, 8)  # the bytes at any address, not only 8-byte aligned ones
        data = raw[off:off + n]
        t = _u8(raw)[off:off + n]
        want = _reference(data)
        assert kernel.crc32c(t) == want, (n, off)
        cut = rng.randrange(0, n + 1)
        assert kernel.crc32c(t[cut:], kernel.crc32c(t[:cut])) == want, (n, cut)


def test_one_changed_bit_anywhere_changes_it(kernel):
    data = bytearray(random.Random(7).randbytes(5 * 8192 + 11))
    base = kernel.crc32c(_u8(bytes(data)))
    for pos in (0, 8191, 8192, 3 * 8192 + 5, len(data) - 1):
        data[pos] ^= 0x10
        assert kernel.crc32c(_u8(bytes(data))) != base, pos
        data[pos] ^= 0x10


def test_bad_input_is_refused(kernel):
    with pytest.raises(RuntimeError, match="contiguous 1-D uint8"):
        kernel.crc32c(torch.zeros(16, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="contiguous 1-D uint8"):
        kernel.crc32c(torch.zeros(32, dtype=torch.uint8)[::2])
    with pytest.raises(RuntimeError, match="prev must be a 32-bit CRC"):
        kernel.crc32c(torch.zeros(4, dtype=torch.uint8), 1 << 32)
