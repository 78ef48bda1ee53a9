"""``FusedOptimizer``: an optimizer applied inside the lookups' backward, on the shards' own storage."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .. import tracking
from .._compat import ShardedTensor
from ..agreement import Rejected
from ..convert.dtensor import dtensor_from_local_shards, layout_of, local_shards_of
from ..convert.reshard import copy_into
from ..layout import ShardLayout
from ..optim_kinds import Hyper, OptimKind, StateKind, WeightDecayMode, lookup
from .state import Binding, TableState, share_storage, state_dtype
from .torchrec_state import export_torchrec, import_torchrec
from .update import check_math

__all__ = ["FusedOptimizer"]

_DECAY_MODES = {"l2": WeightDecayMode.L2, "decoupled": WeightDecayMode.DECOUPLED}


def _kind(kind: object) -> OptimKind:
    """The registered kind named ``kind`` (:func:`..optim_kinds.lookup`), refused with the kinds there are."""
    try:
        return lookup(kind if isinstance(kind, (str, OptimKind)) else repr(kind))
    except ValueError as e:
        raise ValueError(f"FusedOptimizer: {e}") from None


def _decay_mode(kind: OptimKind, asked: str, weight_decay: float) -> WeightDecayMode:
    """The weight decay mode ``kind`` applies for ``weight_decay_mode=asked``: the one asked for when the kind
    has it, else the kind's own for the default ``"l2"`` (Adam's is decoupled, as fbgemm's)."""
    if asked not in _DECAY_MODES:
        raise ValueError(f"FusedOptimizer: weight_decay_mode must be one of {list(_DECAY_MODES)}, got {asked!r}")
    mode = _DECAY_MODES[asked]
    if not weight_decay or mode in kind.decay_modes:
        return mode if weight_decay else WeightDecayMode.NONE
    if not kind.decay_modes:
        raise ValueError(f"FusedOptimizer: kind {kind.name!r} applies no weight decay, got weight_decay={weight_decay}")
    if mode is WeightDecayMode.L2:
        return kind.decay_modes[0]
    having = [k.name for k in OptimKind if mode in k.decay_modes]
    raise ValueError(f"FusedOptimizer: weight_decay_mode={asked!r} is for {having}, not {kind.name!r}")


def _named(weights: object, *, training: bool) -> dict[str, DTensor]:
    if isinstance(weights, Mapping):
        items = [(str(k), v) for k, v in weights.items()]
    elif isinstance(weights, Sequence) and not isinstance(weights, (str, torch.Tensor)):
        items = [(str(i), v) for i, v in enumerate(weights)]
    else:
        raise TypeError(f"FusedOptimizer: weights must be a mapping name -> DTensor or a sequence of DTensors, "
                        f"got {type(weights).__name__}")
    if not items:
        raise ValueError("FusedOptimizer: no weights given")
    seen: dict[int, str] = {}
    for name, w in items:
        if not isinstance(w, DTensor):
            raise TypeError(f"FusedOptimizer: weight {name!r} must be a DTensor, got {type(w).__name__}")
        if w.dim() != 2 or not w.dtype.is_floating_point:
            raise ValueError(f"FusedOptimizer: weight {name!r} must be a 2-D floating table, got "
                             f"{list(w.shape)} {w.dtype}")
        if training and not w.requires_grad:
            raise ValueError(f"FusedOptimizer: weight {name!r} does not require grad: its lookups would run no "
                             "backward, so no update; call weight.requires_grad_()")
        if id(w) in seen:
            raise ValueError(f"FusedOptimizer: weights {seen[id(w)]!r} and {name!r} are the same tensor")
        seen[id(w)] = name
    return dict(items)


class FusedOptimizer:
    """An optimizer that backward applies in place to the rows a step touched; *collective* to build.

    Pass it as ``optimizer=`` to :func:`sharded_embedding_bags`,
    :func:`sharded_embedding_bag` or :func:`sharded_embedding`: backward then
    updates the weights' own shards (``weight.grad`` stays ``None``; nothing
    the size of a table is allocated per step). The result equals the
    unsharded optimizer applied to the full table with the gradient summed over
    every rank's batch, whatever the layout (see :mod:`.update` for the math;
    only rows some rank's batch referenced are updated, as fbgemm's
    ``EXACT_*`` optimizers do). Use each table in one lookup per step.

    Args:
        weights: ``name -> DTensor`` (or a sequence, named ``"0"``, ``"1"``, ...);
            every weight requires grad (to convert state only, see :meth:`for_conversion`).
        kind: a registered kind (:mod:`..optim_kinds`): ``"sgd"``, ``"rowwise_adagrad"`` (fbgemm's
            EXACT_ROWWISE_ADAGRAD), ``"adagrad"`` or ``"adam"`` built in.
        lr: learning rate.
        eps: the denominators' epsilon (Adagrad kinds, Adam); ``None``: the kind's default.
        weight_decay: 0 for none.
        weight_decay_mode: ``"l2"`` (added to the gradient) or ``"decoupled"``
            (row-wise Adagrad only; Adam's decay is always decoupled, as fbgemm's).
        beta1, beta2: Adam's moment decays; ``None``: the kind's defaults.
        stochastic_rounding: for fp16 / bf16 tables, write the updated rows back rounded stochastically
            (unbiased; fbgemm's and TorchRec's default) or, with ``False``, to nearest even. The update itself
            and the optimizer state are fp32. No effect on fp32 tables.
        track_changed_rows: report the rows each step writes, weights and state (:mod:`..tracking`), so that an
            incremental save (``tdb.checkpoint.save(..., base=)``) digests only those instead of scanning every
            row: its cost follows the rows that changed. A save scans as before when the tables were written
            otherwise since its base (any in-place op through torch: ``copy_``, ``nn.init``, a load; the tracker
            sees torch's version counter). Writes torch cannot see (through ``.data``, NumPy, a raw pointer)
            are not seen: do not ask for tracking where something writes the tables that way. Costs a
            boolean per row and marking each step's rows.

    Example::

        >>> opt = tdb.FusedOptimizer({"t0": w0, "t1": w1}, "rowwise_adagrad", lr=0.1)
        >>> outs = tdb.sharded_embedding_bags([ids0, ids1], [w0, w1], [off0, off1], mode="sum", optimizer=opt)
        >>> torch.cat(outs, 1).sum().backward()  # w0, w1 updated in place
        >>> tdb.checkpoint.save({**model_sd, **opt.state_dict()}, "/ckpt/step")
    """

    def __init__(
        self,
        weights: Mapping[str, DTensor] | Sequence[DTensor],
        kind: str,
        *,
        lr: float,
        eps: float | None = None,
        weight_decay: float = 0.0,
        weight_decay_mode: str = "l2",
        beta1: float | None = None,
        beta2: float | None = None,
        stochastic_rounding: bool = True,
        track_changed_rows: bool = False,
    ) -> None:
        okind = _kind(kind)
        check_math(okind)
        named = _named(weights, training=True)
        mode = _decay_mode(okind, weight_decay_mode, weight_decay)
        eps = okind.default("eps") if eps is None else eps
        beta1 = okind.default("beta1") if beta1 is None else beta1
        beta2 = okind.default("beta2") if beta2 is None else beta2
        for what, v in (("lr", lr), ("eps", eps), ("weight_decay", weight_decay)):
            if not isinstance(v, (int, float)) or v < 0 or v != v:
                raise ValueError(f"FusedOptimizer: {what} must be a non-negative number, got {v!r}")
        for what, v in (("beta1", beta1), ("beta2", beta2)):
            if not isinstance(v, (int, float)) or not 0 <= v < 1:
                raise ValueError(f"FusedOptimizer: {what} must be in [0, 1), got {v!r}")
        for what, flag in (("stochastic_rounding", stochastic_rounding), ("track_changed_rows", track_changed_rows)):
            if not isinstance(flag, bool):
                raise ValueError(f"FusedOptimizer: {what} must be True or False, got {flag!r}")
        self._build(named, okind, Hyper(okind, float(lr), float(eps), float(weight_decay), mode, float(beta1),
                                        float(beta2), stochastic_rounding), track_changed_rows)

    @classmethod
    def for_conversion(cls, weights: Mapping[str, DTensor] | Sequence[DTensor], kind: str) -> FusedOptimizer:
        """An optimizer that holds and converts state only; *collective* to build.

        For moving optimizer state between TorchRec and this package's format: the
        weights may be any model's tables as DTensors (those of a TorchRec model's
        ``state_dict()`` require no grad) and no hyper-parameter is asked for, as none
        enters a conversion. :meth:`state_dict`, :meth:`load_state_dict`,
        :meth:`load_torchrec_state_dict` and :meth:`copy_to_torchrec_state_dict` work
        as on any FusedOptimizer; a lookup given it refuses it (on every rank): it has
        no update to apply. A kind whose TorchRec state is not mapped (Adam) is refused.

        Args:
            weights: ``name -> DTensor`` (or a sequence, named ``"0"``, ``"1"``, ...); names as
                TorchRec's tables or parameters (``"t0"`` or ``"ebc.embedding_bags.t0.weight"``).
            kind: a kind whose TorchRec state converts (:attr:`..optim_kinds.OptimKind.torchrec_mapped`):
                ``"sgd"``, ``"rowwise_adagrad"`` or ``"adagrad"`` built in.

        Example::

            >>> tables = tdb.state_dict_to_dtensor(dmp.state_dict())   # no grad required
            >>> opt = tdb.FusedOptimizer.for_conversion({k: tables[k] for k in fused_keys}, "rowwise_adagrad")
            >>> opt.load_torchrec_state_dict(dmp.fused_optimizer.state_dict())
            >>> tdb.checkpoint.save({"tables": tables, "opt": opt}, "/ckpt/ours")
        """
        okind = _kind(kind)
        if not okind.torchrec_mapped:
            raise NotImplementedError(f"FusedOptimizer.for_conversion: TorchRec state for kind {okind.name!r} is "
                                      f"not mapped; kinds {[k.name for k in OptimKind if k.torchrec_mapped]}")
        opt = cls.__new__(cls)
        opt._build(_named(weights, training=False), okind, None)
        return opt

    def _build(self, named: dict[str, DTensor], kind: OptimKind, hyper: Hyper | None, track: bool = False) -> None:
        self._kind = kind
        self._hyper = hyper
        self._tables: dict[str, TableState] = {}
        self._by_id: dict[int, str] = {}
        for name, w in named.items():
            layout = layout_of(w, name=name)
            if layout.dtype is None:
                layout = dataclasses.replace(layout, dtype=w.dtype)
            self._tables[name] = TableState(name, w, layout, dist.get_rank(), local_shards_of(w), kind,
                                            track_changed_rows=track)
            self._by_id[id(w)] = name
        share_storage(list(self._tables.values()))
        if track:
            tracking.watch([x for t in self._tables.values()
                            for x in (*t.shards, *t.row_states, *(v for e in t.elements for v in e.values()))])

    @property
    def hyper(self) -> Hyper:
        """The hyper-parameters backward applies (an optimizer built by :meth:`for_conversion` has none).

        Raises:
            ValueError: for an optimizer built by :meth:`for_conversion`.
        """
        if self._hyper is None:
            raise ValueError(self._no_update())
        return self._hyper

    def _no_update(self) -> str:
        return (f"FusedOptimizer.for_conversion({self.names()}, {self.kind!r}) converts state and applies no "
                "update; to train, build FusedOptimizer(weights, kind, lr=...) over weights that require grad")

    @property
    def kind(self) -> str:
        """The optimizer's kind, as given (``"sgd"``, ...)."""
        return self._kind.name

    def names(self) -> list[str]:
        """The tables' names, in the order given."""
        return list(self._tables)

    def bind(self, weight: object) -> Binding | None:
        """What backward needs to update ``weight`` (the same DTensor object as given), or ``None``.

        Raises:
            Rejected: (a ValueError every rank of the lookup raises) for an optimizer built by
                :meth:`for_conversion`.
        """
        name = self._by_id.get(id(weight))
        if name is None:
            return None
        if self._hyper is None:
            raise Rejected(ValueError, self._no_update())
        return Binding(self._hyper, self._tables[name])

    def table_name(self, weight: object) -> str | None:
        """The name of ``weight``'s table in this optimizer (the same DTensor object as given), or ``None``."""
        return self._by_id.get(id(weight))

    # ------------------------------------------------------------ resharding
    def _table(self, name: str) -> TableState:
        return self._tables[name]

    def _fresh_table(self, name: str, layout: ShardLayout, shards: list[torch.Tensor]) -> TableState:
        """Zeroed state for table ``name`` once its weight holds ``shards`` in ``layout`` (its step count shared
        with the table's), not yet in use: :func:`~torchrec_dtensor_bridge.reshard` fills it, then installs it
        (:meth:`_install_table`) when the weight has moved to ``layout``.

        Raises:
            NotImplementedError: the kind's per-row state cannot follow ``layout`` (its column pieces cut
                the rows differently).
        """
        old = self._tables[name]
        if layout.dtype is None:
            layout = dataclasses.replace(layout, dtype=old.weight.dtype)
        fresh = TableState(name, old.weight, layout.with_name(name), dist.get_rank(), list(shards), self._kind,
                           track_changed_rows=old.track_changed_rows)
        fresh.step = old.step
        return fresh

    def _install_table(self, table: TableState) -> None:
        """Put ``table`` (from :meth:`_fresh_table`) in place of the table of its name: backward updates its
        shards and state from now on."""
        self._tables[table.name] = table
        if table.track_changed_rows:
            tracking.watch([*table.shards, *table.row_states, *(v for e in table.elements for v in e.values())])

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """``{f"{name}.{state}": value}``: DTensors in the weights' layouts (row-wise state: a 1-D DTensor cut
        by the weight's row cuts), a plain tensor for Adam's ``step``; zero-copy (views of the live state).

        Example::

            >>> tdb.checkpoint.save(opt.state_dict(), "/ckpt/opt")
        """
        out: dict[str, Any] = {}
        for name, t in self._tables.items():
            mesh = t.weight.device_mesh
            for spec in t.kind.states:
                state, skind = spec.name, spec.shape
                key = f"{name}.{state}"
                if skind is StateKind.SCALAR:
                    out[key] = t.step
                elif skind is StateKind.ROW:
                    assert t.rows is not None
                    out[key] = dtensor_from_local_shards(t.rows[0], t.row_states, device_mesh=mesh)
                else:
                    lay = t.layout.with_name(key)
                    if lay.dtype is not None and state_dtype(lay.dtype) != lay.dtype:  # fp32 for half tables
                        lay = dataclasses.replace(lay, dtype=state_dtype(lay.dtype))
                    out[key] = dtensor_from_local_shards(lay, [e[state] for e in t.elements], device_mesh=mesh)
        return out

    def load_torchrec_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Take the state of TorchRec's ``model.fused_optimizer.state_dict()`` (any plan whose semantics
        coincide with ours: see :mod:`.torchrec_state` for what is refused and why); *collective* on the
        default group (a TorchRec DMP's group, whose state it reads: every rank of the job calls it).

        Raises:
            ValueError: on every rank, naming each table whose state is missing or does not convert.
            NotImplementedError: for a kind whose TorchRec state is not mapped (Adam).
        """
        import_torchrec(self, state_dict)

    def copy_to_torchrec_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Write this optimizer's state into TorchRec's ``model.fused_optimizer.state_dict()`` (its live
        tensors, any plan whose semantics coincide); *collective* on the default group. Raises as
        :meth:`load_torchrec_state_dict`."""
        export_torchrec(self, state_dict)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Copy ``state_dict`` (keys as :meth:`state_dict`'s) into the state; *collective* when a value is a
        DTensor or ShardedTensor of another layout (it is resharded, any layout and world size).

        Raises:
            KeyError: a key is missing or unexpected (nothing is modified).
            ValueError: a value's shape or dtype does not match (nothing is modified).
        """
        mine = self.state_dict()
        missing = sorted(set(mine) - set(state_dict))
        extra = sorted(set(state_dict) - set(mine))
        if missing or extra:
            raise KeyError(f"FusedOptimizer.load_state_dict: missing keys {missing}, unexpected keys {extra}")
        for key, dst in mine.items():
            src = state_dict[key]
            if not isinstance(src, torch.Tensor):
                raise ValueError(f"FusedOptimizer.load_state_dict: {key} must be a tensor, got {type(src).__name__}")
            if tuple(src.shape) != tuple(dst.shape):
                raise ValueError(f"FusedOptimizer.load_state_dict: {key} has shape {list(src.shape)}, expected "
                                 f"{list(dst.shape)}")
            if isinstance(src, (DTensor, ShardedTensor)) and src.dtype != dst.dtype:
                raise ValueError(f"FusedOptimizer.load_state_dict: {key} has dtype {src.dtype}, expected {dst.dtype}")
        for key, dst in mine.items():
            src = state_dict[key]
            if src is dst:
                continue
            if not isinstance(dst, DTensor):
                dst.copy_(src.full_tensor() if isinstance(src, DTensor) else src)
                continue
            if not isinstance(src, (DTensor, ShardedTensor)):
                src = src.to(dst.dtype)
            copy_into(layout_of(dst, name=key), local_shards_of(dst), src, name=key)
