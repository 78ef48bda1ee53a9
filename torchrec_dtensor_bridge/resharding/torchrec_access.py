"""Every use of TorchRec's internals by :func:`~torchrec_dtensor_bridge.reshard`, in one place.

A ``DistributedModelParallel`` keeps what a reshard needs in private attributes (TorchRec 1.8:
``_sharder_map``, ``_env``, ``_plan``, ``_optim``, ``_init_optim``, ``_dmp_wrapped_module``), and a
``ShardedEmbeddingBagCollection`` keeps its tables' configs in ``_embedding_bag_configs``. Nothing else of
the package reads them; nothing here imports torchrec (the class tests go through
:mod:`..torchrec_plan`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..torchrec_plan import dmp_type

__all__ = [
    "fused_optimizer_kind", "hyperparameters", "install", "is_dmp", "module_plan", "reshard_group", "shard_afresh",
    "sharded_modules", "table_shapes",
]


def is_dmp(model: object) -> bool:
    """Whether ``model`` is a TorchRec ``DistributedModelParallel``."""
    cls = dmp_type()
    return cls is not None and isinstance(model, cls)


def _inner(dmp: Any) -> nn.Module:
    """The model the DMP wraps (inside its data-parallel wrapper, when it has one)."""
    return dmp.module


def sharded_modules(dmp: Any) -> dict[str, nn.Module]:
    """Path -> each sharded ``EmbeddingBagCollection`` of the DMP's plan (paths as the plan names them)."""
    inner = _inner(dmp)
    out = {}
    for path in dmp.plan.plan:
        try:
            m = inner.get_submodule(path)
        except AttributeError:
            continue
        if hasattr(m, "_embedding_bag_configs") and hasattr(m, "module_sharding_plan"):
            out[path] = m
    return out


def module_plan(sharded: Any) -> dict[str, Any]:
    """Table -> ``ParameterSharding`` the sharded module was built with."""
    return dict(sharded.module_sharding_plan)


def table_shapes(sharded: Any) -> dict[str, tuple[int, int]]:
    """Table -> ``(rows, dim)`` of a sharded ``EmbeddingBagCollection``."""
    return {c.name: (int(c.num_embeddings), int(c.embedding_dim)) for c in sharded._embedding_bag_configs}


def reshard_group(dmp: Any) -> dist.ProcessGroup | None:
    """The process group the DMP's tables are sharded over."""
    return dmp._env.process_group


def fused_optimizer_kind(dmp: Any, sharded: Any) -> str | None:
    """The name of fbgemm's ``EmbOptimType`` the module's sharder trains its fused tables with, or ``None``."""
    sharder = dmp._sharder_map.get(sharded.unsharded_module_type)
    params = getattr(sharder, "fused_params", None) or {}
    kind = params.get("optimizer")
    return None if kind is None else str(getattr(kind, "name", kind))


def shard_afresh(dmp: Any, path: str, sharded: Any, plan: Mapping[str, Any]) -> nn.Module:
    """A new sharded module of ``sharded``'s tables under ``plan``, built by the DMP's own sharder (its
    tables allocated and initialised by TorchRec; the global random state is left as it was)."""
    cls = sharded.unsharded_module_type
    unsharded = cls(tables=list(sharded._embedding_bag_configs), is_weighted=bool(sharded._is_weighted),
                    device=torch.device("meta"))
    devices = [torch.cuda.current_device()] if dmp.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        return dmp._sharder_map[cls].shard(unsharded, dict(plan), dmp._env, dmp.device, path)


def hyperparameters(sharded: Any) -> dict[str, dict[str, Any]]:
    """Table parameter name -> its group's hyper-parameters (``lr``, ...) in the module's fused optimizer, for
    the tables this rank holds (another rank's come from that rank)."""
    opt = sharded.fused_optimizer
    names = {id(p): n for n, p in opt.params.items()}
    return {names[id(p)]: {k: v for k, v in g.items() if k != "params"}
            for g in opt.param_groups for p in g["params"] if id(p) in names}


def install(dmp: Any, path: str, new: Any, saved: Mapping[str, Mapping[str, Any]]) -> None:
    """Put ``new`` in place of the sharded module at ``path``: in the model, in the DMP's plan, in its fused
    optimizer (rebuilt as TorchRec's own reshard rebuilds it), each table's hyper-parameters taken from
    ``saved`` (:func:`hyperparameters` of the old module, every rank's)."""
    parent, _, name = path.rpartition(".")
    setattr(_inner(dmp).get_submodule(parent) if parent else _inner(dmp), name, new)
    dmp._plan.plan[path] = new.module_sharding_plan
    names = {id(p): n for n, p in new.fused_optimizer.params.items()}
    for group in new.fused_optimizer.param_groups:
        for p in group["params"]:
            for k, v in saved.get(names.get(id(p), ""), {}).items():
                group[k] = v
    dmp._optim = dmp._init_optim(_inner(dmp))
