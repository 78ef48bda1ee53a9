"""Argument checks of the sharded lookups, local and collective-free, and the batch in canonical form.

Every check runs on every rank and never raises directly: the public functions record a failure (a
:class:`RejectedArguments`) and the agreement step (:func:`.entry.agree`) then makes every rank raise it, so a bad
input on one rank never leaves the others waiting in a collective.

1. :func:`check_options` - the options of one table (mode, padding, ``max_norm``, unsupported flags);
2. :func:`bags_from_input` / :func:`bags_for_embedding` - the input as :class:`Bags` (ids back to back, a
   length per bag, optional weights), the checks that read values gathered in a :class:`ValueCheck`;
3. :func:`check_values` - every table's value checks read in one host synchronisation;
4. :func:`bind_optimizer` - the fused optimizer's binding of the weight, its state checked;
5. :func:`table_fields` - one table's part of the agreement's message: its batch sizes, then what every rank
   must agree on (:class:`TableCodes`: one table's options, shape, dtype, layout and optimizer as integers, the
   same in every process - digests of names and hyper-parameters, IEEE bits of floats, dtypes by their index in
   :data:`DTYPES`), compared by :func:`.entry.check_same_codes` (the difference's message: :mod:`.codes`).
"""

from __future__ import annotations

import dataclasses
import math
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..agreement import RejectedArguments, float_code
from ..optim import FusedOptimizer
from ..optim.state import Binding
from ..optim_kinds import Hyper

__all__ = [
    "CODE_FIELDS", "CODE_WIDTH", "DTYPES", "MODES", "SIZES", "Bags", "RankInfo", "RejectedArguments", "TableCodes",
    "TableOptions", "ValueCheck", "bags_for_embedding", "bags_from_input", "bind_optimizer", "check_options",
    "check_values", "name_code", "read_together", "table_fields",
]


@dataclass(frozen=True)
class Bags:
    """One rank's batch in canonical form.

    Attributes:
        ids: 1-D int64 ids of every bag, back to back.
        lengths: number of ids in each bag (``int64``, one per bag).
        weights: per-sample weights aligned with ``ids``, or ``None``.
    """

    ids: torch.Tensor
    lengths: torch.Tensor
    weights: torch.Tensor | None

    @property
    def num_bags(self) -> int:
        return int(self.lengths.numel())

    def count_per_bag(self, mask: torch.Tensor) -> torch.Tensor:
        """For every bag, how many of its ids ``mask`` (one bool per id) selects: segment sums of a
        prefix sum (faster than ``bincount`` of the selected ids' bags)."""
        prefix = torch.zeros(mask.numel() + 1, dtype=torch.int64, device=mask.device)
        torch.cumsum(mask, 0, out=prefix[1:])
        bounds = torch.zeros(self.num_bags + 1, dtype=torch.int64, device=mask.device)
        torch.cumsum(self.lengths, 0, out=bounds[1:])
        return prefix[bounds[1:]] - prefix[bounds[:-1]]

    def bag_of_id(self) -> torch.Tensor:
        """For every id, the index of its bag."""
        return torch.repeat_interleave(
            torch.arange(self.num_bags, device=self.ids.device), self.lengths, output_size=self.ids.numel()
        )


def read_together(values: Sequence[torch.Tensor]) -> list[list[int]]:
    """Each of ``values`` (small 1-D int64 tensors, e.g. several tables' facts) as a list of ints, read back to
    the host in ONE read per device (one synchronisation on an accelerator, whatever their number)."""
    by_device: dict[torch.device, list[int]] = {}
    for k, v in enumerate(values):
        by_device.setdefault(v.device, []).append(k)
    out: list[list[int]] = [[] for _ in values]
    for members in by_device.values():
        flat = torch.cat([values[k] for k in members]).tolist()
        at = 0
        for k in members:
            out[k] = flat[at : at + values[k].numel()]
            at += values[k].numel()
    return out


def bind_optimizer(fn: str, optimizer: FusedOptimizer | None, weight: object) -> Binding | None:
    """The optimizer's binding for ``weight`` (``None`` without an optimizer); raises :class:`RejectedArguments`."""
    if optimizer is None:
        return None
    if not isinstance(optimizer, FusedOptimizer):
        raise RejectedArguments(TypeError, f"{fn}: optimizer must be a FusedOptimizer, got {type(optimizer).__name__}")
    bind = optimizer.bind(weight)
    if bind is None:
        raise RejectedArguments(ValueError, f"{fn}: the weight is not one of the optimizer's tables "
                                f"{optimizer.names()} (pass the same DTensor objects the optimizer was built with)")
    problem = bind.misfit()
    if problem is not None:
        raise RejectedArguments(ValueError, f"{fn}: {problem}")
    return bind


def check_options(
    fn: str,
    weight_shape: tuple[int, ...],
    *,
    mode: str,
    padding_idx: int | None,
    max_norm: float | None,
    norm_type: float,
    scale_grad_by_freq: bool,
    sparse: bool,
) -> int | None:
    """Check the options; return ``padding_idx`` made non-negative (or ``None``).

    Raises:
        RejectedArguments: carrying the ``TypeError``/``ValueError``/``NotImplementedError`` to raise.
    """
    if len(weight_shape) != 2:
        raise RejectedArguments(ValueError, f"{fn}: weight must be 2-D (num_embeddings, dim), got shape {list(weight_shape)}")
    if mode not in MODES:
        raise RejectedArguments(ValueError, f"{fn}: mode must be one of {list(MODES)}, got mode={mode!r}")
    if scale_grad_by_freq:
        raise RejectedArguments(NotImplementedError, f"{fn}: scale_grad_by_freq=True is not supported")
    if sparse:
        raise RejectedArguments(NotImplementedError, f"{fn}: sparse=True is not supported (gradients are dense DTensors)")
    if max_norm is not None:
        if not isinstance(max_norm, (int, float)) or isinstance(max_norm, bool):
            raise RejectedArguments(TypeError, f"{fn}: max_norm must be a float, got {type(max_norm).__name__}")
        if not max_norm > 0:
            raise RejectedArguments(ValueError, f"{fn}: max_norm must be > 0, got max_norm={max_norm}")
        if not isinstance(norm_type, (int, float)) or isinstance(norm_type, bool) or math.isnan(norm_type):
            raise RejectedArguments(TypeError, f"{fn}: norm_type must be a number, got norm_type={norm_type!r}")
    if padding_idx is None:
        return None
    if not isinstance(padding_idx, int) or isinstance(padding_idx, bool):
        raise RejectedArguments(TypeError, f"{fn}: padding_idx must be an int or None, got {type(padding_idx).__name__}")
    rows = weight_shape[0]
    if not -rows <= padding_idx < rows:
        raise RejectedArguments(ValueError, f"{fn}: padding_idx must be within num_embeddings={rows}, got padding_idx={padding_idx}")
    return padding_idx + rows if padding_idx < 0 else padding_idx


def bags_from_input(
    fn: str,
    input: object,
    offsets: object,
    per_sample_weights: object,
    *,
    rows: int,
    mode: str,
    include_last_offset: bool,
    weight_dtype: torch.dtype,
    pending: list[ValueCheck] | None = None,
) -> Bags:
    """Validate ``embedding_bag`` arguments and return the batch in canonical form.

    The checks that read values (ids inside the table, offsets in order) read the device once: here, or,
    when ``pending`` is given, appended to it for :func:`check_values` to read with other tables' (one
    host synchronisation per call on an accelerator, whatever the number of tables)."""
    if not isinstance(input, torch.Tensor):
        raise RejectedArguments(TypeError, f"{fn}: input must be a Tensor, got {type(input).__name__}")
    if input.dim() > 2:
        raise RejectedArguments(ValueError, f"{fn}: input must be 1-D (with offsets) or 2-D, got {input.dim()} dims")
    if input.dtype not in (torch.int32, torch.int64):
        raise RejectedArguments(TypeError, f"{fn}: input must hold int32 or int64 ids, got dtype {input.dtype}")
    if offsets is not None and not isinstance(offsets, torch.Tensor):
        raise RejectedArguments(TypeError, f"{fn}: offsets must be a Tensor or None, got {type(offsets).__name__}")
    if include_last_offset and offsets is None:
        raise RejectedArguments(ValueError, f"{fn}: include_last_offset=True needs offsets (got offsets=None)")
    ids = input.reshape(-1).to(torch.int64)
    if input.dim() == 2:
        if offsets is not None:
            raise RejectedArguments(ValueError, f"{fn}: offsets must be None when input is 2-D, got offsets of shape {list(offsets.shape)}")
        lengths = torch.full((input.shape[0],), input.shape[1], dtype=torch.int64, device=input.device)
        check = ValueCheck.of(fn, ids, rows, None, None, include_last_offset)
    else:
        if offsets is None:
            raise RejectedArguments(ValueError, f"{fn}: 1-D input needs offsets (got offsets=None)")
        lengths, bounds = _lengths_from_offsets(fn, offsets, ids.numel(), include_last_offset)
        check = ValueCheck.of(fn, ids, rows, offsets, bounds, include_last_offset)
    weights = None
    if per_sample_weights is not None:
        if not isinstance(per_sample_weights, torch.Tensor):
            raise RejectedArguments(TypeError, f"{fn}: per_sample_weights must be a Tensor or None, got {type(per_sample_weights).__name__}")
        if mode != "sum":
            raise RejectedArguments(NotImplementedError, f"{fn}: per_sample_weights is only supported for mode='sum', got mode={mode!r}")
        if per_sample_weights.shape != input.shape:
            raise RejectedArguments(
                ValueError,
                f"{fn}: per_sample_weights must have the shape of input {list(input.shape)}, "
                f"got {list(per_sample_weights.shape)}",
            )
        if per_sample_weights.dtype != weight_dtype:
            raise RejectedArguments(TypeError, f"{fn}: per_sample_weights has dtype {per_sample_weights.dtype}, weight has {weight_dtype}")
        weights = per_sample_weights.reshape(-1)
    if pending is None:
        check_values([check])
    else:
        pending.append(check)
    return Bags(ids, lengths, weights)


def _lengths_from_offsets(fn: str, offsets: torch.Tensor, n: int, include_last_offset: bool,
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """The bags' lengths and their bounds (``offsets`` with ``n`` appended unless it ends them); checks what
    needs no value (the bounds' values: :class:`ValueCheck`)."""
    if offsets.dim() != 1 or offsets.dtype not in (torch.int32, torch.int64):
        raise RejectedArguments(TypeError, f"{fn}: offsets must be a 1-D int32/int64 Tensor, got shape {list(offsets.shape)} dtype {offsets.dtype}")
    offsets = offsets.to(torch.int64)
    if include_last_offset:
        if offsets.numel() == 0:
            raise RejectedArguments(ValueError, f"{fn}: with include_last_offset=True the last offset must be the input length {n}, got None")
        bounds = offsets
    else:
        bounds = torch.cat([offsets, offsets.new_tensor([n])])
    if bounds.numel() > 1:
        return bounds[1:] - bounds[:-1], bounds
    if n:
        raise RejectedArguments(ValueError, f"{fn}: offsets describe no bag but input holds {n} ids")
    return offsets.new_zeros(0), bounds


@dataclass(frozen=True)
class ValueCheck:
    """The checks of one table's batch that read values, as one small int64 tensor of facts computed on the
    batch's device (ids' min and max, the first bound, how many bounds run backwards, the last offset), read
    by :func:`check_values` together with other tables' in one host synchronisation."""

    fn: str
    rows: int
    n: int
    offsets: torch.Tensor | None  # as passed (for the message), when the batch has them
    include_last_offset: bool
    facts: torch.Tensor

    @classmethod  # every rank builds its own, from its arguments; ranks compare them in the agreement step
    def of(cls, fn: str, ids: torch.Tensor, rows: int, offsets: torch.Tensor | None, bounds: torch.Tensor | None,
           include_last_offset: bool) -> ValueCheck:
        dev, n = ids.device, ids.numel()
        parts = [torch.stack(torch.aminmax(ids)) if n else torch.zeros(2, dtype=torch.int64, device=dev)]
        if bounds is not None and bounds.numel() > 1:
            parts += [bounds[:1], (bounds[1:] < bounds[:-1]).sum().reshape(1)]
        else:
            parts.append(torch.zeros(2, dtype=torch.int64, device=dev))
        parts.append(bounds[-1:] if bounds is not None and include_last_offset
                     else torch.full((1,), n, dtype=torch.int64, device=dev))
        return cls(fn, rows, n, offsets, include_last_offset, torch.cat(parts))

    def raise_if_bad(self, facts: list[int]) -> None:
        """The first problem ``facts`` (this check's, read) show, as the exception that names it."""
        lo, hi, first, backward, last = facts
        if self.n and (lo < 0 or hi >= self.rows):
            bad = lo if lo < 0 else hi
            raise RejectedArguments(ValueError, f"{self.fn}: input holds id {bad}, outside [0, num_embeddings={self.rows})")
        if self.offsets is None:
            return
        if self.include_last_offset and last != self.n:
            raise RejectedArguments(ValueError, f"{self.fn}: with include_last_offset=True the last offset must be the input "
                        f"length {self.n}, got {last}")
        if first != 0:
            raise RejectedArguments(ValueError, f"{self.fn}: offsets[0] must be 0, got {first}")
        if backward:
            raise RejectedArguments(ValueError, f"{self.fn}: offsets must be non-decreasing and at most the input length "
                        f"{self.n}, got {self.offsets.tolist()}")


def check_values(checks: Sequence[ValueCheck]) -> None:
    """Reads every check's facts in one host synchronisation per device, then raises the first problem, in
    the order of ``checks``."""
    for c, facts in zip(checks, read_together([c.facts for c in checks])):
        c.raise_if_bad(facts)


def bags_for_embedding(fn: str, input: object, rows: int) -> Bags:
    """``embedding`` input (any shape) as bags of one id each."""
    if not isinstance(input, torch.Tensor):
        raise RejectedArguments(TypeError, f"{fn}: input must be a Tensor, got {type(input).__name__}")
    if input.dtype not in (torch.int32, torch.int64):
        raise RejectedArguments(TypeError, f"{fn}: input must hold int32 or int64 ids, got dtype {input.dtype}")
    ids = input.reshape(-1).to(torch.int64)
    check_values([ValueCheck.of(fn, ids, rows, None, None, False)])
    return Bags(ids, torch.ones_like(ids), None)



@dataclasses.dataclass(frozen=True)
class TableOptions:
    """One table's validated options."""

    mode: str
    padding: int | None
    max_norm: float | None
    norm_type: float
    out_dtype: torch.dtype | None = None


def table_fields(bags: Bags | None, codes: TableCodes, sends: Sequence[int] | None, world: int) -> list[int]:
    """One table's fields in the agreement's message: this rank's batch sizes (bags, ids, whether weighted), its
    :class:`TableCodes`, and how many ids it sends to each rank (``-1`` each when not routed)."""
    sizes = [0, 0, 0] if bags is None else [bags.num_bags, int(bags.ids.numel()), int(bags.weights is not None)]
    routed = [-1] * world if sends is None else [int(c) for c in sends]
    return sizes + codes.values() + routed


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
            -1 if optimizer is None else name_code(optimizer.hyper.kind.name), int(psw_grad),
            0 if optimizer is None else _hyper_code(optimizer.hyper),
            DTYPES.index(out_dtype) if out_dtype in DTYPES else -1,
        )

    def values(self) -> list[int]:
        return [getattr(self, f.name) for f in CODE_FIELDS]


CODE_FIELDS = dataclasses.fields(TableCodes)
SIZES = 3  # num_bags, num_ids, has_weights
CODE_WIDTH = SIZES + len(CODE_FIELDS)
"""How many fields :func:`table_fields` gives a table before its routed counts."""


def _hyper_code(hyper: Hyper) -> int:
    """A digest of an optimizer's hyper-parameters, the same in every process, never 0 ("no optimizer")."""
    values = [hyper.lr, hyper.eps, hyper.weight_decay, float(hyper.weight_decay_mode.value), hyper.beta1, hyper.beta2,
              float(hyper.stochastic_rounding)]
    return name_code(struct.pack(f"<{len(values)}d", *values))


def name_code(data: str | bytes) -> int:
    """A digest of ``data`` (a kind's name), the same in every process: CRC-32 of its bytes, plus 1."""
    return zlib.crc32(data.encode() if isinstance(data, str) else data) + 1
