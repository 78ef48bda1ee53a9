"""A ``Replicate()`` DTensor input reads nothing of its batch back to the host per call (on an accelerator, each
read is a synchronisation) but the lookups' value check at their API edge, unless
``TORCH_DISTRIBUTED_DEBUG=DETAIL`` asks for the agreement that digests (copies) the batch.

* ``split_bags`` (max's fallback on layouts without a ``Partial("max")``) reads where a rank's share of the
  bags starts and ends in one read, none where both ends are known (a group of one, the batch's ends);
* ``check_replicated`` digests the batch under ``DETAIL`` only;
* whole lookups (forward and backward) on a group of one rank: one read, the value check's.
"""

from __future__ import annotations

import traceback

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from torchrec_dtensor_bridge.layout import ShardLayout
from torchrec_dtensor_bridge.lookup import dtensor_input
from torchrec_dtensor_bridge.lookup.arguments import Bags, TableCodes

from .host_reads import count_host_reads


def _bags(lengths: list[int], weights: bool = True) -> Bags:
    g = torch.Generator().manual_seed(len(lengths))
    n = sum(lengths)
    return Bags(torch.randint(0, 50, (n,), generator=g), torch.tensor(lengths, dtype=torch.int64),
                torch.rand(n, generator=g) if weights else None)


@pytest.mark.parametrize("lengths", [[2, 0, 3, 1, 4], [0, 0, 0], [3], []], ids=["bags", "empty_bags", "one", "none"])
@pytest.mark.parametrize("world", [1, 2, 3, 7])
def test_split_bags_reads_where_a_share_starts_and_ends_at_most_once(lengths, world, monkeypatch):
    bags = _bags(lengths)
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    chunks = [len(c) for c in torch.arange(len(lengths)).chunk(world)] if lengths else []
    chunks += [0] * (world - len(chunks))
    b0 = 0
    for rank in range(world):
        reads = count_host_reads(monkeypatch)
        mine = dtensor_input.split_bags(bags, world, rank)
        b1 = b0 + chunks[rank]
        known = {0, len(lengths)}
        assert len(reads) == (0 if {b0, b1} <= known else 1), (rank, reads)
        i0, i1 = starts[b0], starts[b1]
        assert torch.equal(mine.ids, bags.ids[i0:i1]) and torch.equal(mine.lengths, bags.lengths[b0:b1])
        assert mine.weights is not None and bags.weights is not None
        assert torch.equal(mine.weights, bags.weights[i0:i1])
        monkeypatch.undo()
        b0 = b1
    assert b0 == len(lengths)


def test_a_replicated_batch_is_digested_under_detail_only(monkeypatch):
    """Outside ``DETAIL``: no digest (a host copy of the batch), no agreement, nothing read; under it, ONE
    agreement carrying the digest."""
    agreed: list[int] = []
    monkeypatch.setattr(dtensor_input, "agree", lambda *a, digest, **k: agreed.append(digest))
    digests: list[Bags] = []
    digest = dtensor_input.batch_digest
    monkeypatch.setattr(dtensor_input, "batch_digest", lambda b: digests.append(b) or digest(b))
    bags = _bags([2, 1, 3])
    codes = [TableCodes.of(0, "sum", None, None, 2.0, (50, 4), torch.float32)]
    reads = count_host_reads(monkeypatch)
    dtensor_input.check_replicated("f", None, bags, codes, group=None)  # type: ignore[arg-type]
    assert digests == [] and agreed == [] and reads == []
    monkeypatch.setattr(dist, "get_debug_level", lambda: dist.DebugLevel.DETAIL)
    dtensor_input.check_replicated("f", None, bags, codes, group=None)  # type: ignore[arg-type]
    assert digests == [bags] and agreed == [digest(bags)]


def _lookup_reads(monkeypatch: pytest.MonkeyPatch, run) -> list[str]:
    """The reads ``run()`` makes from this package's code, as ``kind@module:line`` (reads of the device mesh, a
    CPU tensor by DeviceMesh's design, left out)."""
    reads = count_host_reads(monkeypatch)
    sites: list[str] = []
    seen = 0

    def where() -> None:
        nonlocal seen
        frames = [f for f in traceback.extract_stack()[:-2] if "torchrec_dtensor_bridge" in f.filename]
        for kind in reads[seen:]:
            at = frames[-1] if frames else None
            if at is not None and not at.filename.endswith("placements.py"):
                sites.append(f"{kind}@{at.filename.rsplit('torchrec_dtensor_bridge/', 1)[-1]}:{at.lineno}")
        seen = len(reads)

    for name in ("tolist", "item", "__int__", "__bool__", "__index__", "__float__"):
        counted = getattr(torch.Tensor, name)

        def located(self, *args, _counted=counted, **kwargs):  # type: ignore[no-untyped-def]
            out = _counted(self, *args, **kwargs)
            where()
            return out

        monkeypatch.setattr(torch.Tensor, name, located)
    run()
    monkeypatch.undo()
    return sites


LAYOUTS = {
    "replicated": ShardLayout.replicated((40, 8), [0]),
    "column_wise": ShardLayout.column_wise((40, 8), [4, 4], ranks=[0, 0]),
    "row_wise": ShardLayout.row_wise((40, 8), [20, 20], ranks=[0, 0]),
}


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_a_replicated_lookup_reads_only_the_value_check(one_rank, name, mode, monkeypatch):
    """A ``Replicate()`` lookup, forward and backward, outside ``DETAIL``: the batch is read once, by the value
    check at the API edge, and never digested (max on row cuts included: its fallback's split reads nothing on
    a group of one)."""
    import torchrec_dtensor_bridge as tdb
    from torchrec_dtensor_bridge.convert import dtensor_from_local_shards
    from torchrec_dtensor_bridge.convert.placements import world_mesh

    assert dist.get_debug_level() != dist.DebugLevel.DETAIL
    layout, mesh = LAYOUTS[name], world_mesh("cpu")
    table = torch.randn(40, 8, generator=torch.Generator().manual_seed(0))
    weight = dtensor_from_local_shards(layout, [table[s.slices()].clone() for s in layout.shards_on(0)],
                                       device_mesh=mesh).requires_grad_()
    ids = torch.randint(0, 40, (30,), generator=torch.Generator().manual_seed(1))
    offsets = torch.arange(0, 30, 3)
    digests: list[object] = []
    monkeypatch.setattr(dtensor_input, "batch_digest", lambda b: digests.append(b) or 0)

    def run() -> None:
        out = tdb.sharded_embedding_bag(DTensor.from_local(ids, mesh, [Replicate()]), weight,
                                        DTensor.from_local(offsets, mesh, [Replicate()]), mode=mode)
        assert isinstance(out, DTensor)
        out.to_local().sum().backward()

    sites = _lookup_reads(monkeypatch, run)
    assert digests == [], "the batch digested outside DETAIL"
    assert len(sites) == 1 and sites[0].startswith("tolist@lookup/arguments.py"), sites
    ref = torch.nn.functional.embedding_bag(ids, table, offsets, mode=mode)
    got = tdb.sharded_embedding_bag(DTensor.from_local(ids, mesh, [Replicate()]), weight,
                                    DTensor.from_local(offsets, mesh, [Replicate()]), mode=mode)
    torch.testing.assert_close(got.full_tensor(), ref)
