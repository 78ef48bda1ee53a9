"""TorchRec's keyed optimizers in a checkpoint: what their ``state_dict()`` leaves out, or cannot say.

- :func:`row_state_hint`: why a per-row optimizer state does not convert between two shapes (another
  optimizer kind; per-column-block states of a column-wise table);
- :func:`column_widths` and :func:`combine_row_states`: a column-wise table's per-block row states (TorchRec's
  row-wise Adagrad keeps one per column block) combined into one value per row on load, weighted by the
  blocks' widths, which a save records (:data:`ROW_STATE_COLUMNS`, read back by :func:`recorded_widths`);
- :func:`hyperparameters` and :func:`apply_hyperparameters`: each parameter's group hyper-parameters (``lr``,
  ...), which TorchRec's ``state_dict()`` omits, saved beside the state and restored per group.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from .._compat import ShardedTensor, shape_and_dtype
from ..convert import layout_of, local_shards_of
from ..convert.reshard import copy_into

__all__ = ["HYPERPARAMETERS", "Hint", "ROW_STATE_COLUMNS", "apply_hyperparameters", "column_widths",
           "combine_row_states", "hyperparameters", "recorded_widths", "row_state_hint"]

Hint = Callable[[tuple[int, ...], tuple[int, ...], "tuple[int, ...] | str"], str]
"""Why a key whose saved and destination shapes differ (given in that order) cannot convert, given the column
blocks' widths the checkpoint records for the key, or why it records none (:func:`recorded_widths`)."""


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


def row_state_hint(table: str, shape: tuple[int, ...]) -> Hint:
    """Why the per-row optimizer state of ``table`` (of ``shape`` in the destination) does not convert.

    The saved state's size alone says little: the checkpoint's column blocks' widths, when it records them,
    say how many blocks it holds and so how many rows the table had; without them only a whole multiple of
    this table's rows reads as one value per row and block, and the reason they are absent is told as it is
    (never "written before they were recorded" unless the checkpoint was).
    """
    rows = shape[0]
    of = f"optimizer state of table {table!r}, {list(shape)} in the destination"

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

    def why(saved: tuple[int, ...], dest: tuple[int, ...], widths: tuple[int, ...] | str) -> str:
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
            if was != rows:
                return afresh(f"{head}: the table had {was} rows when saved and has {rows} now, and a per-row "
                              f"state does not convert between numbers of rows; load into a {was}-row table")
            return afresh(f"{head}; per-block states combine into one value per row, not into another column cut: "
                          "resume under the checkpoint's cut or into a table not cut by columns")
        head = (f" (row-wise {of}: the checkpoint holds {holds(saved[0])}, the destination {holds(dest[0])}; "
                "TorchRec's row-wise Adagrad keeps a separate per-row state for each column shard of a column-wise "
                "table")
        if not rows or saved[0] % rows:
            return afresh(f" (row-wise {of}: the checkpoint holds {saved[0]} values, neither one value per row of "
                          f"this {rows}-row table nor one per row and column block: the table has another number "
                          "of rows than when it was saved, and a per-row state does not convert; load into a table "
                          "of the saved shape")
        if dest[0] == rows:  # per-block states into one per row: exact given the blocks' widths
            return afresh(f"{head}. They combine into one value per row given the column blocks' widths, which the "
                          f"checkpoint does not record for this key ({widths}): resume under the same column cut")
        if saved[0] == rows:
            return (f"{head}, and one value per row does not split into per-shard values exactly: resume under the "
                    "checkpoint's cut, load(..., split_row_states=True) to give every column block its row's value "
                    "(an approximation), or leave its optimizer out of the load to start that state afresh)")
        return afresh(f"{head}; per-shard states do not convert into another number of column shards: resume under "
                      "the checkpoint's cut")

    return why


def combine_row_states(row_states: Mapping[str, tuple[MutableMapping[str, Any], str]],
                       conversions: Mapping[str, tuple[int, ...]], metadata: Any,
                       ) -> tuple[Callable[[], None], Callable[[], None]]:
    """Put a buffer of the saved shape in the view (where ``row_states`` says) under each key of
    ``conversions`` (:func:`.loading.row_state_conversions`); return what, after the load, converts them into
    the destinations and puts the destinations back, and what puts them back untouched (a failed load):

    - a column-cut table's per-block row states, saved, into one value per row: each row its blocks' values
      weighted by their widths (the mean over all columns that each block's value is over its own);
    - one value per row, saved, into a column-cut table's per-block states (asked for with
      ``split_row_states``): every block its row's value.

    Every rank reads each buffer whole; the result is copied into each rank's blocks of the destination
    without communication."""
    swapped = []
    for fqn, widths in conversions.items():
        mapping, key = row_states[fqn]
        dest = mapping[key]
        saved = metadata.state_dict_metadata[fqn]
        mapping[key] = buf = torch.zeros(tuple(saved.size), dtype=saved.properties.dtype)
        swapped.append((fqn, mapping, key, dest, buf, widths))

    def finish() -> None:
        for fqn, mapping, key, dest, buf, widths in swapped:
            if buf.numel() * len(widths) == shape_and_dtype(dest)[0][0]:  # one per row into one per row and block
                rows = buf.repeat(len(widths)).to(shape_and_dtype(dest)[1])
            else:
                w = torch.tensor(widths, dtype=torch.float64)
                per_block = buf.view(len(widths), -1).to(torch.float64)
                rows = ((per_block * w[:, None]).sum(0) / w.sum()).to(shape_and_dtype(dest)[1])
            if isinstance(dest, (DTensor, ShardedTensor)):  # this rank's blocks of it, from the whole
                copy_into(layout_of(dest, name=fqn), local_shards_of(dest), rows, name=fqn)
            else:
                dest.copy_(rows)
            mapping[key] = dest

    def undo() -> None:
        for _, mapping, key, dest, _, _ in swapped:
            mapping[key] = dest

    return finish, undo
