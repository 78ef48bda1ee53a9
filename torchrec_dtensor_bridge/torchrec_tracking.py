"""Change tracking for TorchRec's fused training: the rows TorchRec's fused kernel writes, reported to
:mod:`.tracking`, so that an incremental save of a ``DistributedModelParallel`` skips its scan.

TorchRec trains a table sharded with the ``fused`` compute kernel in its lookup's backward: fbgemm's
table-batched embedding (TBE, ``SplitTableBatchedEmbeddingBagsCodegen``) applies the optimizer to the rows
the lookup read, in place. :func:`track_changed_rows` reports those rows, as a
``FusedOptimizer(..., track_changed_rows=True)`` reports its own (:mod:`.tracking`): the next incremental
save digests only them and takes every other row's digest from its base.

Steps (on each rank, nothing collective):

1. :func:`track_changed_rows` finds the TBEs under the model's sharded embedding modules (TorchRec's
   ``ShardedEmbeddingBagCollection`` / ``ShardedEmbeddingCollection`` hold them in their lookups), and the
   tensors a checkpoint of the model saves for each TBE table - the local shard of the weight in
   ``model.state_dict()``, of each optimizer state in ``model.fused_optimizer.state_dict()`` - matched by
   memory (the same storage, offset, shape and strides). A TBE qualifies when its update is known to write
   the rows looked up and nothing else (:data:`QUALIFIED`); its tensors are watched, the others' are not
   (their saves scan).
2. A forward hook on each qualifying TBE reads the ids that reach it - after TorchRec's input dist, so row
   numbers of this rank's shards, whatever the sharding type (a row-wise shard's ids are already local, a
   column-wise shard is a TBE table of its own) - split per TBE table by ``feature_table_map`` and the bag
   offsets. An id out of a table's range, or offsets that do not split the ids into features, count as
   every row of the table(s) concerned.
3. The ids are reported when the backward reaches the lookup's autograd node (a pre-hook on the node the
   forward returned: the write happens there, so a save between a forward and its backward does not
   absorb rows written after it); the node's post-hook takes the version counter as the kernel left it
   (fbgemm 1.8's CPU kernels write through raw pointers and leave it; a build that moves it is covered).
   The counter rule of :mod:`.tracking` does the rest: any other in-place write through torch (``copy_``,
   ``load_state_dict``, ``tdb.checkpoint.load``, an optimizer's step on the parameter) voids the records
   of the tensors sharing the counter, and the next save scans.

What qualifies was verified on fbgemm_gpu-cpu 1.8's CPU kernels, comparing every table before and after
steps of random ids (``tests/unit/test_torchrec_tracking.py``): the rows that changed, weights and every
optimizer state, are among the ids looked up.
"""

from __future__ import annotations

import inspect
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from . import tracking
from .checkpoint.common import leaves
from .checkpoint.incremental.rows import local_blocks

__all__ = ["QUALIFIED", "FusedTracking", "track_changed_rows"]

QUALIFIED = {"EXACT_SGD", "EXACT_ADAGRAD", "EXACT_ROWWISE_ADAGRAD"}
"""fbgemm ``EmbOptimType`` kinds whose fused update writes exactly the rows looked up (ids deduplicated, each
row written once, weights and per-row state), verified on fbgemm's CPU kernels with every weight-decay mode
those accept (:data:`DECAY_MODES`). The others fbgemm offers are not built for CPU (``ADAM``,
``PARTIAL_ROWWISE_ADAM``, ``LAMB``, ``PARTIAL_ROWWISE_LAMB``, ``LARS_SGD``, ...) or refused there as deprecated
(``SGD``, ``ROWWISE_ADAGRAD``): their tables' saves scan."""

DECAY_MODES = {"NONE", "L2", "DECOUPLE", "COUNTER", "COWCLIP"}
"""fbgemm ``WeightDecayMode`` values that keep the update on the rows looked up (on CPU; ``DECOUPLE_GLOBAL``,
a decay of every row, is built for CUDA only and does not qualify)."""

_TBE = "fbgemm_gpu.split_table_batched_embeddings_ops_training.SplitTableBatchedEmbeddingBagsCodegen"

_hooked: weakref.WeakKeyDictionary[nn.Module, _Hooked] = weakref.WeakKeyDictionary()  # TBE -> its live hooks


def _qualified_name(m: object) -> str:
    return f"{type(m).__module__}.{type(m).__qualname__}"


def _why_not(tbe: nn.Module) -> str | None:
    """Why ``tbe``'s update is not known to write only the rows looked up (``None``: it is)."""
    if _qualified_name(tbe) != _TBE:
        return f"{type(tbe).__name__} is not fbgemm's training TBE with an optimizer in backward (dense kernel, " \
               "data-parallel table, key-value or SSD kernel)"
    kind = getattr(getattr(tbe, "optimizer", None), "name", None)
    if kind not in QUALIFIED:
        return f"optimizer {kind}: its update is not verified to write only the rows looked up"
    mode = getattr(tbe, "weight_decay_mode", None)
    mode = getattr(mode, "name", mode)
    if mode not in DECAY_MODES:
        return f"weight_decay_mode {mode}: not verified to write only the rows looked up"
    if not getattr(tbe, "use_cpu", False):
        return "the TBE is not on the CPU: its kernels are not verified there yet"
    cache = getattr(tbe, "lxu_cache_weights", None)
    if not isinstance(cache, torch.Tensor) or cache.numel():
        return "rows cached (UVM caching): a write-back to the table lands after the step"
    return None


def _tbes(model: nn.Module) -> list[nn.Module]:
    """The kernels under ``model``'s sharded embedding modules (those holding TorchRec's ``_lookups``): the
    innermost modules with ``split_embedding_weights`` (fbgemm's TBEs, not TorchRec's wrappers of them)."""
    found: dict[int, nn.Module] = {}
    for m in model.modules():
        lookups = getattr(m, "_lookups", None)
        for lookup in lookups if isinstance(lookups, list) else []:
            if isinstance(lookup, nn.Module):
                found.update((id(s), s) for s in lookup.modules()
                             if callable(getattr(s, "split_embedding_weights", None)))
    return [m for m in found.values()
            if not any(id(s) in found for s in m.modules() if s is not m)]


def _where(t: torch.Tensor) -> tuple[int, int, tuple[int, ...], tuple[int, ...], torch.dtype]:
    return (t.untyped_storage().data_ptr(), int(t.storage_offset()), tuple(t.shape), tuple(t.stride()), t.dtype)


def _saved_tensors(model: nn.Module) -> dict[tuple, tuple[str, torch.Tensor]]:
    """The local blocks a checkpoint of ``model`` (and of its ``fused_optimizer``) saves, by where their memory
    is: ``(fqn, tensor)``."""
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    state: dict[str, Any] = {"model": model.state_dict()}
    fused = getattr(model, "fused_optimizer", None)
    if fused is not None and callable(getattr(fused, "state_dict", None)):
        state["fused_optimizer"] = {"state": fused.state_dict().get("state", {})}
    out: dict[tuple, tuple[str, torch.Tensor]] = {}
    for fqn, v in leaves(state):
        if isinstance(v, torch.Tensor) and v.dim():
            for _, t in local_blocks(v, rank):
                if t.numel():
                    out.setdefault(_where(t), (fqn.split(".", 1)[1], t))
    return out


def _split_tensors(tbe: Any) -> list[list[torch.Tensor]]:
    """Per TBE table: its weight, then each optimizer state (views fbgemm hands out)."""
    weights = list(tbe.split_embedding_weights())
    states: list[Any] = []
    if callable(getattr(tbe, "split_optimizer_states", None)):
        states = list(tbe.split_optimizer_states() or [])
    return [[w, *(states[i] if i < len(states) else [])] for i, w in enumerate(weights)]


@dataclass
class _Table:
    rows: int
    tensors: list[torch.Tensor]  # the saved blocks (weight, state) of this TBE table found in the state dicts


class _Hooked:
    """One qualifying TBE: its tables' saved tensors, and the hooks reporting the rows its updates write."""

    def __init__(self, tbe: Any, tables: list[_Table]) -> None:
        self.tables = tables
        self.features = [int(t) for t in tbe.feature_table_map]
        self.signature = inspect.signature(tbe.forward)
        self.tensors = [t for tab in tables for t in tab.tensors]
        self.live = True
        tracking.watch(self.tensors)
        self.handle = tbe.register_forward_hook(self._forward, with_kwargs=True)
        self.tbe = weakref.ref(tbe)
        _hooked[tbe] = self

    def remove(self) -> None:
        """No more reports, also from the backward of a forward already run; the records dropped."""
        self.live = False
        self.handle.remove()
        tracking.unwatch(self.tensors)
        tbe = self.tbe()
        if tbe is not None and _hooked.get(tbe) is self:
            del _hooked[tbe]

    def _forward(self, tbe: nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
        if not isinstance(out, torch.Tensor) or out.grad_fn is None:
            return  # no backward: nothing is written
        try:
            arguments = self.signature.bind(*args, **kwargs).arguments
        except TypeError:  # another fbgemm's signature: every row counts as written
            arguments = {}
        written = _rows_looked_up(arguments, self.features, [t.rows for t in self.tables])
        report = [(x, r) for tab, r in zip(self.tables, written) if r.numel() for x in tab.tensors]
        node = out.grad_fn
        before: dict[int, tuple[torch.Tensor, int]] = {}

        def pre(_grads: Any) -> None:  # the kernel writes next: report its rows now
            if self.live:
                before.update(tracking.before_writes(self.tensors))
                tracking.after_writes(before, report)

        def post(_grads_in: Any, _grads_out: Any) -> None:  # the counter as the kernel left it
            if self.live and before:
                tracking.after_writes(before, [])

        node.register_prehook(pre)
        node.register_hook(post)


def _rows_looked_up(arguments: dict[str, Any], features: list[int], rows: list[int]) -> list[torch.Tensor]:
    """Per TBE table, the rows a TBE call with ``arguments`` (its forward's, by name) looks up (repeats
    allowed): every row of a table whose ids are out of range, and of every table when the offsets do not split
    the ids into the ``features`` (their tables: ``feature_table_map``)."""
    indices, offsets = arguments.get("indices"), arguments.get("offsets")
    if not isinstance(indices, torch.Tensor) or not isinstance(offsets, torch.Tensor):
        return [torch.arange(n) for n in rows]
    ends = _feature_ends(offsets, arguments.get("batch_size_per_feature_per_rank"), len(features), indices.numel())
    if ends is None:
        return [torch.arange(n) for n in rows]
    pieces: list[list[torch.Tensor]] = [[] for _ in rows]
    for f, table in enumerate(features):
        pieces[table].append(indices[ends[f] : ends[f + 1]])
    out = []
    for table, n in enumerate(rows):
        ids = torch.cat(pieces[table]).to(torch.int64) if pieces[table] else torch.zeros(0, dtype=torch.int64)
        out.append(torch.arange(n) if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= n) else ids)
    return out


def _feature_ends(offsets: torch.Tensor, per_rank: list[list[int]] | None, features: int, ids: int
                  ) -> list[int] | None:
    """Where each feature's ids start in the ids, and where the last ends (``features + 1`` positions), or
    ``None`` when the bag offsets do not split the ids that way (not ascending, out of the ids): fbgemm reads bag
    ``b`` of feature ``f`` at ``offsets[B_f + b]``, ``B_f`` the bags of the features before (``B`` each, or
    summed over the ranks of ``batch_size_per_feature_per_rank``)."""
    if offsets.dim() != 1 or not features:
        return None
    if per_rank is not None:
        bags = [int(sum(b)) for b in per_rank]
    elif (offsets.numel() - 1) % features == 0:
        bags = [(offsets.numel() - 1) // features] * features
    else:
        return None
    if len(bags) != features or offsets.numel() != sum(bags) + 1:
        return None
    if offsets.numel() > 1 and bool((offsets[1:] < offsets[:-1]).any()):
        return None
    at = [0]
    for b in bags:
        at.append(at[-1] + b)
    ends = offsets[torch.tensor(at)].tolist()
    return ends if ends[0] >= 0 and ends[-1] <= ids else None


@dataclass
class FusedTracking:
    """What :func:`track_changed_rows` switched on, on this rank.

    Attributes:
        tracked: the state_dict keys (``model.state_dict()``'s, and ``"state.<param>.<state>"`` of the fused
            optimizer's) whose local shards' written rows are recorded.
        scanned: the keys of the other tables of the sharded modules (and of their optimizer state), each with
            why its saves still scan.
    """

    tracked: list[str]
    scanned: dict[str, str]
    _hooks: list[_Hooked] = field(default_factory=list, repr=False)

    def remove(self) -> None:
        """Stop tracking: the hooks removed, the records dropped (later saves scan these tables)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []


def track_changed_rows(model: nn.Module) -> FusedTracking:
    """Record the rows TorchRec's fused kernel writes, so that incremental saves digest only those.

    An incremental save (``tdb.checkpoint.save(..., base=)``) finds the rows that changed by digesting every
    row, a scan of the tables. After this call, each training step of ``model`` reports the rows its fused
    update writes - the rows its lookups read, on this rank's shards - and the next incremental save of the
    model's tables (and of its ``fused_optimizer``'s state) digests only those, as for a
    ``FusedOptimizer(..., track_changed_rows=True)``. The checkpoint is the same as after a scan.

    Tracked, whatever the sharding type (table-wise, row-wise, column-wise, table-row-wise, ...): the tables of
    sharded ``EmbeddingBagCollection`` and ``EmbeddingCollection`` modules with the ``fused`` compute kernel on
    the CPU whose optimizer is fbgemm's ``EXACT_SGD``, ``EXACT_ADAGRAD`` or ``EXACT_ROWWISE_ADAGRAD`` (weight decay
    none, ``L2``, ``DECOUPLE``, ``COUNTER`` or ``COWCLIP``), and their optimizer state: their update writes
    exactly the rows looked up (verified on fbgemm's CPU kernels). Scanned, as before: other optimizers (Adam,
    LAMB, ... are not built for CPU), cached (UVM), key-value and CUDA tables (not verified there yet),
    data-parallel tables (TorchRec trains them with the dense optimizer) and every dense parameter;
    :attr:`FusedTracking.scanned` says which, and why.

    The first save after this call scans (it starts the record); each later incremental save whose base is
    the previous save of these tables digests only the rows written since (another base: it scans). A write
    through torch the tracker is not told of is not lost: any in-place write to a tracked table or state
    (``copy_``, ``load_state_dict``, ``tdb.checkpoint.load``, ``nn.init``, an optimizer's step) moves torch's
    version counter, and the next save scans. Writes torch cannot see - through ``.data``, NumPy or a raw
    pointer - are not seen: do not ask for tracking where something writes the tables that way. Switch
    tracking on between steps (not between a forward and its backward), on every rank that trains (each
    rank records its own shards; no collective). Costs a boolean per row and, each step, a pass over the ids
    looked up.

    Args:
        model: a TorchRec ``DistributedModelParallel``, or a sharded ``EmbeddingBagCollection`` /
            ``EmbeddingCollection`` (``torchrec.distributed.shard``).

    Returns:
        What is tracked on this rank, what is scanned and why; its ``remove()`` switches tracking off.

    Raises:
        ValueError: ``model`` holds no TorchRec sharded embedding module, or its tables are tracked already.

    Example::

        >>> dmp = DistributedModelParallel(model, plan=plan, sharders=[sharder])  # fused EXACT_ROWWISE_ADAGRAD
        >>> tdb.track_changed_rows(dmp)
        >>> tdb.checkpoint.save({"model": dmp, "opt": dmp.fused_optimizer}, "/ckpt/s0")
        >>> train(dmp, steps=100)
        >>> tdb.checkpoint.save({"model": dmp, "opt": dmp.fused_optimizer}, "/ckpt/s1", base="/ckpt/s0")
    """
    tbes = _tbes(model)
    if not tbes:
        raise ValueError(f"track_changed_rows: {type(model).__name__} holds no TorchRec sharded embedding module "
                         "(pass a DistributedModelParallel or a module sharded by torchrec.distributed.shard)")
    if any(t in _hooked for t in tbes):
        raise ValueError(f"track_changed_rows: this {type(model).__name__}'s tables are tracked already (call "
                         "remove() on what track_changed_rows returned first)")
    saved = _saved_tensors(model)
    out = FusedTracking([], {})
    for tbe in tbes:
        why = _why_not(tbe)
        tables = []
        for i, split in enumerate(_split_tensors(tbe)):
            found = [saved[_where(t)] for t in split if t.numel() and _where(t) in saved]
            for k, _ in found:
                if why is not None:
                    out.scanned[k] = why
                elif k not in out.tracked:
                    out.tracked.append(k)
            tables.append(_Table(int(split[0].shape[0]), [t for _, t in found]))
        if why is None and any(t.tensors for t in tables):
            out._hooks.append(_Hooked(tbe, tables))
    return out
