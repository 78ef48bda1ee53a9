"""``sharded_embedding_bags``: the pooled lookups of several DTensor tables in one collective call.

What TorchRec's sharded ``EmbeddingBagCollection`` does for its tables, for
DTensor tables of any layouts: one call, the same steps as
:func:`.functional.sharded_embedding_bag` for every table, with the
communication of all tables fused:

1. validate every table's arguments locally, recording - not raising - a failure;
2. agree: ONE ``all_gather`` (verdict, number of tables, every table's sizes
   and options - a second one only beyond 16 tables);
3. ONE ``all_to_all`` of the ids of every table that is not replicated on all ranks, each
   table's only to the ranks that compute it, and a row-cut table's ids each only to
   the rank holding its row (the row strategy's route);
4. ``max_norm`` renormalisation per table that asks for it;
5. every rank pools what it stores of every table, then ONE ``all_to_all`` for all
   tables whose blocks span whole rows (table-wise, column-wise) and ONE
   reduce-scatter (also an ``all_to_all``) for all row-cut tables (row-wise,
   grid) - ``max`` on row cuts adds one ``all_reduce`` per table;
6. ``mean`` / ``max`` finishing per table.

So a table-wise collection of up to 16 tables costs three collectives in
forward (TorchRec's needs three to four) and each rank computes its own tables
while the others compute theirs, instead of taking turns table by table.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NoReturn

import torch
from torch.distributed.tensor import DTensor

import torch.distributed as dist

from ..groups import CommGroup
from ..optim import FusedOptimizer
from ..optim.state import Binding
from .arguments import (Bags, RejectedArguments, TableCodes, TableOptions, ValueCheck, bags_from_input, bind_optimizer,
                        check_options, check_values)
from .entry import agree, agree_and_route, finish, psw_grad, run_tables
from .functional import lookup_group, resolve_table
from .plan import ResolvedTable

__all__ = ["refuse_lookup", "sharded_embedding_bags"]

_FN = "sharded_embedding_bags"


def _per_table(name: str, value: Any, n: int, scalar: tuple[type, ...]) -> list[Any]:
    """``value`` for each of ``n`` tables: a scalar given once, or a sequence of ``n`` values."""
    if value is None or isinstance(value, scalar):
        return [value] * n
    if not isinstance(value, Sequence) or len(value) != n:
        got = f"{len(value)} values" if isinstance(value, Sequence) else type(value).__name__
        raise RejectedArguments(ValueError, f"{_FN}: {name} must be one value or one per table ({n}), got {got}")
    return list(value)


_OUTPUT_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16, torch.float64})

def _weights(weights: Any) -> list[Any]:
    """The weights as a list (a refusal here is recorded; the group is then taken from nothing)."""
    if not isinstance(weights, Sequence) or isinstance(weights, torch.Tensor):
        raise RejectedArguments(TypeError, f"{_FN}: weights must be a list of DTensors, got {type(weights).__name__}")
    return list(weights)


def _labels(names: Any, n: int) -> list[str]:
    """How messages name each table: ``table 'name'`` when names are given, else ``table i``."""
    if names is None:
        return [f"table {t}" for t in range(n)]
    if isinstance(names, (str, bytes)) or not isinstance(names, Sequence) or len(names) != n:
        raise RejectedArguments(ValueError, f"{_FN}: names must be one name per table ({n}), got {names!r}")
    return [f"table {str(name)!r}" for name in names]


def _validate(
    inputs: Any, weights: list[Any], offsets: Any, per_sample_weights: Any, group: CommGroup, *, mode: Any,
    padding_idx: Any, include_last_offset: bool, max_norm: Any, norm_type: Any,
    optimizer: FusedOptimizer | None = None, names: Any = None, output_dtype: Any = None,
) -> tuple[list[ResolvedTable], list[Bags], list[TableOptions], list[TableCodes], list[Binding | None]]:
    """Every table resolved, its canonical batch and options; raises :class:`RejectedArguments` (local)."""
    if output_dtype is not None and output_dtype not in _OUTPUT_DTYPES:
        raise RejectedArguments(ValueError, f"{_FN}: output_dtype must be None or one of "
                                f"{sorted(map(str, _OUTPUT_DTYPES))}, got {output_dtype!r}")
    if not isinstance(inputs, Sequence) or isinstance(inputs, torch.Tensor):
        raise RejectedArguments(TypeError, f"{_FN}: inputs must be a list of Tensors, got {type(inputs).__name__}")
    n = len(weights)
    if n == 0 or len(inputs) != n:
        raise RejectedArguments(
            ValueError, f"{_FN}: need one input per weight and at least one table, got {len(inputs)} inputs "
            f"and {n} weights"
        )
    offs = _per_table("offsets", offsets, n, ())
    psws = _per_table("per_sample_weights", per_sample_weights, n, ())
    modes = _per_table("mode", mode, n, (str,))
    pads = _per_table("padding_idx", padding_idx, n, (int,))
    norms = _per_table("max_norm", max_norm, n, (int, float))
    ptypes = _per_table("norm_type", norm_type, n, (int, float))
    labels = _labels(names, n)
    tables = [resolve_table(f"{_FN} ({labels[t]})", w, group) for t, w in enumerate(weights)]
    bags: list[Bags] = []
    options: list[TableOptions] = []
    codes: list[TableCodes] = []
    binds: list[Binding | None] = []
    pending: list[ValueCheck] = []  # every table's value checks, read at once below
    for t in range(n):
        fn = f"{_FN} ({labels[t]})"
        w = tables[t].weight
        if isinstance(inputs[t], DTensor):
            raise RejectedArguments(
                NotImplementedError, f"{fn}: DTensor inputs are not supported here; pass each rank's own batch as "
                "a plain tensor, or use sharded_embedding_bag"
            )
        shape = tuple(w.shape)
        binds.append(bind_optimizer(fn, optimizer, w))
        padding = check_options(fn, shape, mode=modes[t], padding_idx=pads[t], max_norm=norms[t],
                                norm_type=ptypes[t], scale_grad_by_freq=False, sparse=False)
        bags.append(bags_from_input(fn, inputs[t], offs[t], psws[t], rows=shape[0], mode=modes[t],
                                    include_last_offset=include_last_offset, weight_dtype=w.dtype,
                                    pending=pending))
        options.append(TableOptions(modes[t], padding, norms[t], ptypes[t], output_dtype))
        codes.append(TableCodes.of(2, modes[t], padding, norms[t], ptypes[t], shape, w.dtype, tables[t].digest,
                                   optimizer=binds[t], psw_grad=psw_grad(bags[-1]), out_dtype=output_dtype))
    check_values(pending)  # one host read for every table's ids and offsets
    return tables, bags, options, codes, binds


@torch.compiler.disable(recursive=True)  # collectives and data-dependent routing: a graph break
def sharded_embedding_bags(
    inputs: Sequence[torch.Tensor],
    weights: Sequence[DTensor],
    offsets: Sequence[torch.Tensor | None] | None = None,
    *,
    mode: str | Sequence[str] = "mean",
    per_sample_weights: Sequence[torch.Tensor | None] | None = None,
    padding_idx: int | None | Sequence[int | None] = None,
    include_last_offset: bool = False,
    max_norm: float | None | Sequence[float | None] = None,
    norm_type: float | Sequence[float] = 2.0,
    process_group: dist.ProcessGroup | None = None,
    optimizer: FusedOptimizer | None = None,
    names: Sequence[str] | None = None,
    output_dtype: torch.dtype | None = None,
) -> list[torch.Tensor]:
    """:func:`sharded_embedding_bag` of several tables in one call, with fused collectives; *collective*.

    ``inputs[t]`` (with ``offsets[t]`` and ``per_sample_weights[t]``) is THIS
    rank's own batch for table ``weights[t]``; ranks may pass different batch
    sizes, and each table its own. ``mode``, ``padding_idx``, ``max_norm`` and
    ``norm_type`` are one value for all tables or one per table. Returns, per
    table, this rank's ``(num_bags, embedding_dim)`` output, equal to
    ``F.embedding_bag(inputs[t], full_weight_t, ...)``; gradients flow to every
    weight as with :func:`sharded_embedding_bag`, or, with ``optimizer`` (a
    :class:`FusedOptimizer` holding every weight), backward updates the weights
    in place and leaves ``weight.grad`` ``None``. Every rank of the call's
    group passes the same tables in the same order: the group of the weights'
    meshes (all on one group; tables on one-rank meshes join it), or
    ``process_group``. ``names`` (one per table) name the tables in error
    messages (else their positions). ``output_dtype`` (``None``: each weight's
    dtype, as ``F.embedding_bag``) gives every output in that dtype: the kernels
    pool fp16 and bf16 rows in fp32, and ``torch.float32`` keeps it, as TorchRec's
    half-precision tables do (the output gradient then stays fp32 too).

    Raises:
        TypeError, ValueError, NotImplementedError: on every rank, naming the
            table, when any rank's arguments for any table are invalid or the
            ranks disagree on an option or on the number of tables.

    Example::

        >>> outs = sharded_embedding_bags([ids0, ids1], [w0, w1], [off0, off1], mode="sum")
        >>> torch.cat(outs, dim=1)  # like a KeyedTensor's values
    """
    error: RejectedArguments | None = None
    tables: list[ResolvedTable] = []
    bags: list[Bags] | None = None
    options: list[TableOptions] = []
    codes: list[TableCodes] = []
    binds: list[Binding | None] = []
    listed: list[Any] = []
    try:
        listed = _weights(weights)
    except RejectedArguments as e:
        error = e
    group = lookup_group(_FN, listed, process_group, None)
    if error is None:
        try:
            tables, bags, options, codes, binds = _validate(
                inputs, listed, offsets, per_sample_weights, group, mode=mode, padding_idx=padding_idx,
                include_last_offset=include_last_offset, max_norm=max_norm, norm_type=norm_type,
                optimizer=optimizer, names=names, output_dtype=output_dtype,
            )
        except RejectedArguments as e:
            error = e
    infos, routes = agree_and_route(_FN, error, tables, bags, options, codes, group)
    assert bags is not None
    outs = run_tables(tables, bags, infos, options, routes, skip_padding=True, bindings=binds, fn=_FN)
    return [finish(out, b, o.mode, o.padding) for out, b, o in zip(outs, bags, options)]


def refuse_lookup(weights: Sequence[object], error: RejectedArguments, *,
                  process_group: dist.ProcessGroup | None = None) -> NoReturn:
    """Join, as a failing rank, the :func:`sharded_embedding_bags` call the other ranks make with ``weights``
    (a caller that found its own input bad before it could build the call): every rank raises ``error``;
    *collective*. ``shard_module``'s collection forward uses it for an input it cannot read."""
    tables = [w for w in weights if isinstance(w, DTensor)]
    if tables:
        agree(_FN, error, None, [], lookup_group(_FN, tables, process_group, None))
    raise error.problem.error()
