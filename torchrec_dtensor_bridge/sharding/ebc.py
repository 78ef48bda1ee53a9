"""The sharded forward of a TorchRec ``EmbeddingBagCollection``: KeyedJaggedTensor in, KeyedTensor out.

TorchRec is reached only through :mod:`..torchrec_plan` (the package's one
torchrec import site): an EBC can only exist in a module tree once torchrec is
loaded, and the forward imports ``KeyedTensor`` when it runs.

The forward mirrors TorchRec's (``EmbeddingBagCollection.forward``): for each
table in the EBC's order, for each of the table's features, the pooled
embedding of that feature's bags through the table's ``nn.EmbeddingBag``
(its own pooling mode); the result is a ``KeyedTensor`` with the EBC's keys,
values concatenated along dim 1. Two differences, both for the sharded case:

* all features of one table go through one lookup (their bags back to back),
  and all sharded tables through ONE :func:`sharded_embedding_bags` call, so
  the whole collection costs one fused collective lookup whatever its number
  of tables and features;
* the input is checked before any lookup, and a rank whose input is bad
  joins the first sharded lookup's agreement step as a failing rank, so every
  rank raises instead of the others waiting in the lookup.
"""

from __future__ import annotations

from typing import Any, NoReturn, cast

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..agreement import RejectedArguments
from ..lookup import refuse_lookup, sharded_embedding_bags
from ..optim import FusedOptimizer
from ..torchrec_plan import embedding_bag_collection_type, jagged_types
from .modules import GATHER_OUTPUT_ATTR, gather_output, group_of


__all__ = ["ebc_forward", "ebc_owners"]


def ebc_owners(module: nn.Module) -> dict[int, nn.Module]:
    """``id(inner nn.EmbeddingBag) -> its EmbeddingBagCollection`` for every TorchRec EBC in ``module``."""
    ebc_type = embedding_bag_collection_type()
    if ebc_type is None:
        return {}
    return {
        id(bag): m
        for m in module.modules()
        if isinstance(m, ebc_type)
        for bag in cast(Any, m).embedding_bags.values()
    }


def _check_features(ebc: Any, features: object, kjt_type: type) -> dict[str, Any]:
    """The features' JaggedTensors by name; raises ``RejectedArguments`` for an input the forward cannot take."""
    fn = f"{type(ebc).__name__}.forward"
    if not isinstance(features, kjt_type):
        raise RejectedArguments(TypeError, f"{fn}: expected a KeyedJaggedTensor, got {type(features).__name__}")
    kjt: Any = features
    if kjt.variable_stride_per_key() or kjt.inverse_indices_or_none() is not None:
        raise RejectedArguments(
            NotImplementedError, f"{fn}: variable batch size per feature (VBE) is not supported by the sharded lookups"
        )
    keys = list(kjt.keys())
    missing = [f for names in ebc._feature_names for f in names if f not in keys]
    if missing:
        raise RejectedArguments(ValueError, f"{fn}: the KeyedJaggedTensor lacks features {missing}; it has {keys}")
    if ebc.is_weighted() and kjt.weights_or_none() is None:
        raise RejectedArguments(ValueError, f"{fn}: the collection is weighted but the input has no weights")
    return kjt.to_dict()


def _refuse_everywhere(ebc: Any, error: RejectedArguments) -> NoReturn:
    """Take part, as a failing rank, in the lookup the other ranks are entering: every rank raises ``error``."""
    refuse_lookup([bag.weight for bag in ebc.embedding_bags.values()], error, process_group=group_of(ebc))


def _table_input(bag: nn.EmbeddingBag, jagged: list[Any], weighted: bool) -> dict[str, Any]:
    lengths = torch.cat([jt.lengths() for jt in jagged]).to(torch.int64)
    offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
    return {
        "input": torch.cat([jt.values() for jt in jagged]).to(torch.int64),
        "offsets": offsets if bag.include_last_offset else offsets[:-1],
        "per_sample_weights": torch.cat([jt.weights() for jt in jagged]) if weighted else None,
    }


def _without_last(offsets: torch.Tensor | None, bag: nn.EmbeddingBag) -> torch.Tensor | None:
    return offsets[:-1] if offsets is not None and bag.include_last_offset else offsets


def ebc_forward(self: Any, features: Any, optimizer: FusedOptimizer | None = None) -> Any:
    """``EmbeddingBagCollection.forward`` with sharded tables; *collective* (each rank passes its own batch).

    Args:
        features: this rank's ``KeyedJaggedTensor`` (every feature of the
            collection, one batch size for all features).
        optimizer: a :class:`~torchrec_dtensor_bridge.FusedOptimizer` holding every
            sharded table's weight: backward updates them in place (no ``weight.grad``),
            as TorchRec's fused kernels do.

    Returns:
        A ``KeyedTensor`` with ``self._embedding_names`` as keys and values of
        shape ``(batch, sum of the features' embedding dims)``, as TorchRec's.
    """
    KeyedJaggedTensor, KeyedTensor = jagged_types()
    try:
        by_name = _check_features(self, features, KeyedJaggedTensor)
    except RejectedArguments as e:
        _refuse_everywhere(self, e)
    tables = list(zip(self.embedding_bags.values(), self._feature_names))
    inputs = [_table_input(bag, [by_name[f] for f in names], self.is_weighted()) for bag, names in tables]
    sharded = [k for k, (bag, _) in enumerate(tables) if isinstance(bag.weight, DTensor)]
    outs: dict[int, torch.Tensor] = {}
    if sharded:  # every sharded table in ONE collective lookup
        bags = [tables[k][0] for k in sharded]
        results = sharded_embedding_bags(
            [inputs[k]["input"] for k in sharded],
            [bag.weight for bag in bags],
            [_without_last(inputs[k]["offsets"], bag) for k, bag in zip(sharded, bags)],
            mode=[bag.mode for bag in bags],
            per_sample_weights=[inputs[k]["per_sample_weights"] for k in sharded] if self.is_weighted() else None,
            padding_idx=[bag.padding_idx for bag in bags],
            max_norm=[bag.max_norm for bag in bags],
            norm_type=[bag.norm_type for bag in bags],
            process_group=group_of(self),
            optimizer=optimizer,
            names=[list(self.embedding_bags)[k] for k in sharded],
            output_dtype=torch.float32,  # TorchRec's pooled outputs are fp32 whatever the tables' dtype
        )
        outs.update(zip(sharded, results))
    pooled: list[torch.Tensor] = []
    for k, (bag, names) in enumerate(tables):
        out = (outs[k] if k in outs else bag(**inputs[k])).float()
        pooled.extend(out.reshape(len(names), out.shape[0] // max(len(names), 1), out.shape[1]).unbind(0))
    values = torch.cat(pooled, dim=1)
    if getattr(self, GATHER_OUTPUT_ATTR, False):
        values = gather_output(values, group_of(self))
    return KeyedTensor(keys=self._embedding_names, values=values, length_per_key=self._lengths_per_embedding)
