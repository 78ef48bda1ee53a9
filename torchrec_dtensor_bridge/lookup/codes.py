"""What every rank must agree on for one table of a lookup, as exact integers, and the message that names the first
difference between ranks (the agreement step itself: :func:`.entry.agree`).

1. :class:`TableCodes` - one table's options, shape, dtype, layout and optimizer as integers, the same in every
   process (digests of names and hyper-parameters, IEEE bits of floats, dtypes by their index in :data:`DTYPES`);
2. :func:`check_same_codes` - every rank's codes compared (each rank's row: its batch sizes, these codes, its routed
   counts, :func:`.arguments.table_fields`); the first difference raised as the ``ValueError`` that names it,
   else every rank's :class:`RankInfo`.
"""

from __future__ import annotations

import dataclasses
import struct
import zlib
from dataclasses import dataclass

import torch

from .. import agreement, optim_kinds
from ..agreement import float_code
from ..optim.state import Binding
from ..optim_kinds import Hyper

__all__ = ["CODE_WIDTH", "DTYPES", "MODES", "RankInfo", "TableCodes", "check_same_codes"]

MODES = ("sum", "mean", "max")
"""The pooling modes, in the order their codes number them."""


@dataclass(frozen=True)
class RankInfo:
    """What one rank reported in the agreement step."""

    num_bags: int
    num_ids: int
    has_weights: bool
    sends: tuple[int, ...] | None = None
    """How many of its ids this rank sends to each rank (:mod:`.route`), when routed."""


# Weight dtypes travel as their index in this (process-independent) order.
DTYPES: tuple[torch.dtype, ...] = tuple(sorted(
    {v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str
))


@dataclass(frozen=True)
class TableCodes:
    """What every rank must agree on for one table, as exact integers.

    Attributes:
        op: which public lookup (0 ``embedding_bag``, 1 ``embedding``, 2 ``embedding_bags``).
        mode: index in :data:`MODES` (-1: invalid).
        padding_idx: non-negative padding row, -1 for none.
        max_norm: IEEE bits of ``max_norm`` (0 for none).
        norm_type: IEEE bits of ``norm_type``.
        num_embeddings, embedding_dim: the weight's shape (-1: not 2-D).
        dtype: index of the weight's dtype in :data:`DTYPES`.
        layout: ``ShardLayout.digest()`` of the weight's layout in the group (-1: unknown).
        optimizer: a digest of the fused optimizer's kind's name (-1: none).
        psw_grad: 1 when backward computes the per-sample weights' gradient.
        hyper: a digest of the fused optimizer's hyper-parameters (lr, eps, weight decay and its
            mode, betas, rounding; 0: none): ranks stepping with different ones would part ways silently.
        out_dtype: index of the output's dtype in :data:`DTYPES` (-1: the weight's).
    """

    op: int
    mode: int
    padding_idx: int
    max_norm: int
    norm_type: int
    num_embeddings: int
    embedding_dim: int
    dtype: int
    layout: int
    optimizer: int = -1
    psw_grad: int = 0
    hyper: int = 0
    out_dtype: int = -1

    @classmethod  # every rank builds its own, from its arguments; ranks compare them in the agreement step
    def of(cls, op: int, mode: str, padding: int | None, max_norm: float | None, norm_type: float,
           shape: tuple[int, ...], dtype: torch.dtype | None, layout: int = -1, *, optimizer: Binding | None = None,
           psw_grad: bool = False, out_dtype: torch.dtype | None = None) -> TableCodes:
        two_d = len(shape) == 2
        return cls(
            op, MODES.index(mode) if mode in MODES else -1, -1 if padding is None else int(padding),
            0 if max_norm is None else float_code(max_norm),
            float_code(norm_type) if isinstance(norm_type, (int, float)) else -1,
            int(shape[0]) if two_d else -1, int(shape[1]) if two_d else -1,
            DTYPES.index(dtype) if dtype in DTYPES else -1, layout,
            -1 if optimizer is None else _name_code(optimizer.hyper.kind.name), int(psw_grad),
            0 if optimizer is None else _hyper_code(optimizer.hyper),
            DTYPES.index(out_dtype) if out_dtype in DTYPES else -1,
        )

    def values(self) -> list[int]:
        return [getattr(self, f.name) for f in _CODE_FIELDS]


_CODE_FIELDS = dataclasses.fields(TableCodes)
_SIZES = 3  # num_bags, num_ids, has_weights
CODE_WIDTH = _SIZES + len(_CODE_FIELDS)
"""How many fields :func:`.arguments.table_fields` gives a table before its routed counts."""


def _hyper_code(hyper: Hyper) -> int:
    """A digest of an optimizer's hyper-parameters, the same in every process, never 0 ("no optimizer")."""
    values = [hyper.lr, hyper.eps, hyper.weight_decay, float(hyper.weight_decay_mode.value), hyper.beta1, hyper.beta2,
              float(hyper.stochastic_rounding)]
    return _name_code(struct.pack(f"<{len(values)}d", *values))


def _name_code(data: str | bytes) -> int:
    """A digest of ``data`` (a kind's name), the same in every process: CRC-32 of its bytes, plus 1."""
    return zlib.crc32(data.encode() if isinstance(data, str) else data) + 1


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
        known = {_name_code(k): k for k in optim_kinds.names()}
        return [None if c < 0 else known.get(c, f"an unregistered kind ({c:08x})") for c in column]
    return list(column)


def check_same_codes(fn: str, rows: list[list[int]], table: int | None) -> list[RankInfo]:
    """Compare one table's codes across ranks (``rows``: per rank, its :func:`.arguments.table_fields`); raises the
    ``ValueError`` naming the first difference; else every rank's sizes."""
    if any(r[_SIZES:CODE_WIDTH] != rows[0][_SIZES:CODE_WIDTH] for r in rows):
        _name_the_difference(fn, rows, table)
    return [RankInfo(r[0], r[1], bool(r[2]), None if r[CODE_WIDTH] < 0 else tuple(r[CODE_WIDTH:])) for r in rows]


def _name_the_difference(fn: str, rows: list[list[int]], table: int | None) -> None:
    """Raises the ``ValueError`` that names the first code on which the ranks' ``rows`` differ."""
    where = "" if table is None else f" for table {table}"
    for i, f in enumerate(_CODE_FIELDS):
        column = [r[_SIZES + i] for r in rows]
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
