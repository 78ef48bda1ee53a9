"""The optimizer kinds: one frozen record per kind, in one registry that every layer reads.

An :class:`OptimKind` holds what the stack needs to know about a fused optimizer, apart from its math:

* the states it keeps (:class:`StateSpec`): their names (the ``state_dict`` key suffixes), their shapes
  (:class:`StateKind`: one value per row, per weight element, or per table) and TorchRec's key for each;
* the hyper-parameters it reads besides ``lr``, with their defaults, and the weight decay modes it applies;
* its names elsewhere: fbgemm's ``EmbOptimType`` member (which TorchRec's ``fused_params["optimizer"]``
  takes) and its name in fbgemm's generated ops (``split_embedding_backward_codegen_{name}_{unweighted,weighted}
  _pt2_wrapper``);
* which kernels implement its update: this package's C kernels (``native``: the code ``cpu_kernels.c``
  knows it by), fbgemm's CPU kernels, fbgemm's CUDA kernels. A kind that none of them lists is
  updated by its torch-op math alone.

The registry (:func:`register`, :func:`lookup`, iterating :class:`OptimKind` itself) refuses names it does
not know, and refuses a second record under a name it knows. Readers: :mod:`.kernels` (which
implementation can run a kind, the kernels' argument checks), :mod:`.optim` (the states a table keeps, the
hyper-parameters, TorchRec's state) and :mod:`.lookup` (whether an update is row-wise, whether it counts
steps). This module imports nothing of the package.

To add a kind, register its record and give its math (:func:`.optim.update.elementwise_math`); no kernel
lists it, so its math runs on the touched rows::

    >>> SIGNSGD = register(OptimKind("signsgd", decay_modes=()))  # no state, no weight decay
    >>> @elementwise_math(SIGNSGD)
    ... def _(hyper, w, g, state, step):
    ...     return w - hyper.lr * g.sign()
    >>> opt = tdb.FusedOptimizer(weights, "signsgd", lr=0.01)
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Mapping, Sequence
from types import MappingProxyType
from dataclasses import dataclass, field

import torch

__all__ = [
    "ADAGRAD", "ADAM", "DEFAULTS", "Hyper", "OptimKind", "ROWWISE_ADAGRAD", "SGD", "StateKind", "StateSpec",
    "REGISTERED", "WeightDecayMode", "combine_column_blocks", "lookup", "names", "register", "unregister",
]


class StateKind(enum.Enum):
    """The shape of one optimizer state (it decides the state's DTensor layout)."""

    ROW = "row"  # one value per row: a 1-D tensor cut by the weight's row cuts
    ELEMENT = "element"  # one value per weight element: the weight's own layout
    SCALAR = "scalar"  # one value per table (a step count): a plain tensor


def combine_column_blocks(values: torch.Tensor, widths: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """One value per row from a per-row state kept per column block (TorchRec's row-wise Adagrad on a table
    cut by columns): ``values`` is ``(blocks, rows)``, block ``k``'s row values in row ``k``; each row's
    blocks weighted by their ``widths`` (exact: each block's value is the mean over its own columns), in
    float64, then ``dtype``. The one formula of a checkpoint load and of a reshard, so that a resharded job
    and a resumed one hold the same bits."""
    w = torch.tensor(list(widths), dtype=torch.float64)
    return ((values.to(torch.float64) * w[:, None]).sum(0) / w.sum()).to(dtype)


class WeightDecayMode(enum.Enum):
    """How ``weight_decay`` enters the update (fbgemm's ``WeightDecayMode`` NONE / L2 / DECOUPLED)."""

    NONE = 0
    L2 = 1
    DECOUPLED = 2


DEFAULTS = {"eps": 1e-8, "weight_decay": 0.0, "beta1": 0.9, "beta2": 0.999}
"""The hyper-parameters besides ``lr`` and the decay mode (fields of :class:`Hyper`), with the defaults a kind
inherits."""


@dataclass(frozen=True)
class StateSpec:
    """One state an optimizer keeps per table.

    Attributes:
        name: its name, the suffix of its ``state_dict`` key (``f"{table}.{name}"``).
        shape: one value per row, per element, or per table (the step count).
        torchrec: TorchRec's key suffix for it in ``fused_optimizer.state_dict()``; ``None`` when it is
            not converted.
    """

    name: str
    shape: StateKind
    torchrec: str | None = None


_KINDS: dict[str, OptimKind] = {}
REGISTERED: Mapping[str, OptimKind] = MappingProxyType(_KINDS)
"""The registered kinds by name, read-only (a plain mapping read: what the kernels look a kind up in on every
call)."""
_BUILT_IN: set[str] = set()


class _Registered(type):
    """Iterating the class :class:`OptimKind` gives the registered kinds, in the order they were registered."""

    def __iter__(cls) -> Iterator[OptimKind]:
        return iter(list(_KINDS.values()))

    def __len__(cls) -> int:
        return len(_KINDS)


@dataclass(frozen=True, repr=False)
class OptimKind(metaclass=_Registered):
    """One optimizer kind (see the module docstring); iterating the class gives the registered kinds.

    Attributes:
        name: the kind as users name it (``FusedOptimizer(weights, "rowwise_adagrad")``).
        states: the states it keeps, in order; a table keeps one per-row state and one step count at most,
            and the kernels take two other states at most (as ``momentum1`` and ``momentum2``).
        hyper: the hyper-parameters it reads besides ``lr``, with their defaults (names of :data:`DEFAULTS`).
        decay_modes: the weight decay modes it applies (the first is what ``weight_decay`` means when the
            mode asked for is not one of them but the default ``l2``); empty: no weight decay.
        emb_optim_type: fbgemm's ``EmbOptimType`` member name, which TorchRec's planner takes too.
        fbgemm: its name in fbgemm's generated ops; ``None`` when fbgemm has none.
        native: the code of its update in this package's C kernels (``cpu_kernels.c``); ``None``: none.
        fbgemm_cpu: fbgemm's CPU backward-with-optimizer kernel updates with it.
        fbgemm_cuda: fbgemm's CUDA lookup function updates with it in its backward.
    """

    name: str
    states: tuple[StateSpec, ...] = ()
    hyper: tuple[tuple[str, float], ...] = ()
    decay_modes: tuple[WeightDecayMode, ...] = (WeightDecayMode.L2,)
    emb_optim_type: str | None = None
    fbgemm: str | None = None
    native: int | None = None
    fbgemm_cpu: bool = False
    fbgemm_cuda: bool = False
    # derived from the above once, when the record is made (read on every step: plain attributes)
    tensor_states: tuple[StateSpec, ...] = field(init=False, compare=False)
    """The states kept in tensors beside the weights (per row or per element), in order: what the kernels
    take as ``momentum1`` and ``momentum2``."""
    row_wise: bool = field(init=False, compare=False)
    """It keeps a state with one value per row: a row's update needs the statistics of the whole row (every
    column piece of it)."""
    per_element: bool = field(init=False, compare=False)
    """It keeps a state shaped like the weights."""
    counts_steps: bool = field(init=False, compare=False)
    """It keeps a step count (Adam's bias correction), counted once per backward before its update."""
    kernels: bool = field(init=False, compare=False)
    """Some one-pass kernel (ours or fbgemm's) lists it."""
    torchrec_mapped: bool = field(init=False, compare=False)
    """Its state converts to and from TorchRec's fused optimizer state: TorchRec knows the kind and a key for
    each of its states."""

    def __post_init__(self) -> None:
        derived = {
            "tensor_states": tuple(s for s in self.states if s.shape is not StateKind.SCALAR),
            "row_wise": any(s.shape is StateKind.ROW for s in self.states),
            "per_element": any(s.shape is StateKind.ELEMENT for s in self.states),
            "counts_steps": any(s.shape is StateKind.SCALAR for s in self.states),
            "kernels": self.native is not None or self.fbgemm_cpu or self.fbgemm_cuda,
            "torchrec_mapped": self.emb_optim_type is not None and all(s.torchrec is not None for s in self.states),
        }
        for name, value in derived.items():
            object.__setattr__(self, name, value)
        names = [s.name for s in self.states]
        if not self.name or len(set(names)) != len(names):
            raise ValueError(f"optimizer kind {self.name!r}: a name, and distinct state names {names}")
        unknown = [h for h, _ in self.hyper if h not in DEFAULTS]
        if unknown:
            raise ValueError(f"optimizer kind {self.name!r}: hyper-parameters {unknown} are not among "
                             f"{list(DEFAULTS)}")
        for shape, what in ((StateKind.ROW, "per-row state (its row blocks)"), (StateKind.SCALAR, "step count")):
            if sum(s.shape is shape for s in self.states) > 1:
                raise ValueError(f"optimizer kind {self.name!r}: a table keeps one {what} at most")
        if WeightDecayMode.NONE in self.decay_modes:
            raise ValueError(f"optimizer kind {self.name!r}: decay_modes lists the modes weight decay can take")
        if (self.fbgemm_cpu or self.fbgemm_cuda) and self.fbgemm is None:
            raise ValueError(f"optimizer kind {self.name!r}: fbgemm's kernels need its name in fbgemm")
        if self.kernels and len(self.tensor_states) > 2:
            raise ValueError(f"optimizer kind {self.name!r}: the kernels take two tensor states at most")

    def __repr__(self) -> str:
        return f"OptimKind({self.name!r})"

    def default(self, hyper: str) -> float:
        """The default of hyper-parameter ``hyper`` (a name of :data:`DEFAULTS`) for this kind."""
        return dict(self.hyper).get(hyper, DEFAULTS[hyper])


@dataclass(frozen=True)
class Hyper:
    """The hyper-parameters of one optimizer (the same for all its tables).

    Attributes:
        kind: the update.
        lr: learning rate.
        eps: added to the square root in the (row-wise) Adagrad / Adam denominators.
        weight_decay: 0 for none.
        weight_decay_mode: how ``weight_decay`` applies (one of the kind's ``decay_modes``; NONE without decay).
        beta1: Adam's first-moment decay.
        beta2: Adam's second-moment decay.
        stochastic_rounding: half-precision rows (fp16, bf16) are written back from the fp32 update rounded
            stochastically (unbiased: fbgemm's and TorchRec's default); ``False`` rounds to nearest even.
    """

    kind: OptimKind
    lr: float
    eps: float
    weight_decay: float
    weight_decay_mode: WeightDecayMode
    beta1: float
    beta2: float
    stochastic_rounding: bool = True


def register(kind: OptimKind) -> OptimKind:
    """Adds ``kind`` to the registry and returns it.

    Raises:
        ValueError: a kind of that name is registered already, or a kernel code is another kind's.
    """
    if kind.name in _KINDS:
        raise ValueError(f"optimizer kind {kind.name!r} is registered already")
    taken = [k.name for k in _KINDS.values() if kind.native is not None and k.native == kind.native]
    if taken:
        raise ValueError(f"optimizer kind {kind.name!r}: native code {kind.native} is {taken[0]!r}'s")
    _KINDS[kind.name] = kind
    return kind


def unregister(kind: OptimKind | str) -> None:
    """Removes a kind added by :func:`register` (a built-in kind stays).

    Raises:
        ValueError: for a built-in kind or one not registered.
    """
    name = kind if isinstance(kind, str) else kind.name
    if name in _BUILT_IN or name not in _KINDS:
        raise ValueError(f"optimizer kind {name!r}: " + ("built in" if name in _BUILT_IN else "not registered"))
    del _KINDS[name]


def lookup(kind: OptimKind | str) -> OptimKind:
    """The registered kind named ``kind`` (or ``kind`` itself, when it is the registered record).

    Example::

        >>> lookup("rowwise_adagrad").row_wise
        True

    Raises:
        ValueError: naming the kinds there are, for a name (or record) not registered.
    """
    name = kind if isinstance(kind, str) else getattr(kind, "name", None)
    found = _KINDS.get(name) if isinstance(name, str) else None
    if found is not None and (found is kind or isinstance(kind, str) or kind == found):
        return found
    raise ValueError(f"unknown optimizer kind {name!r}; expected one of {names()}")


def names() -> list[str]:
    """The registered kinds' names, in the order they were registered."""
    return list(_KINDS)


_L2, _DECOUPLED = WeightDecayMode.L2, WeightDecayMode.DECOUPLED

SGD = register(OptimKind(
    "sgd", hyper=(("weight_decay", 0.0),), emb_optim_type="EXACT_SGD", fbgemm="sgd", native=0, fbgemm_cpu=True,
    fbgemm_cuda=True))
ROWWISE_ADAGRAD = register(OptimKind(
    "rowwise_adagrad", states=(StateSpec("momentum1", StateKind.ROW, "momentum1"),),
    hyper=(("eps", 1e-8), ("weight_decay", 0.0)), decay_modes=(_L2, _DECOUPLED),
    emb_optim_type="EXACT_ROWWISE_ADAGRAD", fbgemm="rowwise_adagrad", native=1, fbgemm_cpu=True, fbgemm_cuda=True))
ADAGRAD = register(OptimKind(
    "adagrad", states=(StateSpec("momentum1", StateKind.ELEMENT, "momentum1"),),
    hyper=(("eps", 1e-8), ("weight_decay", 0.0)), emb_optim_type="EXACT_ADAGRAD", fbgemm="adagrad", native=2,
    fbgemm_cpu=True, fbgemm_cuda=True))
ADAM = register(OptimKind(  # TorchRec's Adam state is not converted: its CPU kernels have no Adam to compare with
    "adam", states=(StateSpec("momentum1", StateKind.ELEMENT), StateSpec("momentum2", StateKind.ELEMENT),
                    StateSpec("step", StateKind.SCALAR)),
    hyper=(("eps", 1e-8), ("beta1", 0.9), ("beta2", 0.999), ("weight_decay", 0.0)), decay_modes=(_DECOUPLED,),
    emb_optim_type="ADAM", fbgemm="adam", native=3, fbgemm_cuda=True))
_BUILT_IN.update(_KINDS)
