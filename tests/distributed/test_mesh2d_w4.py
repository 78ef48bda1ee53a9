"""2-D meshes on 4 gloo ranks: TorchRec's 2-D parallelism (sharding groups x replica groups).

``DMPCollection`` refuses CPU (``AssertionError: DMPCollection only supports
CUDA or MTIA``), so the module is sharded by TorchRec itself under the
``ShardingEnv2D`` and the plan remapping ``DMPCollection`` would use
(``torchrec_models.shard_ebc_2d``): its state_dict holds TorchRec's own 2-D
DTensors, mesh ``("replicate", "shard")``, placements ``(Replicate(), ...)``.
Checked against an unsharded ``EmbeddingBagCollection``: values and forward.
"""

from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate

import torchrec_dtensor_bridge as tdb

from .checks import reference_table
from .harness import make_pool_fixture
from .torchrec_models import TABLES, build_ebc, check_module, fill_module, shard_ebc, shard_ebc_2d

pool = make_pool_fixture(4)

# Every sharding type; rows scaled so that the tables' bytes dominate the files' overhead.
TABLES_2D = {n: (rows * 40, dim, kind) for n, (rows, dim, kind) in TABLES.items()}
# TorchRec cannot build a 2-D module where a rank of a 4-rank sharding group holds no shard
# of a table (``RuntimeError: ('Found shape:None, stride:(torch.Size([0, 0]), (0, 1)).'`` in
# its ``_initialize_torch_state``), and its table-row-wise tables on a 1 x 4 mesh hold half
# of the rows (the wrappers' offsets cover 1760 of 3520 elements): the 1 x 4 module cuts
# every table on all 4 ranks, row-wise or column-wise.
WIDE = {"t_rw": "row_wise", "t_tw": "row_wise", "t_cw": "column_wise", "t_trw": "row_wise",
        "t_twc": "column_wise", "t_dp": "data_parallel"}
ONE_RANK = {n: ("table_wise_rank0" if k != "data_parallel" else k) for n, (_, _, k) in TABLES_2D.items()}


def _key(name):
    return f"embedding_bags.{name}.weight"


def _tables(seed):
    return {_key(n): reference_table((r, d), seed=seed + i) for i, (n, (r, d, _)) in enumerate(TABLES_2D.items())}


def _two_d(replicas, seed, kinds=None):
    module, mesh = shard_ebc_2d(build_ebc(TABLES_2D, seed), replicas, TABLES_2D, kinds)
    return module, mesh


def _data_bytes(path):
    return sum(p.stat().st_size for p in Path(path).rglob("*.distcp"))


def _check_2d_dtensors(rank, module, mesh, tables):
    check_module(TABLES_2D, module, tables, rank, "2x2 module")
    sd = module.state_dict()
    replica_peer = [r for r in mesh["replicate"].mesh.tolist() if r != rank][0]
    for key, table in tables.items():
        dt = sd[key]
        if not isinstance(dt, DTensor):
            continue  # data parallel: a plain tensor, as in 1-D
        assert dt.device_mesh.ndim == 2 and dt.placements[0] == Replicate(), (key, dt.placements)
        lay = tdb.layout_of(dt, name=key)
        # every block is held by both replicas, and the unique blocks tile the table once
        assert len(lay.shards) == 2 * len(lay.unique_shards()), (key, lay)
        assert {s.offsets for s in lay.shards_on(rank)} == {s.offsets for s in lay.shards_on(replica_peer)}, key
        assert sum(s.numel for s in lay.unique_shards()) == table.numel(), key
        md = tdb.storage_metadata(dt)
        assert sum(c.sizes.numel() for c in md.chunks) == table.numel(), (key, md.chunks)
        assert torch.equal(tdb.full_tensor(dt), table), key
        picture = tdb.visualize_sharding(dt, name=key)
        assert str(replica_peer) in picture and str(rank) in picture, picture
        # a lookup on the 2-D table (its layout attached once, zero-copy): every rank its own batch, the
        # unsharded result
        ids = torch.randint(0, table.shape[0], (11,), generator=torch.Generator().manual_seed(rank))
        offsets = torch.tensor([0, 4, 4, 9])
        attached = tdb.to_dtensor(dt, name=key)
        assert attached.placements == dt.placements and attached.device_mesh == dt.device_mesh
        got = tdb.sharded_embedding_bag(ids, attached, offsets, mode="sum")
        torch.testing.assert_close(got, F.embedding_bag(ids, table, offsets, mode="sum"))


def _check_checkpoint_2d(rank, world_size, root):
    tables = _tables(seed=20)
    source, mesh = _two_d(2, seed=1)
    fill_module(source, tables)
    _check_2d_dtensors(rank, source, mesh, tables)
    tdb.checkpoint.save(source.state_dict(), f"{root}/2x2")
    if rank == 0:
        unique = sum(t.numel() * t.element_size() for t in tables.values())
        written = _data_bytes(f"{root}/2x2")
        # once per block, not once per replica (which would be 2x)
        assert unique <= written < 1.25 * unique, (written, unique)
    dist.barrier()
    # 2 replicas x 2 shards -> 1 x 4
    wide, _ = _two_d(1, seed=2, kinds=WIDE)
    tdb.checkpoint.load(wide.state_dict(), f"{root}/2x2")
    check_module(TABLES_2D, wide, tables, rank, "1x4 module from 2x2")
    # 2-D -> 1-D on one rank (every table on rank 0)
    one, _ = shard_ebc(build_ebc(TABLES_2D, 3), world_size, TABLES_2D, ONE_RANK)
    tdb.checkpoint.load(tdb.state_dict_to_dtensor(one.state_dict()), f"{root}/2x2")
    check_module(TABLES_2D, one, tables, rank, "one-rank 1-D module from 2x2")
    # 1-D (4 ranks, every sharding type) -> 2 x 2
    tables = _tables(seed=30)
    flat, _ = shard_ebc(build_ebc(TABLES_2D, 4), world_size, TABLES_2D)
    fill_module(flat, tables)
    tdb.checkpoint.save(tdb.state_dict_to_dtensor(flat.state_dict()), f"{root}/1d")
    target, _ = _two_d(2, seed=5)
    tdb.checkpoint.load(target.state_dict(), f"{root}/1d")
    check_module(TABLES_2D, target, tables, rank, "2x2 module from 1-D")
    # 2-D 1x4 -> 2-D 2x2
    tdb.checkpoint.save(wide.state_dict(), f"{root}/1x4")
    back, _ = _two_d(2, seed=6)
    tdb.checkpoint.load(back.state_dict(), f"{root}/1x4")
    check_module(TABLES_2D, back, _tables(seed=20), rank, "2x2 module from 1x4")


def test_2d_dtensors_and_checkpoints_across_2d_and_1d(pool, tmp_path):
    """TorchRec's 2-D DTensors through full_tensor, storage_metadata, visualize_sharding and a
    lookup; a checkpoint writes each block once and loads 2x2 -> 1x4 -> one rank, 1-D -> 2x2,
    1x4 -> 2x2."""
    pool.run(_check_checkpoint_2d, str(tmp_path))
