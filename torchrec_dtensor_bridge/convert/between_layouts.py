"""DTensor ops between two layouts of one table, where DTensor's own rules see only placements.

Two DTensors of one shape and the same placements may still hold different blocks when one of them carries
its layout in a :class:`LocalShardsWrapper` (an uneven cut beside DTensor's even one, as in
``torch.distributed.checkpoint.state_dict.set_model_state_dict(..., full_state_dict=True)``, which
distributes a full tensor with ``distribute_tensor`` and copies it into the module's table). DTensor would
pair their local tensors block for block; here:

1. ``copy_`` between two DTensors whose blocks differ moves each overlap between the ranks that hold it
   (:func:`.reshard.copy_into`: *collective*, as the copy already is for DTensor), converting the dtype
   first where the two differ;
2. anything else goes to DTensor's own path (the same blocks: a local copy, block by block);
3. before any ``torch.optim`` step (a global step pre-hook, registered once at import), optimizer state of a
   parameter that carries its layout, but is itself in another layout (``set_optimizer_state_dict(...,
   full_state_dict=True)`` hands the optimizer state made by ``distribute_tensor``), is moved into the
   parameter's layout (*collective*, as the step of a DTensor optimizer already is). A parameter whose
   state already shares its blocks costs one comparison per state tensor.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .._compat import route_dtensor_op
from ..wrapper import LocalShardsWrapper
from .dtensor import layout_of, local_shards_of
from .reshard import copy_into

__all__ = ["align_optimizer_state"]


def _carries_layout(t: Any) -> bool:
    return isinstance(t, DTensor) and isinstance(t._local_tensor, LocalShardsWrapper)


def _blocks(t: DTensor) -> list[tuple[int | None, tuple[int, ...], tuple[int, ...]]]:
    return sorted(((s.rank or 0), s.offsets, s.sizes) for s in layout_of(t).shards)


def _copy(op: Any, args: tuple, kwargs: dict) -> Any:
    dst, src = args[0], args[1]
    if not (isinstance(dst, DTensor) and isinstance(src, DTensor)) or not (_carries_layout(dst) or
                                                                           _carries_layout(src)):
        return NotImplemented
    if dst.shape != src.shape or _same_blocks(dst, src):
        return NotImplemented  # DTensor's own path: its error, or a copy block by block
    if src.dtype != dst.dtype:
        src = src.to(dst.dtype)
    layout = layout_of(dst)
    copy_into(layout, local_shards_of(dst), src, name=layout.name)
    return dst


def _same_blocks(a: DTensor, b: DTensor) -> bool:
    """Whether ``a`` and ``b`` hold the same blocks on the same ranks (two carried layouts: compared as
    they are; else the layouts' blocks, in any order)."""
    la, lb = a._local_tensor, b._local_tensor
    if isinstance(la, LocalShardsWrapper) and isinstance(lb, LocalShardsWrapper):
        if la.layout_of_table is not None and lb.layout_of_table is not None:
            return la.layout_of_table.shards == lb.layout_of_table.shards
    return _blocks(a) == _blocks(b)


@torch.compiler.disable
def align_optimizer_state(opt: torch.optim.Optimizer, args: Any = None, kwargs: Any = None) -> None:
    """Move ``opt``'s state of every parameter that carries its layout into that layout (see 3. above);
    *collective* where a state tensor moves. Runs eagerly under ``torch.compile(opt.step)`` (a graph break:
    it reads layouts and may communicate, which a graph cannot hold)."""
    for group in opt.param_groups:
        for p in group["params"]:
            state = opt.state.get(p) if _carries_layout(p) else None
            if not state:
                continue
            for key, value in list(state.items()):
                if isinstance(value, DTensor) and value.shape == p.shape and not _same_blocks(value, p):
                    moved: Any = torch.zeros_like(p, dtype=value.dtype, requires_grad=False)  # p's layout
                    layout = layout_of(moved)
                    copy_into(layout, local_shards_of(moved), value, name=f"{layout.name}.{key}")
                    state[key] = moved


route_dtensor_op(torch.ops.aten.copy_.default, _copy)
register_optimizer_step_pre_hook(align_optimizer_state)
