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


def shard_ebc(ebc: EmbeddingBagCollection, world_size: int, tables=TABLES, plan_kinds: dict[str, str] | None = None):
    kinds = plan_kinds or {n: k for n, (_, _, k) in tables.items()}
    plan = construct_module_sharding_plan(
        ebc,
        per_param_sharding=generators(world_size, kinds),
        local_size=world_size,
        world_size=world_size,
        device_type="cpu",
    )
    env = ShardingEnv.from_process_group(dist.group.WORLD)
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
