"""Which implementation runs each kernel op, per device: the one place that decides, by a fixed rule.

Steps of a choice (:func:`pool_impl`, :func:`update_impl`, :func:`dense_impl`; :func:`explain_pool`,
:func:`explain_update` and :func:`explain_dense` give it with its reason):

1. ``$TDB_KERNELS`` forces an implementation (``native``, ``fbgemm`` or ``torch``; ``auto``, the default, lets
   the steps below choose). A forced implementation that cannot do the work leaves it to torch's.
2. What can do the work: this package's C kernels (:mod:`.native`: the built extension, any kind with a
   ``native`` code, fp32, fp16 and bf16 tables), fbgemm's (:mod:`.fbgemm`: installed and loadable; on the
   CPU fp32 and fp16 tables, the kinds whose record says ``fbgemm_cpu``, no weight decay, rounding to nearest
   only: :func:`for_weights`), torch's (always; the reference math, a kind's torch-op update). After a
   lookup's agreement, only what every rank of it has (:func:`settle`).
3. Where ours and fbgemm's both can, the rule (:data:`RULE`): per kind of work, dtype and size (the bytes of
   the call's tables), the one measured faster there, 5 MiB to 2 GiB of tables (docs/kernels.md gives the
   figures and how to measure them again). It depends on nothing measured in the process: the same install,
   environment and call give the same choice in every process, so ranks holding the same table (a replicated
   one) run the same kernel on it; ranks holding different shards may run different ones, each on rows no
   other rank updates.
4. Off the CPU: fbgemm's CUDA kernels where they can do the work (ours are CPU-only), torch's otherwise.

A lookup's ranks agree on what they have (:func:`choice_code` travels in the lookup's agreement): an
implementation runs only where every rank has it (a rank that forces one offers that one alone: forcing
``torch`` on one rank makes every rank run torch's), so that no rank runs what another lacks. Once settled,
a choice is remembered (per op, device type, dtype, optimizer kind, weight decay or not, the side of the
rule's size threshold, and ``$TDB_KERNELS`` / ``$TDB_NATIVE_KERNELS``): a call then consults nothing else;
an agreement that settles on other codes forgets every remembered choice.

Which kinds an update can run with is the kinds' registry's (:mod:`...optim_kinds`): a kind neither kernel
lists gets :attr:`Impl.TORCH`: its torch-op math on the touched rows.

Example::

    >>> explain_update(torch.device("cpu"), "sgd", 0.0, torch.float32, nbytes=1 << 30).impl
    <Impl.NATIVE: 2>
    >>> explain_update(torch.device("cpu"), "sgd", 0.0, torch.float32, nbytes=1 << 20).why
    "rule for update_sgd fp32: ours from 64 MiB of tables, fbgemm's below (fbgemm's time / ours: ...)"
"""

from __future__ import annotations

import enum
import functools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..optim_kinds import REGISTERED, OptimKind, lookup
from . import fbgemm, native

__all__ = ["RULE", "Choice", "Impl", "Rule", "choice_code", "dense_impl", "explain_dense", "explain_pool",
           "explain_update", "for_weights", "pool_impl", "rule_for", "settle", "update_impl"]

log = logging.getLogger(__name__)


class Impl(enum.IntEnum):
    """An implementation; the order is the fallback order (ranks that disagree fall back to the lowest)."""

    TORCH = 0
    FBGEMM = 1
    NATIVE = 2


@dataclass(frozen=True)
class Choice:
    """What runs one kind of work, and why (``rule: ...``, ``override: ...``, or what the others lack)."""

    impl: Impl
    why: str


@dataclass(frozen=True)
class Rule:
    """Which of ours and fbgemm's CPU kernels runs one kind of work on tables of one dtype, where both can:
    ours over at least :attr:`ours_from` bytes of tables in one call, fbgemm's below (0: ours at every size;
    ``None``: fbgemm's at every size).

    Attributes:
        ours_from: the least bytes of tables (the call's storage) ours runs on.
        figures: fbgemm's time / ours at the sizes measured (docs/kernels.md), what decided it.
    """

    ours_from: int | None
    figures: str

    def pick(self, nbytes: int | None) -> Impl:
        """The implementation for a call over ``nbytes`` bytes of tables (``None``: past every threshold)."""
        if self.ours_from is None:
            return Impl.FBGEMM
        return Impl.NATIVE if nbytes is None or nbytes >= self.ours_from else Impl.FBGEMM

    def describe(self) -> str:
        """The rule in words: ``ours``, ``fbgemm's``, or ``ours from 64 MiB, fbgemm's below``."""
        if self.ours_from is None:
            return "fbgemm's"
        if self.ours_from == 0:
            return "ours"
        return f"ours from {self.ours_from >> 20} MiB of tables, fbgemm's below"


_MIB = 1 << 20
RULE: dict[tuple[str, str], Rule] = {
    ("pool", "fp32"): Rule(None, "0.52-0.94x at 10 MiB to 512 MiB"),
    ("pool", "fp16"): Rule(None, "0.67-0.97x at 5 MiB to 256 MiB, noisy below 16 MiB"),
    ("update_sgd", "fp32"): Rule(64 * _MIB, "0.33-0.97x up to 32 MiB, 0.98-1.09x at 64 MiB, 1.35-1.75x above"),
    ("update_sgd", "fp16"): Rule(32 * _MIB, "0.82-1.24x below 32 MiB, 1.0-1.33x at 32 MiB, 1.2-1.66x above"),
    ("update_rowwise_adagrad", "fp32"): Rule(0, "0.68-1.18x at 10 MiB, 1.78-3.34x from 20 MiB"),
    ("update_rowwise_adagrad", "fp16"): Rule(0, "1.0-1.09x at 5-10 MiB, 1.37-2.59x from 16 MiB"),
    ("update_adagrad", "fp32"): Rule(16 * _MIB, "0.64-0.82x at 10 MiB, 1.15-1.80x from 20 MiB"),
    ("update_adagrad", "fp16"): Rule(64 * _MIB, "0.87-0.98x below 64 MiB, 1.05-1.32x from 64 MiB"),
}
"""Step 3: per kind of work (``pool``, ``update_<kind>``) and dtype (``fp32``, ``fp16``: the dtypes both C
kernels take), the :class:`Rule` that picks ours or fbgemm's where both can, from the figures of
``scripts/bench_sparse_update.py`` on this project's machine (one thread, one table of 128 columns a call,
81,920 ids; fbgemm's time / ours, medians; docs/kernels.md). Work both can do that is not listed (a kind
registered later) runs ours: the kernels' own math, written for this package's kinds."""
_UNLISTED = Rule(0, "not measured")


def _forced() -> Impl | None:
    want = os.environ.get("TDB_KERNELS", "auto").lower()
    if want == "auto":
        return None
    if want.upper() in Impl.__members__:
        return Impl[want.upper()]
    _warn_once(f"TDB_KERNELS={want!r} is not one of auto, native, fbgemm, torch: choosing as for auto")
    return None


@functools.lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
    log.warning("torchrec_dtensor_bridge: %s", message)


_agreed: dict[str, int] = {}
"""Per device type, the choices of the ranks of the last lookup agreement, as :func:`settle` combined them."""

_settled: dict[tuple[object, ...], Impl] = {}
"""The choices made since the last agreement that changed :data:`_agreed` (see the module docstring)."""


def _remembered(what: tuple[object, ...], device: torch.device, decide: Callable[[], Impl]) -> Impl:
    """``decide()`` for ``what``, remembered once the device type's choices are settled."""
    code = _agreed.get(device.type)
    if code is None:
        return decide()
    key = (*what, device.type, code, os.environ.get("TDB_KERNELS"), os.environ.get("TDB_NATIVE_KERNELS"))
    found = _settled.get(key)
    if found is None:
        found = _settled[key] = decide()
    return found


def _local(impl: Impl) -> bool:
    """This process has ``impl`` and may run it (a forced implementation is the only one it may run)."""
    if impl is Impl.TORCH:
        return True
    forced = _forced()
    if forced is not None and forced is not impl:
        return False
    if impl is Impl.NATIVE:
        return os.environ.get("TDB_NATIVE_KERNELS", "1") != "0" and native.kernel() is not None
    return fbgemm.available()


def _lacks(impl: Impl, device: torch.device) -> str | None:
    """Why ``impl`` cannot run here (``None`` when it can): not in this process, or not on every rank of the
    last agreement."""
    if impl is Impl.TORCH:
        return None
    if impl is Impl.NATIVE and not _local(impl):
        return f"ours: the extension is {native.missing() or 'not loaded'}"
    if impl is Impl.FBGEMM and not _local(impl):
        return "fbgemm: fbgemm_gpu is not installed or does not load"
    code = _agreed.get(device.type)
    if code is not None and not code >> (0 if impl is Impl.NATIVE else 1) & 1:
        return f"{_NAMES[impl]}: another rank of the last lookup lacks it"
    return None


_NAMES = {Impl.NATIVE: "ours", Impl.FBGEMM: "fbgemm", Impl.TORCH: "torch"}
_DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def _pick(work: str, dtype: torch.dtype, device: torch.device, cannot: dict[Impl, str | None],
          nbytes: int | None = None) -> Choice:
    """Steps 1-3 on the CPU for a call over ``nbytes`` bytes of tables: ``cannot`` gives, for ours and fbgemm's,
    why it cannot do the work (``None``: it can)."""
    reasons = {impl: why if why is not None else _lacks(impl, device) for impl, why in cannot.items()}
    forced = _forced()
    if forced is not None:
        if forced is Impl.TORCH or (forced in reasons and reasons[forced] is None):
            return Choice(forced, f"override: TDB_KERNELS={forced.name.lower()}")
        return Choice(Impl.TORCH, f"override: TDB_KERNELS={forced.name.lower()}, but {reasons.get(forced)}")
    ready = [impl for impl in (Impl.NATIVE, Impl.FBGEMM) if impl in reasons and reasons[impl] is None]
    if len(ready) == 2:
        rule = rule_for(work, dtype)
        impl = rule.pick(nbytes)
        return Choice(impl, f"rule for {work} {_DTYPE_NAMES[dtype]}: {rule.describe()} (fbgemm's time / ours: "
                            f"{rule.figures})")
    lacking = "; ".join(r for r in reasons.values() if r is not None)
    return Choice(ready[0] if ready else Impl.TORCH, lacking)


def rule_for(work: str, dtype: torch.dtype) -> Rule:
    """The :class:`Rule` of ``work`` (``pool``, ``update_<kind>``) on tables of ``dtype``."""
    return RULE.get((work, _DTYPE_NAMES.get(dtype, "")), _UNLISTED)


def _large(work: str, dtype: torch.dtype, nbytes: int | None) -> bool:
    """Which side of its rule's threshold a call over ``nbytes`` bytes of tables is (what a remembered choice
    is kept under)."""
    return rule_for(work, dtype).pick(nbytes) is Impl.NATIVE


def _on_device(device: torch.device, fbgemm_cannot: str | None) -> Choice:
    """Step 4: fbgemm's CUDA kernels where they can do the work (``fbgemm_cannot`` is ``None``), fbgemm's CUDA
    build is installed, every rank of the last agreement has it and ``$TDB_KERNELS`` allows it; torch's
    otherwise (ours are CPU-only)."""
    forced = _forced()
    if device.type != "cuda":
        return Choice(Impl.TORCH, f"no kernels of ours or fbgemm's on {device.type}")
    if forced not in (None, Impl.FBGEMM):
        return Choice(Impl.TORCH, f"override: TDB_KERNELS={forced.name.lower()}, and ours are CPU-only")
    if fbgemm_cannot is not None:
        return Choice(Impl.TORCH, fbgemm_cannot)
    if not fbgemm.cuda_available():
        return Choice(Impl.TORCH, "fbgemm: fbgemm_gpu's CUDA build is not installed or does not load")
    code = _agreed.get(device.type)
    if code is not None and not code >> 1 & 1:
        return Choice(Impl.TORCH, "fbgemm: another rank of the last lookup lacks it")
    return Choice(Impl.FBGEMM, "fbgemm's CUDA kernels (ours are CPU-only)")


def _fbgemm_cpu_cannot(dtype: torch.dtype, *, stochastic: bool = False) -> str | None:
    """Why fbgemm's CPU kernels cannot take tables of ``dtype`` (an update asking for ``stochastic`` rounding)."""
    if dtype not in (torch.float32, torch.float16):
        return f"fbgemm: its CPU kernels take no {_DTYPE_NAMES.get(dtype, str(dtype))} tables"
    if stochastic and dtype != torch.float32:
        return "fbgemm: its CPU kernels round to nearest only (stochastic rounding asked)"
    return None


def explain_pool(device: torch.device, dtype: torch.dtype = torch.float32, nbytes: int | None = None) -> Choice:
    """The implementation of ``tdb::pool_sum`` on ``device`` over ``nbytes`` bytes of tables of ``dtype`` (``None``:
    tables past every threshold of the rule), and why."""
    if dtype not in native.DTYPES:
        return Choice(Impl.TORCH, f"{dtype} tables: torch's ops only")
    if device.type != "cpu":
        return _on_device(device, None)
    return _pick("pool", dtype, device, {Impl.NATIVE: None, Impl.FBGEMM: _fbgemm_cpu_cannot(dtype)}, nbytes)


def pool_impl(device: torch.device, dtype: torch.dtype = torch.float32, nbytes: int | None = None) -> Impl:
    """:func:`explain_pool`'s implementation (remembered once the ranks settled)."""
    return _remembered(("pool", dtype, _large("pool", dtype, nbytes)), device,
                       lambda: explain_pool(device, dtype, nbytes).impl)


def explain_dense(device: torch.device) -> Choice:
    """The implementation of ``tdb::pool_sum_backward`` (the dense weight gradient) on ``device``, and why:
    fbgemm's (ours have none)."""
    if device.type != "cpu":
        return _on_device(device, None)
    return _pick("dense", torch.float32, device, {Impl.NATIVE: "ours: no dense gradient kernel", Impl.FBGEMM: None})


def dense_impl(device: torch.device) -> Impl:
    """:func:`explain_dense`'s implementation (remembered once the ranks settled)."""
    return _remembered(("dense",), device, lambda: explain_dense(device).impl)


def _kind(kind: OptimKind | str) -> OptimKind:
    found = REGISTERED.get(kind if isinstance(kind, str) else kind.name)
    if found is None or not (isinstance(kind, str) or found is kind):
        found = lookup(kind)  # raises, naming the kinds there are
    return found


def explain_update(device: torch.device, kind: OptimKind | str, weight_decay: float,
                   dtype: torch.dtype = torch.float32, *, stochastic: bool = False,
                   nbytes: int | None = None) -> Choice:
    """The implementation of ``tdb::sparse_update`` for optimizer ``kind`` on ``device`` over ``nbytes`` bytes of
    tables of ``dtype`` (``stochastic``: half-precision rows rounded stochastically; ``nbytes=None``: past every
    threshold of the rule), and why; :attr:`Impl.TORCH` means no one-pass kernel (the caller runs the
    optimizer's torch-op math on the touched rows).

    Raises:
        ValueError: for a kind the registry does not know.
    """
    found = _kind(kind)
    if dtype not in native.DTYPES:
        return Choice(Impl.TORCH, f"{dtype} tables: the optimizer's torch-op math")
    if device.type != "cpu":  # weight decay: fbgemm's SGD and Adagrad have none; the torch-op math applies it
        cannot = None if found.fbgemm_cuda else f"fbgemm: no CUDA kernel for {found.name!r}"
        if cannot is None and weight_decay and found.fbgemm_cuda:
            cannot = "fbgemm: its kernels apply no weight decay to this kind"
        return _on_device(device, cannot)
    if found.native is None and not found.fbgemm_cpu:
        return Choice(Impl.TORCH, f"no kernel lists {found.name!r}: its torch-op math")
    ours = None if found.native is not None else f"ours: no kernel for {found.name!r}"
    theirs = (f"fbgemm: no CPU kernel for {found.name!r}" if not found.fbgemm_cpu
              else "fbgemm: its CPU kernels ignore weight decay" if weight_decay
              else _fbgemm_cpu_cannot(dtype, stochastic=stochastic))
    return _pick(f"update_{found.name}", dtype, device, {Impl.NATIVE: ours, Impl.FBGEMM: theirs}, nbytes)


def update_impl(device: torch.device, kind: OptimKind | str, weight_decay: float,
                dtype: torch.dtype = torch.float32, *, stochastic: bool = False, nbytes: int | None = None) -> Impl:
    """:func:`explain_update`'s implementation (remembered once the ranks settled).

    Raises:
        ValueError: for a kind the registry does not know.
    """
    found = _kind(kind)
    stochastic = stochastic and dtype in (torch.float16, torch.bfloat16)  # fp32 rows are not rounded
    large = _large(f"update_{found.name}", dtype, nbytes)
    return _remembered(("update", found, bool(weight_decay), dtype, stochastic, large), device,
                       lambda: explain_update(device, found, weight_decay, dtype, stochastic=stochastic,
                                          nbytes=nbytes).impl)


def for_weights(which: Impl, device: torch.device, dtype: torch.dtype, *, stochastic: bool = False) -> Impl:
    """``which`` (a choice for fp32 tables) for tables of ``dtype``; ``stochastic``: an update that rounds
    half-precision rows stochastically.

    fbgemm's CPU kernels take fp16 tables, not bf16, and round an update to nearest whatever they are asked
    (fbgemm_gpu-cpu 1.8 ignores ``stochastic_rounding``): work they cannot do as asked goes to ours where
    every rank has them (else torch's). fbgemm's CUDA kernels take fp16 and bf16 tables (its CUDA code generator
    dispatches both).
    """
    if dtype == torch.float32 or which is Impl.TORCH:
        return which
    if dtype not in native.DTYPES:
        return Impl.TORCH
    if device.type == "cpu" and which is Impl.FBGEMM and _fbgemm_cpu_cannot(dtype, stochastic=stochastic):
        return Impl.NATIVE if _lacks(Impl.NATIVE, device) is None else Impl.TORCH
    return which


def choice_code(device: torch.device) -> int:
    """What this process can run on ``device``, as one integer for a lookup's agreement: bit 0 our kernels
    (the extension loaded, and not excluded by ``$TDB_KERNELS``), bit 1 fbgemm's. Off the CPU: bit 1 alone,
    fbgemm's CUDA build installed. The rule needs nothing else: it is the same on every rank."""
    if device.type != "cpu":
        return int(device.type == "cuda" and fbgemm.cuda_available() and _forced() in (None, Impl.FBGEMM)) << 1
    return int(_local(Impl.NATIVE)) | int(_local(Impl.FBGEMM)) << 1


def settle(device: torch.device, codes: list[int]) -> None:
    """Every rank's :func:`choice_code` (in rank order), from a lookup's agreement: until the next one, an
    implementation runs only when every rank has it, so that every rank runs the same kernels. Choices
    remembered under other codes are forgotten."""
    both = 3
    for c in codes:
        both &= c
    if _agreed.get(device.type) != both:
        _settled.clear()
    _agreed[device.type] = both
