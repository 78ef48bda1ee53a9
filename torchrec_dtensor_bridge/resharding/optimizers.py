"""The optimizers over resharded tables: their state checked, moved with the tables, and swapped in.

Two kinds, each in two steps (:func:`check_optimizers` before anything is allocated, then per table
:func:`optimizer_moves` returning the moves to run and what to do once every rank has its blocks):

- a ``torch.optim`` optimizer keeps ``state[param]``: every DTensor shaped like the table (Adam's
  ``exp_avg``, Adagrad's ``sum``) moves into the table's new layout - the same tensor object, refilled,
  as the parameter itself - and anything else (a step count) stays as it is; its parameter groups and
  the keys of its ``state`` need no change;
- a :class:`~torchrec_dtensor_bridge.FusedOptimizer` keeps per-row state in the row cuts of the table's
  layout and per-element state in the layout itself: both move, into a fresh table state over the
  table's new shards, which then replaces the old one (its step count kept).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .._compat import refill_dtensor
from ..agreement import Rejected
from ..convert.dtensor import dtensor_from_local_shards, layout_of, local_shards_of
from ..convert.reshard import Move, Piece, pieces
from ..layout import ShardLayout
from ..optim import FusedOptimizer
from ..optim.state import row_layout, state_dtype
from ..optim_kinds import StateKind, lookup
from .tables import WHAT, Table

__all__ = ["Optimizer", "check_optimizers", "optimizer_moves"]

Optimizer = torch.optim.Optimizer | FusedOptimizer
"""What ``reshard(..., optimizers=)`` takes."""

Commit = Callable[[], None]


def _moving(value: object, param: torch.Tensor) -> bool:
    """Whether a ``torch.optim`` state value moves with its table: a DTensor shaped like the table."""
    return isinstance(value, DTensor) and tuple(value.shape) == tuple(param.shape)


def _check_torch_optim(i: int, opt: torch.optim.Optimizer, table: Table) -> None:
    for key, value in opt.state.get(table.param, {}).items():
        if _moving(value, table.param) or not isinstance(value, torch.Tensor) or value.numel() <= 1:
            continue
        raise Rejected(NotImplementedError, f"{WHAT}: optimizers[{i}] ({type(opt).__name__}): its state {key!r} "
                                            f"of table {table.name!r} is a {type(value).__name__} of shape "
                                            f"{list(value.shape)}; only DTensors shaped like the table "
                                            f"{list(table.param.shape)} and single values move with it")


def check_optimizers(optimizers: object, tables: Sequence[Table]) -> list[Optimizer]:
    """The optimizers, each checked against the tables that change; raises :class:`Rejected`."""
    if isinstance(optimizers, (torch.optim.Optimizer, FusedOptimizer)):
        optimizers = [optimizers]
    if not isinstance(optimizers, (list, tuple)):
        raise Rejected(TypeError, f"{WHAT}: optimizers must be a sequence of torch.optim optimizers and "
                                  f"FusedOptimizers, got {type(optimizers).__name__}")
    out: list[Optimizer] = []
    for i, opt in enumerate(optimizers):
        if not isinstance(opt, (torch.optim.Optimizer, FusedOptimizer)):
            raise Rejected(TypeError, f"{WHAT}: optimizers[{i}] is a {type(opt).__name__}, not a torch.optim "
                                      "optimizer nor a FusedOptimizer")
        for t in tables:
            if not t.changes:
                continue
            if isinstance(opt, torch.optim.Optimizer):
                _check_torch_optim(i, opt, t)
            elif opt.table_name(t.param) is not None and lookup(opt.kind).row_wise:
                try:
                    row_layout(t.target, f"{t.name} (per-row state)")
                except NotImplementedError as e:
                    raise Rejected(NotImplementedError, f"{WHAT}: optimizers[{i}] (FusedOptimizer, "
                                                        f"{opt.kind!r}): table {t.name!r}: {e}") from None
        out.append(opt)
    return out


def _empty_like_layout(layout: ShardLayout, device: torch.device) -> list[torch.Tensor]:
    assert layout.dtype is not None, "a target layout carries its dtype"
    return [torch.empty(s.sizes, dtype=layout.dtype, device=device) for s in layout.shards_on(dist.get_rank())]


def _torch_optim(opt: torch.optim.Optimizer, table: Table, weight: list[Piece], device: torch.device,
                 ) -> tuple[list[Move], Commit]:
    moves: list[Move] = []
    refills: list[tuple[DTensor, DTensor]] = []
    for key, value in opt.state.get(table.param, {}).items():
        if not _moving(value, table.param):
            continue
        src = layout_of(value, name=f"{table.name}.{key}")
        dst = dataclasses.replace(table.target, dtype=value.dtype, name=src.name)
        local = _empty_like_layout(dst, device)
        same = src.shards == table.layout.shards
        moves.append(Move(weight if same else pieces(src, dst), src, local_shards_of(value), dst, local))
        refills.append((value, dtensor_from_local_shards(dst, local, device_mesh=value.device_mesh)))

    def commit() -> None:
        for value, moved in refills:
            refill_dtensor(value, moved)

    return moves, commit


def _fused(opt: FusedOptimizer, name: str, table: Table, shards: list[torch.Tensor], weight: list[Piece],
           ) -> tuple[list[Move], Commit]:
    was = opt._table(name)
    fresh = opt._fresh_table(name, table.target, shards)  # zeroed; every element is written below
    moves: list[Move] = []
    if was.rows is not None and fresh.rows is not None:
        src_rows, dst_rows = was.rows[0], fresh.rows[0]
        moves.append(Move(pieces(src_rows, dst_rows), src_rows, was.row_states, dst_rows, fresh.row_states))
    for state in [s.name for s in lookup(opt.kind).states if s.shape is StateKind.ELEMENT]:
        dtype = state_dtype(table.layout.dtype or table.param.dtype)
        src = dataclasses.replace(table.layout, dtype=dtype)
        dst = dataclasses.replace(table.target, dtype=dtype)
        moves.append(Move(weight, src, [e[state] for e in was.elements], dst, [e[state] for e in fresh.elements]))
    return moves, lambda: opt._install_table(fresh)


def optimizer_moves(optimizers: Sequence[Optimizer], table: Table, shards: list[torch.Tensor],
                    weight: list[Piece], device: torch.device) -> tuple[list[Move], list[Commit]]:
    """What moves, for every optimizer holding ``table``, from its old layout to the new one (``shards``: the
    table's new blocks on this rank; ``weight``: the table's own pieces, shared by the states in its layout),
    and what puts the moved state in use once the table has moved."""
    moves: list[Move] = []
    commits: list[Commit] = []
    for opt in optimizers:
        if isinstance(opt, torch.optim.Optimizer):
            if not any(p is table.param for g in opt.param_groups for p in g["params"]):
                continue
            m, c = _torch_optim(opt, table, weight, device)
        else:
            name = opt.table_name(table.param)
            if name is None:
                continue
            m, c = _fused(opt, name, table, shards, weight)
        moves += m
        commits.append(c)
    return moves, commits
