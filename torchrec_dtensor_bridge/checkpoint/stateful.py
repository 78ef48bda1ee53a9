"""DCP ``Stateful`` values of a state_dict: expanded before a save or load, restored after a load.

``save`` and ``load`` take, anywhere in a (nested) state_dict, objects with
``state_dict()`` and ``load_state_dict()``
(:class:`torch.distributed.checkpoint.stateful.Stateful`): a module (a TorchRec
``DistributedModelParallel``), a ``torch.optim`` optimizer, TorchRec's keyed
optimizers (``dmp.fused_optimizer``, ``KeyedOptimizerWrapper``), a
:class:`~..optim.FusedOptimizer`. :func:`expand` replaces each by its state
(the *view*: its live tensors, in place), so the agreement, the validation and
DCP see tensors only. A load runs, on every rank:

1. :func:`expand`; an optimizer that has no state yet for some parameters (before
   its first step) creates it first (a step on zero gradients, the parameters
   then restored bit for bit), so the view names every tensor the checkpoint may
   hold for it, with its shape and dtype;
2. the load validates the view against the checkpoint and agrees (nothing is
   modified); state created in step 1 that the checkpoint does not hold (a save
   made before that optimizer's first step) is removed again (:meth:`Expanded.drop`);
3. DCP loads in place into the view;
4. :meth:`Expanded.restore`: each object's ``load_state_dict()`` with its loaded
   view; plain values the load replaced are written back into the caller's dicts.

A refused load calls :meth:`Expanded.rollback`: the state step 1 created is removed.

A ``torch.optim`` optimizer's state is keyed by its parameters' names in the
first module of the same state_dict that holds them all (TorchRec's keyed
optimizers use the same names), else by their positions as
``Optimizer.state_dict()`` numbers them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from .._compat import ShardedTensor, shape_and_dtype
from .agree import Kind, Problem
from .common import Flat, leaves
from .keyed import HYPERPARAMETERS, Hint, apply_hyperparameters, column_widths, hyperparameters, row_state_hint

__all__ = ["Expanded", "expand", "unloadable"]


def _is_stateful(v: object) -> bool:
    return isinstance(v, Stateful) and not isinstance(v, (torch.Tensor, Mapping))


def _stateful_values(v: object) -> list[Any]:
    """Every Stateful in ``v``, itself or nested in mappings, lists and tuples, in order."""
    if _is_stateful(v):
        return [v]
    if isinstance(v, Mapping):
        return [s for x in v.values() for s in _stateful_values(x)]
    if isinstance(v, (list, tuple)):
        return [s for x in v for s in _stateful_values(x)]
    return []


def _holds_stateful(v: object) -> bool:
    return bool(_stateful_values(v))


def _is_keyed(opt: object) -> bool:
    """TorchRec's ``KeyedOptimizer`` family: a ``torch.optim.Optimizer`` keyed by a mapping ``params``."""
    return isinstance(opt, torch.optim.Optimizer) and isinstance(getattr(opt, "params", None), Mapping)


def _parts(opt: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
    """The optimizers holding ``opt``'s state: itself, or each part of a TorchRec ``CombinedOptimizer``."""
    parts = getattr(opt, "optimizers", None)
    if _is_keyed(opt) and isinstance(parts, list) and all(isinstance(p, tuple) and len(p) == 2 for p in parts):
        return [leaf for _, part in parts for leaf in _parts(part)]
    return [opt]


def _params(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in opt.param_groups for p in g["params"]]


def _create_state(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Create ``opt``'s state for its parameters that have none; return those parameters.

    One ``step()`` with a zero gradient on exactly those parameters (the others get
    none, so their state is untouched); every parameter's value and gradient is
    restored afterwards, so only the optimizer's state changes. A subclass of
    ``nn.Parameter`` over plain memory (TorchRec hands a data-parallel table to the dense
    optimizer as a ``TableBatchedEmbeddingSlice``, whose ``.grad`` is its kernel's) steps as a
    plain Parameter over the same memory, its state then moved to it. An optimizer over
    anything else but plain tensors and DTensors (TorchRec's fused optimizers, whose state
    exists from the start and whose ``step()`` reconfigures their kernel) is left alone;
    over DTensors the step is collective where the optimizer's math is (a DTensor over a
    :class:`LocalShardsWrapper` takes every op of ``torch.optim``'s).
    """
    params = _params(opt)
    if not all(_state_creatable(p) for p in params):
        return []
    lacking = [p for p in params if p.requires_grad and p not in opt.state]
    if not lacking:
        return []
    # a subclass of Parameter (TorchRec's TableBatchedEmbeddingSlice: a data-parallel table, a view of its
    # kernel's weights whose .grad is its kernel's) steps as a plain Parameter over the same memory
    standing = {id(p): nn.Parameter(p.detach()) for p in params if _parameter_view(p)}
    groups = [g["params"] for g in opt.param_groups]
    stepped = [standing.get(id(p), p) for p in params]
    wanted = {id(standing.get(id(p), p)) for p in lacking}
    grads = [p.grad for p in stepped]
    values = [p.detach().clone() for p in stepped]
    try:
        for group in opt.param_groups:
            group["params"] = [standing.get(id(p), p) for p in group["params"]]
        for p in stepped:
            p.grad = torch.zeros_like(p) if id(p) in wanted else None
        opt.step()
    finally:
        with torch.no_grad():
            for p, g, v in zip(stepped, grads, values):
                p.copy_(v)
                p.grad = g
        for group, own in zip(opt.param_groups, groups):
            group["params"] = own
        for p in params:
            if id(p) in standing and standing[id(p)] in opt.state:
                opt.state[p] = opt.state.pop(standing[id(p)])
    return [p for p in lacking if p in opt.state]


def _state_creatable(p: object) -> bool:
    """Whether :func:`_create_state` steps an optimizer over ``p``."""
    return type(p) in (torch.Tensor, nn.Parameter, DTensor) or _parameter_view(p)


def _parameter_view(p: object) -> bool:
    """A subclass of ``nn.Parameter`` over plain memory (not a DTensor, not a wrapper of other tensors)."""
    return (isinstance(p, nn.Parameter) and type(p) is not nn.Parameter and not isinstance(p, DTensor)
            and p.layout == torch.strided and p.device.type != "meta")


def unloadable(stateless: Mapping[str, str], absent: frozenset[str]) -> list[Problem]:
    """A problem per key of ``stateless`` (:attr:`Expanded.stateless`) not in ``absent`` (those the checkpoint
    holds nothing under): the checkpoint holds optimizer state that nothing could be loaded into."""
    return [Problem(Kind.TYPE, f"key {k!r}: the checkpoint holds this optimizer state, but the optimizer has none "
                               f"for the parameter to load it into and none can be created (a {t}: state is "
                               "created for plain tensors, Parameters and DTensors); take a step first")
            for k, t in sorted(stateless.items()) if k not in absent]


@dataclass
class _Created:
    """State an optimizer created for the load: kept only if the checkpoint holds it."""

    key: str  # the flattened key of its subtree in the view
    part: torch.optim.Optimizer  # the optimizer whose ``state`` holds it
    param: torch.Tensor
    states: MutableMapping[Any, Any]  # the view's ``state`` mapping
    name: Any  # its key there


@dataclass
class Expanded:
    """A state_dict with every Stateful replaced by its state (see the module docstring).

    Attributes:
        view: what DCP saves or loads: the caller's mappings, those holding a Stateful copied.
        problems: this rank's refusals (a ``state_dict()`` that is not a mapping, ...), to agree on.
        created: state created for a load (:meth:`drop` removes what the checkpoint lacks).
        stateless: for a load, per state key of a ``torch.optim`` optimizer's parameter no state can be
            created for, the parameter's type (:func:`unloadable` refuses the state a checkpoint holds there).
        extras: (flattened key, its removal from the view) of entries older checkpoints do not hold.
        records: (mapping, key, flattened key) of per-rank records that a save merges across ranks (DCP writes one rank's
            objects): tuples of ``(name, value)`` pairs, each rank's about its own tables.
        row_states: per flattened key of a keyed optimizer's per-row state, where it sits in the view.
        column_widths: per such key of a table cut by columns into several blocks, the blocks' widths (a save
            records them, so that a load can combine the per-block states into one per row).
        hints: per flattened key of a keyed optimizer's per-row state, how a load converts it or why not.
        param_groups: per flattened key of a ``torch.optim`` optimizer's ``param_groups``, its number of groups
            (a load refuses a checkpoint holding another number, as ``Optimizer.load_state_dict`` does).
        loads: each Stateful's ``load_state_dict()`` with its view, in the state_dict's order.
        writeback: (the caller's mapping, its copy in the view, the keys of plain values in it).
    """

    view: dict[str, Any]
    problems: list[Problem] = field(default_factory=list)
    created: list[_Created] = field(default_factory=list)
    stateless: dict[str, str] = field(default_factory=dict)
    extras: list[tuple[str, Callable[[], Any]]] = field(default_factory=list)
    records: list[tuple[dict[str, Any], str, str]] = field(default_factory=list)
    row_states: dict[str, tuple[MutableMapping[str, Any], str]] = field(default_factory=dict)
    column_widths: dict[str, tuple[int, ...]] = field(default_factory=dict)
    hints: dict[str, Hint] = field(default_factory=dict)
    param_groups: dict[str, int] = field(default_factory=dict)
    loads: list[Callable[[], None]] = field(default_factory=list)
    writeback: list[tuple[Mapping[str, Any], dict[str, Any], list[str]]] = field(default_factory=list)
    _leaves: Flat | None = field(default=None, repr=False)

    @property
    def optional(self) -> tuple[str, ...]:
        """The flattened keys of :attr:`created` and :attr:`extras`: loaded where the checkpoint holds them,
        else dropped."""
        return tuple(c.key for c in self.created) + tuple(k for k, _ in self.extras)

    def leaves(self) -> Flat:
        """The view's leaves (:func:`..common.leaves`), walked once: every later step of a save reads this list."""
        if self._leaves is None:
            self._leaves = list(leaves(self.view))
        return self._leaves

    def local_records(self) -> list[Any]:
        """This rank's :attr:`records`, in order (every rank of a save has the same entries)."""
        return [mapping.get(key) for mapping, key, _ in self.records]

    def merge_records(self, every_rank: list[list[Any]]) -> None:
        """Set each record to the union of every rank's (one sorted tuple, the same on every rank), in the view
        and in its :meth:`leaves`."""
        new: dict[str, tuple[Any, ...]] = {}
        for i, (mapping, key, fqn) in enumerate(self.records):
            merged = {pair for ranks in every_rank if i < len(ranks) and isinstance(ranks[i], tuple)
                      for pair in ranks[i]}
            mapping[key] = new[fqn] = tuple(sorted(merged))
        if self._leaves is not None and new:
            self._leaves = [(k, new.get(k, v)) for k, v in self._leaves]

    def drop(self, absent: frozenset[str]) -> None:
        """Remove the created state the checkpoint does not hold (keys ``absent``) from the view and the optimizers."""
        keep = []
        for c in self.created:
            if c.key in absent:
                c.states.pop(c.name, None)
                c.part.state.pop(c.param, None)
            else:
                keep.append(c)
        self.created = keep
        for key, remove in self.extras:
            if key in absent:
                remove()
        self.extras = [(k, r) for k, r in self.extras if k not in absent]

    def rollback(self) -> None:
        """Undo :func:`expand`: remove every state it created (a refused or failed load)."""
        self.drop(frozenset(self.optional))

    def restore(self) -> None:
        """After the load: each Stateful's ``load_state_dict()`` with its view; plain values written back."""
        for load in self.loads:
            load()
        for original, view, keys in self.writeback:
            if isinstance(original, MutableMapping):
                for k in keys:
                    original[k] = view[k]


def _blocks_torchrec_cannot_load(key: str, module: nn.Module, view: Mapping[str, Any]) -> list[Problem]:
    """Tables of a TorchRec sharded module (a DMP, a sharded EBC or EC) whose blocks on this rank its own
    ``load_state_dict()`` cannot take: TorchRec reshapes each rank's blocks of a table to the width of the
    table's first block, so a column-wise table of uneven widths fails there on the ranks holding a block of
    another width, after the others have loaded (and then wait for them). Refused before the load instead."""
    if not any(type(m).__module__.startswith("torchrec.distributed") for m in module.modules()):
        return []
    problems = []
    for name, value in view.items():
        if not isinstance(value, ShardedTensor) or len(shape_and_dtype(value)[0]) != 2:
            continue
        first = value.metadata().shards_metadata[0].shard_sizes[1]
        mine = [s.metadata.shard_sizes[1] for s in value.local_shards() if s.metadata.shard_sizes[1] != first]
        if mine:
            problems.append(Problem(Kind.VALUE, (
                f"key {f'{key}.{name}'!r}: a table cut into column blocks of widths {list(column_widths(value) or ())} "
                f"does not load into TorchRec's module: its load_state_dict() takes every rank's blocks of a table as "
                f"wide as the first ({first} columns), and this rank holds one {mine[0]} wide; load under a plan whose "
                "column blocks of that table have equal widths")))
    return problems


def expand(state_dict: Mapping[str, Any], *, for_load: bool) -> Expanded:
    """``state_dict`` with every Stateful replaced by its state; no collective of its own.

    With ``for_load``, optimizers create the state they lack (see the module docstring).
    Problems are recorded, not raised, for the caller's agreement.

    Example::

        >>> ex = expand({"model": dmp, "dense": adam, "step": 3}, for_load=True)
        >>> sorted(ex.view)      # {"model": {...tensors}, "dense": {"state": ..., "param_groups": ...}, "step": 3}
        ['dense', 'model', 'step']
    """
    modules = [v for v in _stateful_values(state_dict) if isinstance(v, nn.Module)]
    out = Expanded({})
    out.view = _Expander(out, modules, for_load).mapping(state_dict, "")
    return out


class _Expander:
    def __init__(self, out: Expanded, modules: list[nn.Module], for_load: bool) -> None:
        self.out = out
        self.modules = modules
        self.for_load = for_load

    def mapping(self, sd: Mapping[str, Any], prefix: str) -> dict[str, Any]:
        view: dict[str, Any] = {}
        plain: list[str] = []
        for k, v in sd.items():
            key = f"{prefix}{k}"
            if _is_stateful(v):
                state = self.stateful(key, v)
                if state is not None:
                    view[k] = state
            elif isinstance(v, Mapping) and _holds_stateful(v):
                view[k] = self.mapping(v, key + ".")
            elif isinstance(v, (list, tuple)) and _holds_stateful(v):
                self.out.problems.append(Problem(
                    Kind.TYPE, f"key {key!r}: a {type(v).__name__} holding objects with state_dict() / "
                               "load_state_dict(); put them in a dict (DCP expands Stateful values of dicts only)"))
            else:
                view[k] = v
                plain.append(k)
        self.out.writeback.append((sd, view, plain))
        return view

    def stateful(self, key: str, obj: Any) -> Mapping[str, Any] | None:
        if isinstance(obj, torch.optim.Optimizer) and not _is_keyed(obj):
            return self.torch_optimizer(key, obj)
        created = self.create(obj) if self.for_load and _is_keyed(obj) else []
        view = obj.state_dict()
        if not isinstance(view, Mapping):
            self.out.problems.append(Problem(
                Kind.TYPE, f"key {key!r}: {type(obj).__name__}.state_dict() returned a {type(view).__name__}, "
                           "not a mapping (a DCP Stateful's state_dict() returns a dict)"))
            for part, p in created:
                part.state.pop(p, None)
            return None
        if not _is_keyed(obj):
            if self.for_load and isinstance(obj, nn.Module):
                self.out.problems += _blocks_torchrec_cannot_load(key, obj, view)
            self.out.loads.append(lambda: obj.load_state_dict(view))
            return view
        self.keyed_optimizer(key, obj, view, created)
        return self.with_hyperparameters(key, obj, view)

    def with_hyperparameters(self, key: str, opt: Any, view: Mapping[str, Any]) -> dict[str, Any]:
        """``view`` and, under :data:`HYPERPARAMETERS`, each parameter's hyper-parameters (its group's ``lr``,
        ...): TorchRec's keyed optimizers keep them out of ``state_dict()``, so a resume would otherwise run
        with the learning rate the new job was built with. After the load each parameter group takes its
        parameters' saved values, where they agree (a new plan may group tables another way); a checkpoint
        written without them loads as before (the key is optional)."""
        full = {**view, HYPERPARAMETERS: hyperparameters(opt)}
        self.out.extras.append((f"{key}.{HYPERPARAMETERS}", lambda: full.pop(HYPERPARAMETERS, None)))
        self.out.records.append((full, HYPERPARAMETERS, f"{key}.{HYPERPARAMETERS}"))  # each rank knows its own tables: merged on save

        def load() -> None:
            saved = full.get(HYPERPARAMETERS)
            opt.load_state_dict({k: v for k, v in full.items() if k != HYPERPARAMETERS})
            if saved is not None:
                apply_hyperparameters(key, opt, saved)

        self.out.loads.append(load)
        return full

    def create(self, opt: torch.optim.Optimizer) -> list[tuple[torch.optim.Optimizer, torch.Tensor]]:
        return [(part, p) for part in _parts(opt) for p in _create_state(part)]

    def torch_optimizer(self, key: str, opt: torch.optim.Optimizer) -> dict[str, Any]:
        """A ``torch.optim`` optimizer's state, keyed by its parameters' names (``Optimizer.state_dict()``
        numbers them); its ``load_state_dict()`` gets them numbered again, with its own parameter groups'
        parameters and the loaded hyper-parameters (group by group: a load refuses a checkpoint holding
        another number of groups, see :attr:`Expanded.param_groups`)."""
        created = self.create(opt) if self.for_load else []
        names = self.param_names(opt)
        own = opt.state_dict()
        states: dict[str, Any] = {names[i]: dict(v) for i, v in own["state"].items()}
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[i] for i in g["params"]]}
                  for g in own["param_groups"]]
        view: dict[str, Any] = {"state": states, "param_groups": groups}
        self.out.param_groups[f"{key}.param_groups"] = len(groups)
        params = _params(opt)
        position = {id(p): i for i, p in enumerate(params)}
        if self.for_load:  # nothing to load into: refused where the checkpoint holds state for it (unloadable)
            for i, p in enumerate(params):
                if p.requires_grad and p not in opt.state and not _state_creatable(p):
                    self.out.stateless[f"{key}.state.{names[i]}"] = type(p).__name__
        for part, p in created:
            name = names[position[id(p)]]
            self.out.created.append(_Created(f"{key}.state.{name}", part, p, states, name))

        def load() -> None:
            number = {n: i for i, n in enumerate(names)}
            loaded = [{**g, "params": mine["params"]} for g, mine in zip(view["param_groups"], own["param_groups"])]
            opt.load_state_dict({"state": {number[n]: s for n, s in states.items()}, "param_groups": loaded})

        self.out.loads.append(load)
        return view

    def param_names(self, opt: torch.optim.Optimizer) -> list[str]:
        params = _params(opt)
        for m in self.modules:
            names = {id(p): n for n, p in m.named_parameters()}
            if all(id(p) in names for p in params):
                return [names[id(p)] for p in params]
        return [str(i) for i in range(len(params))]

    def keyed_optimizer(self, key: str, opt: Any, view: Mapping[str, Any],
                        created: list[tuple[torch.optim.Optimizer, torch.Tensor]]) -> None:
        """Record a keyed optimizer's created state, and why its row-wise state may not convert."""
        states = view.get("state")
        names = {id(p): k for k, p in opt.params.items()}
        for part, p in created:
            name = names.get(id(p))
            if isinstance(states, MutableMapping) and name in states:
                self.out.created.append(_Created(f"{key}.state.{name}", part, p, states, name))
            else:  # not in the view: nothing would load it
                part.state.pop(p, None)
        if not isinstance(states, Mapping):
            return
        for name, per in states.items():
            param = opt.params.get(name)
            shape = shape_and_dtype(param)[0] if isinstance(param, torch.Tensor) else ()
            if not isinstance(per, Mapping) or len(shape) != 2:
                continue
            widths = column_widths(param)
            for what, v in per.items():
                if isinstance(v, torch.Tensor) and len(shape_and_dtype(v)[0]) == 1:
                    fqn = f"{key}.state.{name}.{what}"
                    self.out.hints[fqn] = row_state_hint(name, tuple(shape), widths)
                    if isinstance(per, MutableMapping):
                        self.out.row_states[fqn] = (per, what)
                    if widths:
                        self.out.column_widths[fqn] = widths
