"""enable_dtensor_state_dict and checkpoints on real DistributedModelParallel models, 2 gloo ranks."""

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner.types import ParameterConstraints  # noqa: F401  (planner importable)
from torchrec.distributed.sharding_plan import construct_module_sharding_plan
from torchrec.distributed.types import ShardingEnv, ShardingPlan

import torchrec_dtensor_bridge as tdb

from .harness import make_pool_fixture
from .torchrec_models import TABLES, build_ebc, generators, random_kjt

pool = make_pool_fixture(2)

PLAN_A = {n: k for n, (_, _, k) in TABLES.items()}
PLAN_B = {  # every table moves to another layout
    "t_rw": "column_wise",
    "t_tw": "row_wise",
    "t_cw": "table_wise",
    "t_trw": "table_column_wise",
    "t_twc": "table_row_wise",
    "t_dp": "data_parallel",
}


class Model(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        self.ebc = build_ebc(seed=seed)

    def forward(self, kjt):
        return self.ebc(kjt)


def _dmp(kinds, seed, world_size):
    model = Model(seed)
    plan = construct_module_sharding_plan(
        model.ebc, per_param_sharding=generators(world_size, kinds), local_size=world_size,
        world_size=world_size, device_type="cpu",
    )
    return DistributedModelParallel(
        model, env=ShardingEnv.from_process_group(dist.group.WORLD), device=torch.device("cpu"),
        plan=ShardingPlan({"ebc": plan}),
    )


def _outputs(dmp, rank):
    kjt = random_kjt(TABLES, batch=6, seed=100 + rank)
    out = dmp(kjt)
    out = out.wait() if hasattr(out, "wait") else out
    return {k: v.detach().clone() for k, v in out.to_dict().items()}  # plans order keys differently


def _same(x, y):
    """Pooled sums under different plans add in different orders: equal up to rounding."""
    torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


def _check_hooks_reshard_in_memory(rank, world_size):
    a = tdb.enable_dtensor_state_dict(_dmp(PLAN_A, seed=1, world_size=world_size))
    b = tdb.enable_dtensor_state_dict(_dmp(PLAN_B, seed=2, world_size=world_size))
    sd = a.state_dict()
    tables = [k for k, v in sd.items() if isinstance(v, DTensor)]
    assert len(tables) == len(TABLES) - 1, tables
    before = _outputs(b, rank)
    assert any(not torch.allclose(v, before[k]) for k, v in _outputs(a, rank).items())
    b.load_state_dict(sd)  # DTensors of plan A into plan B: resharded point to point
    for key in tables:  # bit-exact tables, whatever the pooled outputs' rounding
        assert torch.equal(tdb.full_tensor(b.state_dict()[key]), tdb.full_tensor(sd[key])), key
    _same(_outputs(a, rank), _outputs(b, rank))
    # plain full tensors from an unsharded model load too (sliced locally)
    ref = Model(seed=3)
    full = {f"{k}": v for k, v in ref.state_dict().items()}
    b.load_state_dict(full)
    kjt = random_kjt(TABLES, batch=6, seed=100 + rank)
    _same(_outputs(b, rank), ref(kjt).to_dict())
    # ShardedTensors (TorchRec's own format) of plan A load into plan B as well
    c = _dmp(PLAN_A, seed=4, world_size=world_size)
    b.load_state_dict(c.state_dict())
    _same(_outputs(c, rank), _outputs(b, rank))


def test_hooks_reshard_between_plans(pool):
    pool.run(_check_hooks_reshard_in_memory)


def _check_bad_load(rank, world_size):
    b = tdb.enable_dtensor_state_dict(_dmp(PLAN_B, seed=2, world_size=world_size))
    before = {k: tdb.full_tensor(v).clone() if isinstance(v, DTensor) else v.clone() for k, v in b.state_dict().items()}
    full = Model(seed=3).state_dict()
    full["ebc.embedding_bags.t_cw.weight"] = torch.zeros(9, 15)
    try:
        b.load_state_dict(full)
    except ValueError as e:
        assert "'ebc.embedding_bags.t_cw.weight' has shape [9, 15]" in str(e), str(e)
    else:
        raise AssertionError("a wrong shape was accepted")
    after = b.state_dict()
    for k, v in before.items():
        got = tdb.full_tensor(after[k]) if isinstance(after[k], DTensor) else after[k]
        assert torch.equal(got, v), f"{k} changed by a refused load"


def test_bad_shape_refused_before_any_write(pool):
    pool.run(_check_bad_load)


def _check_checkpoint_between_plans(rank, world_size, path):
    a = tdb.enable_dtensor_state_dict(_dmp(PLAN_A, seed=1, world_size=world_size))
    b = tdb.enable_dtensor_state_dict(_dmp(PLAN_B, seed=2, world_size=world_size))
    tdb.checkpoint.save(a.state_dict(), path)
    dest = b.state_dict()
    tdb.checkpoint.load(dest, path)  # in place into b's own storage
    _same(_outputs(a, rank), _outputs(b, rank))


def test_checkpoint_between_plans(pool, tmp_path):
    pool.run(_check_checkpoint_between_plans, str(tmp_path / "ck"))
