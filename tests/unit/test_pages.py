"""``_pages.release``: the whole pages inside a tensor's bytes go back to the system; its neighbours keep theirs."""

from __future__ import annotations

import mmap
import sys

import pytest
import torch

from torchrec_dtensor_bridge._pages import release


def _rss() -> int:
    for line in open("/proc/self/status").read().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise KeyError("VmRSS")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise(MADV_DONTNEED) is Linux's")
def test_a_part_of_a_buffer_reads_zeros_and_its_memory_is_returned():
    flat = torch.arange(16 << 18, dtype=torch.float32) + 1  # 16 MiB, every value non-zero
    keep = flat.clone()
    part = flat[1000:(12 << 18) + 1000]  # 12 MiB starting inside a page
    rss = _rss()
    released = release(part)
    assert rss - _rss() >= released - (1 << 20) and released >= (12 << 20) - 2 * mmap.PAGESIZE, (released, rss)
    page = mmap.PAGESIZE // 4  # float32 values a page
    first = -(-(flat.data_ptr() + 4000) // mmap.PAGESIZE) * mmap.PAGESIZE
    lead = (first - flat.data_ptr()) // 4  # the first value of the first released page
    assert torch.equal(flat[:lead], keep[:lead]), "values before the first whole page changed"
    assert not flat[lead:lead + released // 4].any(), "a released page does not read zeros"
    assert torch.equal(flat[lead + released // 4:], keep[lead + released // 4:]), "values after the part changed"
    assert lead - 1000 < page
    part.copy_(keep[1000:(12 << 18) + 1000])  # written again: the pages come back with the values
    assert torch.equal(flat, keep)


def test_what_cannot_be_released_is_left_as_it_is():
    small = torch.ones(100)  # no whole page inside
    assert release(small) == 0 and bool(small.eq(1).all())
    strided = torch.ones(4096, 8)[:, 0]
    assert release(strided) == 0 and bool(strided.eq(1).all())
    assert release(torch.empty(0)) == 0
