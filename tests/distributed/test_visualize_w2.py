"""``visualize_sharding(print=True)`` prints once (global rank 0), ``print="all"`` on every rank; the returned
picture is the same on every rank either way (2 gloo ranks)."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch
from torch.distributed.tensor import Shard, distribute_tensor

import torchrec_dtensor_bridge as tdb
from torchrec_dtensor_bridge.convert.placements import world_mesh

from .harness import make_pool_fixture

pool = make_pool_fixture(2)


def printed(rank: int, world: int, how: object) -> tuple[str, str]:
    dt = distribute_tensor(torch.zeros(6, 4), world_mesh("cpu"), [Shard(0)])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        text = tdb.visualize_sharding(dt, name="t", print=how)
    return text, out.getvalue()


@pytest.mark.parametrize("how,printers", [(True, [0]), ("all", [0, 1]), (False, [])])
def test_pictures_print_once_unless_asked(pool, how, printers):
    got = pool.run(printed, how)
    assert got[0][0] == got[1][0] and "t" in got[0][0]
    for rank, (text, out) in enumerate(got):
        assert out == (text + "\n" if rank in printers else ""), (how, rank, out)


def test_print_must_be_a_known_value():
    with pytest.raises(ValueError, match="print must be True, False or 'all', got 'yes'"):
        tdb.visualize_sharding(tdb.ShardLayout.row_wise((4, 2), 2), print="yes")
