"""The optimizers a :class:`~.optimizer.FusedOptimizer` applies, and their hyper-parameters."""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["Hyper", "OptimKind", "StateKind", "WeightDecayMode"]


class OptimKind(enum.Enum):
    """Which update backward applies to the rows a step touched (see :mod:`.update` for the math)."""

    SGD = "sgd"
    ROWWISE_ADAGRAD = "rowwise_adagrad"
    ADAGRAD = "adagrad"
    ADAM = "adam"

    @classmethod
    def parse(cls, kind: object) -> OptimKind:
        if isinstance(kind, OptimKind):
            return kind
        for k in cls:
            if k.value == kind:
                return k
        raise ValueError(f"FusedOptimizer: unknown kind {kind!r}; expected one of {[k.value for k in cls]}")


class WeightDecayMode(enum.Enum):
    """How ``weight_decay`` enters the update (fbgemm's ``WeightDecayMode`` NONE / L2 / DECOUPLED)."""

    NONE = 0
    L2 = 1
    DECOUPLED = 2


class StateKind(enum.Enum):
    """The shape of one optimizer state (decides its DTensor layout)."""

    ROW = "row"  # one value per row: a 1-D tensor cut by the weight's row cuts
    ELEMENT = "element"  # one value per weight element: the weight's own layout
    SCALAR = "scalar"  # one value per table (Adam's step): a plain tensor


STATES: dict[OptimKind, tuple[tuple[str, StateKind], ...]] = {
    OptimKind.SGD: (),
    OptimKind.ROWWISE_ADAGRAD: (("momentum1", StateKind.ROW),),
    OptimKind.ADAGRAD: (("momentum1", StateKind.ELEMENT),),
    OptimKind.ADAM: (("momentum1", StateKind.ELEMENT), ("momentum2", StateKind.ELEMENT), ("step", StateKind.SCALAR)),
}
"""Per kind, its states' names (the ``state_dict`` key suffixes) and shapes."""


@dataclass(frozen=True)
class Hyper:
    """The hyper-parameters of one optimizer (the same for all its tables).

    Attributes:
        kind: the update.
        lr: learning rate.
        eps: added to the square root in the (row-wise) Adagrad / Adam denominators.
        weight_decay: 0 for none.
        weight_decay_mode: how ``weight_decay`` applies (row-wise Adagrad: L2 or DECOUPLED;
            SGD / Adagrad: L2; Adam: DECOUPLED, as fbgemm's Adam).
        beta1: Adam's first-moment decay.
        beta2: Adam's second-moment decay.
    """

    kind: OptimKind
    lr: float
    eps: float
    weight_decay: float
    weight_decay_mode: WeightDecayMode
    beta1: float
    beta2: float
