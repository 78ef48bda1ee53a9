"""``reshard``: move a running model's tables and their optimizer state to another plan, in memory."""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from .._compat import refill_dtensor
from ..agreement import Problem, ProblemKind, Rejected, agree, check_same
from ..convert.dtensor import dtensor_from_local_shards, layout_of, local_shards_of
from ..convert.reshard import Move, move_pieces, pieces
from ..groups import CommGroup, call_group
from ..layout import ShardLayout
from .dmp import reshard_dmp
from .batches import schedule
from .optimizers import Optimizer, check_optimizers, optimizer_moves
from .tables import STAGING_BYTES, WHAT, Table, check_plan, sharded_tables
from .torchrec_access import is_dmp

__all__ = ["reshard"]


@dataclass
class _Step:
    """One table's move: the blocks to copy into its new storage, and what puts it in use afterwards."""

    table: Table
    moves: list[Move]
    commit: Callable[[], None]


def _new_blocks(layout: ShardLayout, device: torch.device, rank: int) -> list[torch.Tensor]:
    assert layout.dtype is not None, "a target layout carries its dtype"
    return [torch.empty(s.sizes, dtype=layout.dtype, device=device) for s in layout.shards_on(rank)]


def _prepare(table: Table, optimizers: Sequence[Optimizer], group: CommGroup, rank: int) -> _Step:
    """Allocate ``table``'s new storage (weight, gradient, optimizer state) and list what moves into it."""
    old = table.param
    mesh = old.device_mesh
    local = _new_blocks(table.target, group.device, rank)
    refills = [(old, dtensor_from_local_shards(table.target, local, device_mesh=mesh))]
    weight = pieces(table.layout, table.target)
    moves = [Move(weight, table.layout, local_shards_of(old), table.target, local)]
    grad = old.grad
    if isinstance(grad, DTensor):
        src = layout_of(grad, name=f"{table.name}.grad")
        dst = dataclasses.replace(table.target, dtype=grad.dtype, name=src.name)
        blocks = _new_blocks(dst, group.device, rank)
        same = src.shards == table.layout.shards
        moves.append(Move(weight if same else pieces(src, dst), src, local_shards_of(grad), dst, blocks))
        refills.append((grad, dtensor_from_local_shards(dst, blocks, device_mesh=mesh)))
    state_moves, commits = optimizer_moves(optimizers, table, local, weight, group.device)

    def commit() -> None:
        for t, moved in refills:
            refill_dtensor(t, moved)
        for c in commits:
            c()

    return _Step(table, moves + state_moves, commit)


def _move(batch: Sequence[Table], optimizers: Sequence[Optimizer], group: CommGroup, rank: int) -> None:
    """Move a batch of tables and their optimizer state to their target layouts, in use once every rank has
    its blocks of all of them; *collective*. Raises on every rank, the tables as they were, when a rank
    could not allocate or receive."""
    problem, steps = None, []
    for table in batch:
        try:
            steps.append(_prepare(table, optimizers, group, rank))
        except Exception as e:  # noqa: BLE001 - shared with every rank, which all raise
            problem = _failure(f"allocating the new blocks of table {table.name!r}", e)
            steps = []
            break
    agree(WHAT, problem, [], group, refused="could not allocate its new blocks")
    try:
        move_pieces([m for step in steps for m in step.moves], group=group.group, rank=rank,
                    staging_bytes=STAGING_BYTES)
    except Exception as e:  # noqa: BLE001 - every rank takes part in the move, then all raise
        names = ", ".join(repr(t.name) for t in batch)
        problem = _failure(f"moving table{'s' if len(batch) > 1 else ''} {names}", e)
    agree(WHAT, problem, [], group, refused="did not receive all its new blocks")
    for step in steps:
        step.commit()


def _back(table: Table) -> Table:
    """The move that undoes ``table``'s."""
    return dataclasses.replace(table, layout=table.target, target=table.layout)


def _digest(tables: Sequence[Table]) -> int:
    text = repr([(t.name, t.target.digest()) for t in tables])
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 2


def _failure(message: str, error: BaseException) -> Problem:
    return Problem.of(ProblemKind.FAILURE, f"{WHAT}: {message}: {type(error).__name__}: {error}")


def reshard(model: nn.Module, plan: Mapping[str, ShardLayout], *,
            optimizers: Sequence[Optimizer] = (), split_row_states: bool = False) -> nn.Module:
    """Move ``model``'s tables, and every optimizer state over them, to ``plan``, in memory; *collective*.

    ``model`` is a module sharded by :func:`~torchrec_dtensor_bridge.shard_module`, or a TorchRec
    ``DistributedModelParallel`` whose tables train with TorchRec's fused kernel. For a ``shard_module``
    model ``plan`` maps table names (as ``shard_module`` takes them) to their new layouts over the ranks
    of the tables' mesh, any layout on either side: cut by rows, columns or both, on some of the ranks or
    all, replicated (data parallel: the whole table, or blocks, held by several ranks; a new copy is
    filled from one holder of its box, the rank's own copy where it has one); for a DMP it is a TorchRec
    ``ShardingPlan`` (module path -> table -> ``ParameterSharding``) or one sharded module's
    ``{table: ParameterSharding}``. A table the plan does not name, or gives the blocks every rank holds
    now (replicas listed in another order of ranks included), stays as it is. Every rank of the tables'
    group calls it with the same plan. Steps, the same on every rank:

    1. check the plan against the model (names, shapes, dtypes, ranks, coverage) and the optimizers
       against the tables, and agree on the verdict and the plan (one ``all_gather``): on any problem
       every rank raises before anything is allocated;
    2. batch by batch (:func:`schedule`: one table, or several whose new blocks are on different ranks,
       ordered so that the tables freeing memory where it is tightest go first): allocate the tables'
       new storage - weight, gradient, optimizer state - and agree that every rank could; move into it
       only what changes owner: each overlap of an old block with a new block travels from the rank
       holding it to the rank taking it, point to point on the tables' group (weights and states
       together, pieces that are not contiguous through buffers of at most :data:`STAGING_BYTES` a
       rank), blocks that stay on their rank copied locally while the first pieces travel; agree that
       every rank has all its new blocks, and only then put them in use: each table's parameter - the
       same object, which the module and the optimizers keep referring to - holds the new storage, and
       so do its gradient and each ``torch.optim`` state shaped like it (single values such as ``step``
       kept); each :class:`~torchrec_dtensor_bridge.FusedOptimizer` holding the table updates it with
       the moved state. The old storage is freed then, so a rank's memory grows by its largest new share
       of one table (and the buffers) above the larger of its memory before and after the call, wherever
       an order of the tables allows it. If a rank fails to allocate or receive, every rank raises, after
       the tables already moved have been moved back (one by one).

    A DMP's sharded module whose plan changes is built anew by the DMP's own sharder, its tables'
    memory not yet taken (on the CPU: fbgemm's host buffers allocated without their zero fill), and takes
    its tables and fused optimizer state from the old one in the same batches: once a batch is in, the
    memory of its old blocks is released (the old module's buffers hold all its tables and are freed
    whole only with it; a released block reads as zeros), and if a later batch fails the tables already
    moved are moved back into the old module before every rank raises. The new module then takes the old
    one's place in the model, in ``dmp.plan`` and in ``dmp.fused_optimizer`` (each table's ``lr`` kept),
    and the old one is freed; its dense parameters, their optimizers and its data-parallel wrapper are
    left as they are, and so are its data-parallel tables (the new module takes over the old one's
    data-parallel lookup: they keep their parameters). On a GPU fbgemm allocates a kernel's device
    buffer whole (not measured on a GPU yet).

    Optimizer state moves as a checkpoint load would convert it. A ``FusedOptimizer``'s row-wise state
    is one value per row (the whole row's statistic, whatever the column cut): it follows any plan
    exactly, and ``split_row_states`` changes nothing for it. TorchRec's row-wise Adagrad (a DMP) keeps
    one value per row and column block of a column-cut table; those move block for block into the same
    column blocks, and combine (weighted by the blocks' widths) into a plan with one column block. Into
    another cut with several column blocks (one value per row split into blocks, or blocks of other
    widths) the state does not convert exactly: refused unless ``split_row_states``, which gives every
    new block its row's value (the old blocks' combined so), as
    ``checkpoint.load(..., split_row_states=True)`` gives a block one value per row.

    Pass every optimizer over the resharded tables of a ``shard_module`` model: the state of one left
    out stays in the old layout.

    Args:
        model: a module sharded by ``shard_module``, or a ``DistributedModelParallel``.
        plan: table name -> :class:`~torchrec_dtensor_bridge.ShardLayout` (global ranks); for a DMP, a
            ``ShardingPlan`` or ``{table: ParameterSharding}``.
        optimizers: ``torch.optim`` optimizers and ``FusedOptimizer``s over a ``shard_module`` model's
            tables (a DMP's fused optimizer moves by itself; its dense optimizers stay as they are).
        split_row_states: a DMP's row-wise Adagrad table whose column cut changes into several blocks
            takes, in every new block, its row's value (an approximation, hence asked for, as by
            ``checkpoint.load``: a block's own statistic over its columns was never kept). Without it
            such a plan is refused. For a ``shard_module`` model it changes nothing: a
            ``FusedOptimizer`` keeps one value per whole row, which follows any column cut.

    Returns:
        ``model`` itself, resharded.

    Raises:
        TypeError, ValueError, NotImplementedError: on every rank before any byte moves, naming the table
            and the values: a name that is no sharded table of the model; a layout of another shape or
            dtype, with a block on a rank outside the tables' group (a plan for another world size), or
            not covering the table; an optimizer state that cannot follow the table (a DMP's per-row
            state split into column blocks without ``split_row_states=True``); a DMP table not trained by
            the fused kernel, or into or out of data-parallel (its state belongs to the dense optimizer);
            ranks passing different plans.
        RuntimeError: on every rank when a rank could not allocate or receive its new blocks; the
            model and the optimizers are then as before (the message says so when moving the tables
            already moved back failed too).

    Example::

        >>> tdb.shard_module(model, {"emb.weight": ShardLayout.table_wise((1000, 64), 0)}, mesh)
        >>> opt = torch.optim.Adam(model.parameters(), lr=0.01)
        >>> ...  # train
        >>> tdb.reshard(model, {"emb.weight": ShardLayout.row_wise((1000, 64), world)}, optimizers=[opt])
        >>> ...  # train on: model.emb.weight and opt's state are row-wise now
        >>> tdb.reshard(dmp, new_sharding_plan)  # a DistributedModelParallel, its fused optimizer with it
        >>> tdb.reshard(dmp, column_wise_plan, split_row_states=True)  # row-wise Adagrad state into blocks
    """
    if is_dmp(model):  # its fused optimizer moves with its tables; its dense optimizers stay as they are
        return reshard_dmp(model, plan, split_row_states=split_row_states)
    if not isinstance(model, nn.Module):
        raise TypeError(f"{WHAT}: model must be an nn.Module, got {type(model).__name__}")
    found = sharded_tables(model)
    if not found:
        raise TypeError(f"{WHAT}: the {type(model).__name__} holds no table sharded by shard_module")
    group = call_group(WHAT, [p for _, p in found.values()], None, None)
    rank = group.members[group.rank or 0]
    problem, tables, opts = None, [], []
    try:
        if not isinstance(split_row_states, bool):
            raise Rejected(TypeError, f"{WHAT}: split_row_states must be a bool, got {split_row_states!r}")
        tables = check_plan(found, plan, group.members)
        opts = check_optimizers(optimizers, tables)
    except Rejected as e:
        problem = e.problem
    rows = agree(WHAT, problem, [_digest(tables), len(opts)], group)
    check_same(WHAT, "the plan (a digest of its layouts)", [r[0] for r in rows])
    check_same(WHAT, "the number of optimizers", [r[1] for r in rows])
    done: list[Table] = []
    try:
        for batch in schedule([t for t in tables if t.changes], group.members):
            _move(batch, opts, group, rank)  # the old storage goes once nothing refers to it
            done.extend(batch)
    except Exception as error:
        _move_back(done, opts, group, rank, error)
        raise
    return model


def _move_back(done: list[Table], optimizers: Sequence[Optimizer], group: CommGroup, rank: int,
               error: Exception) -> None:
    """After a failed move, every table moved before it goes back to its old layout (*collective*)."""
    try:
        for table in reversed(done):
            _move([_back(table)], optimizers, group, rank)
    except Exception as e:
        raise RuntimeError(f"{WHAT}: {error}; moving the tables already moved back failed too ({e}): "
                           f"{[t.name for t in done]} may be under the new plan") from error
