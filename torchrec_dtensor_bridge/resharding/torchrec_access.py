"""Every use of TorchRec's internals by :func:`~torchrec_dtensor_bridge.reshard`, in one place.

A ``DistributedModelParallel`` keeps what a reshard needs in private attributes (TorchRec 1.8:
``_sharder_map``, ``_env``, ``_plan``, ``_optim``, ``_init_optim``, ``_dmp_wrapped_module``). Its fused kernels
fill their tables with random values when built (``init_parameters``, and the collection's
``reset_parameters`` through each table config's ``init_fn``), which :func:`shard_afresh` skips:
every value is then written from the old module. On the CPU fbgemm's kernel (1.8:
``SplitTableBatchedEmbeddingBagsCodegen._apply_split``) zero-fills each host buffer it allocates, every
table of the kernel at once; :func:`shard_afresh` gives it buffers allocated without the fill (fbgemm's own
``preallocated_host_buffer``), whose pages the system provides as values are first written, table by
table. A sharded module's data-parallel tables are its data-parallel lookups' (each wrapped in a
``DistributedDataParallel`` of its own), which :func:`keep_data_parallel` hands on. A sharded module holds
reference cycles (its
state_dict hook closes over it; each fused table's weight lists, in ``_in_backward_optimizers``, an optimizer
holding the weight and the kernel with every table), which :func:`retire` breaks. Its sharded
``EmbeddingBagCollection`` keeps its tables' configs in ``_embedding_bag_configs`` (state_dict keys
``embedding_bags.<table>.weight``), its sharded ``EmbeddingCollection`` in ``_embedding_configs`` (keys
``embeddings.<table>.weight``), each the flags its unsharded module was built with in others. The sharder
of a sharded module is the one whose ``sharded_module_type`` it is: a ``ShardedEmbeddingCollection``
reports ``nn.Module`` as its ``unsharded_module_type``, which keys no sharder. Nothing else of the package
reads these; nothing here imports torchrec (the class tests go through :mod:`..torchrec_plan`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..torchrec_plan import (dmp_type, embedding_bag_collection_type, embedding_collection_type, fbgemm_kernel_type,
                             fused_kernel_types)

__all__ = [
    "fused_optimizer_kind", "hyperparameters", "install", "is_dmp", "keep_data_parallel", "module_plan",
    "reshard_group", "retire",
    "shard_afresh", "sharded_modules", "sharding_types", "table_shapes", "weight_key",
]


@dataclass(frozen=True)
class _Family:
    """Where a sharded module of one unsharded class keeps what :func:`shard_afresh` rebuilds it from."""

    configs: str  # the attribute holding its tables' configs
    prefix: str  # its tables' state_dict keys: ``{prefix}.{table}.weight``
    flags: tuple[tuple[str, str], ...]  # (the unsharded class's constructor argument, the attribute keeping it)
    builds: tuple[str, ...] | None  # the sharding types the sharded class builds; None: every type


_BAGS = _Family("_embedding_bag_configs", "embedding_bags", (("is_weighted", "_is_weighted"),), None)
# ShardedEmbeddingCollection.create_embedding_sharding builds these and raises on any other type (the
# sharder's ``sharding_types(device)`` lists what a planner may propose on a device, not what it builds)
_SEQUENCES = _Family("_embedding_configs", "embeddings", (
    ("need_indices", "_need_indices"), ("use_gather_select", "_use_gather_select"),
    ("use_gather_select_per_sharding", "_use_gather_select_per_sharding")),
    ("column_wise", "data_parallel", "row_wise", "table_wise"))


def _family(sharded: Any) -> _Family:
    return _BAGS if hasattr(sharded, _BAGS.configs) else _SEQUENCES


def is_dmp(model: object) -> bool:
    """Whether ``model`` is a TorchRec ``DistributedModelParallel``."""
    cls = dmp_type()
    return cls is not None and isinstance(model, cls)


def _inner(dmp: Any) -> nn.Module:
    """The model the DMP wraps (inside its data-parallel wrapper, when it has one)."""
    return dmp.module


def _sharder(dmp: Any, sharded: Any) -> Any:
    """The DMP's sharder that builds modules of ``sharded``'s class, or ``None``."""
    return next((s for s in dmp._sharder_map.values()
                 if getattr(s, "sharded_module_type", None) is type(sharded)), None)


def sharded_modules(dmp: Any) -> dict[str, nn.Module]:
    """Path -> each sharded ``EmbeddingBagCollection`` and ``EmbeddingCollection`` of the DMP's plan (paths as
    the plan names them); other sharded modules are not listed."""
    inner = _inner(dmp)
    kinds = {embedding_bag_collection_type(), embedding_collection_type()} - {None}
    out = {}
    for path in dmp.plan.plan:
        try:
            m = inner.get_submodule(path)
        except AttributeError:
            continue
        sharder = _sharder(dmp, m)
        if sharder is not None and sharder.module_type in kinds and hasattr(m, "module_sharding_plan"):
            out[path] = m
    return out


def module_plan(sharded: Any) -> dict[str, Any]:
    """Table -> ``ParameterSharding`` the sharded module was built with."""
    return dict(sharded.module_sharding_plan)


def table_shapes(sharded: Any) -> dict[str, tuple[int, int]]:
    """Table -> ``(rows, dim)`` of a module of :func:`sharded_modules`."""
    return {c.name: (int(c.num_embeddings), int(c.embedding_dim)) for c in getattr(sharded, _family(sharded).configs)}


def weight_key(sharded: Any, table: str) -> str:
    """The key of ``table``'s weight in the module's ``state_dict`` and its fused optimizer's state."""
    return f"{_family(sharded).prefix}.{table}.weight"


def reshard_group(dmp: Any) -> dist.ProcessGroup | None:
    """The process group the DMP's tables are sharded over."""
    return dmp._env.process_group


def sharding_types(sharded: Any) -> tuple[str, ...] | None:
    """The sharding types a module of ``sharded``'s class can be built with (an ``EmbeddingCollection``'s: no
    table-row-wise, table-column-wise or grid), or ``None`` where it takes every type."""
    return _family(sharded).builds


def fused_optimizer_kind(dmp: Any, sharded: Any) -> str | None:
    """The name of fbgemm's ``EmbOptimType`` the module's sharder trains its fused tables with, or ``None``."""
    sharder = _sharder(dmp, sharded)
    params = getattr(sharder, "fused_params", None) or {}
    kind = params.get("optimizer")
    return None if kind is None else str(getattr(kind, "name", kind))


def _left_as_allocated(value: object) -> None:
    """A fused kernel's ``init_parameters``, and each table config's ``init_fn``, while :func:`_unfilled`
    holds: the tables stay as fbgemm allocated them."""


def _unzeroed(apply: Callable[..., None], lazy: Collection[str]) -> Callable[..., None]:
    """fbgemm's ``_apply_split`` giving each host buffer named in ``lazy`` (``"weights"``, ``"momentum1"``,
    ...) allocated without its zero fill, as fbgemm's ``preallocated_host_buffer`` takes it."""

    def apply_split(self: Any, split: Any, prefix: str, dtype: torch.dtype, *args: Any,
                    preallocated_host_buffer: torch.Tensor | None = None, **kwargs: Any) -> None:
        if preallocated_host_buffer is None and prefix in lazy and split.host_size > 0:
            preallocated_host_buffer = torch.empty(split.host_size, dtype=dtype, device=self.current_device)
        apply(self, split, prefix, dtype, *args, preallocated_host_buffer=preallocated_host_buffer, **kwargs)

    return apply_split


@contextmanager
def _unfilled(configs: list[Any], lazy: Collection[str]) -> Iterator[None]:
    """TorchRec's fused kernels built without the random fills of their tables: the kernel's own
    (``init_parameters``: a pass of ``uniform_`` over every value) and the sharded collection's
    (``reset_parameters`` calls each table config's ``init_fn``: another pass). Together they are the larger
    part of building a module. Nor with fbgemm's zero fill of the host buffers named in ``lazy`` (the
    caller writes every value of them). The kernel classes and the config objects (shared with the old
    module) are changed while it holds, so a fused kernel another thread builds meanwhile is left unfilled
    too."""
    kernels = fused_kernel_types()
    own = [(cls, cls.__dict__.get("init_parameters")) for cls in kernels]
    fns = [c.init_fn for c in configs]
    cls_tbe = fbgemm_kernel_type()
    apply = getattr(cls_tbe, "__dict__", {}).get("_apply_split")
    for cls in kernels:
        setattr(cls, "init_parameters", _left_as_allocated)
    for c in configs:
        c.init_fn = _left_as_allocated
    if apply is not None and lazy:
        setattr(cls_tbe, "_apply_split", _unzeroed(apply, lazy))
    try:
        yield
    finally:
        if apply is not None and lazy:
            setattr(cls_tbe, "_apply_split", apply)
        for c, fn in zip(configs, fns):
            c.init_fn = fn
        for cls, method in own:
            if method is None:
                delattr(cls, "init_parameters")
            else:
                setattr(cls, "init_parameters", method)


def shard_afresh(dmp: Any, path: str, sharded: Any, plan: Mapping[str, Any], states: Collection[str] = ()
                 ) -> nn.Module:
    """A new sharded module of ``sharded``'s tables under ``plan``, built by the DMP's own sharder: its tables
    and optimizer state allocated by TorchRec, left as allocated (the caller writes every value of the
    weights and of the fused optimizer's ``states``, fbgemm's names: ``"momentum1"``, ...; on the CPU their
    memory is taken as the values are written), the global random state as it was."""
    family, sharder = _family(sharded), _sharder(dmp, sharded)
    flags = {arg: getattr(sharded, attr) for arg, attr in family.flags}
    configs = list(getattr(sharded, family.configs))
    unsharded = sharder.module_type(tables=configs, device=torch.device("meta"), **flags)
    devices = [torch.cuda.current_device()] if dmp.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), _unfilled(configs, {"weights", *states}):
        return sharder.shard(unsharded, dict(plan), dmp._env, dmp.device, path)


def _data_parallel_lookups(sharded: Any) -> list[tuple[int, Any]]:
    """``(index, lookup)`` of each of the module's data-parallel lookups: those TorchRec wraps in a
    ``DistributedDataParallel`` of their own (``init_data_parallel``)."""
    return [(i, lookup) for i, lookup in enumerate(sharded._lookups)
            if isinstance(lookup, torch.nn.parallel.DistributedDataParallel)]


def _lookup_tables(lookup: Any) -> list[str]:
    return [name for name, _ in lookup.module.named_parameters_by_table()]


def keep_data_parallel(new: Any, old: Any) -> None:
    """Give ``new`` (:func:`shard_afresh` of ``old``'s tables) ``old``'s data-parallel lookups in place of its
    own: their tables (which stay data-parallel) keep their parameters, which the dense optimizer, the
    lookups' own ``DistributedDataParallel`` and the DMP's wrapper refer to. Raises ``ValueError`` where the two
    modules group their data-parallel tables differently."""
    mine, theirs = _data_parallel_lookups(new), _data_parallel_lookups(old)
    groups = ([_lookup_tables(lookup) for _, lookup in mine], [_lookup_tables(lookup) for _, lookup in theirs])
    if groups[0] != groups[1]:
        raise ValueError(f"the rebuilt module groups its data-parallel tables as {groups[0]}, the module now as "
                         f"{groups[1]}")
    tables = getattr(new, _family(new).prefix)
    for (i, _), (_, lookup) in zip(mine, theirs):
        new._lookups[i] = lookup
        for name in _lookup_tables(lookup):
            tables[name].register_parameter("weight", getattr(old, _family(old).prefix)[name].weight)


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


class _Replaced:
    """The ``forward`` of a module :func:`retire` took out of use: a call raises, naming where its tables went."""

    def __init__(self, path: str) -> None:
        self.path = path  # not the module: that would make a cycle again

    def __call__(self, *args: object, **kwargs: object) -> Any:
        raise RuntimeError(f"this sharded module was replaced by torchrec_dtensor_bridge.reshard: its tables are no "
                           f"longer the model's; call the model, or the module now at {self.path!r}")


def retire(sharded: Any, path: str, new: Any) -> list[weakref.ref[Any]]:
    """Take a module :func:`install` replaced by ``new`` out of use and out of its reference cycles, so that its
    tables and optimizer state are freed as soon as nothing else refers to it, not at the next garbage
    collection: its state_dict hooks are dropped, and each weight's ``_in_backward_optimizers``. A later call of
    it raises ``RuntimeError``. Returns weak references to the module and every parameter and buffer of it and
    of its kernels (which hold the tables' storage), but for the data-parallel lookups ``new`` took over
    (:func:`keep_data_parallel`): all dead once it is freed."""
    refs: list[weakref.ref[Any]] = [weakref.ref(sharded)]
    sharded._state_dict_hooks.clear()
    kept = {id(t) for top in [new, *new._lookups] for m in top.modules()  # the data-parallel tables, which stay
            for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)]}
    for top in [sharded, *getattr(sharded, "_lookups", ())]:
        for m in top.modules():
            for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)]:
                if id(t) not in kept:
                    t.__dict__.pop("_in_backward_optimizers", None)
                    refs.append(weakref.ref(t))
    sharded.forward = _Replaced(path)
    return refs
