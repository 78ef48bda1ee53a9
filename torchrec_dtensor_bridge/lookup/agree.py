"""The lookups' agreement step: what every rank must agree on, and the message naming a difference.

:func:`agree` runs the package's agreement step (:mod:`..agreement`: ONE small ``all_gather`` on the
lookup's group) in which every rank reports its verdict (a local failure from :mod:`.arguments`), its
batch sizes, its options and a digest of each weight's layout as :class:`TableCodes`, the kind (and, for
a ``Replicate()`` input, a digest) of its input, its kernel choices and where its ids go. If any rank
failed, or the ranks disagree on any of these, every rank raises the same error, naming the difference.

The same step exchanges the per-rank batch sizes the lookup needs anyway, so agreement costs no extra
round trip on the happy path.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .. import agreement, kernels
from ..agreement import RejectedArguments, float_code
from ..groups import CommGroup
from ..optim.kinds import OptimKind
from .arguments import MODES, Bags

if TYPE_CHECKING:
    from ..optim.kinds import Hyper
    from ..optim.state import Binding

__all__ = ["InputKind", "RankInfo", "TableCodes", "agree", "batch_digest"]


@dataclass(frozen=True)
class RankInfo:
    """What one rank reported in the agreement step."""

    num_bags: int
    num_ids: int
    has_weights: bool
    sends: tuple[int, ...] | None = None
    """How many of its ids this rank sends to each rank (:mod:`.route`), when routed."""



class InputKind(enum.Enum):
    """How a rank passed its batch; ranks must agree (a ``Replicate()`` input is one batch for all)."""

    PLAIN = 0
    REPLICATE = 1
    SHARD = 2

    def describe(self) -> str:
        return {InputKind.PLAIN: "a plain tensor", InputKind.REPLICATE: "a Replicate() DTensor",
                InputKind.SHARD: "a Shard(0) DTensor"}[self]


def batch_digest(bags: Bags) -> int:
    """62 bits of a batch's ids, bag lengths and weights: ranks holding one ``Replicate()`` batch compare it."""
    h = hashlib.blake2b(digest_size=8)
    for t in (bags.ids, bags.lengths, bags.weights):
        if t is not None:
            h.update(str(t.dtype).encode())
            h.update(t.detach().contiguous().cpu().numpy().tobytes())
    return int.from_bytes(h.digest(), "little") >> 2



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
        optimizer: index of the fused optimizer's kind in ``OptimKind`` (-1: none).
        psw_grad: 1 when backward computes the per-sample weights' gradient.
        hyper: a digest of the fused optimizer's hyper-parameters (lr, eps, weight decay and its
            mode, betas; 0: none): ranks stepping with different ones would part ways silently.
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

    @classmethod
    def of(cls, op: int, mode: str, padding: int | None, max_norm: float | None, norm_type: float,
           shape: tuple[int, ...], dtype: torch.dtype | None, layout: int = -1, *, optimizer: Binding | None = None,
           psw_grad: bool = False) -> TableCodes:
        two_d = len(shape) == 2
        return cls(
            op, MODES.index(mode) if mode in MODES else -1, -1 if padding is None else int(padding),
            0 if max_norm is None else float_code(max_norm),
            float_code(norm_type) if isinstance(norm_type, (int, float)) else -1,
            int(shape[0]) if two_d else -1, int(shape[1]) if two_d else -1,
            DTYPES.index(dtype) if dtype in DTYPES else -1, layout,
            -1 if optimizer is None else list(OptimKind).index(optimizer.hyper.kind), int(psw_grad),
            0 if optimizer is None else _hyper_code(optimizer.hyper),
        )

    def values(self) -> list[int]:
        return [getattr(self, f.name) for f in _CODE_FIELDS]


_CODE_FIELDS = dataclasses.fields(TableCodes)
_SIZES = 3  # num_bags, num_ids, has_weights
_HEADER = 4  # number of tables, input kind, input digest, kernel choices (kernels.choice_code)
FIRST_MESSAGE_TABLES = 16
"""Tables whose sizes and options travel in the agreement's first (fixed-size) message."""


def _table_fields(bags: Bags | None, codes: TableCodes, sends: Sequence[int] | None, world: int) -> list[int]:
    sizes = [0, 0, 0] if bags is None else [bags.num_bags, int(bags.ids.numel()), int(bags.weights is not None)]
    routed = [-1] * world if sends is None else [int(c) for c in sends]
    return sizes + codes.values() + routed


def _hyper_code(hyper: Hyper) -> int:
    """A digest of an optimizer's hyper-parameters, the same in every process (CRC-32 of their bytes)."""
    values = [hyper.lr, hyper.eps, hyper.weight_decay, float(hyper.weight_decay_mode.value), hyper.beta1,
              hyper.beta2]
    return zlib.crc32(struct.pack(f"<{len(values)}d", *values)) + 1  # never 0 ("no optimizer")


def _float(code: int) -> float:
    return float(struct.unpack("<d", struct.pack("<q", code))[0])


def _shown(name: str, column: list[int]) -> list[object]:
    if name == "mode":
        return [MODES[c] if 0 <= c < len(MODES) else "?" for c in column]
    if name == "hyper":
        return ["none" if c == 0 else f"{c:08x}" for c in column]
    if name in ("max_norm", "norm_type"):
        return [None if name == "max_norm" and c == 0 else _float(c) for c in column]
    if name == "padding_idx":
        return [None if c < 0 else c for c in column]
    return list(column)


def _check_same(fn: str, rows: list[list[int]], table: int | None) -> list[RankInfo]:
    """Compare one table's codes across ranks (``rows``: per rank, its fields); its per-rank sizes."""
    nf = _SIZES + len(_CODE_FIELDS)
    if any(r[_SIZES:nf] != rows[0][_SIZES:nf] for r in rows):
        _name_the_difference(fn, rows, table)
    return [RankInfo(r[0], r[1], bool(r[2]), None if r[nf] < 0 else tuple(r[nf:])) for r in rows]


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


def agree(
    fn: str,
    error: RejectedArguments | None,
    bags: Sequence[Bags] | None,
    codes: Sequence[TableCodes],
    group: CommGroup,
    sends: Sequence[Sequence[int] | None] | None = None,
    *,
    kind: InputKind = InputKind.PLAIN,
    digest: int = 0,
) -> list[list[RankInfo]]:
    """The agreement step for a lookup of one or several tables; *collective* over ``group``.

    Returns ``infos[table][rank]``: every rank's batch sizes for each table
    (ranks are group ranks). ONE ``all_gather`` (:func:`..agreement.agree`)
    carries the verdict, the number of tables, the input's kind and digest and
    the sizes and codes of the first :data:`FIRST_MESSAGE_TABLES` tables,
    padded to that many - the same size whatever the call, so ranks that
    disagree even on the number of tables or on the input's kind still meet in
    it and raise. Only a lookup of more tables needs a second ``all_gather``.

    Args:
        fn: public function name, for messages.
        error: this rank's validation failure, if any.
        bags: this rank's canonical batch per table (``None`` when ``error`` is set).
        codes: per table, what every rank must agree on.
        group: the lookup's group.
        sends: per table, how many ids this rank will send to each rank (:mod:`.route`), or ``None``.
        kind: how this rank passed its batch.
        digest: for a ``Replicate()`` input, :func:`batch_digest` of it (0 otherwise).

    Raises:
        The failing rank's exception kind on every rank, or ``ValueError`` when ranks disagree.
    """
    n, world = len(codes), group.size
    per_table = [None] * n if bags is None else list(bags)
    routes = [None] * n if sends is None or bags is None else list(sends)
    nf = _SIZES + len(_CODE_FIELDS) + world
    try:
        fields = [x for b, c, r in zip(per_table, codes, routes) for x in _table_fields(b, c, r, world)]
        device = per_table[0].ids.device if per_table and per_table[0] is not None else torch.device("cpu")
        header = [n, kind.value, digest if kind is InputKind.REPLICATE else 0, kernels.choice_code(device)]
    except Exception as e:  # noqa: BLE001 - this rank still meets the others in the agreement, failing
        if error is None:
            error = RejectedArguments(RuntimeError, f"{fn}: this rank could not prepare its part of the "
                                      f"agreement step: {type(e).__name__}: {e}")
        fields, header = [], [n, kind.value, 0, 0]
    width = _HEADER + FIRST_MESSAGE_TABLES * nf
    rows = agreement.agree(fn, None if error is None else error.problem, header + fields, group, width=width)
    counts = [r[0] for r in rows]
    if len(set(counts)) > 1:
        raise ValueError(f"{fn}: ranks passed different numbers of tables: {counts} (rank order)")
    agreement.check_same(fn, "the input's kind", [r[1] for r in rows],
                         shown=[InputKind(r[1]).describe() for r in rows],
                         hint="every rank must pass its input alike")
    agreement.check_same(fn, "the Replicate() input's values (digests)", [r[2] for r in rows],
                         hint="a Replicate() input must be the same batch on every rank")
    kernels.settle(device, [r[3] for r in rows])  # the ranks run the same kernels, or fall back together
    tables = [r[_HEADER:] for r in rows]
    if n > FIRST_MESSAGE_TABLES:
        more = agreement.exchange(fields[FIRST_MESSAGE_TABLES * nf :], group)
        tables = [t + m for t, m in zip(tables, more)]
    return [_check_same(fn, [t[i * nf : (i + 1) * nf] for t in tables], i if n > 1 else None) for i in range(n)]
