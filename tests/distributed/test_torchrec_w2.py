"""Real TorchRec sharded modules on 2 gloo ranks: state_dict -> DTensor -> back, and DCP."""

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.tensor import DTensor

import torchrec_dtensor_bridge as tdb
from torchrec_dtensor_bridge.torchrec_plan import layout_from_parameter_sharding

from .checks import check_roundtrip, reference_table, st_signature
from .harness import make_pool_fixture
from .torchrec_models import TABLES, build_ebc, random_kjt, shard_ebc

pool = make_pool_fixture(2)


def _fill_with_reference(sd):
    """Write a known table into every shard through torch's own ShardedTensor API."""
    tables = {}
    for i, (key, value) in enumerate(sorted(sd.items())):
        if isinstance(value, ShardedTensor):
            table = reference_table(tuple(value.size()), value.dtype, seed=i)
            for s in value.local_shards():
                idx = tuple(slice(o, o + z) for o, z in zip(s.metadata.shard_offsets, s.metadata.shard_sizes))
                s.tensor.copy_(table[idx])
            tables[key] = table
    return tables


def _check_state_dict_roundtrip(rank, world_size):
    sharded, plan = shard_ebc(build_ebc(), world_size)
    sd = sharded.state_dict()
    tables = _fill_with_reference(sd)
    assert len(tables) == len(TABLES) - 1, sorted(tables)  # data_parallel stays a plain tensor
    for key, table in tables.items():
        check_roundtrip(sd[key], table, key)
    converted = tdb.state_dict_to_dtensor(sd)
    assert converted.keys() == sd.keys()
    for key, value in converted.items():
        assert isinstance(value, DTensor) == (key in tables), key
        if key not in tables:
            assert value is sd[key]
    back = tdb.state_dict_to_sharded_tensor(converted)
    for key in tables:
        assert st_signature(back[key]) == st_signature(sd[key]), key
    # Layouts from the plan agree with the ShardedTensors TorchRec built.
    for name, ps in plan.items():
        key = f"embedding_bags.{name}.weight"
        rows, dim, _ = TABLES[name]
        lay = layout_from_parameter_sharding(ps, (rows, dim), world_size=world_size, name=name)
        if key in tables:
            got = tdb.layout_of(sd[key], name=name)
            assert sorted((s.rank, s.offsets, s.sizes) for s in got.shards) == sorted(
                (s.rank, s.offsets, s.sizes) for s in lay.shards
            ), (name, got, lay)
        else:
            assert lay.kind is tdb.LayoutKind.REPLICATED
    return {k: tdb.layout_of(converted[k], name=k).kind.value for k in tables}


def test_torchrec_state_dict_roundtrip(pool):
    kinds = pool.run(_check_state_dict_roundtrip)[0]
    assert kinds["embedding_bags.t_rw.weight"] == "row_wise"
    assert kinds["embedding_bags.t_cw.weight"] == "column_wise"
    assert kinds["embedding_bags.t_tw.weight"] == "table_wise"


def _check_writes_reach_the_module(rank, world_size):
    """Zero-copy in practice: writing through the DTensor changes the module's forward."""
    ebc = build_ebc(seed=1)
    sharded, _ = shard_ebc(build_ebc(seed=2), world_size)
    sd = tdb.state_dict_to_dtensor(sharded.state_dict())
    full = ebc.state_dict()
    for key, value in sd.items():
        if isinstance(value, DTensor):
            lay = tdb.layout_of(value, name=key)
            for spec, t in zip(lay.shards_on(rank), tdb.convert.local_shards_of(value)):
                t.copy_(full[key][spec.slices()])
        else:
            value.copy_(full[key])
    kjt = random_kjt(TABLES, batch=5, seed=10 + rank)
    want = ebc(kjt).to_dict()
    got = sharded(kjt).wait().to_dict()  # the sharded module orders keys its own way
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-5)


def test_writes_through_dtensor_reach_module(pool):
    pool.run(_check_writes_reach_the_module)


def _check_dcp_roundtrip(rank, world_size, path):
    sharded, _ = shard_ebc(build_ebc(), world_size)
    sd = sharded.state_dict()
    tables = _fill_with_reference(sd)
    dts = tdb.state_dict_to_dtensor(sd)
    dcp.save(dts, checkpoint_id=path)
    for value in dts.values():
        for t in (tdb.convert.local_shards_of(value) if isinstance(value, DTensor) else [value]):
            t.zero_()
    dcp.load(dts, checkpoint_id=path)
    for key, table in tables.items():
        assert torch.equal(tdb.full_tensor(dts[key]), table), key
        # the module's own ShardedTensor storage was updated in place
        assert torch.equal(tdb.full_tensor(sd[key]), table), key
    # the checkpoint records every shard of every table exactly once
    md = dcp.FileSystemReader(path).read_metadata()
    for key, table in tables.items():
        chunks = md.state_dict_metadata[key].chunks
        assert sum(c.sizes.numel() for c in chunks) == table.numel(), (key, chunks)
        assert tuple(md.state_dict_metadata[key].size) == tuple(table.shape)


def test_dcp_save_load_bit_exact(pool, tmp_path):
    pool.run(_check_dcp_roundtrip, str(tmp_path / "ckpt"))


def _check_dcp_uneven(rank, world_size, path):
    """An uneven row-wise DTensor (7/3 split, DTensor's even-chunk pitfall) saves correct metadata."""
    from .checks import build_sharded_tensor

    layout = tdb.ShardLayout.row_wise((10, 6), [7, 3], name="u")
    table = reference_table((10, 6))
    dt = tdb.to_dtensor(build_sharded_tensor(layout, table, rank))
    dcp.save({"u": dt}, checkpoint_id=path)
    for t in tdb.convert.local_shards_of(dt):
        t.fill_(-1)
    dcp.load({"u": dt}, checkpoint_id=path)
    assert torch.equal(tdb.full_tensor(dt), table)
    md = dcp.FileSystemReader(path).read_metadata().state_dict_metadata["u"]
    assert sorted((tuple(c.offsets), tuple(c.sizes)) for c in md.chunks) == [((0, 0), (7, 6)), ((7, 0), (3, 6))]
    dist.barrier()


def test_dcp_uneven_row_wise(pool, tmp_path):
    pool.run(_check_dcp_uneven, str(tmp_path / "ckpt"))


def _check_optimizer_state(rank, world_size, path):
    """Row-wise Adagrad's 1-D momentum1 (one value per row; 4 column shards -> a 36-row vector
    with two shards per rank) converts, gathers and checkpoints like the weights."""
    from .torchrec_models import shard_ebc_with_rowwise_adagrad

    model, tables = shard_ebc_with_rowwise_adagrad(world_size)
    osd = model.fused_optimizer.state_dict()
    flat = {f"{k}/{n}": v for k, per in osd["state"].items() for n, v in per.items()}
    # TorchRec leaves a table's state out on ranks that hold none of it: check the common keys,
    # in one order, so every rank joins the same collectives.
    keys = [None] * world_size
    dist.all_gather_object(keys, sorted(flat))
    flat = {k: flat[k] for k in sorted(set.intersection(*map(set, keys)))}
    assert "embedding_bags.t_tw.weight/t_tw.momentum1" not in flat
    assert flat and all(isinstance(v, ShardedTensor) and v.dim() == 1 for v in flat.values()), flat.keys()
    refs = _fill_with_reference(flat)
    for key, st in flat.items():
        check_roundtrip(st, refs[key], key)
    converted = tdb.state_dict_to_dtensor(osd)
    assert converted.keys() == osd.keys()
    for k in osd.keys() - {"state"}:
        assert converted[k] == osd[k], k  # non-tensor entries pass through
    states = {f"{k}/{n}": v for k, per in converted["state"].items() for n, v in per.items()}
    states = {k: states[k] for k in flat}
    assert all(isinstance(v, DTensor) for v in states.values())
    cw = states["embedding_bags.t_cw.weight/t_cw.momentum1"]
    assert cw.shape == (4 * TABLES["t_cw"][0],)
    dcp.save({"state": converted["state"]}, checkpoint_id=path)
    for v in states.values():
        for t in tdb.convert.local_shards_of(v):
            t.fill_(-7)
    dcp.load({"state": converted["state"]}, checkpoint_id=path)
    for key, v in states.items():
        assert torch.equal(tdb.full_tensor(v), refs[key]), key
        assert torch.equal(tdb.full_tensor(flat[key]), refs[key]), key  # the optimizer's own storage
    back = tdb.state_dict_to_sharded_tensor(converted)
    for k, per in osd["state"].items():
        for n, st in per.items():
            assert st_signature(back["state"][k][n]) == st_signature(st), (k, n)


def test_fused_optimizer_state(pool, tmp_path):
    pool.run(_check_optimizer_state, str(tmp_path / "opt"))


def _check_torchrec_native_dtensors(rank, world_size):
    """TorchRec's own DTensor state_dict (its wrapper; table-wise as Replicate() on the full
    mesh, empty elsewhere: DTensor.full_tensor gets that wrong) is handled by ours."""
    from torchrec.distributed.shard import shard
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan
    from torchrec.distributed.types import ShardingEnv

    from .torchrec_models import generators

    kinds = {n: k for n, (_, _, k) in TABLES.items() if k != "data_parallel"}
    tables = {n: TABLES[n] for n in kinds}
    ebc = build_ebc(tables)
    plan = construct_module_sharding_plan(
        ebc, per_param_sharding=generators(world_size, kinds), local_size=world_size, world_size=world_size,
        device_type="cpu",
    )
    env = ShardingEnv(world_size, rank, dist.group.WORLD, output_dtensor=True)
    sharded = shard(ebc, plan=plan, env=env, device=torch.device("cpu"))
    sd = sharded.state_dict()
    for i, (key, value) in enumerate(sorted(sd.items())):
        assert isinstance(value, DTensor), (key, type(value))
        table = reference_table(tuple(value.shape), value.dtype, seed=i)
        lay = tdb.layout_of(value, name=key)  # collective: TorchRec's wrapper carries no layout
        for spec, t in zip(lay.shards_on(rank), tdb.convert.local_shards_of(value)):
            t.copy_(table[spec.slices()])
        assert torch.equal(tdb.full_tensor(value), table), key
        st = tdb.to_sharded_tensor(value)
        assert torch.equal(tdb.full_tensor(st), table), key
        assert sum(c.sizes.numel() for c in tdb.storage_metadata(value).chunks) == table.numel()


def test_torchrec_native_dtensor_state_dict(pool):
    pool.run(_check_torchrec_native_dtensors)


def _check_no_deprecation_noise(rank, world_size, path):
    """The package's own use of TorchRec's ShardedTensors (conversions both ways, gathers, copies between
    layouts) shows the user no ShardedTensor deprecation warning: that use is not theirs to change."""
    import warnings

    from torchrec_dtensor_bridge.convert.reshard import copy_into

    sharded, _ = shard_ebc(build_ebc(), world_size)
    sd = sharded.state_dict()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        dts = tdb.state_dict_to_dtensor(sd)
        back = tdb.state_dict_to_sharded_tensor(dts)
        for key, st in sd.items():
            if isinstance(st, ShardedTensor):
                tdb.layout_of(back[key], name=key)
                tdb.full_tensor(st)
                copy_into(tdb.layout_of(dts[key]), tdb.convert.local_shards_of(dts[key]), st, name=key)
        tdb.checkpoint.save(sd, path)  # TorchRec's ShardedTensors as they are
        tdb.checkpoint.load(sd, path)
    ours = "torchrec_dtensor_bridge"  # where torch's own code (DCP's planner) warns is not ours to change
    noise = [f"{w.filename}:{w.lineno}: {w.message}" for w in seen
             if "ShardedTensor" in str(w.message) and ours in w.filename]
    assert not noise, noise
    return len(seen)


def test_no_sharded_tensor_deprecation_warnings(pool, tmp_path):
    pool.run(_check_no_deprecation_noise, str(tmp_path / "ck"))
