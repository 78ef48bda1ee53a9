"""The message that names the first difference between ranks' :class:`.arguments.TableCodes` (what every rank must
agree on for one table); run only when the ranks differ (the comparison: :func:`.entry.check_same_codes`).
"""

from __future__ import annotations

import struct

from .. import agreement, optim_kinds
from .arguments import CODE_FIELDS, DTYPES, MODES, SIZES, name_code

__all__ = ["name_the_difference"]


def _float(code: int) -> float:
    return float(struct.unpack("<d", struct.pack("<q", code))[0])


def _shown(name: str, column: list[int]) -> list[object]:
    if name == "mode":
        return [MODES[c] if 0 <= c < len(MODES) else "?" for c in column]
    if name == "hyper":
        return ["none" if c == 0 else f"{c:08x}" for c in column]
    if name in ("max_norm", "norm_type"):
        return [None if name == "max_norm" and c == 0 else _float(c) for c in column]
    if name in ("dtype", "out_dtype"):
        return [(None if name == "out_dtype" else "?") if c < 0 else DTYPES[c] for c in column]
    if name == "padding_idx":
        return [None if c < 0 else c for c in column]
    if name == "optimizer":
        known = {name_code(k): k for k in optim_kinds.names()}
        return [None if c < 0 else known.get(c, f"an unregistered kind ({c:08x})") for c in column]
    return list(column)


def name_the_difference(fn: str, rows: list[list[int]], table: int | None) -> None:
    """Raises the ``ValueError`` that names the first code on which the ranks' ``rows`` differ."""
    where = "" if table is None else f" for table {table}"
    for i, f in enumerate(CODE_FIELDS):
        column = [r[SIZES + i] for r in rows]
        if f.name == "dtype" and any(c != column[0] for c in column):
            names = [str(DTYPES[c]) if c >= 0 else "?" for c in column]
            raise ValueError(
                f"{fn}: the weight's dtype differs between ranks{where}: {names} (rank order); a rank "
                "holding no shard of a table must still build its DTensor with the table's dtype "
                "(give the ShardLayout a dtype)"
            )
        if f.name == "hyper" and any(c != column[0] for c in column):
            raise ValueError(
                f"{fn}: the fused optimizer's hyper-parameters differ between ranks{where} (digests "
                f"{_shown(f.name, column)}, rank order); build the FusedOptimizer with the same lr, eps, "
                "weight_decay, weight_decay_mode and betas on every rank"
            )
        if f.name == "layout" and any(c != column[0] for c in column):
            raise ValueError(
                f"{fn}: the weight's layout differs between ranks{where} (layout digests {column}, rank "
                "order); every rank must hold the same DTensor: the same blocks on the same ranks"
            )
        agreement.check_same(fn, f.name + where, column, shown=_shown(f.name, column))
