"""Per-row digests of the blocks a save writes: what lets an incremental save find the rows that changed.

A save records, for every block of every tensor it writes (a rank's shard, or a
whole tensor), one digest per row (per dim-0 slice; a 0-d tensor is one row):

* rows of at most 8 bytes (1-D row state, one value per row) are their own
  digest: the bytes themselves, exact;
* longer rows get a 64-bit digest (:func:`row_digests`), 8 bytes per row: 1.6 %
  of a 128-wide fp32 table.

An incremental save computes the digests of the memory it saves and compares
them with the base's: a row whose digest differs is written, every other row
is the base's. Nothing of the base's data is read.

The digest of a row of ``n`` bytes, read as ``ceil(n / 8)`` little-endian
64-bit words ``w`` (the last one zero-padded), is ``mix(sum_i mix(w[i] + (i+1) G) ^ n)``
modulo 2**64 (``mix``: splitmix64's finaliser, ``G`` the golden-ratio constant).
Each word goes through a bijective mixer before the sum, so a changed row keeps
its digest only by a 2**-64 accident. ``csrc/row_digests.c`` computes it at memory
speed (in the package's built extension, :mod:`...kernels.native`; 64-bit lanes of
AVX-512 where the machine has them: ~10 GB/s a core on the development machine),
split over torch's intra-op threads; without the extension (a pure-Python install)
the same numbers come from torch ops, about ten times slower.

Example::

    >>> d = row_digests(torch.zeros(4, 128))   # int64 [4]
    >>> changed_rows(d, d.clone())             # tensor([], dtype=torch.int64)
"""

from __future__ import annotations

import torch

from ...kernels import native

__all__ = ["DIGEST_BYTES", "digest_width", "row_digests"]

DIGEST_BYTES = 8
"""Bytes of one row's digest for rows longer than that (shorter rows are their own digest)."""

_G = 0x9E3779B97F4A7C15
_C1 = 0xBF58476D1CE4E5B9
_C2 = 0x94D049BB133111EB
_CHUNK_BYTES = 1 << 20  # rows hashed at once by the torch fallback (cache-sized temporaries)


def _signed(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


def digest_width(row_bytes: int) -> int:
    """Bytes of one row's digest: the row itself up to 8 bytes, else :data:`DIGEST_BYTES`."""
    return row_bytes if row_bytes <= DIGEST_BYTES else DIGEST_BYTES


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` (contiguous rows, on its device) as a ``[rows, row_bytes]`` uint8 view (a 0-d tensor: one row)."""
    t = t.detach()
    n = t.shape[0] if t.dim() else 1
    width = t[0].numel() if t.dim() and n else (1 if not t.dim() else int(torch.Size(t.shape[1:]).numel()))
    rows = t.reshape(n, width)
    if rows.numel() and (rows.stride(-1) != 1 or rows.stride(0) != width):
        rows = rows.contiguous()
    return rows.view(torch.uint8) if rows.dtype != torch.uint8 else rows


def _mix(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 (wrapping, logical shifts)."""
    z ^= (z >> 30) & ((1 << 34) - 1)
    z.mul_(_signed(_C1))
    z ^= (z >> 27) & ((1 << 37) - 1)
    z.mul_(_signed(_C2))
    z ^= (z >> 31) & ((1 << 33) - 1)
    return z


def _torch_digests(rows: torch.Tensor) -> torch.Tensor:
    n, nbytes = rows.shape
    words = -(-nbytes // 8)
    out = torch.empty(n, dtype=torch.int64, device=rows.device)
    pos = torch.arange(1, words + 1, dtype=torch.int64, device=rows.device) * _signed(_G)
    step = max(1, _CHUNK_BYTES // max(nbytes, 1))
    for a in range(0, n, step):
        part = rows[a : a + step]
        if nbytes % 8:
            part = torch.nn.functional.pad(part, (0, words * 8 - nbytes))
        w = part.contiguous().view(torch.int64) + pos
        h = _mix(w).sum(1) ^ nbytes
        out[a : a + step] = _mix(h)
    return out


def row_digests(t: torch.Tensor) -> torch.Tensor:
    """One digest per row (dim-0 slice) of ``t``, on the CPU: ``int64 [rows]`` for rows longer than 8 bytes, else
    the rows' own bytes, ``uint8 [rows, row_bytes]``. A 0-d tensor is one row. A table on a GPU is digested
    there (torch ops): only the digests come to the host."""
    rows = _as_rows(t)
    n, nbytes = rows.shape
    if nbytes <= DIGEST_BYTES:
        return rows.cpu().clone() if rows.device.type == "cpu" else rows.cpu()
    kernel = native.kernel() if rows.device.type == "cpu" else None  # on a GPU: torch ops where the rows are
    if kernel is None:
        return _torch_digests(rows).cpu()
    return kernel.row_digests(rows)  # split over torch's intra-op threads, on row boundaries
