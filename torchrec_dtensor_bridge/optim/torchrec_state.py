"""TorchRec's ``fused_optimizer.state_dict()`` in and out of a :class:`.optimizer.FusedOptimizer`.

TorchRec's format: ``{"state": {param_key: {f"{table}.{state}": ShardedTensor}}, "param_groups": [...]}``.
A table's state is matched by name: our table named ``table`` or ``param_key``; each state by the key its
kind's record gives TorchRec's (:attr:`...optim_kinds.StateSpec.torchrec`). What moves, and what is refused
(with the reason):

* ``rowwise_adagrad`` <-> ``EXACT_ROWWISE_ADAGRAD`` ``momentum1``: one value per row, when
  TorchRec's state has one value per row (table-wise, row-wise, table-row-wise,
  data-parallel). Refused for column-wise / table-column-wise tables: TorchRec's
  kernel runs on each column shard alone, so it keeps a separate per-row state per
  column shard (its ``momentum1`` has ``k x rows`` values) whose updates depend on
  the cut; the unsharded optimizer has one state per whole row, and neither
  converts into the other.
* ``adagrad`` <-> ``EXACT_ADAGRAD`` ``momentum1``: element-wise, the weight's shape, any layout.
* ``sgd``: no state; nothing moves.
* ``adam``: refused (not mapped: TorchRec's CPU kernels have no Adam to compare against).
* a table without state in TorchRec's ``fused_optimizer``: refused, naming the table. TorchRec
  keeps optimizer state only for tables planned with the fused compute kernel
  (``compute_kernel="fused"``, ``EmbeddingComputeKernel.FUSED``); a dense-kernel table is
  trained by an ordinary optimizer of the user's, outside ``fused_optimizer``.

Both directions reshard (:func:`..convert.reshard.copy_into`), so the two sides
may use different plans; both are *collective*.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .._compat import ShardedTensor
from ..convert.dtensor import layout_of, local_shards_of
from ..convert.reshard import copy_into
from ..optim_kinds import lookup

__all__ = ["export_torchrec", "import_torchrec"]


def _theirs(osd: Mapping[str, Any], names: list[str]) -> dict[str, dict[str, torch.Tensor]]:
    """Per our table, TorchRec's state tensors on this rank (by our state name)."""
    state = osd.get("state") if isinstance(osd, Mapping) else None
    if not isinstance(state, Mapping):
        raise ValueError("TorchRec fused optimizer state_dict: expected a mapping with a 'state' entry")
    out: dict[str, dict[str, torch.Tensor]] = {}
    for param_key, per in state.items():
        if not isinstance(per, Mapping):
            continue
        for key, value in per.items():
            table, _, what = str(key).rpartition(".")
            name = table if table in names else (param_key if param_key in names else None)
            if name is not None and isinstance(value, torch.Tensor):
                out.setdefault(name, {})[what] = value
    return out


def _their_tables(osd: Mapping[str, Any]) -> list[str]:
    """The table names TorchRec's state holds on this rank (its keys are ``f"{table}.{state}"``)."""
    names = {str(key).rpartition(".")[0] for per in osd["state"].values() if isinstance(per, Mapping) for key in per}
    return sorted(names)


def _no_state(table: str, state: str, theirs: list[str]) -> str:
    """Why TorchRec's state has no ``state`` for ``table``, and what to do."""
    held = f"it holds state for tables {theirs}" if theirs else "it holds no table's state"
    return (f"table {table!r}: TorchRec's fused_optimizer.state_dict() has no {state} for it ({held}). TorchRec "
            "keeps optimizer state only for tables with the FUSED compute kernel: plan the table with "
            "compute_kernel=\"fused\" (EmbeddingComputeKernel.FUSED); a table with the dense kernel is trained "
            "by a separate optimizer of yours, and its state is not in fused_optimizer.state_dict()")


def _pairs(opt: Any, osd: Mapping[str, Any]) -> list[tuple[str, str, Any, torch.Tensor | None]]:
    """(table, state, our DTensor, TorchRec's tensor or None on a rank without it), checked on every rank; the
    state by our name (TorchRec's key for it is the kind's :attr:`..optim_kinds.StateSpec.torchrec`)."""
    kind = lookup(opt.kind)
    if not kind.torchrec_mapped:
        raise NotImplementedError(f"FusedOptimizer: TorchRec state for kind {kind.name!r} is not mapped")
    ours_of = {spec.torchrec: spec.name for spec in kind.states}
    names = opt.names()
    theirs = {n: {ours_of[k]: v for k, v in per.items() if k in ours_of} for n, per in _theirs(osd, names).items()}
    mine = opt.state_dict()
    have = {(n, s): tuple(theirs[n][s].shape) for n in theirs for s in theirs[n]}
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (have, _their_tables(osd)))
    seen = [h for h, _ in gathered]
    their_tables = sorted({t for _, tables in gathered for t in tables})
    problems, out = [], []
    for n in names:
        for s in (spec.name for spec in kind.states):
            shapes = {r: h[(n, s)] for r, h in enumerate(seen) if (n, s) in h}
            ours = mine[f"{n}.{s}"]
            if not shapes:
                problems.append(_no_state(n, s, their_tables))
                continue
            shape = next(iter(shapes.values()))
            if shape != tuple(ours.shape):
                why = (" (TorchRec keeps a per-row state for every column shard of a column-wise table: "
                       "its row-wise Adagrad is not the unsharded one, so the states do not convert)"
                       if kind.row_wise and len(shape) == 1 else "")
                problems.append(f"{n}.{s}: TorchRec's has shape {list(shape)}, ours {list(ours.shape)}{why}")
                continue
            lay = layout_of(ours, name=f"{n}.{s}")
            needs = {sp.rank for sp in lay.shards if sp.numel}
            lacking = [r for r in range(len(seen)) if r not in shapes and r in needs]
            if lacking:
                problems.append(f"{n}.{s}: ranks {lacking} hold our state but not TorchRec's (TorchRec leaves a "
                                "table's state out on ranks holding none of the table); use a layout on the "
                                "ranks that hold it")
                continue
            out.append((n, s, ours, theirs.get(n, {}).get(s)))
    if problems:
        raise ValueError("FusedOptimizer: TorchRec fused optimizer state does not match: " + "; ".join(problems))
    return out


def import_torchrec(opt: Any, osd: Mapping[str, Any]) -> None:
    """Copy TorchRec's ``fused_optimizer.state_dict()`` into ``opt``'s state; *collective*."""
    for n, s, ours, theirs in _pairs(opt, osd):
        if theirs is not None:
            copy_into(layout_of(ours, name=f"{n}.{s}"), local_shards_of(ours), theirs.to(ours.dtype)
                      if theirs.dtype != ours.dtype else theirs, name=f"{n}.{s}")


def export_torchrec(opt: Any, osd: Mapping[str, Any]) -> None:
    """Copy ``opt``'s state into the tensors of TorchRec's ``fused_optimizer.state_dict()`` ``osd`` (which
    are TorchRec's live state: the model trains on from there); *collective*."""
    for n, s, ours, theirs in _pairs(opt, osd):
        if theirs is not None:
            if not isinstance(theirs, (ShardedTensor, DTensor)):
                raise TypeError(f"FusedOptimizer: TorchRec's {n}.{s} is a {type(theirs).__name__}, expected a "
                                "ShardedTensor or DTensor")
            lay = layout_of(theirs, name=f"{n}.{s}")
            copy_into(lay, local_shards_of(theirs), ours, name=f"{n}.{s}")
