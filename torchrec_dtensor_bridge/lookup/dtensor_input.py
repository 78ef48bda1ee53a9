"""DTensor inputs of :func:`.functional.sharded_embedding_bag` and :func:`.functional.sharded_embedding`.

DTensor inputs (``input``, and ``offsets``/``per_sample_weights`` when they are
DTensors too; a plain ``offsets``/``per_sample_weights`` next to a DTensor
``input`` is taken as that rank's local part) must live on a 1-D mesh over the
lookup's group in its rank order:

* ``Shard(0)`` (batch-sharded): each rank's local part is its own batch (local
  ``offsets`` index local ids); the plain-tensor path above runs unchanged and
  the output is a ``Shard(0)`` DTensor of all ranks' bags in rank order, with
  explicit shape. When the ranks' bag counts are not ``torch.chunk``'s even
  split, the output carries its true rows in a :class:`LocalShardsWrapper`
  (``convert.dtensor_from_local_shards``; read it with ``tdb.full_tensor``) and
  is not differentiable - pass even batches to train through it.
* ``Replicate()``: every rank holds the same whole batch - DTensor's contract:
  the caller guarantees it, and no collective checks it (no agreement step; a
  local failure raises on its rank only). Under ``TORCH_DISTRIBUTED_DEBUG=DETAIL``
  (torch's switch for consistency checks of collectives) ONE small agreement
  ``all_gather`` runs first: a rank whose batch, kind or options differ from the
  others' makes every rank raise (the batch's digest copies it to the host: only
  then). Without ``DETAIL`` nothing of the batch is read back to the host but
  the lookups' value check at their API edge (and, for max's fallback below,
  where this rank's share of the bags starts and ends). Then:

  - replicated weight: a local lookup, a ``Replicate()`` output; no collective
    in forward or backward;
  - column-cut weight whose blocks are the even ``Shard(1)`` split in mesh order
    (one block per rank): each rank looks up its columns for the whole batch;
    ``Shard(1)`` output (last dim for ``sharded_embedding``); no data
    collective in forward or backward until the output is gathered;
  - any other layout (row-wise, grid, uneven or several column blocks per rank,
    table-wise), ``sum``/``mean``: each rank pools the rows it stores (first
    copy of each block) into a ``Partial()`` (sum) output; ``mean`` divides by
    the true bag size locally, which is linear and so exact under the sum.
    ``full_tensor()`` / ``redistribute(Replicate())`` completes it with ONE
    ``all_reduce``; backward needs none (replicated blocks excepted);
  - ``mode="max"`` on those layouts (a ``Partial("max")`` would give ``-inf``
    for empty bags and could not pick torch's winner): falls back to splitting
    the bags evenly (``torch.chunk``) and running the plain-tensor path on each
    rank's chunk; ``Shard(0)`` output.

  ``max_norm`` still renormalises first (one ``all_reduce`` of partial norms
  when rows are cut into column pieces).
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..agreement import RejectedArguments
from ..convert.dtensor import dtensor_from_local_shards
from ..groups import CommGroup, comm_group
from ..layout import ShardLayout, chunk_sizes, contiguous_strides
from ..optim.state import Binding
from .entry import InputKind, agree
from .arguments import Bags, TableCodes
from .entry import finish, make_plan
from .function import pooled_lookup
from .plan import BatchPlan, PoolOptions, ResolvedTable
from .renorm import renormalize

__all__ = ["check_replicated", "input_kind", "local_inputs", "replicated_dtensor", "replicated_input",
           "rows_dtensor", "split_bags"]


def input_kind(fn: str, input: object) -> tuple[InputKind, CommGroup | None]:
    """How ``input`` is passed, and the group of a DTensor input's mesh. Local; raises
    :class:`RejectedArguments`."""
    if not isinstance(input, DTensor):
        return InputKind.PLAIN, None
    mesh = input.device_mesh
    if mesh.ndim != 1:
        raise RejectedArguments(
            NotImplementedError, f"{fn}: a DTensor input must live on a 1-D mesh (the lookup group's), got {mesh}"
        )
    p = input.placements[0]
    if isinstance(p, Replicate):
        return InputKind.REPLICATE, comm_group(input)
    if type(p) is Shard and p.dim in (0, -input.dim()):
        return InputKind.SHARD, comm_group(input)
    raise RejectedArguments(
        NotImplementedError, f"{fn}: DTensor input placements {list(input.placements)} are not supported "
        "(use [Replicate()] or [Shard(0)])"
    )


def local_inputs(fn: str, input: object, **others: object) -> tuple[Any, dict[str, Any]]:
    """The local parts of a DTensor ``input`` and of its companions (plain ones are taken as local parts). Local; raises :class:`RejectedArguments`."""
    assert isinstance(input, DTensor)
    local = {}
    for name, v in others.items():
        if isinstance(v, DTensor):
            if v.device_mesh != input.device_mesh or list(v.placements) != list(input.placements):
                raise RejectedArguments(
                    ValueError, f"{fn}: {name} must be on input's mesh with input's placements "
                    f"{list(input.placements)}, got {list(v.placements)}"
                )
            v = v.to_local()
        local[name] = v
    return input.to_local(), local


def rows_dtensor(out: torch.Tensor, rows: list[int], mesh: Any) -> DTensor:
    """This rank's ``out`` (``rows[rank]`` rows) as a ``Shard(0)`` DTensor of all ranks' rows."""
    shape = torch.Size((sum(rows),) + tuple(out.shape[1:]))
    if rows == chunk_sizes(sum(rows), len(rows)):
        return DTensor.from_local(out, mesh, [Shard(0)], run_check=False, shape=shape,
                                  stride=contiguous_strides(shape))
    flat = out.reshape(out.shape[0], -1)
    members = [int(r) for r in mesh.mesh.tolist()]
    lay = ShardLayout.row_wise((sum(rows), flat.shape[1]), rows, ranks=members, dtype=out.dtype)
    if len(shape) != 2:
        raise NotImplementedError("uneven Shard(0) batches of a multi-dim sharded_embedding input are not supported")
    return dtensor_from_local_shards(lay, [out.detach()], device_mesh=mesh)


def split_bags(bags: Bags, world: int, rank: int) -> Bags:
    """This rank's ``torch.chunk`` share of a replicated batch's bags.

    Where its ids start and end: at the batch's ends (the first rank's start, the last rank's end) known
    without a read; elsewhere read back to the host together, in ONE read (on an accelerator, one
    synchronisation; none in a group of one)."""
    counts = chunk_sizes(bags.num_bags, world)
    b0 = sum(counts[:rank])
    b1 = b0 + counts[rank]
    first_id = {0: 0, bags.num_bags: bags.ids.numel()}  # the canonical form: the lengths sum to the ids
    unknown = sorted({b0, b1} - first_id.keys())
    if unknown:
        ends = torch.cumsum(bags.lengths, 0)  # ends[b - 1]: where bag b starts
        first_id.update(zip(unknown, torch.stack([ends[b - 1] for b in unknown]).tolist()))
    i0, i1 = first_id[b0], first_id[b1]
    w = None if bags.weights is None else bags.weights[i0:i1]
    return Bags(bags.ids[i0:i1], bags.lengths[b0:b1], w)


def replicated_input(
    table: ResolvedTable, bags: Bags, *, mode: str, padding: int | None, skip_padding: bool,
    max_norm: float | None, norm_type: float, binding: Binding | None = None, fn: str = "lookup",
) -> tuple[torch.Tensor, list, bool] | None:
    """The communication-free lookup of an agreed replicated batch: (local output, placements, whether the
    output is this rank's columns); or ``None`` for the fallback (max on a layout that would need a Partial
    max). The table's strategy says which strategy answers and how (``Strategy.for_replicated_batch``)."""
    group, layout, world = table.group, table.layout, table.group.size
    answer = table.strategy.for_replicated_batch(layout, world, mode == "max")
    if answer is None:
        return None
    strategy, placement = answer
    rank = group.rank
    assert rank is not None
    if max_norm is not None:
        renormalize(layout, layout.shards_on(rank), list(table.shards), bags.ids, max_norm, norm_type, group.group)
    plan = make_plan(dataclasses.replace(table, strategy=strategy),
                     BatchPlan(bags, (bags.num_bags,) * world, replicated=True),
                     PoolOptions(mode == "max", padding, skip_padding), fn=fn, binding=binding)
    (out,) = pooled_lookup([plan], [table.weight])
    return finish(out, bags, mode, padding), [placement], isinstance(placement, Shard)


def batch_digest(bags: Bags) -> int:
    """62 bits of a batch's ids, bag lengths and weights: ranks holding one ``Replicate()`` batch compare it."""
    h = hashlib.blake2b(digest_size=8)
    for t in (bags.ids, bags.lengths, bags.weights):
        if t is not None:
            h.update(str(t.dtype).encode())
            h.update(t.detach().contiguous().cpu().numpy().tobytes())
    return int.from_bytes(h.digest(), "little") >> 2


def check_replicated(fn: str, error: RejectedArguments | None, bags: Bags | None, codes: list[TableCodes],
                      group: CommGroup) -> None:
    """A ``Replicate()`` batch follows DTensor's contract: the caller guarantees that every rank holds the same
    batch and options, so no collective checks it - unless ``TORCH_DISTRIBUTED_DEBUG=DETAIL``, torch's switch
    for consistency checks of collectives: then ONE agreement (options, layout, a digest of the batch) makes
    every rank raise on any difference. Without it a local failure raises on this rank only."""
    if dist.get_debug_level() == dist.DebugLevel.DETAIL:
        digest = 0 if bags is None else batch_digest(bags)
        agree(fn, error, None if bags is None else [bags], codes, group, kind=InputKind.REPLICATE, digest=digest)
    elif error is not None:
        raise error.problem.error()


def replicated_dtensor(out: torch.Tensor, mesh: Any, placements: list, shape: tuple[int, ...]) -> DTensor:
    """A communication-free lookup's output as a DTensor of global ``shape``."""
    gshape = torch.Size(shape)
    return DTensor.from_local(out, mesh, placements, run_check=False, shape=gshape,
                              stride=contiguous_strides(gshape))


