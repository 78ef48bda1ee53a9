"""``reshard`` of a TorchRec ``DistributedModelParallel``: its fused tables and their optimizer state.

A sharded ``EmbeddingBagCollection`` or ``EmbeddingCollection`` whose plan changes is rebuilt by the DMP's
own sharder under the new plan (TorchRec allocates its tables; on the CPU their pages are taken only as
they are written); each table then takes its values and fused optimizer state from the old module, only
the blocks that change owner travelling (:func:`..convert.reshard.move_pieces`), in the batches of
:func:`.batches.schedule` (every table of a rebuilt module, those whose blocks stay included: the new
module holds them all). Once every rank has a batch, the memory of its old blocks is released
(:func:`.._pages.release`: the old module's buffers are freed only with it), so that a rank's memory grows
by about one table's new share, not by the module's; a later batch that fails moves the tables already
moved back into the old module first. The new module replaces the old one in the model, the DMP's plan
and its fused optimizer once every table is in. Dense parameters, their optimizer and the
data-parallel wrapper are not touched. A plan is checked against the sharding types the module's class is
built with (a sharded ``EmbeddingCollection``: table-wise, row-wise and column-wise, no table-row-wise,
table-column-wise or grid), so that TorchRec is never asked to build what it refuses.

TorchRec's fused optimizer state, per table (the registry's kinds, :mod:`..optim_kinds`):

- element-wise state (Adagrad's ``momentum1``) has the weight's layout;
- per-row state (row-wise Adagrad's ``momentum1``) moves as :mod:`.row_states` says.
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .._compat import ShardedTensor
from .._pages import release
from ..agreement import Problem, ProblemKind, Rejected, agree, check_same, gather_objects
from ..convert.reshard import Move, move_pieces, pieces
from ..groups import CommGroup, of_group
from ..layout import ShardLayout, ShardSpec
from ..optim_kinds import OptimKind, StateKind
from ..torchrec_plan import layout_from_parameter_sharding
from . import row_states
from . import torchrec_access as trec
from .batches import bytes_by_rank, schedule
from .tables import STAGING_BYTES, WHAT

__all__ = ["reshard_dmp"]


@dataclass(frozen=True)
class _Table:
    """One table of a sharded module, now and under the plan (layouts in global ranks)."""

    path: str
    name: str
    rows: int
    old: ShardLayout
    new: ShardLayout


@dataclass
class _Module:
    """One sharded module whose plan changes."""

    path: str
    old: Any
    plan: dict[str, Any]
    tables: list[_Table]
    new: Any = None


@dataclass
class _Step:
    """One table's move into its module's new storage.

    Attributes:
        table: the table.
        layout, target: its weight's layout now and under the plan, with its dtype.
        exact: the moves of its weight and fused optimizer states whose new blocks, in the new module's
            storage, are a copy of the old ones: once in use, their old blocks' memory is released
            (:func:`.._pages.release`); moved back on a failure.
        combined: the moves of a per-row state combined from column blocks, into buffers ``finish``
            combines; its old blocks are kept (no way back from the combined values).
        finish: what completes the new state once the moves are in.
    """

    table: _Table
    layout: ShardLayout
    target: ShardLayout
    exact: list[Move]
    combined: list[Move] = field(default_factory=list)
    finish: list[Callable[[], None]] = field(default_factory=list)

    @property
    def moves(self) -> list[Move]:
        return self.exact + self.combined


def _fail(kind: type[Exception], table: str, message: str) -> Rejected:
    return Rejected(kind, f"{WHAT}: table {table!r}: {message}")


def _kind(name: str | None) -> OptimKind | None:
    return next((k for k in OptimKind if name is not None and k.emb_optim_type == name), None)


def _global(layout: ShardLayout, members: tuple[int, ...]) -> ShardLayout:
    return ShardLayout(layout.global_shape, tuple(ShardSpec(members[s.rank or 0], s.offsets, s.sizes)
                                                  for s in layout.shards), layout.dtype, layout.name)


def _module_plans(dmp: Any, plan: object, modules: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """``path -> {table: ParameterSharding}`` from a ``ShardingPlan`` or one module's table dict."""
    inner = getattr(plan, "plan", None)
    if isinstance(inner, Mapping):
        return {str(p): dict(v) for p, v in inner.items()}
    if not isinstance(plan, Mapping):
        raise Rejected(TypeError, f"{WHAT}: plan must be a TorchRec ShardingPlan or a module's dict of "
                                  f"ParameterShardings, got {type(plan).__name__}")
    names = set(plan)
    holders = [p for p, m in modules.items() if names <= set(trec.table_shapes(m))]
    if len(holders) != 1:
        raise Rejected(ValueError, f"{WHAT}: the tables {sorted(names)} are not all in one sharded module of the "
                                   f"model (its modules: {sorted(modules)}); pass a ShardingPlan")
    return {holders[0]: dict(plan)}


def _data_parallel(ps: Any) -> bool:
    return getattr(ps, "sharding_type", None) == "data_parallel"


def _check_table(path: str, name: str, shape: tuple[int, int], old_ps: Any, new_ps: Any, group: CommGroup,
                 kind: OptimKind | None, types: tuple[str, ...] | None, split: bool) -> _Table | None:
    """The table's move, or ``None`` for a data-parallel table that stays one (it stays as it is)."""
    full = f"{path}.{name}"
    if _data_parallel(old_ps) and _data_parallel(new_ps) and old_ps.compute_kernel == new_ps.compute_kernel:
        return None
    if _data_parallel(old_ps) or _data_parallel(new_ps):
        now, then = ("data_parallel", "another sharding") if _data_parallel(old_ps) else (
            old_ps.sharding_type, "data_parallel")
        raise _fail(NotImplementedError, full, f"{now} now, {then} in the plan; a data-parallel table of a "
                    "DMP is trained by the dense optimizer (and its own DistributedDataParallel), a sharded one by "
                    "the fused kernel, whose states do not convert into each other: it stays data-parallel, "
                    "or moves through a checkpoint")
    for ps, which in ((old_ps, "now"), (new_ps, "in the plan")):
        if getattr(ps, "compute_kernel", None) != "fused":
            raise _fail(NotImplementedError, full, f"{ps.sharding_type} with the {ps.compute_kernel!r} kernel "
                                                   f"{which}; reshard moves tables trained by the fused kernel")
    if types is not None and new_ps.sharding_type not in types:
        raise _fail(ValueError, full, f"{new_ps.sharding_type} sharding in the plan; the module at {path!r} is "
                                      f"built with {[t for t in types if t != 'data_parallel']} only")
    try:
        old = layout_from_parameter_sharding(old_ps, shape, world_size=group.size, name=full)
        new = layout_from_parameter_sharding(new_ps, shape, world_size=group.size, name=full)
    except (TypeError, ValueError) as e:
        raise _fail(type(e), full, f"the plan's {new_ps.sharding_type} sharding does not fit the table of shape "
                                   f"{list(shape)} on {group.size} ranks: {e}") from None
    before, after = row_states.widths(old), row_states.widths(new)
    if kind is not None and kind.row_wise and len(after) > 1 and before != after and not split:
        raise _fail(NotImplementedError, full, f"its {kind.name} state keeps a value per row and column block; "
                    f"column blocks of widths {before} do not convert exactly into blocks of widths {after} (only "
                    "into the same blocks, or combined into one); pass split_row_states=True to give every new "
                    "block its row's value (the old blocks' combined, weighted by their widths: an approximation, "
                    "as checkpoint.load(..., split_row_states=True) makes)")
    return _Table(path, name, shape[0], _global(old, group.members), _global(new, group.members))


def _check(dmp: Any, plan: object, group: CommGroup, split: bool) -> list[_Module]:
    if not isinstance(split, bool):
        raise Rejected(TypeError, f"{WHAT}: split_row_states must be a bool, got {split!r}")
    modules = trec.sharded_modules(dmp)
    out = []
    for path, given in _module_plans(dmp, plan, modules).items():
        if path not in modules:
            raise Rejected(ValueError, f"{WHAT}: plan entry {path!r}: the model has no sharded EmbeddingBagCollection "
                                       f"or EmbeddingCollection there; those it has are at {sorted(modules)}")
        old = modules[path]
        shapes, now = trec.table_shapes(old), trec.module_plan(old)
        unknown = sorted(set(given) - set(shapes))
        if unknown:
            raise _fail(ValueError, f"{path}.{unknown[0]}", f"the module at {path!r} has no such table; its "
                                                            f"tables are {sorted(shapes)}")
        kind = _kind(trec.fused_optimizer_kind(dmp, old))
        if kind is not None and kind.states and not kind.torchrec_mapped:
            raise Rejected(NotImplementedError, f"{WHAT}: the fused optimizer {kind.name!r} of {path!r} keeps "
                                                "state whose TorchRec form is not mapped")
        merged, types = {**now, **given}, trec.sharding_types(old)
        checked = [_check_table(path, t, shapes[t], now[t], merged[t], group, kind, types, split) for t in shapes]
        tables = [t for t in checked if t is not None]
        if any(t.old.shards != t.new.shards for t in tables):
            out.append(_Module(path, old, merged, tables))
    return out


def _local(value: object, layout: ShardLayout, rank: int, what: str) -> list[torch.Tensor]:
    """This rank's blocks of TorchRec's ``value`` (a ShardedTensor or DTensor; ``None``: none), in
    ``layout.shards_on(rank)`` order."""
    held: dict[tuple[int, ...], torch.Tensor] = {}
    if isinstance(value, ShardedTensor):
        held = {tuple(s.metadata.shard_offsets): s.tensor for s in value.local_shards()}
    elif isinstance(value, DTensor):
        local: Any = value.to_local()
        if hasattr(local, "local_shards"):
            held = {tuple(o): t for o, t in zip(local.local_offsets(), local.local_shards())}
        elif local.numel():
            held = {(0,) * value.dim(): local}
    out = []
    for s in layout.shards_on(rank):
        t = held.get(s.offsets)
        if t is None or tuple(t.shape) != s.sizes:
            raise ValueError(f"{what}: TorchRec holds no block {list(s.sizes)} at {list(s.offsets)} on rank {rank}")
        out.append(t)
    return out


def _table_moves(m: _Module, t: _Table, kind: OptimKind | None, rank: int) -> _Step:
    """The moves of ``t``'s weight and fused optimizer state from module ``m.old`` into ``m.new``."""
    key = trec.weight_key(m.old, t.name)
    old_w, new_w = m.old.state_dict()[key], m.new.state_dict()[key]
    weight = Move(pieces(t.old, t.new), t.old, _local(old_w, t.old, rank, key), t.new, _local(new_w, t.new, rank, key))
    dtype = getattr(old_w, "dtype", None)
    step = _Step(t, dataclasses.replace(t.old, dtype=dtype), dataclasses.replace(t.new, dtype=dtype), [weight])
    old_s = m.old.fused_optimizer.state_dict()["state"].get(key, {})
    new_s = m.new.fused_optimizer.state_dict()["state"].get(key, {})
    for spec in kind.states if kind is not None else ():
        skey = f"{t.name}.{spec.torchrec}"
        if spec.shape is StateKind.ELEMENT:
            step.exact.append(Move(weight.pieces, t.old, _local(old_s.get(skey), t.old, rank, skey), t.new,
                                   _local(new_s.get(skey), t.new, rank, skey)))
            continue
        old_flat, old_grid = row_states.row_table(t.old, t.rows)
        new_flat, new_grid = row_states.row_table(t.new, t.rows)
        src = [x.view(1, -1) for x in _local(old_s.get(skey), old_flat, rank, skey)]
        dst = _local(new_s.get(skey), new_flat, rank, skey)
        if row_states.widths(t.old) == row_states.widths(t.new):
            step.exact.append(Move(pieces(old_grid, new_grid), old_grid, src, new_grid, [x.view(1, -1) for x in dst]))
            continue
        device = dst[0].device if dst else torch.device("cpu")
        boxes, into, bufs = row_states.row_boxes(t.old, t.new, t.rows, skey, rank, device)
        step.combined.append(Move(pieces(old_grid, into), old_grid, src, into, bufs))
        step.finish.append(row_states.combiner(row_states.widths(t.old), boxes, dst))
    return step


def _digest(modules: list[_Module]) -> int:
    text = repr([(t.path, t.name, t.new.digest()) for m in modules for t in m.tables])
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 2


def _failure(message: str, error: BaseException) -> Problem:
    return Problem.of(ProblemKind.FAILURE, f"{WHAT}: {message}: {type(error).__name__}: {error}")


def _let_go(modules: list[_Module], *held: list[Any]) -> None:
    """Where a step raises, the new modules built and everything listing their storage are let go of
    first (the traceback keeps the frames that refer to them)."""
    for m in modules:
        m.new = None
    for x in held:
        x.clear()


def _staging(batch: list[_Step], kept: dict[int, int]) -> int:
    """The transfer buffers' budget for ``batch``: :data:`STAGING_BYTES` less, on the rank where it is most,
    what the rank holds beside (``kept``: old per-row states kept until every table is in, for the way back;
    the buffers the batch's combined states are received in), at least an eighth of it. From the layouts
    alone: the same on every rank."""
    extra = dict(kept)
    for step in batch:
        for x in step.combined:
            for r, n in bytes_by_rank(x.dst_layout).items():
                extra[r] = extra.get(r, 0) + n
    return max(STAGING_BYTES - max(extra.values(), default=0), STAGING_BYTES // 8)


def _move(batch: list[_Step], group: CommGroup, rank: int, staging: int) -> Problem | None:
    """Move ``batch``'s tables into their new modules (*collective*); the failure, or ``None``."""
    try:
        move_pieces([x for step in batch for x in step.moves], group=group.group, rank=rank,
                    staging_bytes=staging)
        for step in batch:
            for f in step.finish:
                f()
    except Exception as e:  # noqa: BLE001 - every rank takes part in the move, then all raise
        names = ", ".join(f"{t.table.path}.{t.table.name}" for t in batch)
        return _failure(f"moving table{'s' if len(batch) > 1 else ''} {names}", e)
    return None


def _move_back(done: list[_Step], group: CommGroup, rank: int, error: BaseException) -> None:
    """After a failed batch, every table moved before it takes its old blocks, released once in use, back
    from the new module, one table at a time (*collective*)."""
    try:
        for step in reversed(done):
            back = [Move(pieces(x.dst_layout, x.src_layout), x.dst_layout, x.dst_local, x.src_layout, x.src_local)
                    for x in step.exact]
            problem = None
            try:
                move_pieces(back, group=group.group, rank=rank, staging_bytes=STAGING_BYTES)
            except Exception as e:  # noqa: BLE001 - every rank takes part, then all raise
                problem = _failure(f"moving table {step.table.path}.{step.table.name} back", e)
            agree(WHAT, problem, [], group, refused="could not move its tables back")
            for x in step.exact:
                for t in x.dst_local:
                    release(t)
    except Exception as e:
        names = [f"{s.table.path}.{s.table.name}" for s in done]
        raise RuntimeError(f"{WHAT}: {error}; moving the tables already moved back failed too ({e}): the old "
                           f"modules' tables {names} may have lost their values") from error


def _replace(dmp: Any, plan: object, split_row_states: bool) -> list[Any]:
    """Steps 1-4 of :func:`reshard_dmp`; returns :func:`..torchrec_access.retire`'s weak references."""
    group = of_group(trec.reshard_group(dmp))
    rank = dist.get_rank()
    problem, modules = None, []
    try:
        modules = _check(dmp, plan, group, split_row_states)
    except Rejected as e:
        problem = e.problem
    rows = agree(WHAT, problem, [_digest(modules)], group)
    check_same(WHAT, "the plan (a digest of its layouts)", [r[0] for r in rows])
    saved: list[dict[str, dict[str, Any]]] = [{} for _ in modules]  # each table's lr, ... from its holders
    for held in gather_objects([trec.hyperparameters(m.old) for m in modules], group):
        for mine, theirs in zip(saved, held):
            mine.update(theirs)
    steps: list[_Step] = []
    try:
        for m in modules:
            kind = _kind(trec.fused_optimizer_kind(dmp, m.old))
            states = [s.torchrec for s in kind.states if s.torchrec] if kind is not None else []
            m.new = trec.shard_afresh(dmp, m.path, m.old, m.plan, states)
            trec.keep_data_parallel(m.new, m.old)
            steps.extend(_table_moves(m, t, kind, rank) for t in m.tables)
    except Exception as e:  # noqa: BLE001 - shared with every rank, which all raise
        problem = _failure("building the new sharded modules", e)
    try:
        agree(WHAT, problem, [], group, refused="could not build its new sharded modules")
    except BaseException:
        _let_go(modules, steps)
        raise
    done: list[_Step] = []
    kept: dict[int, int] = {}  # per rank, the old per-row states combined, not released: no way back from them
    batches = schedule(steps, group.members)  # every table of a rebuilt module: the new module holds them all
    for batch in batches:
        try:
            agree(WHAT, _move(batch, group, rank, _staging(batch, kept)), [], group,
                  refused="did not receive all its new blocks")
        except BaseException as error:
            try:
                _move_back(done, group, rank, error)
            finally:
                _let_go(modules, steps, done, *batches)
            raise
        for step in batch:  # in use once the modules are installed: the old blocks are not read again
            for x in step.exact:
                for t in x.src_local:
                    release(t)
            for x in step.combined:
                for r, n in bytes_by_rank(x.src_layout).items():
                    kept[r] = kept.get(r, 0) + n
            step.combined, step.finish = [], []  # and the buffers a combined state was received in go
        done.extend(batch)
    with torch.no_grad():
        for m, values in zip(modules, saved):
            trec.install(dmp, m.path, m.new, values)
    return [r for m in modules for r in trec.retire(m.old, m.path, m.new)]


def reshard_dmp(dmp: Any, plan: object, *, split_row_states: bool = False) -> Any:
    """:func:`~torchrec_dtensor_bridge.reshard` of a ``DistributedModelParallel`` (steps and
    ``split_row_states`` as there).

    1. Check the plan against the model on every rank, and agree on the verdict (*collective*).
    2. Build each changed sharded module afresh under the plan, its tables' memory not yet taken, and plan
       its tables' moves.
    3. Batch by batch, move the tables' blocks and fused optimizer state and agree that every rank has them
       (*collective*), then release the old blocks' memory; on a failure, move the tables already moved back.
    4. Install the new modules; retire the old ones, so that their tables are freed when this returns.
    """
    retired = _replace(dmp, plan, split_row_states)
    if any(r() is not None for r in retired):
        gc.collect()  # a reference cycle retire does not know of, or the caller still refers to an old module
    return dmp
