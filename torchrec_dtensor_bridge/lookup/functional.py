"""``sharded_embedding_bag`` and ``sharded_embedding``: torch's functional lookups on DTensor tables.

Order of work on every rank (the same on all ranks, so nothing can hang):

1. validate the arguments locally (SPEC §4), recording - not raising - a failure;
2. one agreement ``all_gather``: every rank's verdict, batch sizes and options;
   any failure or disagreement raises on every rank;
3. gather all ranks' ids (unless the table is fully replicated and needs no ``max_norm``);
4. ``max_norm``: renormalise the referenced stored rows in place;
5. the pooled lookup and its exchange (:mod:`.algorithms`);
6. ``mean``: divide by the true bag size; ``max``: empty bags give 0.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..convert.dtensor import layout_of, local_shards_of
from .algorithms import LookupPlan, Strategy, pooled_lookup, strategy_for
from .exchange import gather_bags
from .renorm import renormalize
from .validate import (
    MODES,
    Bags,
    RejectedArguments,
    agree,
    bags_for_embedding,
    bags_from_input,
    check_options,
)

__all__ = ["sharded_embedding", "sharded_embedding_bag"]


def _check_weight(fn: str, weight: object) -> DTensor:
    if not isinstance(weight, DTensor):
        raise RejectedArguments(TypeError, f"{fn}: weight must be a DTensor, got {type(weight).__name__}")
    return weight


def _check_not_dtensor_input(fn: str, input: object) -> None:
    if isinstance(input, DTensor):
        raise RejectedArguments(
            NotImplementedError, f"{fn}: DTensor input is not supported yet; pass this rank's own batch as a Tensor"
        )


def _options(op: int, mode: str, padding: int | None, max_norm: float | None, norm_type: float,
             shape: tuple[int, ...]) -> dict[str, float]:
    return {
        "op": float(op),
        "mode": float(MODES.index(mode)) if mode in MODES else float("nan"),
        "padding_idx": -1.0 if padding is None else float(padding),
        "max_norm": 0.0 if max_norm is None else float(max_norm),
        "norm_type": float(norm_type) if isinstance(norm_type, (int, float)) else float("nan"),
        "num_embeddings": float(shape[0]) if len(shape) == 2 else float("nan"),
        "embedding_dim": float(shape[1]) if len(shape) == 2 else float("nan"),
    }


def _run(
    weight: DTensor,
    bags: Bags,
    infos: list,
    *,
    max_mode: bool,
    padding_idx: int | None,
    skip_padding: bool,
    max_norm: float | None,
    norm_type: float,
) -> torch.Tensor:
    """Steps 3-5 for validated arguments; returns the pooled (sum or raw max) output of this rank's bags."""
    layout = layout_of(weight)
    if layout.dtype is None:
        layout = dataclasses.replace(layout, dtype=weight.dtype)
    shards = local_shards_of(weight)
    world = dist.get_world_size()
    replicated = strategy_for(layout, world) is Strategy.LOCAL
    gathered = None
    if not replicated or max_norm is not None:
        gathered = gather_bags(bags, infos, None, float_dtype=weight.dtype)
    if max_norm is not None:
        assert gathered is not None
        renormalize(layout, layout.shards_on(dist.get_rank()), shards, gathered.ids, max_norm, norm_type, None)
    plan = LookupPlan(
        layout=layout,
        shards=shards,
        batch=bags if replicated or gathered is None else gathered,
        num_bags=[i.num_bags for i in infos],
        max_mode=max_mode,
        padding_idx=padding_idx,
        skip_padding=skip_padding,
        track=weight.requires_grad and torch.is_grad_enabled(),
    )
    return pooled_lookup(plan, weight)


def sharded_embedding_bag(
    input: torch.Tensor,
    weight: DTensor,
    offsets: torch.Tensor | None = None,
    *,
    mode: str = "mean",
    per_sample_weights: torch.Tensor | None = None,
    padding_idx: int | None = None,
    include_last_offset: bool = False,
    max_norm: float | None = None,
    norm_type: float = 2.0,
    scale_grad_by_freq: bool = False,
    sparse: bool = False,
) -> torch.Tensor:
    """``F.embedding_bag`` over a DTensor table of any layout; *collective*.

    ``input`` (with ``offsets``/``per_sample_weights``) is THIS rank's own batch;
    ranks may pass batches of different sizes. The result is this rank's own
    ``(num_bags, embedding_dim)`` output as a plain tensor, equal to
    ``F.embedding_bag(input, full_weight, ...)``. When ``weight.requires_grad``,
    backward fills ``weight.grad`` with a DTensor of the weight's layout holding
    the gradient of all ranks' batches. ``max_norm`` renormalises the stored rows
    referenced by any rank, in place.

    Raises:
        TypeError, ValueError, NotImplementedError: on every rank, when any rank's
            arguments are invalid (SPEC §4) or the ranks disagree on an option.

    Example::

        >>> out = sharded_embedding_bag(ids, dt_weight, offsets, mode="sum")
        >>> out.sum().backward()  # dt_weight.grad: a DTensor like dt_weight
    """
    fn = "sharded_embedding_bag"
    error, bags, padding = None, None, None
    shape: tuple[int, ...] = ()
    try:
        w = _check_weight(fn, weight)
        shape = tuple(w.shape)
        _check_not_dtensor_input(fn, input)
        padding = check_options(
            fn, shape, mode=mode, padding_idx=padding_idx, max_norm=max_norm, norm_type=norm_type,
            scale_grad_by_freq=scale_grad_by_freq, sparse=sparse,
        )
        bags = bags_from_input(
            fn, input, offsets, per_sample_weights, rows=shape[0], mode=mode,
            include_last_offset=include_last_offset, weight_dtype=w.dtype,
        )
    except RejectedArguments as e:
        error = e
    infos = agree(fn, error, bags, _options(0, mode, padding, max_norm, norm_type, shape))
    assert bags is not None
    out = _run(weight, bags, infos, max_mode=mode == "max", padding_idx=padding, skip_padding=True,
               max_norm=max_norm, norm_type=norm_type)
    if mode == "sum":
        return out
    valid = bags.ids != padding if padding is not None else torch.ones_like(bags.ids, dtype=torch.bool)
    sizes = torch.bincount(bags.bag_of_id()[valid], minlength=bags.num_bags).unsqueeze(1)
    if mode == "mean":
        return out / sizes.clamp(min=1).to(out.dtype)
    return out.masked_fill(sizes == 0, 0.0)


def sharded_embedding(
    input: torch.Tensor,
    weight: DTensor,
    padding_idx: int | None = None,
    max_norm: float | None = None,
    norm_type: float = 2.0,
    *,
    scale_grad_by_freq: bool = False,
    sparse: bool = False,
) -> torch.Tensor:
    """``F.embedding`` over a DTensor table of any layout; *collective*.

    ``input`` (ids of any shape) is THIS rank's own batch; the result is
    ``input.shape + (embedding_dim,)`` as a plain tensor, equal to
    ``F.embedding(input, full_weight, ...)``; the ``padding_idx`` row is looked
    up but receives no gradient, as in torch.

    Example::

        >>> rows = sharded_embedding(ids, dt_weight)  # (*ids.shape, dim)
    """
    fn = "sharded_embedding"
    error, bags, padding = None, None, None
    shape: tuple[int, ...] = ()
    try:
        w = _check_weight(fn, weight)
        shape = tuple(w.shape)
        _check_not_dtensor_input(fn, input)
        padding = check_options(
            fn, shape, mode="sum", padding_idx=padding_idx, max_norm=max_norm, norm_type=norm_type,
            scale_grad_by_freq=scale_grad_by_freq, sparse=sparse,
        )
        bags = bags_for_embedding(fn, input, shape[0])
    except RejectedArguments as e:
        error = e
    infos = agree(fn, error, bags, _options(1, "sum", padding, max_norm, norm_type, shape))
    assert bags is not None and isinstance(input, torch.Tensor)
    out = _run(weight, bags, infos, max_mode=False, padding_idx=padding, skip_padding=False,
               max_norm=max_norm, norm_type=norm_type)
    return out.view(tuple(input.shape) + (shape[1],))
