"""Which implementation runs each kernel op, per device: the one place that decides.

Steps of a choice (:func:`pool_impl`, :func:`update_impl`, :func:`dense_impl`):

1. ``$TDB_KERNELS`` forces an implementation (``native``, ``fbgemm`` or ``torch``; ``auto``, the default,
   lets the steps below choose); ``TDB_NATIVE_KERNELS=0`` means ``fbgemm``. On CUDA, where ours do not
   run, fbgemm's CUDA kernels run unless forced otherwise, and torch's where fbgemm's cannot do the work.
2. What is available: this package's C kernels (:mod:`.native`, when they could be built), fbgemm's
   (:mod:`.fbgemm`, when installed), torch's (always; the reference math).
3. Where both C kernels can do the work, the one measured faster on THIS machine: a one-time calibration
   per kernel kind (:func:`calibrated`), both run side by side on the same synthetic work, interleaved,
   the fastest runs compared; the result is kept in the kernel cache, keyed by the library, fbgemm's version,
   the CPU model and the thread count, so other processes of the machine reuse it. Pooling over a storage of
   256 MiB or more is timed again on the process's own first calls there (:func:`pool_trial`), whose verdict
   then stands for the process: which kernel pools faster depends on the table's size.

A lookup's ranks agree on the choices (:func:`choice_code` travels in the lookup's agreement, :func:`settle`):
an implementation runs only where every rank has it (a rank that forces one offers that one alone: forcing
``torch`` on one rank makes every rank run torch's), and the first rank's calibration decides between the
two C kernels, so every rank runs the same kernels. Once settled, a choice is remembered (per op, device
type, optimizer kind, weight decay or not, and ``$TDB_KERNELS`` / ``$TDB_NATIVE_KERNELS``): a call then
consults nothing else; an agreement that settles on other codes forgets every remembered choice.

Which kinds an update can run with is the kinds' registry's (:mod:`...optim_kinds`): ours for a kind with a
``native`` code, fbgemm's for one with ``fbgemm_cpu`` (``fbgemm_cuda`` on CUDA); a kind neither lists
gets :attr:`Impl.TORCH`: its torch-op math on the touched rows.
"""

from __future__ import annotations

import enum
import functools
import json
import logging
import os
import platform
import statistics
import time
from collections.abc import Callable

import torch

from ..optim_kinds import REGISTERED, Hyper, OptimKind, StateKind, WeightDecayMode, lookup
from . import build, fbgemm, native
from .args import Batch, State, Tables

__all__ = ["Impl", "calibrated", "choice_code", "dense_impl", "for_weights", "pool_impl", "pool_timed", "pool_trial",
           "settle", "update_impl"]

log = logging.getLogger(__name__)


class Impl(enum.IntEnum):
    """An implementation; the order is the fallback order (ranks that disagree fall back to the lowest)."""

    TORCH = 0
    FBGEMM = 1
    NATIVE = 2


def _forced() -> Impl | None:
    want = os.environ.get("TDB_KERNELS", "auto").lower()
    if want == "auto":
        return Impl.FBGEMM if os.environ.get("TDB_NATIVE_KERNELS", "1") == "0" else None
    if want.upper() in Impl.__members__:
        return Impl[want.upper()]
    _warn_once(f"TDB_KERNELS={want!r} is not one of auto, native, fbgemm, torch: choosing as for auto")
    return None


@functools.lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
    log.warning("torchrec_dtensor_bridge: %s", message)


def _calibrated() -> list[str]:
    """The work both C implementations can do: the pooled sum, and the update of each kind both list (in the
    registry's order); a machine's calibration chooses between them for each."""
    both = [k.name for k in REGISTERED.values() if k.native is not None and k.fbgemm_cpu]
    return ["pool", "pool_fp16", *(f"update_{k}" for k in both), *(f"update_{k}_fp16" for k in both)]


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
    if impl is Impl.FBGEMM:
        return fbgemm.available()
    return False


def _available(impl: Impl, device: torch.device) -> bool:
    """Built here, and (after an agreement) on every rank of it."""
    code = _agreed.get(device.type)
    on_all = code is None or impl is Impl.TORCH or bool(code >> (0 if impl is Impl.NATIVE else 1) & 1)
    return on_all and _local(impl)


def _prefers_native(what: str, device: torch.device) -> bool:
    code = _agreed.get(device.type)
    if code is None:
        return calibrated(what) is Impl.NATIVE
    return bool(code >> (2 + _calibrated().index(what)) & 1)


def _on_device(device: torch.device, fbgemm_can: bool) -> Impl:
    """Off the CPU: fbgemm's CUDA kernels where they can do the work (``fbgemm_can``), fbgemm's CUDA build
    is installed, every rank of the last agreement has it and ``$TDB_KERNELS`` allows it; torch otherwise
    (ours are CPU-only)."""
    if device.type != "cuda" or not fbgemm_can or _forced() not in (None, Impl.FBGEMM):
        return Impl.TORCH
    code = _agreed.get(device.type)
    on_all = code is None or bool(code >> 1 & 1)
    return Impl.FBGEMM if on_all and fbgemm.cuda_available() else Impl.TORCH


def _pick(candidates: list[Impl], what: str, device: torch.device) -> Impl:
    """Steps 1-3 over ``candidates`` (the implementations that can do the work)."""
    if device.type != "cpu":
        return _on_device(device, Impl.FBGEMM in candidates)
    forced = _forced()
    if forced is not None:
        return forced if forced in candidates and _available(forced, device) else Impl.TORCH
    ready = [c for c in candidates if _available(c, device)]
    if Impl.NATIVE in ready and Impl.FBGEMM in ready:
        return Impl.NATIVE if _prefers_native(what, device) else Impl.FBGEMM
    return ready[0] if ready else Impl.TORCH


def pool_impl(device: torch.device, dtype: torch.dtype = torch.float32) -> Impl:
    """The implementation of ``tdb::pool_sum`` on ``device`` for tables of ``dtype`` (fp16 tables calibrated on
    their own: the two C kernels read half-precision rows differently)."""
    what = _named("pool", dtype)
    return _remembered((what, dtype), device,
                       lambda: for_weights(_pick([Impl.NATIVE, Impl.FBGEMM], what, device), device, dtype))


def dense_impl(device: torch.device) -> Impl:
    """The implementation of ``tdb::pool_sum_backward`` (the dense weight gradient) on ``device``."""
    return _remembered(("dense",), device, lambda: _pick([Impl.FBGEMM], "dense", device))


def update_impl(device: torch.device, kind: OptimKind | str, weight_decay: float,
                dtype: torch.dtype = torch.float32, *, stochastic: bool = False) -> Impl:
    """The implementation of ``tdb::sparse_update`` for optimizer ``kind`` on ``device`` over tables of
    ``dtype`` (``stochastic``: half-precision rows rounded stochastically); :attr:`Impl.TORCH` means no
    one-pass kernel (the caller runs the optimizer's torch-op math on the touched rows).

    Raises:
        ValueError: for a kind the registry does not know.
    """
    found = REGISTERED.get(kind if isinstance(kind, str) else kind.name)
    if found is None or not (isinstance(kind, str) or found is kind):
        found = lookup(kind)  # raises, naming the kinds there are
    stochastic = stochastic and dtype in (torch.float16, torch.bfloat16)  # fp32 rows are not rounded
    return _remembered(("update", found, bool(weight_decay), dtype, stochastic), device,
                       lambda: for_weights(_update_impl(device, found, bool(weight_decay), dtype), device, dtype,
                                           stochastic=stochastic))


def _update_impl(device: torch.device, kind: OptimKind, decayed: bool, dtype: torch.dtype = torch.float32) -> Impl:
    """fp16 tables calibrated on their own (``update_<kind>_fp16``): the two C kernels' fp16 updates differ in
    speed otherwise than their fp32 ones (fbgemm's converts every element on its own)."""
    if device.type != "cpu":  # weight decay: fbgemm's SGD and Adagrad have none; the torch-op math applies it
        return _on_device(device, kind.fbgemm_cuda and not decayed)
    candidates = [Impl.NATIVE] if kind.native is not None else []
    if kind.fbgemm_cpu and not decayed:  # fbgemm-gpu-cpu ignores weight decay
        candidates.append(Impl.FBGEMM)
    if not candidates:  # no kernel lists the kind
        return Impl.TORCH
    return _pick(candidates, _named(f"update_{kind.name}", dtype), device)


def _named(work: str, dtype: torch.dtype) -> str:
    """The calibrated work's name for tables of ``dtype`` (:func:`_calibrated`: fp16 measured on its own)."""
    return f"{work}_fp16" if dtype == torch.float16 else work


def for_weights(which: Impl, device: torch.device, dtype: torch.dtype, *, stochastic: bool = False) -> Impl:
    """``which`` (a choice for fp32 tables) for tables of ``dtype`` (what :func:`pool_impl` and
    :func:`update_impl` apply); ``stochastic``: an update that rounds half-precision rows stochastically.

    fbgemm's CPU kernels take fp16 tables, not bf16, and round an update to nearest whatever they are asked
    (fbgemm_gpu-cpu 1.8 ignores ``stochastic_rounding``): work they cannot do as asked goes to ours where
    every rank has them (else torch's). fbgemm's CUDA kernels take fp16 and bf16 tables (its CUDA code generator
    dispatches both). The same inputs give the same answer on every rank of an agreement.
    """
    if dtype == torch.float32 or which is Impl.TORCH:
        return which
    if dtype not in native.DTYPES:
        return Impl.TORCH
    if device.type != "cpu":
        return which
    if which is Impl.FBGEMM and (dtype != torch.float16 or stochastic):
        return Impl.NATIVE if _available(Impl.NATIVE, device) else Impl.TORCH
    return which


def choice_code(device: torch.device) -> int:
    """What this process would run on ``device``, as one integer for a lookup's agreement: bit 0 the native
    kernels built, bit 1 fbgemm's installed, then one bit per calibrated work (:func:`_calibrated`):
    ours measured faster here. Off the CPU: bit 1 alone, fbgemm's CUDA build installed."""
    if device.type != "cpu":
        return int(device.type == "cuda" and fbgemm.cuda_available()) << 1
    code = int(_local(Impl.NATIVE)) | int(_local(Impl.FBGEMM)) << 1
    if code == 3 and _forced() is None:
        for k, what in enumerate(_calibrated()):
            code |= int(calibrated(what) is Impl.NATIVE) << (2 + k)
    return code


def settle(device: torch.device, codes: list[int]) -> None:
    """Every rank's :func:`choice_code` (in rank order), from a lookup's agreement: until the next one, an
    implementation runs only when every rank has it, and where both C kernels can do the work, the first
    rank's calibration decides, so that every rank runs the same kernels. Choices remembered under other
    codes are forgotten."""
    both = 3
    for c in codes:
        both &= c
    code = both | (codes[0] & ~3 if codes else 0)
    if _agreed.get(device.type) != code:
        _settled.clear()
    _agreed[device.type] = code


# --- step 3: calibration -------------------------------------------------------------------------------------

_ROWS, _DIM, _BAGS, _PER_BAG, _REPS = 1 << 18, 128, 4096, 20, 9


def _record_path() -> str:
    lib = native.kernel()
    ident = "-".join((lib.path.stem if lib is not None else "none", getattr(fbgemm._module(), "__version__", "?"),
                      str(torch.get_num_threads())))
    home = lib.path.parent if lib is not None else build.cache_dir()  # beside the library: a trusted directory
    return str(home / f"calibration-{ident}.json")


# --- pooling timed on the work itself ---------------------------------------------------------------------------
# The two C kernels pool with the same bits, and which is faster depends on the table: the synthetic calibration
# (128 MiB) can disagree with tables of GiBs (BENCHMARKS.md: row-wise training step). A process's first pooled
# sums over a storage of at least _TRIAL_BYTES alternate the two kernels, timed; the other kernel replaces the
# calibration's verdict for this process when its median is at least _TRIAL_MARGIN faster (a busy machine's
# noise alone does not flip it; its lookups' next agreement settles on the first rank's, as always).
_TRIAL_BYTES = 256 << 20
_TRIAL_CALLS = 7  # per kernel; the first of each is not counted (warm-up)
_TRIAL_MARGIN = 0.05
_trials: dict[str, dict[Impl, list[float]]] = {}
_tried: dict[str, Impl] = {}


def pool_trial(device: torch.device, dtype: torch.dtype, storage_bytes: int, chosen: Impl) -> Impl | None:
    """The kernel to time on this pooled sum (``None``: no trial; run ``chosen``): while this process's trial of
    ``dtype``'s pooling is running, on the CPU, over a storage of at least 256 MiB, with both C kernels chosen
    between by calibration (not forced)."""
    what = _named("pool", dtype)
    if (what in _tried or device.type != "cpu" or storage_bytes < _TRIAL_BYTES
            or chosen not in (Impl.NATIVE, Impl.FBGEMM) or _forced() is not None
            or not (_available(Impl.NATIVE, device) and _available(Impl.FBGEMM, device))
            or for_weights(Impl.FBGEMM, device, dtype) is not Impl.FBGEMM):
        return None
    times = _trials.setdefault(what, {Impl.NATIVE: [], Impl.FBGEMM: []})
    return Impl.NATIVE if len(times[Impl.NATIVE]) <= len(times[Impl.FBGEMM]) else Impl.FBGEMM


def pool_timed(which: Impl, dtype: torch.dtype, seconds: float) -> None:
    """Record a trial's time (:func:`pool_trial`); once both kernels ran :data:`_TRIAL_CALLS` times, this process's
    choice for ``dtype``'s pooling: the calibration's, unless the other kernel's median is at least
    :data:`_TRIAL_MARGIN` (5 %) below it."""
    what = _named("pool", dtype)
    times = _trials.get(what)
    if times is None or what in _tried:
        return
    times[which].append(seconds)
    if all(len(t) >= _TRIAL_CALLS for t in times.values()):
        median = {k: statistics.median(t[1:]) for k, t in times.items()}
        calibrated = _calibrated_here(what)
        other = Impl.FBGEMM if calibrated is Impl.NATIVE else Impl.NATIVE
        _tried[what] = other if median[other] <= (1 - _TRIAL_MARGIN) * median[calibrated] else calibrated
        log.info("torchrec_dtensor_bridge: %s on this job's tables: ours %.2f ms, fbgemm %.2f ms: %s", what,
                 median[Impl.NATIVE] * 1e3, median[Impl.FBGEMM] * 1e3, _tried[what].name.lower())
        _settled.clear()


def calibrated(what: str) -> Impl:
    """:attr:`Impl.NATIVE` or :attr:`Impl.FBGEMM`, whichever ran ``what`` faster on this machine (step 3); for
    pooling, on this process's own tables once it timed both there (:func:`pool_trial`)."""
    tried = _tried.get(what)
    return tried if tried is not None else _calibrated_here(what)


@functools.lru_cache(maxsize=None)
def _calibrated_here(what: str) -> Impl:
    """:attr:`Impl.NATIVE` or :attr:`Impl.FBGEMM`, whichever ran ``what`` faster on this machine's synthetic work."""
    path, model = _record_path(), build.cpu_model() or platform.machine()
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
        if record.get("cpu") == model and what in record.get("choices", {}):
            return Impl[record["choices"][what]]
    except (OSError, ValueError, KeyError):
        record = {}
    try:
        ours, theirs = _measure(what)
    except Exception as e:  # noqa: BLE001 - a failed measurement must not fail (or desynchronise) a lookup
        log.warning("torchrec_dtensor_bridge: kernel calibration of %s failed (%s): using fbgemm's", what, e)
        return Impl.FBGEMM
    pick = Impl.NATIVE if ours <= theirs else Impl.FBGEMM
    log.info("torchrec_dtensor_bridge: %s: ours %.2f ms, fbgemm %.2f ms: %s", what, ours * 1e3, theirs * 1e3,
             pick.name.lower())
    choices = dict(record.get("choices", {})) if record.get("cpu") == model else {}
    choices[what] = pick.name
    try:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({"cpu": model, "choices": choices}, f)
        os.replace(tmp, path)
    except OSError as e:  # a read-only cache: measured again by the next process
        log.warning("torchrec_dtensor_bridge: kernel calibration not saved (%s)", e)
    return pick


def _measure(what: str) -> tuple[float, float]:
    """Seconds of ours and fbgemm's on one synthetic table (128 MiB: out of cache), interleaved: the fastest of
    each (other work on the machine only ever adds time)."""
    gen = torch.Generator().manual_seed(0)
    half = what.endswith("_fp16")
    weights = torch.rand(_ROWS * _DIM, generator=gen, dtype=torch.float16 if half else torch.float32)
    ids = torch.randint(0, _ROWS, (_BAGS * _PER_BAG,), generator=gen)
    offsets = torch.arange(0, ids.numel() + 1, _PER_BAG)
    grad = torch.rand(_BAGS, _DIM, generator=gen) * 1e-3
    tables, batch = Tables(weights, [0], [_DIM], [_ROWS]), Batch(ids, offsets)
    kernel = native.kernel()
    assert kernel is not None, "calibrated only where both C kernels are"
    if what in ("pool", "pool_fp16"):
        jobs: dict[Impl, Callable[[], object]] = {Impl.NATIVE: lambda: kernel.pool_tables(tables, batch),
                                                  Impl.FBGEMM: lambda: fbgemm.pool_sum(tables, batch)}
    else:
        kind = lookup(what.removeprefix("update_").removesuffix("_fp16"))
        m1, m2 = [torch.zeros(_ROWS if s.shape is StateKind.ROW else _ROWS * _DIM) for s in kind.tensor_states
                  ] + [None] * (2 - len(kind.tensor_states))
        state = State(m1, [0] if m1 is not None else [], m2, [0] if m2 is not None else [], step=1)
        hyper = Hyper(kind, 0.01, 1e-8, 0.0, WeightDecayMode.NONE, 0.9, 0.999, False)  # fbgemm's rounding
        jobs = {Impl.NATIVE: lambda: kernel.update_tables(tables, batch, grad, state, hyper),
                Impl.FBGEMM: lambda: fbgemm.update(tables, batch, grad, state, hyper)}
    times: dict[Impl, list[float]] = {k: [] for k in jobs}
    for _ in range(_REPS):
        for which, job in jobs.items():
            t0 = time.perf_counter()
            job()
            times[which].append(time.perf_counter() - t0)
    return min(times[Impl.NATIVE]), min(times[Impl.FBGEMM])
