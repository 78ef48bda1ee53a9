"""``sharded_embedding_bag`` and ``sharded_embedding``: torch's functional lookups on DTensor tables.

Order of work on every rank (the same on all ranks, so nothing can hang):

0. resolve the weight once (:func:`resolve_table`: layout, local shards,
   the call's group - the weight's mesh, its sharding axis on a 2-D mesh, or
   ``process_group`` - and strategy), collective-free;
1. validate the arguments locally (:mod:`.arguments`), recording - not raising - a failure;
2. one agreement ``all_gather`` on that group: every rank's verdict, batch
   sizes, options, a digest of the weight's layout and its input's kind; any
   failure or disagreement raises on every rank;
3. send every rank's ids to the ranks that compute blocks of the table - a row-cut
   table's ids each only to the rank holding its row (the strategy's route; the counts
   travel in step 2) - in one ``all_to_all``; none when the table is fully
   replicated and needs no ``max_norm``;
4. ``max_norm``: renormalise the referenced stored rows in place;
5. the pooled lookup and its strategy's exchanges (:mod:`.function`);
6. ``mean``: divide by the true bag size; ``max``: empty bags give 0.

Step 0 is this module's own, shared with :mod:`.tables` (collective-free): :func:`lookup_group`, the call's
group (:func:`..groups.call_group`) with its collectives' tensors on the tables' device (:func:`on_device`), and
:func:`resolve_table`, a weight's layout in the group's ranks, this rank's shards and its strategy
(:func:`pick_strategy`, the one place that picks one), shards in CUDA unified memory refused
(:func:`refuse_unified_memory`). A DTensor whose local tensor is a shards wrapper without a layout (TorchRec's
own) would need a collective to learn its layout; it is refused (through the agreement step):
``tdb.to_dtensor(w)`` (collective, zero-copy) gives the same table with its layout.

DTensor inputs (``Shard(0)`` or ``Replicate()`` on a 1-D mesh over the lookup's group) are described in
:mod:`.dtensor_input`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from .. import kernels
from ..agreement import Rejected, RejectedArguments
from ..convert.dtensor import layout_of, local_shards_of, needs_layout_gather
from ..groups import CommGroup, call_group
from ..layout import ShardLayout
from ..optim import FusedOptimizer
from . import dtensor_input
from .entry import InputKind
from .arguments import Bags, TableCodes, TableOptions, bags_for_embedding, bags_from_input, bind_optimizer, check_options
from .entry import agree_and_route, finish, psw_grad, run_tables
from .plan import ResolvedTable, Strategy
from .strategies import COLUMNS, ROWS, WHOLE

__all__ = [
    "lookup_group", "on_device", "pick_strategy", "refuse_unified_memory", "resolve_table", "sharded_embedding",
    "sharded_embedding_bag",
]


def _plain_inputs(fn: str, **others: object) -> None:
    """A plain ``input``'s companions must be plain too. Local; raises :class:`RejectedArguments`."""
    for name, v in others.items():
        if isinstance(v, DTensor):
            raise RejectedArguments(TypeError, f"{fn}: {name} is a DTensor but input is not; pass both as DTensors")


def _local_inputs(fn: str, input: object, **others: object) -> tuple[Any, dict[str, Any]]:
    """The local parts of ``input`` and of its companions. Local; raises :class:`RejectedArguments`."""
    if isinstance(input, DTensor):
        return dtensor_input.local_inputs(fn, input, **others)
    _plain_inputs(fn, **others)
    return input, others


def _edge(fn: str, weight: object, input: object, process_group: dist.ProcessGroup | None
          ) -> tuple[CommGroup, InputKind, Any, ResolvedTable | None, RejectedArguments | None]:
    """The API edge, the same on every rank: the call's group (raises directly when there is none), the
    input's kind, and the weight resolved once (a failure is recorded for the agreement step)."""
    error: RejectedArguments | None = None
    kind, input_group = InputKind.PLAIN, None
    if isinstance(input, DTensor):
        try:
            kind, input_group = dtensor_input.input_kind(fn, input)
        except RejectedArguments as e:
            error = e
    group = lookup_group(fn, [weight], process_group, input_group)
    mesh = input.device_mesh if isinstance(input, DTensor) else None
    table = None
    if error is None:
        try:
            table = resolve_table(fn, weight, group)
        except RejectedArguments as e:
            error = e
    return group, kind, mesh, table, error


@dataclass(frozen=True)
class _Lookup:
    """One table's lookup, done: this rank's finished output and what shapes it as the caller's result."""

    out: torch.Tensor
    bags: Bags
    kind: InputKind
    mesh: Any
    placements: list | None = None
    """A ``Replicate()`` batch answered without communication: the output's placements (else ``None``)."""
    columns: bool = False
    """... and whether ``out`` is this rank's columns."""
    rows: list[int] = dataclasses.field(default_factory=list)
    """Otherwise: every rank's number of bags (or ids), in rank order."""


def _lookup(
    fn: str, op: int, input: Any, weight: Any, *, mode: str, max_norm: float | None, norm_type: float,
    skip_padding: bool, process_group: dist.ProcessGroup | None, optimizer: FusedOptimizer | None,
    prepare: Callable[[Any, InputKind], tuple[Any, int | None, Bags]],
) -> _Lookup:
    """Steps 0-6 of the module docstring for one table, shared by both functions: the API edge, the local
    checks (``prepare(input, kind)`` -> (local input, padding, bags), raising :class:`RejectedArguments`),
    then a ``Replicate()`` batch's communication-free path or the agreement and the lookup."""
    group, kind, mesh, table, error = _edge(fn, weight, input, process_group)
    bags, padding, bind = None, None, None
    shape = tuple(weight.shape) if isinstance(weight, DTensor) else ()
    dtype = weight.dtype if isinstance(weight, DTensor) else None
    if error is None:
        try:
            bind = bind_optimizer(fn, optimizer, weight)
            _, padding, bags = prepare(input, kind)
        except RejectedArguments as e:
            error = e
    codes = [TableCodes.of(op, mode, padding, max_norm, norm_type, shape, dtype, -1 if table is None else table.digest,
                           optimizer=bind, psw_grad=bags is not None and psw_grad(bags))]
    if kind is InputKind.REPLICATE:
        dtensor_input.check_replicated(fn, error, bags, codes, group)
        assert bags is not None and table is not None
        done = dtensor_input.replicated_input(table, bags, mode=mode, padding=padding, skip_padding=skip_padding,
                                              max_norm=max_norm, norm_type=norm_type, binding=bind, fn=fn)
        if done is not None:
            return _Lookup(done[0], bags, kind, mesh, placements=done[1], columns=done[2])
        assert group.rank is not None
        bags = dtensor_input.split_bags(bags, group.size, group.rank)  # max on a layout without a Partial("max")
    opts = [TableOptions(mode, padding, max_norm, norm_type)]
    tables = [] if table is None else [table]
    infos, routes = agree_and_route(fn, error, tables, None if bags is None else [bags], opts, codes, group,
                                    kind=InputKind.PLAIN if kind is InputKind.REPLICATE else kind)
    assert bags is not None
    (out,) = run_tables(tables, [bags], infos, opts, routes, skip_padding=skip_padding, bindings=[bind], fn=fn)
    return _Lookup(finish(out, bags, mode, padding), bags, kind, mesh, rows=[i.num_bags for i in infos[0]])


def _replicated_dtensor(res: _Lookup, shape: tuple[int, ...]) -> DTensor:
    assert res.placements is not None
    return dtensor_input.replicated_dtensor(res.out, res.mesh, res.placements, shape)


@torch.compiler.disable(recursive=True)  # collectives and data-dependent routing: a graph break
def sharded_embedding_bag(
    input: torch.Tensor,
    weight: DTensor,
    offsets: torch.Tensor | None = None,
    *,
    mode: str = "mean",
    per_sample_weights: torch.Tensor | None = None,
    padding_idx: int | None = None,
    include_last_offset: bool = False,
    max_norm: float | None = None,
    norm_type: float = 2.0,
    scale_grad_by_freq: bool = False,
    sparse: bool = False,
    process_group: dist.ProcessGroup | None = None,
    optimizer: FusedOptimizer | None = None,
) -> torch.Tensor:
    """``F.embedding_bag`` over a DTensor table of any layout; *collective* over the weight's group.

    ``input`` (with ``offsets``/``per_sample_weights``) is THIS rank's own batch;
    ranks may pass batches of different sizes. The result is this rank's own
    ``(num_bags, embedding_dim)`` output as a plain tensor, equal to
    ``F.embedding_bag(input, full_weight, ...)``. When ``weight.requires_grad``,
    backward fills ``weight.grad`` with a DTensor of the weight's layout holding
    the gradient of all ranks' batches. A weight that does not require grad (the
    DTensors of ``state_dict_to_dtensor`` do not) is a frozen table, as in torch:
    the output has no ``grad_fn``; call ``weight.requires_grad_()`` to train it.
    ``max_norm`` renormalises the stored rows referenced by any rank, in place.

    Every rank of the weight's group calls it: the group of its mesh (on a 2-D
    mesh ``(replica, shard)`` the shard axis, whose replica axis must hold
    identical data - each replica group looks up on its own), or
    ``process_group`` when given (needed for a table on a one-rank mesh inside
    a sub-mesh; such a table otherwise uses the default group).

    A DTensor ``input`` (``Replicate()`` or ``Shard(0)`` on a 1-D mesh over the
    same group) gives a DTensor result: ``Shard(0)`` for a batch-sharded input;
    for a replicated input ``Replicate()``/``Shard(1)``/``Partial()`` by the
    weight's layout, with no data collective in forward or backward (see the
    module docstring).

    With ``optimizer`` (a :class:`FusedOptimizer` holding ``weight``), backward
    updates the weight in place instead (``weight.grad`` stays ``None``).

    Raises:
        TypeError, ValueError, NotImplementedError: on every rank, when any rank's
            arguments are invalid, the ranks disagree on an option, on
            the weight's layout or on the input's kind or (replicated) values.

    Example::

        >>> out = sharded_embedding_bag(ids, dt_weight, offsets, mode="sum")
        >>> out.sum().backward()  # dt_weight.grad: a DTensor like dt_weight
    """
    fn = "sharded_embedding_bag"

    def prepare(input: Any, kind: InputKind) -> tuple[Any, int | None, Bags]:
        local_input, local = _local_inputs(fn, input, offsets=offsets, per_sample_weights=per_sample_weights)
        shape = tuple(weight.shape)
        padding = check_options(fn, shape, mode=mode, padding_idx=padding_idx, max_norm=max_norm,
                                norm_type=norm_type, scale_grad_by_freq=scale_grad_by_freq, sparse=sparse)
        bags = bags_from_input(fn, local_input, local["offsets"], local["per_sample_weights"], rows=shape[0],
                               mode=mode, include_last_offset=include_last_offset, weight_dtype=weight.dtype)
        if kind is not InputKind.PLAIN and psw_grad(bags):
            raise RejectedArguments(NotImplementedError, f"{fn}: the gradient of per_sample_weights is computed "
                                    "for plain-tensor inputs only; pass per_sample_weights.detach() with a "
                                    "DTensor input")
        return local_input, padding, bags

    res = _lookup(fn, 0, input, weight, mode=mode, max_norm=max_norm, norm_type=norm_type, skip_padding=True,
                  process_group=process_group, optimizer=optimizer, prepare=prepare)
    if res.placements is not None:
        return _replicated_dtensor(res, (res.bags.num_bags, weight.shape[1]))
    if res.kind is InputKind.PLAIN:
        return res.out
    return dtensor_input.rows_dtensor(res.out, res.rows, res.mesh)


@torch.compiler.disable(recursive=True)  # collectives and data-dependent routing: a graph break
def sharded_embedding(
    input: torch.Tensor,
    weight: DTensor,
    padding_idx: int | None = None,
    max_norm: float | None = None,
    norm_type: float = 2.0,
    *,
    scale_grad_by_freq: bool = False,
    sparse: bool = False,
    process_group: dist.ProcessGroup | None = None,
    optimizer: FusedOptimizer | None = None,
) -> torch.Tensor:
    """``F.embedding`` over a DTensor table of any layout; *collective* over the weight's group.

    ``input`` (ids of any shape) is THIS rank's own batch; the result is
    ``input.shape + (embedding_dim,)`` as a plain tensor, equal to
    ``F.embedding(input, full_weight, ...)``; the ``padding_idx`` row is looked
    up but receives no gradient, as in torch. The group, DTensor inputs and
    errors are as for :func:`sharded_embedding_bag` (a column-cut output of a
    replicated input is ``Shard`` on the last dim). ``optimizer``: as for
    :func:`sharded_embedding_bag`.

    Example::

        >>> rows = sharded_embedding(ids, dt_weight)  # (*ids.shape, dim)
    """
    fn = "sharded_embedding"

    def prepare(input: Any, kind: InputKind) -> tuple[Any, int | None, Bags]:
        local_input, _ = _local_inputs(fn, input)
        shape = tuple(weight.shape)
        padding = check_options(fn, shape, mode="sum", padding_idx=padding_idx, max_norm=max_norm,
                                norm_type=norm_type, scale_grad_by_freq=scale_grad_by_freq, sparse=sparse)
        return local_input, padding, bags_for_embedding(fn, local_input, shape[0])

    res = _lookup(fn, 1, input, weight, mode="sum", max_norm=max_norm, norm_type=norm_type, skip_padding=False,
                  process_group=process_group, optimizer=optimizer, prepare=prepare)
    ids = input.to_local() if isinstance(input, DTensor) else input
    out = res.out.view(tuple(ids.shape) + (res.out.shape[1],))
    if res.placements is not None:
        if res.columns:
            res = dataclasses.replace(res, placements=[Shard(ids.dim())])
        return _replicated_dtensor(dataclasses.replace(res, out=out), tuple(ids.shape) + (weight.shape[1],))
    if res.kind is InputKind.PLAIN:
        return out
    per_row = max(1, int(torch.Size(ids.shape[1:]).numel()))
    return dtensor_input.rows_dtensor(out, [n // per_row for n in res.rows], res.mesh)


# --- step 0: the call's group, and each weight resolved --------------------------------------------------


def lookup_group(fn: str, weights: Sequence[object], process_group: dist.ProcessGroup | None,
                 input_mesh_group: CommGroup | None) -> CommGroup:
    """The call's group (:func:`..groups.call_group`) with its collectives' tensors on the weights' device.

    A group of CUDA meshes names ``cuda:torch.cuda.current_device()``: in a process that never called
    ``torch.cuda.set_device``, ``cuda:0``, whatever GPU its tables live on. The lookups put their collectives'
    tensors where the tables' shards are (the first weight whose local tensor is of the group's device type),
    which is where their batches and outputs already live."""
    group = call_group(fn, weights, process_group, input_mesh_group)
    return on_device(group, [w.device for w in weights if isinstance(w, DTensor)])


def on_device(group: CommGroup, devices: Sequence[torch.device]) -> CommGroup:
    """``group`` with its collectives' device the first of ``devices`` of its device type (``group`` itself
    when none is, or it is that device already)."""
    for d in devices:
        if d.type == group.device.type:
            return group if d == group.device else dataclasses.replace(group, device=d)
    return group


def pick_strategy(layout: ShardLayout, world: int) -> Strategy:
    """The cheapest correct strategy for ``layout`` on ``world`` ranks: the one place that picks."""
    full = {s.rank for s in layout.shards if s.sizes == layout.global_shape}
    if full >= set(range(world)):
        return WHOLE
    rows = layout.global_shape[0]
    if all(s.sizes[0] == rows for s in layout.unique_shards() if s.numel):
        return COLUMNS
    return ROWS


def resolve_table(fn: str, weight: object, group: CommGroup) -> ResolvedTable:
    """``weight`` resolved for a lookup on ``group``; collective-free.

    Raises:
        Rejected: a weight that is not a DTensor, carries no layout (module
            docstring), is not whole inside ``group``, or whose local tensors
            do not match its layout.
    """
    if not isinstance(weight, DTensor):
        raise Rejected(TypeError, f"{fn}: weight must be a DTensor, got {type(weight).__name__}")
    if needs_layout_gather(weight):
        raise Rejected(
            NotImplementedError,
            f"{fn}: the weight's local tensor is a shards wrapper without the table's layout (TorchRec's own "
            "wrapper); a lookup does not gather layouts - attach it once with "
            "tdb.to_dtensor(weight) (collective, zero-copy)",
        )
    try:
        whole = layout_of(weight)
    except (ValueError, NotImplementedError) as e:
        raise Rejected(type(e), f"{fn}: {e}") from None
    if whole.dtype is None:
        whole = dataclasses.replace(whole, dtype=weight.dtype)
    layout = whole.on_ranks(group.members)
    covered = sum(s.numel for s in layout.unique_shards())
    if covered != layout.numel:
        raise Rejected(
            ValueError,
            f"{fn}: the weight's blocks on the lookup's ranks {list(group.members)} cover {covered} of "
            f"{layout.numel} elements; the table must be whole inside the group (a 2-D mesh: look up on its "
            "sharding axis, whose replica axis holds identical data)",
        )
    shards = local_shards_of(weight)
    rank = group.rank
    assert rank is not None, "call_group keeps only members"
    mine = layout.shards_on(rank)
    if len(shards) != len(mine) or any(tuple(t.shape) != s.sizes for t, s in zip(shards, mine)):
        raise Rejected(
            ValueError,
            f"{fn}: rank {group.members[rank]} holds local tensors of shapes {[list(t.shape) for t in shards]} "
            f"but the weight's layout gives it blocks {[list(s.sizes) for s in mine]}",
        )
    refuse_unified_memory(fn, whole, shards)
    return ResolvedTable(
        weight, whole, layout, tuple(shards), group, pick_strategy(layout, group.size), layout.digest()
    )


def refuse_unified_memory(fn: str, layout: ShardLayout, shards: Sequence[torch.Tensor]) -> None:
    """Raises :class:`..agreement.Rejected` naming the table when a shard lives in CUDA unified memory.

    TorchRec keeps a table placed in ``EmbeddingLocation.MANAGED`` or ``MANAGED_CACHING`` in unified memory
    (``MANAGED_CACHING`` with a cache of its rows in device memory that its own module reads and writes back).
    The lookups read and update the shards' storage directly, as device memory: past that cache, whose rows
    are newer than the storage's. Both are refused, since a shard alone does not tell them apart."""
    for s in shards:
        if kernels.in_unified_memory(s):
            raise Rejected(
                NotImplementedError,
                f"{fn}: table {layout.name!r} has rows in CUDA unified memory (TorchRec's EmbeddingLocation.MANAGED or "
                "MANAGED_CACHING, compute kernels fused_uvm / fused_uvm_caching); the lookups read and update "
                "device memory directly, past MANAGED_CACHING's cache: place the table in EmbeddingLocation.DEVICE "
                "(compute_kernel='fused') or HOST",
            )
