"""TorchRec interop both ways, on real sharded modules (2 gloo ranks).

Our DTensors load through TorchRec's OWN ``load_state_dict`` of a DMP built
with ``ShardingEnv(..., output_dtensor=True)`` and of a default (ShardedTensor)
one, for every sharding type; TorchRec's own DTensors go through our whole API.
Every module is checked against an unsharded ``EmbeddingBagCollection``
holding the same tables: values (``torch.equal``) and forward output.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.tensor import DTensor, Shard

import torchrec_dtensor_bridge as tdb
from torchrec_dtensor_bridge.convert import local_shards_of

from .checks import reference_table, st_signature
from .harness import make_pool_fixture
from .torchrec_models import TABLES, build_ebc, check_module, fill_module, shard_ebc

pool = make_pool_fixture(2)

# Every sharding type, plus an evenly split row-wise table (exactly ``Shard(0)``: the
# case where a plain local tensor used to reach TorchRec's hook) and a table-wise
# table on rank 0 as well as the one on the last rank.
INTEROP = dict(TABLES, t_rwe=(10, 4, "row_wise"), t_tw0=(5, 8, "table_wise"))
PLANS = dict({n: k for n, (_, _, k) in INTEROP.items()}, t_tw0="table_wise_rank0")
# The same tables under another plan (for checkpoints that reshard).
OTHER = {n: "row_wise" if k != "data_parallel" else k for n, (_, _, k) in INTEROP.items()}


def _key(name):
    return f"embedding_bags.{name}.weight"


def _tables(seed=100):
    return {_key(n): reference_table((r, d), seed=seed + i) for i, (n, (r, d, _)) in enumerate(INTEROP.items())}


def _module(seed, *, output_dtensor=False, plan=None):
    sharded, _ = shard_ebc(build_ebc(INTEROP, seed), dist.get_world_size(), INTEROP, plan or PLANS,
                           output_dtensor=output_dtensor)
    return sharded


def _check_torchrec_loads_ours(rank, world_size, output_dtensor):
    tables = _tables()
    source = _module(1)
    fill_module(source, tables)
    st_sd = source.state_dict()
    ours = tdb.state_dict_to_dtensor(st_sd)
    for key, value in ours.items():
        if isinstance(st_sd[key], ShardedTensor):
            # TorchRec's hook reads the wrapper; it is still the module's own storage.
            assert isinstance(value._local_tensor, tdb.LocalShardsWrapper), (key, type(value._local_tensor))
            assert sorted(t.data_ptr() for t in local_shards_of(value)) == sorted(
                s.tensor.data_ptr() for s in st_sd[key].local_shards()
            ), f"{key}: a copy was made on rank {rank}"
        else:
            assert value is st_sd[key]  # data parallel: the plain tensor, as TorchRec keeps it
    target = _module(2, output_dtensor=output_dtensor)
    kinds = {type(v) for v in target.state_dict().values()}
    assert (DTensor in kinds) == output_dtensor and (ShardedTensor in kinds) != output_dtensor, kinds
    result = target.load_state_dict(ours)  # TorchRec's own load_state_dict, no hook of ours
    assert not result.missing_keys and not result.unexpected_keys, result
    check_module(INTEROP, target, tables, rank, f"output_dtensor={output_dtensor} target")
    check_module(INTEROP, source, tables, rank, "source after the load")  # the source is unchanged


@pytest.mark.parametrize("output_dtensor", [True, False], ids=["dtensor_module", "sharded_tensor_module"])
def test_torchrec_load_state_dict_takes_our_dtensors(pool, output_dtensor):
    pool.run(_check_torchrec_loads_ours, output_dtensor)


def _check_our_api_on_torchrec_dtensors(rank, world_size):
    tables = _tables(seed=200)
    native = _module(3, output_dtensor=True)
    fill_module(native, tables)
    sd = native.state_dict()
    reference = _module(4)  # the same plan, ShardedTensor state_dict
    st_sd = reference.state_dict()
    for key, table in tables.items():
        dt = sd[key]
        if not isinstance(dt, DTensor):
            assert st_sd[key].shape == table.shape  # data parallel: plain tensors on both
            continue
        assert not isinstance(dt._local_tensor, tdb.LocalShardsWrapper), "expected TorchRec's own wrapper"
        assert torch.equal(tdb.full_tensor(dt), table), key
        md = tdb.storage_metadata(dt)
        want = sorted((tuple(m.shard_offsets), tuple(m.shard_sizes)) for m in st_sd[key].metadata().shards_metadata
                      if all(m.shard_sizes))
        assert sorted((tuple(c.offsets), tuple(c.sizes)) for c in md.chunks) == want, key
        assert tuple(md.size) == tuple(table.shape)
        name = key.split(".")[1]
        assert tdb.visualize_sharding(dt, name=name) == tdb.visualize_sharding(st_sd[key], name=name), key
        st = tdb.to_sharded_tensor(dt)
        # (TorchRec's wrapper carries no order of the other ranks' shards: compare as sets)
        assert sorted(st_signature(st)) == sorted(st_signature(st_sd[key])), key
        assert sorted(s.tensor.data_ptr() for s in st.local_shards()) == sorted(
            t.data_ptr() for t in dt._local_tensor.local_shards()
        ), f"{key}: to_sharded_tensor copied on rank {rank}"
        assert torch.equal(tdb.full_tensor(st), table), key
        g = torch.Generator().manual_seed(rank)
        ids = torch.randint(0, table.shape[0], (9,), generator=g)
        offsets = torch.tensor([0, 2, 2, 7])
        # A lookup makes no hidden collective: TorchRec's layout-less wrapper is refused on every rank with
        # the fix: to_dtensor(dt) attaches the layout (collective, zero-copy), then it looks up.
        with pytest.raises(NotImplementedError, match=r"tdb\.to_dtensor\(weight\)"):
            tdb.sharded_embedding_bag(ids, dt, offsets, mode="sum")
        attached = tdb.to_dtensor(dt)
        assert sorted(t.data_ptr() for t in attached._local_tensor.local_shards()) == sorted(
            t.data_ptr() for t in dt._local_tensor.local_shards()), f"{key}: to_dtensor(DTensor) copied"
        assert attached.device_mesh == dt.device_mesh
        # TorchRec marks a table-wise table Replicate() on the whole mesh though one rank holds it, and a
        # table-row-wise one Shard(1); the attached DTensor says where the cut is (rows: Shard(0), columns:
        # Shard(1)), so DTensor gathers and reduces it across the ranks (the table's value on each)
        column_cut = INTEROP[name][2] in ("column_wise", "table_column_wise")
        assert attached.placements == (Shard(1) if column_cut else Shard(0),), (key, attached.placements)
        assert torch.equal(attached.full_tensor(), table), key
        torch.testing.assert_close(attached.sum().full_tensor(), table.sum())
        torch.testing.assert_close(attached.norm().full_tensor(), table.norm())
        got = tdb.sharded_embedding_bag(ids, attached, offsets, mode="sum")
        torch.testing.assert_close(got, F.embedding_bag(ids, table, offsets, mode="sum"))
    # ... into TorchRec's own ShardedTensor module, through our ShardedTensor view.
    result = reference.load_state_dict(tdb.state_dict_to_sharded_tensor(sd))
    assert not result.missing_keys and not result.unexpected_keys, result
    check_module(INTEROP, reference, tables, rank, "ShardedTensor module from TorchRec's DTensors")


def test_our_api_on_torchrec_dtensors(pool):
    pool.run(_check_our_api_on_torchrec_dtensors)


def _check_checkpoint_both_ways(rank, world_size, root):
    tables = _tables(seed=300)
    native = _module(5, output_dtensor=True)
    fill_module(native, tables)
    # TorchRec's DTensors saved, loaded into ours under another plan (resharded)...
    tdb.checkpoint.save(native.state_dict(), f"{root}/native")
    other = _module(6, plan=OTHER)
    tdb.checkpoint.load(tdb.state_dict_to_dtensor(other.state_dict()), f"{root}/native")
    check_module(INTEROP, other, tables, rank, "row-wise module loaded from TorchRec's DTensors")
    # ... and ours saved, loaded in place into TorchRec's own DTensors.
    tdb.checkpoint.save(tdb.state_dict_to_dtensor(other.state_dict()), f"{root}/ours")
    fresh = _module(7, output_dtensor=True)
    tdb.checkpoint.load(fresh.state_dict(), f"{root}/ours")
    check_module(INTEROP, fresh, tables, rank, "output_dtensor module loaded from our DTensors")


def test_checkpoint_torchrec_dtensors_both_ways(pool, tmp_path):
    pool.run(_check_checkpoint_both_ways, str(tmp_path))


EC_TABLES = {"e_rw": (10, 8, "row_wise"), "e_tw": (7, 8, "table_wise"), "e_cw": (9, 8, "column_wise"),
             "e_tw0": (6, 8, "table_wise_rank0")}  # an EmbeddingCollection has one dim


def _sharded_ec(seed, output_dtensor):
    from torchrec import EmbeddingCollection, EmbeddingConfig
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.shard import shard
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan
    from torchrec.distributed.types import ShardingEnv

    from .torchrec_models import generators

    torch.manual_seed(seed)
    ec = EmbeddingCollection(
        tables=[EmbeddingConfig(name=n, embedding_dim=d, num_embeddings=r, feature_names=[f"f_{n}"])
                for n, (r, d, _) in EC_TABLES.items()],
        device=torch.device("cpu"),
    )
    world = dist.get_world_size()
    kinds = {n: k for n, (_, _, k) in EC_TABLES.items()}
    sharder = EmbeddingCollectionSharder()
    plan = construct_module_sharding_plan(ec, per_param_sharding=generators(world, kinds), sharder=sharder,
                                          local_size=world, world_size=world, device_type="cpu")
    env = ShardingEnv(world, dist.get_rank(), dist.group.WORLD, output_dtensor=output_dtensor)
    return shard(ec, plan=plan, env=env, device=torch.device("cpu"), sharder=sharder), ec


def _check_embedding_collection(rank, world_size):
    """The same both ways for TorchRec's (unpooled) EmbeddingCollection, whose load hook is its own.

    Values only: a sharded EmbeddingCollection's forward on CPU aborts the process inside
    TorchRec (``double free or corruption``) even for a freshly sharded module."""
    tables = {f"embeddings.{n}.weight": reference_table((r, d), seed=50 + i)
              for i, (n, (r, d, _)) in enumerate(EC_TABLES.items())}
    source, _ = _sharded_ec(1, output_dtensor=False)
    fill_module(source, tables)
    target, _ = _sharded_ec(2, output_dtensor=True)
    result = target.load_state_dict(tdb.state_dict_to_dtensor(source.state_dict()))
    assert not result.missing_keys and not result.unexpected_keys, result
    back, _ = _sharded_ec(3, output_dtensor=False)
    back.load_state_dict(tdb.state_dict_to_sharded_tensor(target.state_dict()))
    for what, module in (("output_dtensor EC", target), ("ShardedTensor EC", back)):
        sd = module.state_dict()
        assert sorted(sd) == sorted(tables), (what, sorted(sd))
        for key, table in tables.items():
            assert torch.equal(tdb.full_tensor(sd[key]), table), (what, key, rank)


def test_embedding_collection_both_ways(pool):
    pool.run(_check_embedding_collection)
