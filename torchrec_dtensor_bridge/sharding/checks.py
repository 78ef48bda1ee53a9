"""Validation of a ``shard_module`` call, agreed on by every rank before anything changes.

Order of work (every rank, the same steps, so no rank can be left waiting):

1. :func:`resolve_plan` checks this rank's arguments locally - the mesh, the
   source rank, each plan entry against the module - and stops at the first
   failure with a :class:`RejectedArguments`, which the caller holds for step 2;
2. :func:`agree` runs the package's agreement step (:mod:`..agreement`: ONE
   ``all_gather`` on the mesh's group) carrying every rank's verdict, a digest
   of its plan, its ``src_rank`` and a digest of the named parameters' dtypes;
   any failure or disagreement raises on every rank (a plan or dtype mismatch
   then gathers the per-entry details to name them, on that error path only).

Ranks are global ranks (as a ``DeviceMesh`` lists them): the mesh may be any
1-D mesh holding this rank, ``src_rank`` and every block's rank are ranks of it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from .. import agreement
from ..agreement import RejectedArguments
from ..groups import CommGroup, of_group
from ..layout import ShardLayout

__all__ = ["PlanEntry", "agree", "mesh_group", "resolve_plan"]


@dataclass(frozen=True)
class PlanEntry:
    """One validated plan entry.

    Attributes:
        name: the parameter's name in the plan.
        owner: the module holding the parameter (an ``nn.Embedding`` or ``nn.EmbeddingBag``).
        param: the parameter as it is now (only ``src_rank``'s values count).
        layout: the entry's layout, named after the parameter.
    """

    name: str
    owner: nn.Module
    param: nn.Parameter
    layout: ShardLayout


def _fail(kind: type[Exception], message: str) -> RejectedArguments:
    return RejectedArguments(kind, f"shard_module: {message}")


def _mesh_ranks(mesh: DeviceMesh) -> list[int]:
    return [int(r) for r in mesh.mesh.flatten().tolist()]


def mesh_group(device_mesh: object) -> CommGroup:
    """The group ``shard_module`` agrees on and its modules' lookups run on: the 1-D mesh's group.

    Raises ``TypeError``/``ValueError`` directly (there is no group to agree on)
    for a mesh that is not 1-D or does not hold this rank: structure every
    rank sees alike.
    """
    if not isinstance(device_mesh, DeviceMesh):
        raise TypeError(f"shard_module: device_mesh must be a DeviceMesh, got {type(device_mesh).__name__}")
    ranks = _mesh_ranks(device_mesh)
    if device_mesh.ndim != 1:
        raise ValueError(
            f"shard_module: device_mesh must be a 1-D mesh (the sharded lookups run on its group); got a "
            f"{device_mesh.ndim}-D mesh over ranks {ranks}"
        )
    me = dist.get_rank()
    if me not in ranks:
        raise ValueError(f"shard_module: rank {me} is not in device_mesh's ranks {ranks}; only they call it")
    group = device_mesh.get_group() if len(ranks) > 1 else None
    g = of_group(group, device_mesh.device_type)
    return CommGroup(g.group, tuple(ranks), g.device, device_mesh)


def _check_mesh(device_mesh: DeviceMesh, src_rank: object) -> None:
    ranks = _mesh_ranks(device_mesh)
    if isinstance(src_rank, bool) or not isinstance(src_rank, int) or src_rank not in ranks:
        where = f"in [0, {len(ranks)})" if ranks == list(range(len(ranks))) else f"of device_mesh {ranks}"
        raise _fail(ValueError, f"src_rank must be a rank {where}, got {src_rank!r}")


def _lookup_param(module: nn.Module, name: str) -> tuple[nn.Module, nn.Parameter]:
    path, _, attr = name.rpartition(".")
    try:
        owner = module.get_submodule(path)
    except AttributeError:
        raise _fail(ValueError, f"plan entry {name!r}: the module has no submodule {path!r}") from None
    if attr in owner._parameters:
        param = owner._parameters[attr]
        if not isinstance(param, torch.Tensor):
            raise _fail(TypeError, f"plan entry {name!r}: the parameter is not a tensor (it is {param!r})")
        return owner, param
    if attr in owner._buffers:
        raise _fail(TypeError, f"plan entry {name!r}: is a buffer, not a parameter; only parameters are sharded")
    if hasattr(owner, attr):
        value = getattr(owner, attr)
        raise _fail(TypeError, f"plan entry {name!r}: is not a tensor parameter (it is a {type(value).__name__})")
    raise _fail(ValueError, f"plan entry {name!r}: the module has no parameter of that name")


def _check_param(name: str, owner: nn.Module, param: torch.Tensor, mesh: DeviceMesh) -> None:
    if isinstance(param, DTensor):
        raise _fail(ValueError, f"plan entry {name!r}: the parameter is already a DTensor (sharded)")
    if not isinstance(owner, (nn.Embedding, nn.EmbeddingBag)) or name.rpartition(".")[2] != "weight":
        raise _fail(
            ValueError,
            f"plan entry {name!r}: belongs to a {type(owner).__name__}; shard_module shards the weight of "
            "nn.Embedding and nn.EmbeddingBag modules (also inside a TorchRec EmbeddingBagCollection)",
        )
    if owner.scale_grad_by_freq or owner.sparse:
        raise _fail(
            NotImplementedError,
            f"plan entry {name!r}: the {type(owner).__name__} has "
            f"scale_grad_by_freq={owner.scale_grad_by_freq}, sparse={owner.sparse}; "
            "the sharded lookups support neither",
        )
    if not param.is_contiguous():
        raise _fail(
            ValueError, f"plan entry {name!r}: the parameter is not contiguous (stride {list(param.stride())})"
        )
    if not param.is_floating_point():
        raise _fail(TypeError, f"plan entry {name!r}: the parameter has dtype {param.dtype}, not floating point")
    if param.device.type != mesh.device_type:
        raise _fail(
            ValueError,
            f"plan entry {name!r}: the parameter is on {param.device} but device_mesh is a "
            f"{mesh.device_type!r} mesh",
        )


def _check_layout(name: str, layout: object, param: torch.Tensor, ranks: list[int]) -> ShardLayout:
    if not isinstance(layout, ShardLayout):
        raise _fail(TypeError, f"plan entry {name!r}: expected a ShardLayout, got {type(layout).__name__}")
    layout = layout.with_name(name)
    if layout.global_shape != tuple(param.shape):
        raise _fail(
            ValueError,
            f"plan entry {name!r}: the layout's global_shape {list(layout.global_shape)} differs from the "
            f"parameter's shape {list(param.shape)}",
        )
    if layout.dtype is not None and layout.dtype != param.dtype:
        raise _fail(
            ValueError,
            f"plan entry {name!r}: the layout's dtype {layout.dtype} differs from the parameter's {param.dtype}",
        )
    for i, s in enumerate(layout.shards):
        if s.rank is None or s.rank not in ranks:
            where = f"[0, {len(ranks)})" if ranks == list(range(len(ranks))) else str(ranks)
            raise _fail(
                ValueError,
                f"plan entry {name!r}: shard {i} (offsets {list(s.offsets)}, sizes {list(s.sizes)}) is on "
                f"rank {s.rank}, outside the mesh's ranks {where}",
            )
    try:
        layout.validate()
    except ValueError as e:
        raise _fail(ValueError, f"plan entry {name!r}: {e}") from None
    return layout


def _check_aliases(module: nn.Module, entries: list[PlanEntry]) -> None:
    """Two entries for one parameter, or a parameter tied to another module, are refused."""
    by_param: dict[int, str] = {}
    for e in entries:
        other = by_param.setdefault(id(e.param), e.name)
        if other != e.name:
            raise _fail(
                ValueError, f"plan entries {other!r} and {e.name!r} name the same parameter (aliases); keep one"
            )
    holders: dict[int, list[str]] = {id(e.param): [] for e in entries}
    for mod_name, m in module.named_modules(remove_duplicate=True):
        for attr, p in m._parameters.items():
            if p is not None and id(p) in holders:
                holders[id(p)].append(f"{mod_name}.{attr}" if mod_name else attr)
    for e in entries:
        if len(holders[id(e.param)]) > 1:
            raise _fail(
                ValueError,
                f"plan entry {e.name!r}: the parameter is tied to {sorted(holders[id(e.param)])}; "
                "sharding a parameter shared by several modules is not supported",
            )


def resolve_plan(
    module: object, plan: object, device_mesh: object, src_rank: object
) -> list[PlanEntry]:
    """Step 1: this rank's local checks; returns the entries in plan order.

    Raises:
        RejectedArguments: the first failed check (kind and message to raise on every rank).
    """
    if not isinstance(module, nn.Module):
        raise _fail(TypeError, f"module must be an nn.Module, got {type(module).__name__}")
    if not isinstance(plan, Mapping):
        raise _fail(TypeError, f"plan must be a mapping of parameter names to ShardLayouts, got {type(plan).__name__}")
    assert isinstance(device_mesh, DeviceMesh), "mesh_group checked it"
    _check_mesh(device_mesh, src_rank)
    ranks = _mesh_ranks(device_mesh)
    entries = []
    for name, layout in plan.items():
        if not isinstance(name, str):
            raise _fail(TypeError, f"plan keys must be parameter names (str), got {name!r}")
        owner, param = _lookup_param(module, name)
        _check_param(name, owner, param, device_mesh)
        entries.append(PlanEntry(name, owner, param, _check_layout(name, layout, param, ranks)))
    _check_aliases(module, entries)
    return entries


def _entry_digest(name: object, layout: object) -> int:
    if isinstance(layout, ShardLayout):
        blocks = [(s.rank, s.offsets, s.sizes) for s in layout.shards]
        text = repr((name, layout.global_shape, str(layout.dtype), blocks))
    else:
        text = repr((name, type(layout).__name__))
    return _digest(text)


def _digest(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 2


def _plan_digests(plan: object) -> dict[str, int] | None:
    if not isinstance(plan, Mapping):
        return None
    return {str(k): _entry_digest(k, v) for k, v in plan.items()}


def agree(
    plan: object, src_rank: object, entries: list[PlanEntry] | None, error: RejectedArguments | None,
    group: CommGroup,
) -> None:
    """Step 2: every rank's verdict and digests in one agreement ``all_gather``; *collective* over ``group``.

    Raises:
        TypeError, ValueError, NotImplementedError: on every rank, when any
            rank's checks failed (its own kind and message) or the ranks passed
            different plans, ``src_rank`` values or parameter dtypes.
    """
    digests = _plan_digests(plan)
    dtypes = None if entries is None else {e.name: str(e.param.dtype) for e in entries}
    src = src_rank if isinstance(src_rank, int) and not isinstance(src_rank, bool) else -1
    mine = [src, _digest(repr(sorted((digests or {}).items()))), _digest(repr(sorted((dtypes or {}).items())))]
    rows = agreement.agree("shard_module", None if error is None else error.problem, mine, group,
                           refused="refused the call")
    if any(r[0] != rows[0][0] for r in rows):
        raise ValueError(f"shard_module: ranks passed different src_rank values {[r[0] for r in rows]} (rank order)")
    if any(r[1] != rows[0][1] for r in rows):
        plans: list[dict[str, int]] = [p or {} for p in agreement.gather_objects(digests, group)]
        keys = sorted({k for p in plans for k in p})
        differ = [k for k in keys if len({p.get(k) for p in plans}) > 1]
        raise ValueError(
            f"shard_module: ranks passed different plans; entries that differ: {differ} "
            f"(a missing entry or a different layout); every rank must pass the same plan"
        )
    if any(r[2] != rows[0][2] for r in rows):
        seen_all: list[dict[str, str]] = [d or {} for d in agreement.gather_objects(dtypes, group)]
        for name in seen_all[0]:
            seen = [d.get(name) for d in seen_all]
            if len(set(seen)) > 1:
                raise ValueError(
                    f"shard_module: parameter {name!r} has different dtypes on the ranks: {seen} (rank order)"
                )
        raise ValueError("shard_module: the ranks' parameters differ in dtype")
