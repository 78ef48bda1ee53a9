"""The tables of a module sharded by ``shard_module``, and a plan for them, checked against them.

Everything here is local and collective-free: :func:`sharded_tables` reads the module, :func:`check_plan`
checks a plan entry by entry and raises :class:`~..agreement.Rejected` (held by the caller until every rank
agrees) naming the table and the values at fault.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..agreement import Rejected
from ..convert.dtensor import layout_of
from ..layout import ShardLayout
from ..sharding.modules import is_sharded_class

__all__ = ["STAGING_BYTES", "WHAT", "Table", "check_plan", "held", "sharded_tables"]

WHAT = "reshard"

STAGING_BYTES = 64 << 20
"""The most bytes of transfer buffers a rank holds at once while a table moves: pieces not contiguous in
their old or new block (column cuts) travel through buffers, in rounds of at most this many bytes."""


@dataclass(frozen=True)
class Table:
    """One sharded table and where the plan puts it.

    Attributes:
        name: the parameter's name in the module (the plan's key, as ``shard_module`` takes it).
        owner: the ``nn.Embedding`` / ``nn.EmbeddingBag`` holding it.
        param: the parameter now (an ``nn.Parameter`` holding a DTensor).
        layout: its layout now (named, with its dtype).
        target: the plan's layout for it (named, with its dtype).
    """

    name: str
    owner: nn.Module
    param: DTensor
    layout: ShardLayout
    target: ShardLayout

    @property
    def attr(self) -> str:
        """The parameter's attribute on :attr:`owner`."""
        return self.name.rpartition(".")[2]

    @property
    def changes(self) -> bool:
        """Whether some rank's blocks change (a box, or their order on the rank): the same blocks listed in
        another order of ranks (replicas of a data-parallel table) are the same layout."""
        return held(self.layout) != held(self.target)


def held(layout: ShardLayout) -> list[tuple[int | None, tuple[int, ...], tuple[int, ...]]]:
    """Every rank's blocks, ranks in order, each rank's in its layout order: what a DTensor of ``layout``
    holds, whatever order the layout lists the ranks in."""
    return sorted(((s.rank, s.offsets, s.sizes) for s in layout.shards), key=lambda b: (b[0] is None, b[0] or 0))


def sharded_tables(model: nn.Module) -> dict[str, tuple[nn.Module, DTensor]]:
    """``name -> (owner, parameter)`` for every table ``shard_module`` sharded in ``model``, in module order."""
    out: dict[str, tuple[nn.Module, DTensor]] = {}
    for prefix, m in model.named_modules():
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and is_sharded_class(type(m)):
            w = m._parameters.get("weight")
            if isinstance(w, DTensor):
                out[f"{prefix}.weight" if prefix else "weight"] = (m, w)
    return out


def _fail(kind: type[Exception], message: str) -> Rejected:
    return Rejected(kind, f"{WHAT}: {message}")


def _check_entry(name: str, layout: object, param: torch.Tensor, members: tuple[int, ...]) -> ShardLayout:
    if not isinstance(layout, ShardLayout):
        raise _fail(TypeError, f"plan entry {name!r}: expected a ShardLayout, got {type(layout).__name__}")
    if layout.global_shape != tuple(param.shape):
        raise _fail(ValueError, f"plan entry {name!r}: the layout's global_shape {list(layout.global_shape)} "
                                f"differs from the table's shape {list(param.shape)}")
    if layout.dtype is not None and layout.dtype != param.dtype:
        raise _fail(ValueError, f"plan entry {name!r}: the layout's dtype {layout.dtype} differs from the "
                                f"table's {param.dtype}")
    for i, s in enumerate(layout.shards):
        if s.rank is None or s.rank not in members:
            raise _fail(ValueError, f"plan entry {name!r}: shard {i} (offsets {list(s.offsets)}, sizes "
                                    f"{list(s.sizes)}) is on rank {s.rank}, outside the ranks of the table's "
                                    f"mesh {list(members)} (a plan for another world size?)")
    named = dataclasses.replace(layout, dtype=param.dtype, name=name)
    try:
        named.validate()
    except ValueError as e:
        raise _fail(ValueError, f"plan entry {name!r}: {e}") from None
    return named


def check_plan(tables: Mapping[str, tuple[nn.Module, DTensor]], plan: object,
               members: tuple[int, ...]) -> list[Table]:
    """The plan's tables, in the plan's order, each checked against the module's table of its name.

    A table the plan does not name keeps its layout. Raises :class:`Rejected` for a plan that is not a
    mapping of names to ``ShardLayout``s, a name that is no sharded table of the module, a layout whose
    shape or dtype differs from the table's, that puts a block on a rank outside the table's mesh, or
    that does not cover the table exactly.
    """
    if not isinstance(plan, Mapping):
        raise _fail(TypeError, f"plan must be a mapping of table names to ShardLayouts, got {type(plan).__name__}")
    out = []
    for name, layout in plan.items():
        if name not in tables:
            raise _fail(ValueError, f"plan entry {name!r}: the module has no table of that name sharded by "
                                    f"shard_module; its tables are {sorted(tables)}")
        owner, param = tables[name]
        target = _check_entry(name, layout, param, members)
        now = dataclasses.replace(layout_of(param, name=name), dtype=param.dtype, name=name)
        out.append(Table(name, owner, param, now, target))
    return out
