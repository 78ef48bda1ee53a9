"""The process group of the CUDA tests: one per test module, a one-rank group over a file store (NCCL for CUDA
tensors, gloo for CPU ones). Only tests skipped without a CUDA device ask for it."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist


@pytest.fixture(scope="module")
def groups() -> Iterator[None]:
    torch.cuda.set_device(0)
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("cpu:gloo,cuda:nccl", init_method=f"file://{os.path.join(d, 'store')}", rank=0,
                                world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()
