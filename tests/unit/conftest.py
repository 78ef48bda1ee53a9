"""Fixtures of the one-process tests that run lookups."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch.distributed as dist

from torchrec_dtensor_bridge.kernels import choose


@pytest.fixture(scope="module")
def one_rank() -> Iterator[None]:
    """A default group of one rank (gloo), for a module's lookups."""
    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def own_kernel_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel choices a module's lookups settle (their agreements, some under a forced implementation) stay
    in that module: later tests' direct op calls choose afresh (``pytestmark = usefixtures(...)``)."""
    monkeypatch.setattr(choose, "_agreed", {})
    monkeypatch.setattr(choose, "_settled", {})
