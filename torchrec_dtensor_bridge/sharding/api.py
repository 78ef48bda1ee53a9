"""``shard_module``: turn a module's embedding tables into DTensor-sharded parameters."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..agreement import RejectedArguments
from ..convert.dtensor import dtensor_from_local_shards
from ..groups import CommGroup
from ..layout import ShardLayout
from .checks import PlanEntry, agree, mesh_group, resolve_plan
from .ebc import ebc_forward, ebc_owners
from .modules import GATHER_OUTPUT_ATTR, GROUP_ATTR, forward_for, install_forward
from .scatter import scatter_blocks

__all__ = ["shard_module"]


def _sharded_parameter(entry: PlanEntry, device_mesh: DeviceMesh, src_rank: int, group: CommGroup) -> nn.Parameter:
    with torch.no_grad():
        shards = scatter_blocks(entry.param.detach(), entry.layout, src_rank, group.members)
    # the table's dtype, also where this rank holds none of it (an fp16 table is fp16 on every rank)
    layout = dataclasses.replace(entry.layout, dtype=entry.param.dtype)
    dt = dtensor_from_local_shards(layout, shards, device_mesh=device_mesh, device=entry.param.device)
    return nn.Parameter(dt, requires_grad=entry.param.requires_grad)


def shard_module(
    module: nn.Module,
    plan: Mapping[str, ShardLayout],
    device_mesh: DeviceMesh,
    src_rank: int = 0,
    *,
    gather_output: bool = False,
) -> nn.Module:
    """Shard ``module``'s embedding tables as ``plan`` says, with ``src_rank``'s values; *collective*.

    Mirrors PyTorch's older ``torch.distributed._shard.shard_module``. Every
    rank of ``device_mesh`` calls it with the same ``plan`` and ``src_rank``;
    its collectives, and those of the sharded module's forwards, run on the
    mesh's group (other ranks take no part). Steps, the same on every rank:

    1. check the call locally (below) and agree on the verdict, the plan,
       ``src_rank`` and the parameters' dtypes (digests) in one agreement
       ``all_gather``; on any failure or disagreement every rank raises and
       the module is left unchanged;
    2. for each entry in plan order, ``src_rank`` sends every rank exactly the
       blocks the layout gives it (point to point, never the whole table);
       other ranks' values of the table are ignored;
    3. each parameter becomes ``nn.Parameter(DTensor)`` over the received
       blocks (``requires_grad`` kept), and each sharded module's forward runs
       the sharded lookups: its class is swapped for a cached subclass
       (``ShardedEmbeddingBag``, ``ShardedEmbedding``,
       ``ShardedEmbeddingBagCollection``) that only overrides ``forward``.

    Forwards are *collective*; each rank passes its own batch (sizes may
    differ) and gets its own batch's output: ``nn.EmbeddingBag`` ->
    :func:`~torchrec_dtensor_bridge.sharded_embedding_bag` with the module's
    ``mode``, ``padding_idx``, ``max_norm``, ``norm_type`` and
    ``include_last_offset``; ``nn.Embedding`` ->
    :func:`~torchrec_dtensor_bridge.sharded_embedding`; a TorchRec
    ``EmbeddingBagCollection`` takes a ``KeyedJaggedTensor`` and returns a
    ``KeyedTensor`` like TorchRec's, all its sharded tables looked up in ONE
    :func:`~torchrec_dtensor_bridge.sharded_embedding_bags` call (tables not
    in the plan stay local).
    Backward fills ``weight.grad`` with a DTensor of the weight's layout
    holding the gradient of all ranks' batches.

    Args:
        module: the unsharded module; modified in place.
        plan: parameter name (as in ``module.named_parameters()``, e.g.
            ``"weight"``, ``"emb.weight"``, ``"embedding_bags.t0.weight"``) ->
            layout of that table over global ranks (ranks of ``device_mesh``).
        device_mesh: a 1-D mesh holding this rank: the whole world or a
            sub-mesh. A table held by one rank lives on that rank's one-rank
            mesh, as everywhere in this package; the module's lookups still run
            on ``device_mesh``'s group.
        src_rank: the (global) rank whose values are scattered; a rank of the mesh.
        gather_output: the output hook. ``False`` (default): each rank gets
            only the local part - its own batch's output, a plain tensor.
            ``True``: the output is resharded to a full copy - every rank gets
            all ranks' outputs concatenated in rank order (for an EBC, the
            ``KeyedTensor`` values), with a backward that sums every rank's
            gradient of a row.

    Returns:
        ``module`` itself, sharded.

    Raises:
        TypeError, ValueError, NotImplementedError: on every rank when any rank
            finds a problem: a plan that is not a mapping of names to
            ``ShardLayout``s; a name that is missing, not a tensor parameter,
            or not the weight of an embedding module; a non-contiguous or
            already sharded parameter; a layout whose global shape or dtype
            differs from the parameter's, that does not cover the table, or
            that puts a block on a rank outside the mesh; two entries for one
            parameter, or a parameter tied to several modules; a bad mesh or
            ``src_rank``; ranks passing different plans or ``src_rank``.

    Example::

        >>> emb = nn.EmbeddingBag(1000, 64, mode="sum")
        >>> mesh = init_device_mesh("cpu", (world,))
        >>> shard_module(emb, {"weight": ShardLayout.row_wise((1000, 64), world)}, mesh)
        >>> out = emb(ids, offsets)      # this rank's bags; emb.weight is a DTensor
        >>> out.sum().backward()         # emb.weight.grad: a DTensor like emb.weight
    """
    group = mesh_group(device_mesh)
    error, entries = None, None
    try:
        if not isinstance(gather_output, bool):
            raise RejectedArguments(TypeError, f"shard_module: gather_output must be a bool, got {gather_output!r}")
        entries = resolve_plan(module, plan, device_mesh, src_rank)
    except RejectedArguments as e:
        error = e
    agree(plan, src_rank, entries, error, group)
    assert entries is not None and isinstance(src_rank, int)
    params = [_sharded_parameter(e, device_mesh, src_rank, group) for e in entries]
    # Nothing above touched the module; from here on nothing can fail.
    owners = ebc_owners(module)
    for entry, param in zip(entries, params):
        entry.owner._parameters[entry.name.rpartition(".")[2]] = param
        install_forward(entry.owner, forward_for(entry.owner))
        ebc = owners.get(id(entry.owner))
        if ebc is not None:
            install_forward(ebc, ebc_forward)
        for holder in (entry.owner, ebc):
            if holder is not None:
                setattr(holder, GROUP_ATTR, group.group)
        setattr(ebc if ebc is not None else entry.owner, GATHER_OUTPUT_ATTR, gather_output)
    return module
