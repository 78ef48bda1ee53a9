"""What every lookup shares once its arguments are validated: the options, steps 3-6 of a lookup.

:func:`run_tables` runs the lookups of one or several tables together (see
:mod:`.functional` for the order of work): the ids of every table that needs
them travel in ONE ``all_to_all`` (routed, :mod:`.route`), ``max_norm`` renormalises, and
:func:`.algorithms.pooled_lookup` fuses the tables' output exchanges.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..convert.dtensor import layout_of, local_shards_of
from ..optim.kinds import OptimKind
from .algorithms import LookupPlan, Strategy, pooled_lookup, strategy_for
from .exchange import gather_bags
from .renorm import renormalize
from .route import Route, route_for
from .validate import DTYPES, MODES, Bags, RankInfo, RejectedArguments, agree

__all__ = ["TableOptions", "agree_and_route", "finish", "option_codes", "psw_grad", "routes_for", "run_tables"]


def finish(out: torch.Tensor, bags: Bags, mode: str, padding: int | None) -> torch.Tensor:
    """After the pooled lookup: ``mean`` divides by the true bag size; ``max``: empty bags give 0."""
    if mode == "sum":
        return out
    valid = bags.ids != padding if padding is not None else torch.ones_like(bags.ids, dtype=torch.bool)
    sizes = bags.count_per_bag(valid).unsqueeze(1)
    if mode == "mean":
        return out / sizes.clamp(min=1).to(out.dtype)
    return out.masked_fill(sizes == 0, 0.0)


def option_codes(op: int, mode: str, padding: int | None, max_norm: float | None, norm_type: float,
                 shape: tuple[int, ...], dtype: torch.dtype | None, optimizer: Any = None,
                 psw_grad: bool = False) -> dict[str, float]:
    """The numbers every rank must agree on for one table (see :func:`.validate.agree`)."""
    return {
        "dtype": float(DTYPES.index(dtype)) if dtype in DTYPES else float("nan"),
        "op": float(op),
        "mode": float(MODES.index(mode)) if mode in MODES else float("nan"),
        "padding_idx": -1.0 if padding is None else float(padding),
        "max_norm": 0.0 if max_norm is None else float(max_norm),
        "norm_type": float(norm_type) if isinstance(norm_type, (int, float)) else float("nan"),
        "num_embeddings": float(shape[0]) if len(shape) == 2 else float("nan"),
        "embedding_dim": float(shape[1]) if len(shape) == 2 else float("nan"),
        "optimizer": -1.0 if optimizer is None else float(list(OptimKind).index(optimizer.hyper.kind)),
        "psw_grad": float(psw_grad),
    }


@dataclasses.dataclass(frozen=True)
class TableOptions:
    """One table's validated options."""

    mode: str
    padding: int | None
    max_norm: float | None
    norm_type: float


def routes_for(weights: list[DTensor], bags: list[Bags], options: list[TableOptions]) -> list[Route | None]:
    """Per table, where this rank's ids go (:mod:`.route`); ``None`` for a replicated table that needs none."""
    world = dist.get_world_size()
    out: list[Route | None] = []
    for w, b, o in zip(weights, bags, options):
        layout = layout_of(w)
        if strategy_for(layout, world) is Strategy.LOCAL and o.max_norm is None:
            out.append(None)
        else:
            out.append(route_for(layout, b, world, everyone=o.max_norm is not None))
    return out


def agree_and_route(
    fn: str, error: RejectedArguments | None, weights: list[DTensor], bags: list[Bags] | None,
    options: list[TableOptions], codes: list[dict[str, float]],
) -> tuple[list[list[RankInfo]], list[Route | None]]:
    """Routes for validated arguments (a failure becomes this rank's verdict), then the agreement step that
    also carries the routed counts; *collective*, raises on every rank when any rank failed."""
    routes: list[Route | None] = []
    if error is None and bags is not None:
        try:
            routes = routes_for(weights, bags, options)
        except Exception as e:  # noqa: BLE001 - every rank must reach the agreement step
            kind = type(e) if type(e) in (TypeError, ValueError, NotImplementedError) else RuntimeError
            error, bags = RejectedArguments(kind, f"{fn}: {e}"), None
    sends = [None if r is None else r.counts for r in routes] if routes else None
    infos = agree(fn, error, bags, codes, sends=sends)
    return infos, routes


def run_tables(
    weights: list[DTensor], bags: list[Bags], infos: list[list[RankInfo]], options: list[TableOptions],
    routes: list[Route | None], *, skip_padding: bool, bindings: list[Any] | None = None,
) -> list[torch.Tensor]:
    """Steps 3-5 for validated arguments, all tables at once; per table the pooled (sum or raw max) output of
    this rank's bags. Ids of every table that needs them travel in one exchange (``routes``, agreed in
    ``infos``), outputs in fused collectives."""
    layouts = [layout_of(w) for w in weights]
    layouts = [lay if lay.dtype is not None else dataclasses.replace(lay, dtype=w.dtype)
               for lay, w in zip(layouts, weights)]
    shards = [local_shards_of(w) for w in weights]
    rank, world = dist.get_rank(), dist.get_world_size()
    need = [t for t, r in enumerate(routes) if r is not None]
    dtypes = {weights[t].dtype for t in need}
    float_dtype = dtypes.pop() if len(dtypes) == 1 else torch.float64
    gathered = dict(zip(need, gather_bags(
        [bags[t] for t in need], [infos[t] for t in need], None, float_dtype=float_dtype,
        rows=max((lay.global_shape[0] for lay in layouts), default=0),
        routes=[r for r in routes if r is not None],
    )))
    for t, g in gathered.items():
        if g.weights is not None and g.weights.dtype != weights[t].dtype:
            gathered[t] = Bags(g.ids, g.lengths, g.weights.to(weights[t].dtype))
        o = options[t]
        if o.max_norm is not None:
            renormalize(layouts[t], layouts[t].shards_on(rank), shards[t], gathered[t].ids, o.max_norm, o.norm_type,
                        None)
    track = torch.is_grad_enabled()
    plans = [
        LookupPlan(
            layout=layouts[t],
            shards=shards[t],
            batch=bags[t] if strategy_for(layouts[t], world) is Strategy.LOCAL else gathered[t],
            num_bags=[i.num_bags for i in infos[t]],
            max_mode=o.mode == "max",
            padding_idx=o.padding,
            skip_padding=skip_padding,
            track=weights[t].requires_grad and track,
            routed=routes[t] is not None and o.max_norm is None,
            optimizer=None if bindings is None else bindings[t],
            psw_grad=psw_grad(bags[t]) and track,
            route=routes[t],
            received=tuple(0 if i.sends is None else i.sends[rank] for i in infos[t]),
        )
        for t, o in enumerate(options)
    ]
    return pooled_lookup(plans, weights, [b.weights if p.psw_grad else None for b, p in zip(bags, plans)])


def psw_grad(bags: Bags) -> bool:
    """Whether a lookup of ``bags`` computes its per-sample weights' gradient (agreed by every rank)."""
    return bags.weights is not None and bags.weights.requires_grad and torch.is_grad_enabled()
