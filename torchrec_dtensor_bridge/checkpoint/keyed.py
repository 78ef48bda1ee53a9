"""TorchRec's keyed optimizers in a checkpoint: what their ``state_dict()`` leaves out, or cannot say.

- :class:`Hint` (:func:`row_state_hint`): how a table's per-row optimizer state converts on load between
  column cuts, or why it does not. TorchRec's row-wise Adagrad keeps one value per row and column block
  (block ``k``'s at ``k * rows + row``); the rule is the one :func:`~torchrec_dtensor_bridge.reshard` follows
  for a DMP: the same blocks load block for block; into one block each row's saved values are combined,
  weighted by their blocks' widths (exact: each block's value is the mean over its own columns); into any
  other cut only with ``split_row_states``, every new block given that combined value (an approximation),
  else refused naming both cuts;
- :func:`column_widths` and :func:`combine_row_states`: a column-cut table's blocks' widths, which a save
  records (:data:`ROW_STATE_COLUMNS`, read back by :func:`recorded_widths`), and the conversion itself;
- :func:`hyperparameters` and :func:`apply_hyperparameters`: each parameter's group hyper-parameters (``lr``,
  ...), which TorchRec's ``state_dict()`` omits, saved beside the state and restored per group.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch.distributed.tensor import DTensor

from .._compat import ShardedTensor, shape_and_dtype
from ..convert import layout_of, local_shards_of
from ..convert.reshard import copy_into
from ..optim_kinds import combine_column_blocks

__all__ = ["HYPERPARAMETERS", "Hint", "ROW_STATE_COLUMNS", "RowConversion", "apply_hyperparameters", "column_widths",
           "combine_row_states", "hyperparameters", "recorded_widths", "row_state_hint"]


def column_widths(param: Any) -> tuple[int, ...] | None:
    """The widths of a table's column blocks in its blocks' order, when it is cut by columns into several
    (TorchRec then keeps one per-row state per column block, the blocks one after another); else ``None``."""
    if not isinstance(param, (ShardedTensor, DTensor)):
        return None
    layout = layout_of(param)
    cols: list[tuple[int, int]] = []
    for spec in layout.shards:
        block = (spec.offsets[1], spec.sizes[1])
        if spec.numel and block not in cols:
            cols.append(block)
    return tuple(w for _, w in cols) if len(cols) > 1 else None


ROW_STATE_COLUMNS = "row_state_columns"
"""The manifest's record, per flattened key of a column-cut table's per-row optimizer state, of the table's
column blocks' widths (written by a save; what lets a load combine the blocks' states into one per row)."""


def recorded_widths(manifest: dict[str, Any] | None, fqn: str) -> tuple[int, ...] | str:
    """The column blocks' widths the checkpoint records for ``fqn`` (whole numbers, at least two), or why it
    records none, as a refusal says it."""
    if manifest is None:
        return "it has no manifest of tdb.checkpoint.save, which records them"
    if "migrated_from" in manifest:
        return f"it was migrated from {manifest['migrated_from']}, which does not record them"
    if ROW_STATE_COLUMNS not in manifest:
        return "it was written before tdb.checkpoint.save recorded them"
    recorded = manifest[ROW_STATE_COLUMNS]
    widths = recorded.get(fqn) if isinstance(recorded, dict) else None
    if isinstance(widths, list) and len(widths) > 1 and all(type(w) is int and w > 0 for w in widths):
        return tuple(widths)
    return ("a save records them for a column-cut table saved with its optimizer itself, not its state_dict() "
            "nor through compact; else the table was not cut by columns and had another number of rows")


HYPERPARAMETERS = "hyperparameters"
"""The key, beside a keyed optimizer's ``state``, of its parameters' hyper-parameters."""


def hyperparameters(opt: Any) -> tuple[tuple[str, tuple[tuple[str, Any], ...]], ...]:
    """Per parameter name, its group's plain hyper-parameters (numbers, strings, tuples of numbers); one
    picklable leaf (tuples, not dicts: DCP keeps it one object)."""
    names = {id(p): n for n, p in opt.params.items()}
    out = []
    for group in opt.param_groups:
        values = tuple(sorted((k, v) for k, v in group.items() if k != "params" and _plain(v)))
        out += [(names[id(p)], values) for p in group["params"] if id(p) in names]
    return tuple(sorted(out))


def _plain(v: Any) -> bool:
    if isinstance(v, tuple):
        return all(_plain(x) for x in v)
    return isinstance(v, (bool, int, float, str))


def apply_hyperparameters(key: str, opt: Any, saved: Any) -> None:
    """Each parameter group of ``opt`` takes its parameters' saved hyper-parameters where they agree; a
    group whose tables saved different values keeps its own, with a warning naming them."""
    by_name = {n: dict(v) for n, v in saved} if isinstance(saved, tuple) else {}
    names = {id(p): n for n, p in opt.params.items()}
    for group in opt.param_groups:
        mine = [names[id(p)] for p in group["params"] if id(p) in names and names[id(p)] in by_name]
        values = {tuple(sorted(by_name[n].items())) for n in mine}
        if len(values) > 1:
            warnings.warn(f"{key}: the tables {mine} now share one parameter group but were saved with different "
                          f"hyper-parameters {[by_name[n] for n in mine]}; the group keeps {group.get('lr')!r} "
                          "as its lr and its other values", stacklevel=3)
            continue
        for k, v in (dict(values.pop()) if values else {}).items():
            if k in group:
                group[k] = v


def row_state_hint(table: str, shape: tuple[int, ...], columns: tuple[int, ...] | None = None) -> Hint:
    """What a load needs to convert the per-row optimizer state of ``table`` (``shape``: the table's, in the
    destination; ``columns``: its column blocks' widths there, when it is cut into several,
    :func:`column_widths`), or to say why it does not convert."""
    return Hint(table, shape, columns)


class RowConversion(NamedTuple):
    """How a saved per-row state converts on load (:meth:`Hint.conversion`).

    Attributes:
        widths: the saved column blocks' widths; each row's values are combined weighted by them (one
            block: one value per row, taken as it is).
        blocks: the destination's number of column blocks; every one takes its row's combined value.
    """

    widths: tuple[int, ...]
    blocks: int


def _holds(widths: tuple[int, ...]) -> str:
    if len(widths) == 1:
        return "one value per row"
    return f"one value per row for each of {len(widths)} column shards (widths {list(widths)})"


@dataclass(frozen=True)
class Hint:
    """The per-row optimizer state of one table as the destination holds it (TorchRec's row-wise Adagrad:
    one value per row and column block, block ``k``'s at ``k * rows + row``): whether and how a saved state
    converts into it (:meth:`conversion`), or why not.

    Attributes:
        table: the table's name.
        shape: the table's shape in the destination (rows, columns).
        columns: its column blocks' widths in the destination, when it is cut into several; else ``None``.
    """

    table: str
    shape: tuple[int, ...]
    columns: tuple[int, ...] | None = None

    def conversion(self, saved: tuple[int, ...], dest: tuple[int, ...], recorded: tuple[int, ...] | str,
                   split: bool) -> RowConversion | str | None:
        """How the saved state (of shape ``saved``; ``recorded``: its column blocks' widths as the checkpoint
        records them, or why it records none, :func:`recorded_widths`) loads into the destination's (``dest``).

        ``None``: as it is (the same column blocks, block for block; a checkpoint recording no widths that holds
        as many blocks as the destination is taken to have its cut, as every load before the widths were
        recorded took it). A :class:`RowConversion`: into one column block, each row's saved values combined
        weighted by their blocks' widths (exact); into another cut of several blocks, only with ``split``,
        every new block given that combined value (an approximation). A string: why it does not convert, as a
        refusal of the key says it (the same on every rank that holds the key).
        """
        mismatch = f"saved shape {list(saved)}, destination shape {list(dest)}"
        if len(saved) != 1 or len(dest) != 1 or len(self.shape) != 2:
            return None if saved == dest else mismatch + self.why(saved, dest, recorded)
        rows, cols = self.shape
        into = self.columns or (cols,)
        if dest[0] != len(into) * rows:  # not one value per row and block of this table: left to the shapes
            return None if saved == dest else mismatch + self.why(saved, dest, recorded)
        if isinstance(recorded, tuple) and saved[0] == len(recorded) * rows and sum(recorded) == cols:
            was = recorded
        elif not isinstance(recorded, tuple) and saved[0] == rows:
            was = (cols,)
        elif not isinstance(recorded, tuple) and saved == dest:
            return None  # as many blocks, widths not recorded: taken as the destination's cut
        else:
            return mismatch + self.why(saved, dest, recorded)
        if was == into:
            return None
        if len(into) == 1:
            return RowConversion(was, 1)
        if split:
            return RowConversion(was, len(into))
        return (f"{mismatch} (row-wise optimizer state of table {self.table!r}, {list(self.shape)} in the "
                f"destination: the checkpoint holds {_holds(was)}, the destination {_holds(into)}; a per-row state "
                "converts exactly only into the same column blocks or into one value per row (the blocks' values "
                "combined, weighted by their widths): resume under the checkpoint's cut, "
                "load(..., split_row_states=True) to give every new column block its row's saved values combined "
                "that way (an approximation), or leave its optimizer out of the load to start that state afresh)")

    def why(self, saved: tuple[int, ...], dest: tuple[int, ...], widths: tuple[int, ...] | str) -> str:
        """Why a saved state of shape ``saved`` does not convert into ``dest`` (given the column blocks'
        widths the checkpoint records, or why it records none), as appended to the key's refusal. The saved
        state's size alone says little: the recorded widths say how many blocks it holds and so how many rows
        the table had; without them only a whole multiple of this table's rows reads as one value per row and
        block, and the reason they are absent is told as it is."""
        rows = self.shape[0] if self.shape else 0
        of = f"optimizer state of table {self.table!r}, {list(self.shape)} in the destination"

        def holds(n: int) -> str:
            if n == rows:
                return "one value per row"
            if rows and n % rows == 0:
                return f"one value per row for each of {n // rows} column shards"
            return f"{n} values"

        def kept(shape: tuple[int, ...]) -> str:
            return holds(shape[0]) if len(shape) == 1 else f"one value per element ({list(shape)})"

        def afresh(what: str) -> str:
            return f"{what}, or leave its optimizer out of the load to start that state afresh)"

        if len(saved) != len(dest):  # per element against per row: another optimizer kind
            return (f" ({of}: the checkpoint holds {kept(saved)}, the destination {kept(dest)}: the optimizer "
                    "changed between the save and the load (element-wise Adagrad keeps a value per element, "
                    "row-wise Adagrad one per row), and its state does not convert; load with the optimizer kind "
                    "that saved it, or leave the optimizer out of the load)")
        if isinstance(widths, tuple):  # recorded: the saved blocks, and so the saved rows, are known
            blocks = len(widths)
            was = saved[0] // blocks
            head = (f" (row-wise {of}: the checkpoint holds one value per row for each of {blocks} column blocks "
                    f"(widths {list(widths)}) of a {was}-row table, the destination {holds(dest[0])}")
            if was != rows or saved[0] % blocks:
                return afresh(f"{head}: the table had {was} rows when saved and has {rows} now, and a per-row "
                              f"state does not convert between numbers of rows; load into a {was}-row table")
            cols = self.shape[1] if len(self.shape) > 1 else 0
            return afresh(f"{head}: the table had {sum(widths)} columns when saved and has {cols} now, and a "
                          "per-row state does not convert between tables; load into the table that saved it")
        head = (f" (row-wise {of}: the checkpoint holds {holds(saved[0])}, the destination {holds(dest[0])}; "
                "TorchRec's row-wise Adagrad keeps a separate per-row state for each column shard of a column-wise "
                "table")
        if not rows or saved[0] % rows:
            return afresh(f" (row-wise {of}: the checkpoint holds {saved[0]} values, neither one value per row of "
                          f"this {rows}-row table nor one per row and column block: the table has another number "
                          "of rows than when it was saved, and a per-row state does not convert; load into a table "
                          "of the saved shape")
        return afresh(f"{head}. They combine into one value per row, and so into any column cut, given the column "
                      f"blocks' widths, which the checkpoint does not record for this key ({widths}): resume under "
                      "the same column cut")


def combine_row_states(row_states: Mapping[str, tuple[MutableMapping[str, Any], str]],
                       conversions: Mapping[str, RowConversion], metadata: Any,
                       ) -> tuple[Callable[[], None], Callable[[], None]]:
    """Put a buffer of the saved shape in the view (where ``row_states`` says) under each key of
    ``conversions`` (:meth:`Hint.conversion`); return what, after the load, converts them into the
    destinations and puts the destinations back, and what puts them back untouched (a failed load).

    Each row's saved values are combined, weighted by their blocks' widths, in float64 as
    :func:`~torchrec_dtensor_bridge.reshard` combines them (so that a resharded job and a resumed one hold the
    same bits; one saved block: its values as they are), and every destination block takes that value. Every
    rank reads each buffer whole; the result is copied into each rank's blocks of the destination without
    communication."""
    swapped = []
    for fqn, how in conversions.items():
        mapping, key = row_states[fqn]
        dest = mapping[key]
        saved = metadata.state_dict_metadata[fqn]
        mapping[key] = buf = torch.zeros(tuple(saved.size), dtype=saved.properties.dtype)
        swapped.append((fqn, mapping, key, dest, buf, how))

    def finish() -> None:
        for fqn, mapping, key, dest, buf, (widths, blocks) in swapped:
            dtype = shape_and_dtype(dest)[1]
            if len(widths) > 1:
                rows = combine_column_blocks(buf.view(len(widths), -1), widths, dtype)
            else:
                rows = buf.to(dtype)
            if blocks > 1:
                rows = rows.repeat(blocks)
            if isinstance(dest, (DTensor, ShardedTensor)):  # this rank's blocks of it, from the whole
                copy_into(layout_of(dest, name=fqn), local_shards_of(dest), rows, name=fqn)
            else:
                dest.copy_(rows)
            mapping[key] = dest

    def undo() -> None:
        for _, mapping, key, dest, _, _ in swapped:
            mapping[key] = dest

    return finish, undo
