"""The few collectives that make checkpoint decisions unanimous: every rank raises, or none does."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from .commit import CheckpointError, IncompleteCheckpointError

__all__ = ["dist_info", "from_rank0", "gather", "raise_if_any"]

Problem = tuple[str, str]
"""(kind, message); kind ``"value"`` raises ``ValueError``, ``"incomplete"`` ``IncompleteCheckpointError``,
anything else ``CheckpointError``."""


def dist_info(group: dist.ProcessGroup | None) -> tuple[int, int, bool]:
    """(rank, world size, whether a process group is up); ``(0, 1, False)`` without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group), True
    return 0, 1, False


def gather(obj: Any, group: dist.ProcessGroup | None) -> list[Any]:
    """Every rank's ``obj``, on every rank (``[obj]`` without a process group)."""
    _, world, on = dist_info(group)
    if not on:
        return [obj]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj, group=group)
    return out


def from_rank0(obj: Any, group: dist.ProcessGroup | None) -> Any:
    """Rank 0's ``obj``, on every rank."""
    _, _, on = dist_info(group)
    if not on:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group else 0, group=group)
    return box[0]


def raise_if_any(problems: list[Problem], group: dist.ProcessGroup | None, what: str) -> None:
    """Every rank raises if any rank reported a problem, with every rank's messages; *collective*."""
    everyone = gather(problems, group)
    flat = [(r, kind, msg) for r, probs in enumerate(everyone) for kind, msg in probs]
    if not flat:
        return
    seen: dict[str, list[int]] = {}
    for r, _, msg in flat:
        seen.setdefault(msg, []).append(r)
    text = "\n  ".join(f"{msg} (rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))})" for msg, rs in seen.items())
    kinds = {k for _, k, _ in flat}
    exc: type[Exception] = {"value": ValueError, "incomplete": IncompleteCheckpointError}.get(
        kinds.pop() if len(kinds) == 1 else "", CheckpointError
    )
    raise exc(f"{what}:\n  {text}")
