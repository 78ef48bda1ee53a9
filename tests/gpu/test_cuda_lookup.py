"""The lookups on CUDA shards (one GPU, a one-rank NCCL group); skipped where there is no CUDA device.

Every layout a single rank can hold (several row blocks, several column
blocks, a grid, the whole table) against ``F.embedding_bag`` on the full
table on the same device: outputs and ``weight.grad``.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from torchrec_dtensor_bridge.layout import ShardLayout

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

SHAPE = (23, 12)
LAYOUTS = {
    "row_blocks": ShardLayout.row_wise(SHAPE, [7, 10, 6], ranks=[0, 0, 0]),
    "column_blocks": ShardLayout.column_wise(SHAPE, [5, 7], ranks=[0, 0]),
    "grid": ShardLayout.grid(SHAPE, [11, 12], [6, 6], [0, 0, 0, 0]),
    "whole": ShardLayout.table_wise(SHAPE, 0),
}


@pytest.fixture(scope="module")
def nccl_group():
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("nccl", init_method=f"file://{os.path.join(d, 'store')}", rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_cuda_lookup_parity(nccl_group, name, mode):
    from torch.distributed.device_mesh import init_device_mesh

    import torchrec_dtensor_bridge as tdb
    from torchrec_dtensor_bridge.convert import dtensor_from_local_shards

    dev = torch.device("cuda")
    layout = LAYOUTS[name]
    table = torch.randn(SHAPE, generator=torch.Generator().manual_seed(3)).to(dev)
    mesh = init_device_mesh("cuda", (1,))
    weight = dtensor_from_local_shards(layout, [table[s.slices()].clone() for s in layout.shards_on(0)],
                                       device_mesh=mesh).requires_grad_()
    ids = torch.randint(0, SHAPE[0], (30,), generator=torch.Generator().manual_seed(4)).to(dev)
    offsets = torch.tensor([0, 4, 4, 11, 20], device=dev)
    out = tdb.sharded_embedding_bag(ids, weight, offsets, mode=mode)
    full = table.clone().requires_grad_()
    ref = F.embedding_bag(ids, full, offsets, mode=mode)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    g = torch.linspace(-1, 1, ref.numel(), device=dev).view_as(ref)
    (out * g).sum().backward()
    (ref * g).sum().backward()
    torch.testing.assert_close(tdb.full_tensor(weight.grad), full.grad, rtol=1e-5, atol=1e-5)
