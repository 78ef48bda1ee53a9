"""How many of the package's files one training step runs through (2 gloo ranks).

A profile hook (``sys.setprofile``) records, on every rank, the file of every Python function the package
runs during one forward + backward of one table with a ``FusedOptimizer``, after a warm-up step (so that
one-time work - caches, first imports - is not counted). A step should read as one way
down: the public function, the shared entry path, the strategy of the table's layout, the local kernel
calls, the optimizer. Modules only another strategy needs must not run.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import torchrec_dtensor_bridge as tdb
from torchrec_dtensor_bridge.convert import dtensor_from_local_shards
from torchrec_dtensor_bridge.layout import ShardLayout

from .harness import make_pool_fixture

pool = make_pool_fixture(2)

PKG = Path(tdb.__file__).parent
SHAPE = (64, 16)
LAYOUTS = {
    "table_wise": ShardLayout.table_wise(SHAPE, 1),
    "row_wise_uneven": ShardLayout.row_wise(SHAPE, [40, 24]),
}
MAX_LOOKUP_FILES = 5
MAX_FILES = 18


def _files_of_one_step(rank: int, world: int, layout_name: str) -> list[str]:
    layout = LAYOUTS[layout_name]
    table = torch.randn(SHAPE, generator=torch.Generator().manual_seed(0))
    shards = [table[s.slices()].clone() for s in layout.shards_on(rank)]
    weight = dtensor_from_local_shards(layout, shards).requires_grad_()
    opt = tdb.FusedOptimizer({"t": weight}, "rowwise_adagrad", lr=0.1, eps=1e-8)
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, SHAPE[0], (24,), generator=g)
    offsets = torch.arange(0, 24, 3)

    def step() -> None:
        out = tdb.sharded_embedding_bag(ids, weight, offsets, mode="sum", optimizer=opt)
        out.sum().backward()

    step()  # warm-up
    seen: set[str] = set()
    root = str(PKG)

    def hook(frame, event, arg) -> None:  # noqa: ANN001 - sys.setprofile's signature
        if event == "call":
            name = frame.f_code.co_filename
            if name.startswith(root):
                seen.add(str(Path(name).relative_to(PKG)))

    sys.setprofile(hook)
    try:
        step()
    finally:
        sys.setprofile(None)
    return sorted(seen)


@pytest.mark.parametrize("layout_name", sorted(LAYOUTS))
def test_one_step_runs_through_few_files(pool, layout_name):
    per_rank = pool.run(_files_of_one_step, layout_name)
    for rank, files in enumerate(per_rank):
        lookup = [f for f in files if f.startswith("lookup/")]
        report = f"rank {rank}, {layout_name}: {len(files)} files: {files}"
        assert len(lookup) <= MAX_LOOKUP_FILES, report
        assert len(files) <= MAX_FILES, report
        if layout_name == "table_wise":
            assert not any("rows" in Path(f).stem for f in lookup), report
