"""The optimizer kinds and hyper-parameters as :mod:`..optim` names them: the registry's (:mod:`...optim_kinds`).

Kept so that ``optim.kinds`` reads as before; the records, and the one list of kinds, live in the registry.
"""

from __future__ import annotations

from ..optim_kinds import Hyper, OptimKind, StateKind, StateSpec, WeightDecayMode, lookup

__all__ = ["Hyper", "OptimKind", "StateKind", "StateSpec", "WeightDecayMode", "lookup"]
