"""Per-rank checks shared by the distributed test modules (run inside harness workers)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, init_from_local_shards
from torch.distributed.tensor import DTensor

import torchrec_dtensor_bridge as tdb
from torchrec_dtensor_bridge.layout import ShardLayout


def reference_table(shape: tuple[int, ...], dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    """A table whose every element is distinct, the same on every rank."""
    n = 1
    for d in shape:
        n *= d
    return (torch.arange(n, dtype=torch.float64) + 1000 * seed).to(dtype).reshape(shape)


def build_sharded_tensor(layout: ShardLayout, table: torch.Tensor, rank: int) -> ShardedTensor:
    """A real ShardedTensor built by torch (collective), holding ``layout``'s blocks of ``table``."""
    local = [
        Shard(
            tensor=table[s.slices()].clone(),
            metadata=ShardMetadata(list(s.offsets), list(s.sizes), f"rank:{rank}/cpu"),
        )
        for s in layout.shards_on(rank)
    ]
    return init_from_local_shards(local, *table.shape)


def st_signature(st: ShardedTensor) -> list[tuple]:
    return [
        (tuple(m.shard_offsets), tuple(m.shard_sizes), str(m.placement)) for m in st.metadata().shards_metadata
    ]


def check_roundtrip(st: ShardedTensor, table: torch.Tensor, name: str = "table") -> DTensor:
    """to_dtensor / full_tensor / to_sharded_tensor / storage_metadata on a real ShardedTensor."""
    rank = dist.get_rank()
    dt = tdb.to_dtensor(st)
    assert isinstance(dt, DTensor), type(dt)
    assert dt.shape == table.shape and dt.stride() == table.stride(), (dt.shape, dt.stride())
    assert dt.dtype == table.dtype
    # zero-copy: the DTensor's local shards are the ShardedTensor's tensors
    st_ptrs = sorted(s.tensor.data_ptr() for s in st.local_shards() if s.tensor.numel())
    local = dt.to_local()
    dt_shards = local.local_shards() if isinstance(local, tdb.LocalShardsWrapper) else (
        [local] if dt.device_mesh.get_coordinate() is not None else []
    )
    assert sorted(t.data_ptr() for t in dt_shards if t.numel()) == st_ptrs, f"{name}: copy made on rank {rank}"
    full = tdb.full_tensor(dt)
    assert torch.equal(full, table), f"{name}: full_tensor(DTensor) differs on rank {rank}"
    assert torch.equal(tdb.full_tensor(st), table), f"{name}: full_tensor(ShardedTensor) differs"
    back = tdb.to_sharded_tensor(dt)
    assert st_signature(back) == st_signature(st), (st_signature(back), st_signature(st))
    assert back.size() == st.size() and back.dtype == st.dtype
    # same storage; the order of local shards follows the metadata (torch may keep another order)
    assert sorted(s.tensor.data_ptr() for s in back.local_shards()) == sorted(
        s.tensor.data_ptr() for s in st.local_shards()
    )
    for s in back.local_shards():  # and each tensor sits at its own offsets
        want = table[tuple(slice(o, o + z) for o, z in zip(s.metadata.shard_offsets, s.metadata.shard_sizes))]
        assert torch.equal(s.tensor, want), (s.metadata, name)
    md = tdb.storage_metadata(dt)
    boxes = sorted((tuple(c.offsets), tuple(c.sizes)) for c in md.chunks)
    want = sorted(
        (tuple(m.shard_offsets), tuple(m.shard_sizes))
        for m in st.metadata().shards_metadata
        if all(m.shard_sizes)
    )
    assert boxes == want, (boxes, want)
    assert tuple(md.size) == tuple(table.shape)
    return dt


def check_layout(rank: int, world_size: int, layout: ShardLayout, dtype: torch.dtype = torch.float32) -> str:
    """Build a real ShardedTensor for ``layout`` and run every round-trip check; return the picture."""
    table = reference_table(layout.global_shape, dtype)
    st = build_sharded_tensor(layout, table, rank)
    dt = check_roundtrip(st, table, layout.name)
    return tdb.visualize_sharding(dt, name=layout.name)


def expect_raises(exc: type[Exception], match: str, fn) -> None:
    """``fn()`` raises ``exc`` whose message contains ``match`` (called on every rank of a test, each with
    the message it must see: the shared check that a refused collective call raises everywhere)."""
    try:
        fn()
    except exc as e:
        assert match in str(e), (match, str(e))
        return
    except Exception as e:  # noqa: BLE001 - report the wrong kind
        raise AssertionError(f"expected {exc.__name__} matching {match!r}, got {type(e).__name__}: {e}") from e
    raise AssertionError(f"expected {exc.__name__} matching {match!r}, nothing raised")


def layouts_w2(shape: tuple[int, int] = (12, 8)) -> dict[str, ShardLayout]:
    """Every layout family on 2 ranks, for one ``(rows, cols)`` table: the distributed tests' shared table
    (rows and columns of ``(12, 8)`` cut so that every block is non-empty)."""
    return {
        "replicated": ShardLayout.replicated(shape, [0, 1]),
        "row_wise": ShardLayout.row_wise(shape, 2),
        "row_wise_two_per_rank": ShardLayout.row_wise(shape, [3, 3, 4, 2], ranks=[0, 1, 0, 1]),
        "grid": ShardLayout.grid(shape, [5, 7], [3, 5], [0, 1, 1, 0]),
        "column_wise": ShardLayout.column_wise(shape, 2),
        "column_wise_uneven": ShardLayout.column_wise(shape, [3, 5]),
        "column_wise_two_per_rank": ShardLayout.column_wise(shape, [2, 2, 3, 1], ranks=[0, 1, 1, 0]),
        "table_wise": ShardLayout.table_wise(shape, 1),
    }
