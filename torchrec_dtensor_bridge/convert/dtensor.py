"""Zero-copy ShardedTensor <-> DTensor for single tensors (whole state_dicts: :mod:`.state_dicts`)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from .._compat import ShardedTensor, make_sharded_tensor, sharded_tensor_process_group
from ..layout import LayoutKind, ShardLayout, ShardSpec, contiguous_strides
from ..wrapper import LocalShardsWrapper
from ..groups import CommGroup, comm_group, of_group, sharding_axis
from .metadata import layout_from_sharded_tensor, layout_to_sharded_tensor_metadata
from .placements import layout_from_placements, placement_for_layout, world_mesh

__all__ = [
    "dtensor_from_local_shards",
    "gather_layout",
    "layout_of",
    "needs_layout_gather",
    "local_shards_of",
    "sharded_from_layout",
    "to_dtensor",
    "to_sharded_tensor",
]


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def dtensor_from_local_shards(
    layout: ShardLayout,
    local_shards: list[torch.Tensor],
    *,
    device_mesh: DeviceMesh | None = None,
    process_group: dist.ProcessGroup | None = None,
    device: torch.device | str | None = None,
    wrap: bool = False,
) -> DTensor:
    """A DTensor over this rank's ``local_shards`` (in ``layout.shards_on(rank)`` order).

    Not collective and zero-copy: the DTensor's local shards are ``local_shards``.
    The local tensor is a plain tensor where the placements describe the layout
    exactly, else a :class:`LocalShardsWrapper` carrying the layout; ``wrap=True``
    gives the wrapper for every sharded layout (the form TorchRec's ``load_state_dict``
    reads). A full replica on every mesh rank keeps its plain tensor: under
    ``Replicate()`` DTensor hands the local tensor itself to the user (``full_tensor()``).
    """
    rank = _rank()
    mine = layout.shards_on(rank)
    if len(mine) != len(local_shards):
        raise ValueError(
            f"table {layout.name!r}: rank {rank} holds {len(mine)} shards in the layout "
            f"but {len(local_shards)} local tensors were given"
        )
    for i, (spec, t) in enumerate(zip(mine, local_shards)):
        if tuple(t.shape) != spec.sizes:
            raise ValueError(
                f"table {layout.name!r}: local shard {i} on rank {rank} has shape {list(t.shape)}, "
                f"layout says {list(spec.sizes)} at offsets {list(spec.offsets)}"
            )
    dev = torch.device(device) if device is not None else (
        local_shards[0].device if local_shards else _device_of_layout(layout)
    )
    dtype = local_shards[0].dtype if local_shards else (layout.dtype or torch.get_default_dtype())
    if layout.dtype is None:
        layout = ShardLayout(layout.global_shape, layout.shards, dtype, layout.name)
    where = placement_for_layout(layout, dev.type, device_mesh, process_group)
    replica = where.exact and all(isinstance(p, Replicate) for p in where.placements)
    if where.exact and len(local_shards) <= 1 and (replica or not wrap):
        local = local_shards[0] if local_shards else torch.empty(
            (0,) * layout.ndim, dtype=dtype, device=dev
        )
    else:
        local = LocalShardsWrapper(
            local_shards, [s.offsets for s in mine], layout.global_shape, layout=layout, dtype=dtype, device=dev,
            _trusted=_consistent(local_shards),
        )
    shape = torch.Size(layout.global_shape)
    return DTensor.from_local(
        local, where.mesh, where.placements, run_check=False, shape=shape, stride=contiguous_strides(shape)
    )


def _consistent(shards: list[torch.Tensor]) -> bool:
    """Shards already matched to a validated layout need only agree in dtype and device."""
    return all(s.dtype == shards[0].dtype and s.device == shards[0].device for s in shards[1:])


def _device_of_layout(layout: ShardLayout) -> torch.device:
    for s in layout.shards:
        if s.device:
            return torch.device(torch.device(s.device).type)
    return torch.device("cpu")


def to_dtensor(
    sharded_tensor: ShardedTensor | DTensor, device_mesh: DeviceMesh | None = None, *, name: str | None = None
) -> DTensor:
    """The DTensor view of a ShardedTensor; not collective, zero-copy.

    Given a DTensor instead (e.g. one of TorchRec's ``output_dtensor=True``
    DTensors, whose local tensor is a shards wrapper without the table's
    layout), returns the same DTensor - same mesh and local shards - with
    our :class:`LocalShardsWrapper` carrying the whole layout, which lookups
    need. Its placements are kept, except where they misdescribe the layout
    on a 1-D mesh of several ranks: TorchRec's ``Replicate()`` for a table one
    rank holds and ``Shard(1)`` for a table-row-wise table become
    ``Shard(0)``, so that DTensor's own ``full_tensor()`` and reductions
    give the table's values on every rank. This is *collective* exactly when :func:`layout_of` is
    (a layout-less wrapper on a mesh of several ranks: every rank of its group
    calls it); a DTensor that already carries its layout is returned as is.
    A table on a one-rank mesh needs no communication: its owner's wrapper
    holds the whole table, and every other rank (an empty plain tensor, or an
    empty wrapper with or without a layout) gets the layout from the mesh and
    an empty wrapper carrying it.

    The result's local shards are the ShardedTensor's local tensors (same
    ``data_ptr``). A ShardedTensor of a sub-group gives a DTensor on that
    group's mesh (also a table held by one rank), so its collectives stay there.
    Works for every TorchRec sharding type; a table-wise table lives on the
    mesh of the whole group (``Shard(0)``; its owner holds it, the others an
    empty wrapper), like every other table of the model. The local tensor is always a
    :class:`LocalShardsWrapper` carrying the whole layout (as in TorchRec's own
    DTensors), so TorchRec's ``load_state_dict`` of a ShardedTensor or
    ``output_dtensor=True`` module reads it directly.

    Example::

        >>> dt = tdb.to_dtensor(model.state_dict()["ebc.embedding_bags.t0.weight"])
        >>> tdb.full_tensor(dt)  # the whole table on every rank
    """
    if isinstance(sharded_tensor, DTensor):
        return _with_layout(sharded_tensor, name or "table")
    if not isinstance(sharded_tensor, ShardedTensor):
        raise TypeError(f"to_dtensor expects a ShardedTensor or DTensor, got {type(sharded_tensor).__name__}")
    layout = layout_from_sharded_tensor(sharded_tensor, name=name or "table")
    tensors = _in_layout_order(sharded_tensor, layout.shards_on(_rank()))
    group = sharded_tensor_process_group(sharded_tensor)
    if device_mesh is None and group is not None and of_group(group).members != of_group(None).members:
        # a ShardedTensor of a sub-group stays on that group's mesh (a one-rank mesh would send the
        # table's collectives to the default group)
        device_mesh = world_mesh(_device_of_layout(layout).type if not tensors else tensors[0].device.type, group)
    return dtensor_from_local_shards(layout, tensors, device_mesh=device_mesh, process_group=group, wrap=True)


def _with_layout(t: DTensor, name: str) -> DTensor:
    """``t`` with its local tensor our wrapper carrying the whole layout (zero-copy; see :func:`to_dtensor`)."""
    local: Any = t._local_tensor
    if isinstance(local, LocalShardsWrapper) and local.layout_of_table is not None:
        placements = _true_placements(t, local.layout_of_table)
        if (local.layout_of_table.name == name or name == "table") and placements == tuple(t.placements):
            return t
        # the same shards under the table's name (its state_dict key): what errors and pictures say
        if name != "table":
            local = local._like(local.local_shards(), local.layout_of_table.with_name(name))
        return DTensor.from_local(local, t.device_mesh, placements, run_check=False, shape=t.shape,
                                  stride=t.stride())
    layout = layout_of(t, name=name)
    if layout.dtype is None:
        layout = ShardLayout(layout.global_shape, layout.shards, t.dtype, layout.name)
    mine = layout.shards_on(_rank())
    if _is_shards_wrapper(local):  # match by offsets and sizes: an empty block may share offsets with a real one
        by_key = dict(zip(_blocks(local), local.local_shards()))
        tensors = [by_key[(spec.offsets, spec.sizes)] for spec in mine]
    else:  # a plain local tensor: this rank's one block (or none)
        tensors = local_shards_of(t)
    dev = tensors[0].device if tensors else local.device
    if dev.type == "meta":  # TorchRec's empty wrapper of a rank that holds nothing is a meta tensor
        dev = torch.device(t.device_mesh.device_type)
    wrapped = LocalShardsWrapper(tensors, [s.offsets for s in mine], layout.global_shape, layout=layout,
                                 dtype=t.dtype, device=dev, _trusted=_consistent(tensors))
    return DTensor.from_local(wrapped, t.device_mesh, _true_placements(t, layout), run_check=False,
                              shape=t.shape, stride=t.stride())


def _true_placements(t: DTensor, layout: ShardLayout) -> tuple:
    """``t``'s placements, with the sharding axis' placement the one DTensor needs for ``layout``
    (:attr:`~..layout.ShardLayout.nearest_shard_dim`, as every DTensor of ours carries).

    TorchRec marks a table-wise table ``Replicate()`` on the whole mesh though one rank holds it (DTensor
    would take each rank's local result of a reduction, 0 on the others, for the table's) and a
    table-row-wise table ``Shard(1)`` though its rows are cut (``full_tensor()`` would gather columns).
    A replicated layout, a one-rank mesh and a mesh of several axes (TorchRec's 2-D ``DMPCollection``,
    whose layouts list every replica's blocks) keep theirs."""
    placements = tuple(t.placements)
    mesh = t.device_mesh
    axis = sharding_axis(mesh, placements)
    if mesh.ndim != 1 or mesh.size() == 1 or axis is None or layout.kind is LayoutKind.REPLICATED:
        return placements
    fixed = list(placements)
    fixed[axis] = Shard(layout.nearest_shard_dim or 0)
    return tuple(fixed)


def _is_shards_wrapper(t: Any) -> bool:
    return callable(getattr(t, "local_shards", None)) and callable(getattr(t, "local_offsets", None))


def carried_name(t: Any) -> str | None:
    """The table name a DTensor's or wrapper's carried layout records (``None``: it carries none)."""
    local = t._local_tensor if isinstance(t, DTensor) else t
    layout = local.layout_of_table if isinstance(local, LocalShardsWrapper) else None
    return None if layout is None else layout.name


def layout_of(
    t: DTensor | ShardedTensor | LocalShardsWrapper,
    *,
    name: str | None = None,
    process_group: dist.ProcessGroup | None = None,
) -> ShardLayout:
    """The layout of a DTensor, ShardedTensor or layout-carrying wrapper; ranks are global ranks.

    Collective-free, except for ONE case, which is documented collective: a
    DTensor of several ranks whose local tensor is a shards wrapper without a
    layout (TorchRec's own wrapper, torch's ``LocalShardsWrapper``). Then
    every rank of its group (:func:`..groups.comm_group`: the mesh's sharding
    axis, or ``process_group``) must call it, in the same order, and the
    offsets are gathered on that group; blocks of other replica groups of a
    2-D mesh are taken to be the same (the replica axis holds identical data).
    On such a mesh every rank's local tensor must be a layout-less shards
    wrapper (an empty one where a rank holds nothing, TorchRec's convention),
    or every rank's must carry the layout: a rank cannot know that the others
    communicate.

    A table on a one-rank mesh (a table held by one rank, torch's table-wise
    example) never communicates: the mesh's rank holds the whole table, so
    its own blocks are the layout, and every other rank derives the layout
    from the mesh and placements, whatever its form of "nothing on this
    rank" (an empty plain tensor, or an empty shards wrapper with or without
    a layout). A rank outside the mesh that holds data raises ``ValueError``.

    Args:
        t: the tensor.
        name: the table's name, for the layout and error messages.
        process_group: the group a layout gather runs on (default: :func:`..groups.comm_group`).

    Returns:
        The whole table's layout.

    Raises:
        TypeError: ``t`` is not a DTensor, ShardedTensor or LocalShardsWrapper.
        ValueError: a wrapper that carries no layout on its own; a table on a
            one-rank mesh whose owner's blocks do not cover it, or whose other
            ranks hold data; a rank outside a mesh of several ranks whose
            wrapper carries no layout (it cannot take part in the gather).

    Example::

        >>> tdb.layout_of(dt).kind
        <LayoutKind.ROW_WISE: 'row_wise'>
    """
    name = name or carried_name(t) or "table"
    if isinstance(t, ShardedTensor):
        return layout_from_sharded_tensor(t, name=name)
    if isinstance(t, LocalShardsWrapper):
        if t.layout_of_table is None:
            raise ValueError(f"table {name!r}: this LocalShardsWrapper carries no layout of the whole table")
        return t.layout_of_table.with_name(name)
    if not isinstance(t, DTensor):
        raise TypeError(f"table {name!r}: expected a DTensor or ShardedTensor, got {type(t).__name__}")
    local = t._local_tensor
    if isinstance(local, LocalShardsWrapper) and local.layout_of_table is not None:
        return local.layout_of_table.with_name(name)
    if t.device_mesh.size() == 1:
        return _one_rank_layout(t, local, name)
    if needs_layout_gather(t):
        return gather_layout(t, _blocks(local), name=name, process_group=process_group)
    return layout_from_placements(t.device_mesh, t.placements, t.shape, dtype=t.dtype, name=name)


def needs_layout_gather(t: DTensor) -> bool:
    """Whether :func:`layout_of` ``(t)`` is a collective: a layout-less shards wrapper on a mesh of
    several ranks. Local; ranks of one DTensor that answer differently hold inconsistent DTensors."""
    local = t._local_tensor
    if isinstance(local, LocalShardsWrapper) and local.layout_of_table is not None:
        return False
    return _is_shards_wrapper(local) and t.device_mesh.size() > 1


def _one_rank_layout(t: DTensor, local: Any, name: str) -> ShardLayout:
    """A table on a one-rank mesh: all of it on the mesh's rank; collective-free on every rank."""
    mesh = t.device_mesh
    if mesh.get_coordinate() is not None:  # the owner: its blocks are the whole layout
        if _is_shards_wrapper(local):
            return _own_layout(t, local, name)
        return layout_from_placements(mesh, t.placements, t.shape, dtype=t.dtype, name=name)
    owner = int(mesh.mesh.flatten()[0].item())
    if _is_shards_wrapper(local):
        held = [(list(o), list(s.shape)) for o, s in zip(local.local_offsets(), local.local_shards()) if s.numel()]
    else:
        held = [([0] * local.ndim, list(local.shape))] if local.numel() else []
    if held:
        raise ValueError(
            f"table {name!r}: rank {_rank()} is outside the one-rank mesh of rank {owner} (the rank that holds "
            f"the whole table) but its local tensor holds blocks (offsets, sizes) {held}; a rank that holds "
            "nothing of the table passes an empty tensor or an empty LocalShardsWrapper"
        )
    return layout_from_placements(mesh, t.placements, t.shape, dtype=t.dtype, name=name)


def _blocks(local: Any) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    return [
        (tuple(int(v) for v in o), tuple(int(v) for v in s.shape))
        for o, s in zip(local.local_offsets(), local.local_shards())
    ]


def _own_layout(t: DTensor, local: Any, name: str) -> ShardLayout:
    rank = _rank()
    lay = ShardLayout(tuple(t.shape), tuple(ShardSpec(rank, o, s) for o, s in _blocks(local)), t.dtype, name)
    try:
        lay.validate()
    except ValueError as e:
        raise ValueError(
            f"{e}; rank {rank} is the only rank of this table's one-rank mesh, so its LocalShardsWrapper must "
            "hold the whole table (or carry the layout: LocalShardsWrapper(..., layout=...))"
        ) from None
    return lay


def gather_layout(
    t: DTensor,
    blocks: Sequence[tuple[tuple[int, ...], tuple[int, ...]]],
    *,
    name: str = "table",
    process_group: dist.ProcessGroup | None = None,
) -> ShardLayout:
    """The layout made of every group member's ``blocks``; *collective* over ``t``'s group.

    Every member of the group (:func:`..groups.comm_group` of ``t`` and
    ``process_group``) calls it, in the same order, with its own blocks
    (``(offsets, sizes)`` in the order of its local shards; none where it holds
    nothing). On a mesh of more axes than the group's, the other lines hold
    what the member at the same coordinate of the group's axis holds (replica
    axes hold identical data). Every rank builds and validates the same
    layout, so every rank returns it or every rank raises the same error.

    Raises:
        ValueError: this rank is not in the group (raised without
            communicating), or the gathered blocks do not make a valid layout.
    """
    rank = _rank()
    outside = process_group is None and t.device_mesh.get_coordinate() is None
    group = None if outside else comm_group(t, process_group)
    if group is None or rank not in group.members:
        members = list(group.members) if group else [int(r) for r in t.device_mesh.mesh.flatten().tolist()]
        raise ValueError(
            f"table {name!r}: rank {rank} is not in the group of ranks {members} this DTensor's "
            "layout is gathered on, and its local tensor carries no layout; call it on the group's ranks only, "
            "or give this rank's empty LocalShardsWrapper the layout (layout=...)"
        )
    everyone: list[Any] = [None] * group.size
    mine = [(tuple(int(v) for v in o), tuple(int(v) for v in z)) for o, z in blocks]
    dist.all_gather_object(everyone, (rank, mine), group=group.group)
    shards = [ShardSpec(r, o, s) for r, held in everyone for o, s in held]
    shards += _replica_blocks(t, group, everyone)
    lay = ShardLayout(tuple(t.shape), tuple(shards), t.dtype, name)
    lay.validate()
    return lay


def _replica_blocks(t: DTensor, group: CommGroup, everyone: list[Any]) -> list[ShardSpec]:
    """On a mesh of more axes than the group's, the blocks of the other lines: rank ``q`` holds what
    the group member at ``q``'s coordinate on the group's axis holds (replica axes hold identical data)."""
    mesh = t.device_mesh
    axis = sharding_axis(mesh, t.placements)
    if mesh.ndim == 1 or axis is None or group.mesh is not mesh:
        return []
    held = dict(everyone)
    ranks = mesh.mesh
    out = []
    for coord in itertools.product(*(range(n) for n in ranks.shape)):
        q = int(ranks[coord].item())
        if q not in held:
            out += [ShardSpec(q, o, s) for o, s in held[group.members[coord[axis]]]]
    return out


def _in_layout_order(st: ShardedTensor, specs: tuple[ShardSpec, ...]) -> list[torch.Tensor]:
    """``st``'s local tensors ordered as ``specs`` (a ShardedTensor may keep its local
    shards in another order than its metadata). Matched by offsets AND sizes: an
    empty block may share its offsets with a real one."""
    pool: dict[tuple, list[torch.Tensor]] = {}
    for s in st.local_shards():
        key = (tuple(s.metadata.shard_offsets), tuple(s.metadata.shard_sizes))
        pool.setdefault(key, []).append(s.tensor)
    return [pool[(spec.offsets, spec.sizes)].pop(0) for spec in specs]


def local_shards_of(t: DTensor | ShardedTensor) -> list[torch.Tensor]:
    """This rank's shard tensors (real storage), in the layout's order for this rank."""
    if isinstance(t, ShardedTensor):
        return _in_layout_order(t, layout_from_sharded_tensor(t).shards_on(_rank()))
    local: Any = t._local_tensor
    if _is_shards_wrapper(local):
        return list(local.local_shards())
    if t.device_mesh.get_coordinate() is None:
        return []  # a rank outside the mesh holds nothing
    return [local]


def to_sharded_tensor(dtensor: DTensor, process_group: dist.ProcessGroup | None = None) -> ShardedTensor:
    """The ShardedTensor view of a DTensor; zero-copy; the inverse of :func:`to_dtensor`.

    Not collective, except for a layout-less shards wrapper (see :func:`layout_of`).
    The ShardedTensor's process group is ``process_group``, else the group of a
    1-D mesh of several ranks (its placement ranks are ranks of that group), else
    the default group.

    The metadata lists every shard of every rank (offsets, sizes, placement) as
    TorchRec builds it. Replicated (data-parallel) DTensors have no
    ShardedTensor form and raise ``ValueError``.
    """
    if not isinstance(dtensor, DTensor):
        raise TypeError(f"to_sharded_tensor expects a DTensor, got {type(dtensor).__name__}")
    return sharded_from_layout(dtensor, layout_of(dtensor, process_group=process_group), process_group)


def sharded_from_layout(
    dtensor: DTensor, layout: ShardLayout, process_group: dist.ProcessGroup | None
) -> ShardedTensor:
    """:func:`to_sharded_tensor` once ``layout_of(dtensor)`` is known (it may be collective)."""
    if layout.kind is LayoutKind.REPLICATED or len(layout.unique_shards()) != len(layout.shards):
        raise ValueError(
            f"a replicated DTensor (placements {dtensor.placements}) has no ShardedTensor form; "
            "use its local tensor"
        )
    if process_group is None and dtensor.device_mesh.ndim == 1 and dtensor.device_mesh.size() > 1:
        process_group = comm_group(dtensor).group
    rank = _rank()
    mine = layout.shards_on(rank)
    tensors = local_shards_of(dtensor)
    if len(tensors) != len(mine):
        raise ValueError(f"rank {rank} holds {len(tensors)} local tensors but the layout lists {len(mine)} shards")
    device = tensors[0].device if tensors else _device_of_layout(layout)
    md = layout_to_sharded_tensor_metadata(
        layout, process_group=process_group, device=device, requires_grad=dtensor.requires_grad
    )
    local_md = [m for m, s in zip(md.shards_metadata, layout.shards) if s.rank == rank]
    return make_sharded_tensor(list(zip(tensors, local_md)), md, process_group)
