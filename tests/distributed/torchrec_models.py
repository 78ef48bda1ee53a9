"""Real TorchRec sharded EmbeddingBagCollections on CPU/gloo, built with hand-written plans."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.distributed.shard import shard
from torchrec.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_row_wise,
    table_wise,
)
from torchrec.distributed.types import ShardingEnv

TABLES = {
    # name: (rows, dim, plan)
    "t_rw": (13, 8, "row_wise"),
    "t_tw": (7, 12, "table_wise"),
    "t_cw": (9, 16, "column_wise"),
    "t_trw": (11, 8, "table_row_wise"),
    "t_twc": (6, 16, "table_column_wise"),
    "t_dp": (5, 4, "data_parallel"),
}


def _table_column_wise(ranks):
    gen = column_wise(ranks=ranks)

    def make(param, local_size, world_size, device_type, sharder):
        ps = gen(param, local_size, world_size, device_type, sharder)
        return dataclasses.replace(ps, sharding_type="table_column_wise")

    return make


def generators(world_size: int, kinds: dict[str, str]):
    last = world_size - 1
    make = {
        "row_wise": lambda: row_wise(),
        "table_wise": lambda: table_wise(rank=last),
        "table_wise_rank0": lambda: table_wise(rank=0),
        "column_wise": lambda: column_wise(ranks=[r % world_size for r in range(4)]),
        "table_row_wise": lambda: table_row_wise(host_index=0),
        "table_column_wise": lambda: _table_column_wise([last, 0]),
        "data_parallel": lambda: data_parallel(),
    }
    return {name: make[kind]() for name, kind in kinds.items()}


def build_ebc(tables: dict[str, tuple[int, int, str]] = TABLES, seed: int = 0) -> EmbeddingBagCollection:
    torch.manual_seed(seed)
    configs = [
        EmbeddingBagConfig(name=n, embedding_dim=d, num_embeddings=r, feature_names=[f"f_{n}"])
        for n, (r, d, _) in tables.items()
    ]
    return EmbeddingBagCollection(tables=configs, device=torch.device("cpu"))


def shard_ebc(
    ebc: EmbeddingBagCollection,
    world_size: int,
    tables=TABLES,
    plan_kinds: dict[str, str] | None = None,
    *,
    output_dtensor: bool = False,
    process_group=None,
):
    """``ebc`` sharded by TorchRec over ``process_group`` (default: every rank; ``world_size`` is its
    size); ``output_dtensor=True``: its state_dict holds TorchRec's own DTensors."""
    kinds = plan_kinds or {n: k for n, (_, _, k) in tables.items()}
    plan = construct_module_sharding_plan(
        ebc,
        per_param_sharding=generators(world_size, kinds),
        local_size=world_size,
        world_size=world_size,
        device_type="cpu",
    )
    pg = process_group or dist.group.WORLD
    env = ShardingEnv(world_size, dist.get_rank(pg), pg, output_dtensor=output_dtensor)
    return shard(ebc, plan=plan, env=env, device=torch.device("cpu")), plan


def random_kjt(tables, batch: int, seed: int) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(seed)
    keys, lengths, values = [], [], []
    for n, (rows, _, _) in tables.items():
        ln = torch.randint(0, 4, (batch,), generator=g)
        keys.append(f"f_{n}")
        lengths.append(ln)
        values.append(torch.randint(0, rows, (int(ln.sum()),), generator=g))
    return KeyedJaggedTensor.from_lengths_sync(keys=keys, values=torch.cat(values), lengths=torch.cat(lengths))


def shard_ebc_with_rowwise_adagrad(world_size: int, seed: int = 0):
    """A fused-kernel sharded EBC with row-wise Adagrad: its optimizer keeps 1-D per-row state."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    sharder = EmbeddingBagCollectionSharder(
        fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.1}
    )
    last = world_size - 1
    tables = {n: spec for n, spec in TABLES.items() if spec[2] != "data_parallel"}
    per_param = {
        "t_rw": row_wise(compute_kernel="fused"),
        "t_tw": table_wise(rank=last, compute_kernel="fused"),
        "t_cw": column_wise(ranks=[r % world_size for r in range(4)], compute_kernel="fused"),
        "t_trw": row_wise(compute_kernel="fused"),
        "t_twc": table_wise(rank=0, compute_kernel="fused"),
    }
    ebc = build_ebc(tables, seed)
    plan = construct_module_sharding_plan(
        ebc, per_param_sharding=per_param, sharder=sharder, local_size=world_size, world_size=world_size,
        device_type="cpu",
    )
    env = ShardingEnv.from_process_group(dist.group.WORLD)
    return shard(ebc, plan=plan, env=env, device=torch.device("cpu"), sharder=sharder), tables


def mesh_2d(replicas: int, group_size: int):
    """TorchRec's 2-D mesh (as ``DMPCollection`` builds it): dims ``("replicate", "shard")``,
    sharding group ``g`` = ranks ``[g, g + replicas, g + 2 * replicas, ...]``."""
    from torch.distributed.device_mesh import DeviceMesh

    peers = [[replicas * r + g for r in range(group_size)] for g in range(replicas)]
    return DeviceMesh("cpu", peers, mesh_dim_names=("replicate", "shard"))


def shard_ebc_2d(ebc: EmbeddingBagCollection, replicas: int, tables=TABLES, plan_kinds: dict[str, str] | None = None):
    """``ebc`` sharded the way ``DMPCollection`` shards it, on CPU.

    ``DMPCollection`` itself refuses CPU (``AssertionError: DMPCollection only
    supports CUDA or MTIA``), so this does its three steps with TorchRec's own
    public pieces: the 2-D mesh, a plan made for one sharding group and moved
    onto this rank's group (each plan rank ``r`` -> global ``r * replicas +
    group``), and ``shard`` under a ``ShardingEnv2D`` (whose state_dict is
    TorchRec's 2-D DTensors: ``(Replicate(), <sharding>)``).
    """
    from torchrec.distributed.types import ShardingEnv2D

    world = dist.get_world_size()
    group_size = world // replicas
    kinds = plan_kinds or {n: k for n, (_, _, k) in tables.items()}
    plan = construct_module_sharding_plan(
        ebc, per_param_sharding=generators(group_size, kinds), local_size=group_size, world_size=group_size,
        device_type="cpu",
    )
    group = dist.get_rank() % replicas
    for ps in plan.values():
        ps.ranks = [r * replicas + group for r in ps.ranks] if ps.ranks else ps.ranks
        for sm in getattr(ps.sharding_spec, "shards", None) or []:
            sm.placement._rank = sm.placement.rank() * replicas + group
    mesh = mesh_2d(replicas, group_size)
    env = ShardingEnv2D(
        sharding_pg=mesh.get_group("shard"), replica_pg=mesh.get_group("replicate"), global_pg=dist.group.WORLD,
        device_mesh=mesh, node_group_size=group_size,
    )
    return shard(ebc, plan=plan, env=env, device=torch.device("cpu")), mesh


def fill_module(module, tables: dict[str, torch.Tensor]) -> None:
    """Write ``tables`` (state_dict key -> whole table) into a sharded module's own storage,
    through whatever its state_dict holds: ShardedTensors, TorchRec's DTensors, plain tensors."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

    for key, value in module.state_dict().items():
        table = tables[key]
        if isinstance(value, ShardedTensor):
            pieces = [(s.tensor, s.metadata.shard_offsets) for s in value.local_shards()]
        elif isinstance(value, DTensor):
            local = value._local_tensor
            pieces = list(zip(local.local_shards(), local.local_offsets()))
        else:
            pieces = [(value, [0] * value.dim())]
        for t, off in pieces:
            t.copy_(table[tuple(slice(o, o + z) for o, z in zip(off, t.shape))])


def check_module(tables_cfg, module, tables: dict[str, torch.Tensor], rank: int, what: str) -> None:
    """Every table of ``module`` equals ``tables`` (exactly), and its forward output equals an
    unsharded ``EmbeddingBagCollection`` holding the same tables, on this rank's own batch."""
    import torchrec_dtensor_bridge as tdb
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

    sd = module.state_dict()
    assert sorted(sd) == sorted(tables), (what, sorted(sd))
    for key, table in tables.items():
        value = sd[key]
        got = tdb.full_tensor(value) if isinstance(value, (DTensor, ShardedTensor)) else value
        assert torch.equal(got, table), f"{what}: {key} differs on rank {rank}"
    ref = build_ebc(tables_cfg, seed=0)
    with torch.no_grad():
        for key, table in tables.items():
            ref.embedding_bags[key.split(".")[1]].weight.copy_(table)
    kjt = random_kjt(tables_cfg, batch=6, seed=40 + rank)
    want = ref(kjt).to_dict()
    got = module(kjt).wait().to_dict()
    assert want.keys() == got.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], msg=lambda m: f"{what}: forward {k} on rank {rank}: {m}")


def shard_fused(ebc: EmbeddingBagCollection, per_param: dict, kind: str, *, lr: float, eps: float):
    """``ebc`` sharded by ``per_param`` over every rank, its tables trained by TorchRec's fused kernel with
    ``kind`` (``"sgd"`` or ``"rowwise_adagrad"``)."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    opt = {"sgd": EmbOptimType.EXACT_SGD, "rowwise_adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD}[kind]
    sharder = EmbeddingBagCollectionSharder(fused_params={"optimizer": opt, "learning_rate": lr, "eps": eps})
    world = dist.get_world_size()
    plan = construct_module_sharding_plan(ebc, per_param_sharding=per_param, sharder=sharder, local_size=world,
                                          world_size=world, device_type="cpu")
    return shard(ebc, plan=plan, env=ShardingEnv.from_process_group(dist.group.WORLD), device=torch.device("cpu"),
                 sharder=sharder)


def seeded_tables(module, names, *, scale: float = 1.0) -> dict:
    """``module``'s tables as DTensors (zero-copy), every copy of table ``i`` filled with the same seeded values
    (``randn * scale`` in the table's dtype); name -> DTensor."""
    import torchrec_dtensor_bridge as tdb
    from torchrec_dtensor_bridge.convert import local_shards_of

    weights = tdb.state_dict_to_dtensor(module.state_dict())
    with torch.no_grad():
        for i, n in enumerate(names):
            w = weights[f"embedding_bags.{n}.weight"]
            full = (torch.randn(tuple(w.shape), generator=torch.Generator().manual_seed(10 + i)) * scale).to(w.dtype)
            for spec, shard_t in zip(tdb.layout_of(w).shards_on(dist.get_rank()), local_shards_of(w)):
                r0, c0 = spec.offsets
                shard_t.copy_(full[r0 : r0 + spec.sizes[0], c0 : c0 + spec.sizes[1]])
    return {n: weights[f"embedding_bags.{n}.weight"] for n in names}
