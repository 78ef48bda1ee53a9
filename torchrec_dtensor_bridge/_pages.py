"""Memory a tensor's values no longer need given back to the system while its storage stays allocated.

A storage shared by many tables (fbgemm keeps all of one kernel's tables in one buffer) can only be freed
whole; :func:`release` returns the pages of one table's part of it as soon as that part is no longer read:
Linux ``madvise(MADV_DONTNEED)`` over the whole pages inside the part's bytes. The pages stay mapped, read
as zeros, and are provided afresh when written again. Elsewhere (another system, memory not on the CPU) it
releases nothing.
"""

from __future__ import annotations

import ctypes
import mmap

import torch

__all__ = ["release"]

_PAGE = mmap.PAGESIZE
_DONTNEED = getattr(mmap, "MADV_DONTNEED", None)
_madvise = None
if _DONTNEED is not None:
    try:
        _madvise = ctypes.CDLL(None, use_errno=True).madvise
        _madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _madvise.restype = ctypes.c_int
    except (OSError, AttributeError):
        _madvise = None


def release(t: torch.Tensor) -> int:
    """Give the whole pages inside contiguous CPU tensor ``t``'s bytes back to the system; ``t`` then reads
    as zeros there (the bytes of pages it shares with its neighbours at either end are kept). Returns the
    bytes released (0 where the system cannot)."""
    if _madvise is None or t.device.type != "cpu" or not t.is_contiguous() or not t.numel():
        return 0
    start = t.data_ptr()
    first = -(-start // _PAGE) * _PAGE
    end = (start + t.numel() * t.element_size()) // _PAGE * _PAGE
    if end <= first:
        return 0
    if _madvise(first, end - first, _DONTNEED) != 0:
        return 0  # the memory stays as it is: correct, only held longer
    return end - first
