"""Fixtures of the one-process tests that run lookups, and of the fake-CUDA modules."""

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


@pytest.fixture(scope="session")
def fake_cuda_results(request: pytest.FixtureRequest) -> dict[str, dict[str, str | None]]:
    """The results of the fake-CUDA checks of every test module of this session that asks for them (by module
    import name, then check name), run in one subprocess (``test_fake_cuda.subprocess_results``): the modules
    the session selected tests of, and those alone."""
    from .test_fake_cuda import subprocess_results

    modules = sorted({item.module.__name__ for item in request.session.items
                      if "fake_cuda_results" in getattr(item, "fixturenames", ()) and getattr(item, "module", None)})
    return subprocess_results(modules)
