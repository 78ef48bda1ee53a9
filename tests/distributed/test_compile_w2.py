"""``torch.compile`` of a small model around the lookups (2 gloo ranks): the lookups are a graph break (their
collectives and id routing stay eager), the layers around them compile, and the results equal eager - the
forward under ``no_grad`` and a training step's gradients, for row-wise, table-wise and column-wise tables."""

from __future__ import annotations

import re

import pytest
import torch

import torchrec_dtensor_bridge as tdb
from torchrec_dtensor_bridge.convert import dtensor_from_local_shards
from torchrec_dtensor_bridge.convert.placements import world_mesh
from torchrec_dtensor_bridge.wrapper import LocalShardsWrapper

from .harness import make_pool_fixture

pool = make_pool_fixture(2)

SHAPE = (50, 8)
LAYOUTS = {
    "row_wise_uneven": tdb.ShardLayout.row_wise(SHAPE, [20, 30]),
    "table_wise": tdb.ShardLayout.table_wise(SHAPE, 1),
    "column_wise_uneven": tdb.ShardLayout.column_wise(SHAPE, [3, 5]),
}


def _weight(layout: tdb.ShardLayout, full: torch.Tensor, rank: int) -> torch.Tensor:
    shards = [full[s.offsets[0] : s.offsets[0] + s.sizes[0], s.offsets[1] : s.offsets[1] + s.sizes[1]].clone()
              for s in layout.shards_on(rank)]
    return dtensor_from_local_shards(layout, shards, device_mesh=world_mesh("cpu"))


def check_compiled_equals_eager(rank: int, world: int, name: str) -> None:
    torch.manual_seed(0)
    full = torch.randn(SHAPE)
    lin = torch.nn.Linear(SHAPE[1], 3)
    ids = torch.randint(0, SHAPE[0], (12,), generator=torch.Generator().manual_seed(rank))
    offsets = torch.arange(0, 12, 3)
    weights = [_weight(LAYOUTS[name], full, rank).requires_grad_() for _ in range(2)]

    def model(w: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return lin(torch.relu(tdb.sharded_embedding_bag(ids, w, offsets, mode="sum")))

    compiled = torch.compile(model)
    with torch.no_grad():
        assert torch.allclose(compiled(weights[0], ids, offsets), model(weights[0], ids, offsets)), name
    grads = []
    for w, fn in zip(weights, (model, compiled)):
        lin.zero_grad()
        fn(w, ids, offsets).square().sum().backward()
        grads.append((tdb.full_tensor(w.grad), lin.weight.grad.clone()))
    torch.testing.assert_close(grads[1][0], grads[0][0], msg=lambda m: f"{name}: weight grad: {m}")
    torch.testing.assert_close(grads[1][1], grads[0][1], msg=lambda m: f"{name}: linear grad: {m}")


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_compiled_model_equals_eager(pool, name):
    pool.run(check_compiled_equals_eager, name)



def _shards(t: torch.Tensor) -> list[torch.Tensor]:
    local = t._local_tensor  # type: ignore[attr-defined]
    assert isinstance(local, LocalShardsWrapper), type(local)
    return local.local_shards()


def check_dtensor_over_wrapper_passes_compile(rank: int, world: int, name: str) -> None:
    """A DTensor whose local tensor is our wrapper (every layout here: a rank holding nothing has an empty
    one) through compiled functions: what eager computes, compiled computes; what eager refuses, compiled
    refuses with the same error. Under inductor it crashed the process (SIGSEGV: the wrapper was compiled as a
    dense tensor, its missing data read); the values are compared under ``aot_eager`` (the same flatten and
    tracing through the wrapper's ops, without inductor's C++ build)."""
    from torch._inductor import config as inductor_config

    full = torch.randn(SHAPE, generator=torch.Generator().manual_seed(1))
    weight = _weight(LAYOUTS[name], full, rank)
    eager = weight.clone().mul_(2)
    compiled = torch.compile(lambda x: x.clone().mul_(2), backend="aot_eager")(weight)
    assert [s.shape for s in _shards(compiled)] == [s.shape for s in _shards(eager)], name
    assert all(torch.equal(a, b) for a, b in zip(_shards(compiled), _shards(eager))), name
    torch.testing.assert_close(tdb.full_tensor(compiled), full * 2)
    # out-of-place ops compiled: the same blocks at the same offsets (flatten / unflatten keeps them)
    eager = weight * 2 + weight.sin()
    compiled = torch.compile(lambda x: x * 2 + x.sin(), backend="aot_eager")(weight)
    assert _offsets(compiled) == _offsets(eager) == _offsets(weight), (name, _offsets(compiled), _offsets(eager))
    assert tdb.layout_of(compiled).shards == LAYOUTS[name].shards, name
    torch.testing.assert_close(tdb.full_tensor(compiled), full * 2 + full.sin())
    # what eager refuses (a cumulative sum along a dim the rank's blocks do not span whole), compiled refuses
    along = 1 - (LAYOUTS[name].nearest_shard_dim or 0)
    with pytest.raises(NotImplementedError) as refused:
        torch.cumsum(weight, along)
    with inductor_config.patch(force_disable_caches=True):  # a graph cached before flatten would crash
        with pytest.raises(NotImplementedError, match=re.escape(str(refused.value).split(";")[0][:60])):
            torch.compile(lambda x: torch.cumsum(x, along))(weight)


def _offsets(t: torch.Tensor) -> list[list[int]]:
    return [list(o) for o in t._local_tensor.local_offsets()]  # type: ignore[attr-defined]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_dtensor_over_wrapper_passes_compile(pool, name):
    pool.run(check_dtensor_over_wrapper_passes_compile, name)
