"""One table's optimizer state on this rank: tensors beside the weight's shards, and their layouts.

Row-wise state (row-wise Adagrad's ``momentum1``) is one 1-D tensor per distinct
row range this rank holds: column pieces of the same rows on one rank share it
(the update of a row is applied once), and ranks holding column pieces of the
same rows hold replicas of it, kept equal because every holder sees the same
whole-row statistics. Element-wise state has the weight's layout; scalar state
(Adam's step) is one plain tensor per table.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import DTensor

from ..layout import ShardLayout, ShardSpec
from ..optim_kinds import Hyper, OptimKind, StateKind

__all__ = ["Binding", "TableState", "row_layout", "share_storage", "state_dtype"]


def row_layout(layout: ShardLayout, name: str) -> tuple[ShardLayout, list[int]]:
    """The 1-D layout of per-row state for a weight of ``layout``, and, for each of the weight's
    shards, the index of its row block in that layout.

    Raises:
        NotImplementedError: when the weight's column pieces cut the rows differently
            (a row block would partly overlap another).
    """
    specs: list[ShardSpec] = []
    where: dict[tuple[int | None, int, int], int] = {}
    index = []
    for s in layout.shards:
        key = (s.rank, s.offsets[0], s.sizes[0])
        if key not in where:
            where[key] = len(specs)
            specs.append(ShardSpec(s.rank, (s.offsets[0],), (s.sizes[0],), s.device))
        index.append(where[key])
    lay = ShardLayout((layout.global_shape[0],), tuple(specs), torch.float32, name)
    try:
        lay.validate()
    except ValueError as e:
        raise NotImplementedError(
            f"FusedOptimizer: table {layout.name!r}: per-row state needs the same row cuts in every column "
            f"piece ({e})"
        ) from None
    return lay, index


@dataclass
class TableState:
    """A table's weight and optimizer state on this rank.

    Attributes:
        name: the table's name in the optimizer (the ``state_dict`` key prefix).
        weight: the DTensor the lookups receive.
        layout: its layout (with dtype).
        rank: this rank (in the weight's group).
        shards: the weight's shards on this rank, in layout order (their own storage).
        kind: the optimizer.
        rows: per-row state layout (row-wise kinds), and for each local shard its row block index.
        row_states: this rank's row blocks of per-row state (row layout order).
        elements: per local shard, its element-wise states by name.
        step: steps applied (Adam's bias correction).
        track_changed_rows: report the rows each fused update writes (:mod:`...tracking`).
    """

    name: str
    weight: DTensor
    layout: ShardLayout
    rank: int
    shards: list[torch.Tensor]
    kind: OptimKind
    rows: tuple[ShardLayout, list[int]] | None = None
    row_states: list[torch.Tensor] = field(default_factory=list)
    elements: list[dict[str, torch.Tensor]] = field(default_factory=list)
    step: torch.Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.int64))
    track_changed_rows: bool = False

    def __post_init__(self) -> None:
        per_row = [s.name for s in self.kind.states if s.shape is StateKind.ROW]
        if per_row:
            self.rows = row_layout(self.layout, f"{self.name}.{per_row[0]}")
            lay, _ = self.rows
            self.row_states = [torch.zeros(s.sizes, dtype=torch.float32, device=self._device())
                               for s in lay.shards_on(self.rank)]
        element = [s.name for s in self.kind.states if s.shape is StateKind.ELEMENT]
        self.elements = [{n: torch.zeros_like(s, dtype=state_dtype(s.dtype)) for n in element} for s in self.shards]

    def _device(self) -> torch.device:
        return self.shards[0].device if self.shards else torch.device("cpu")

    def local_row_index(self, shard: int) -> int:
        """Which of this rank's ``row_states`` local shard ``shard`` uses."""
        assert self.rows is not None, "row-wise state only"
        lay, index = self.rows
        mine = [i for i, s in enumerate(self.layout.shards) if s.rank == self.rank]
        local_rows = [i for i, s in enumerate(lay.shards) if s.rank == self.rank]
        return local_rows.index(index[mine[shard]])


@dataclass(frozen=True)
class Binding:
    """What a lookup's backward needs to update one table: the optimizer's hyper-parameters and the table."""

    hyper: Hyper
    table: TableState

    def misfit(self) -> str | None:
        """Why the table's state on this rank no longer fits its shards, or ``None`` when it does: the kernels
        write ``state[row]`` unchecked, so per-row state must be one fp32 value per row of each row block and
        element-wise state shaped as its shard, in :func:`state_dtype` of its dtype; all contiguous, on the shards' device. Lookups
        check it before their agreement step, so a damaged state on one rank makes every rank raise before
        anything is updated."""
        t = self.table
        checks = []
        if t.rows is not None:
            blocks = t.rows[0].shards_on(t.rank)
            checks.append(("momentum1", list(t.row_states), [(tuple(b.sizes), torch.float32) for b in blocks]))
        for name in t.elements[0] if t.elements else {}:
            checks.append((name, [e[name] for e in t.elements],
                           [(tuple(s.shape), state_dtype(s.dtype)) for s in t.shards]))
        for name, got, want in checks:
            devices = {x.device for x in got} | {s.device for s in t.shards}
            if [(tuple(x.shape), x.dtype) for x in got] != want or len(devices) > 1 or not all(
                    x.is_contiguous() for x in got):
                return (f"the optimizer's state '{t.name}.{name}' on this rank no longer fits the table: "
                        f"{[(list(x.shape), x.dtype) for x in got]} on {sorted(map(str, devices))}, the shards "
                        f"need {[(list(shape), dtype) for shape, dtype in want]}, contiguous, on the shards' device")
        return None


def state_dtype(weight_dtype: torch.dtype) -> torch.dtype:
    """The dtype of a table's element-wise optimizer state: fp32 for half-precision tables (fp16, bf16: as
    fbgemm and TorchRec keep it), else the table's own."""
    return torch.float32 if weight_dtype in (torch.float16, torch.bfloat16) else weight_dtype


def _packed(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors``' values in one new buffer, as views of it in order."""
    if not tensors:
        return []
    buf = torch.cat([t.reshape(-1) for t in tensors])
    views, at = [], 0
    for t in tensors:
        views.append(buf[at : at + t.numel()].view(t.shape))
        at += t.numel()
    return views


def _mirrored(shards: list[torch.Tensor], states: list[torch.Tensor]) -> list[torch.Tensor]:
    """``states`` (one like each of ``shards``) in one new buffer laid out as the shards' storage: each at its
    shard's offset, so one kernel call addresses weights and state alike (fbgemm's CPU Adagrad reads its
    momentum at the weights' offsets)."""
    lo = min(int(s.storage_offset()) for s in shards)
    hi = max(int(s.storage_offset()) + s.numel() for s in shards)
    buf = torch.zeros(hi - lo, dtype=states[0].dtype, device=states[0].device)
    views = []
    for s, st in zip(shards, states):
        at = int(s.storage_offset()) - lo
        view = buf[at : at + st.numel()].view(st.shape)
        view.copy_(st)
        views.append(view)
    return views


def share_storage(tables: list[TableState]) -> None:
    """Tables whose shards on this rank all live in one storage (a TorchRec fused module's buffer) keep each
    kind of state in one buffer for that storage, so one kernel call updates them all; each table still
    sees its own views (``row_states``, ``elements``), in its own layout. Per-row state is packed back to
    back; element-wise state mirrors the weights' storage."""
    groups: dict[tuple[int, str], list[TableState]] = {}
    for t in tables:
        homes = {(s.untyped_storage().data_ptr(), str(s.device)) for s in t.shards if s.numel()}
        if len(homes) == 1 and all(s.numel() for s in t.shards):
            groups.setdefault(homes.pop(), []).append(t)
    for members in groups.values():
        if len(members) < 2:
            continue
        rows = _packed([r for t in members for r in t.row_states])
        for t in members:
            t.row_states, rows = rows[: len(t.row_states)], rows[len(t.row_states) :]
        shards = [s for t in members for s in t.shards]
        names = sorted({n for t in members for e in t.elements for n in e})
        for name in names:
            views = _mirrored(shards, [e[name] for t in members for e in t.elements])
            for t in members:
                for e in t.elements:
                    e[name] = views.pop(0)
