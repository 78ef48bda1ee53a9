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
   the CPU model and the thread count, so other processes of the machine reuse it.

A lookup's ranks agree on the choices (:func:`choice_code` travels in the lookup's agreement, :func:`settle`):
an implementation runs only where every rank has it, and the first rank's calibration decides between the
two C kernels, so every rank runs the same kernels.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import platform
import time
from collections.abc import Callable

import torch

from . import build, fbgemm, impl, native
from .impl import Impl

__all__ = ["Impl", "calibrated", "choice_code", "dense_impl", "pool_impl", "settle", "update_impl"]

log = logging.getLogger(__name__)


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


_CALIBRATED = ("pool", "update_sgd", "update_rowwise_adagrad", "update_adagrad")
"""The kernel kinds both C implementations have: the ones a machine's calibration chooses between."""

_agreed: dict[str, int] = {}
"""Per device type, the choices of the ranks of the last lookup agreement, as :func:`settle` combined them."""


def _local(impl: Impl) -> bool:
    if impl is Impl.NATIVE:
        return os.environ.get("TDB_NATIVE_KERNELS", "1") != "0" and native.kernel() is not None
    if impl is Impl.FBGEMM:
        return fbgemm.available()
    return True


def _available(impl: Impl, device: torch.device) -> bool:
    """Built here, and (after an agreement) on every rank of it."""
    code = _agreed.get(device.type)
    on_all = code is None or impl is Impl.TORCH or bool(code >> (0 if impl is Impl.NATIVE else 1) & 1)
    return on_all and _local(impl)


def _prefers_native(what: str, device: torch.device) -> bool:
    code = _agreed.get(device.type)
    if code is None:
        return calibrated(what) is Impl.NATIVE
    return bool(code >> (2 + _CALIBRATED.index(what)) & 1)


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


def pool_impl(device: torch.device) -> Impl:
    """The implementation of ``tdb::pool_sum`` on ``device``."""
    return _pick([Impl.NATIVE, Impl.FBGEMM], "pool", device)


def dense_impl(device: torch.device) -> Impl:
    """The implementation of ``tdb::pool_sum_backward`` (the dense weight gradient) on ``device``."""
    return _pick([Impl.FBGEMM], "dense", device)


def update_impl(device: torch.device, kind: str, weight_decay: float) -> Impl:
    """The implementation of ``tdb::sparse_update`` for optimizer ``kind`` on ``device``; :attr:`Impl.TORCH`
    means no one-pass kernel (the caller runs the optimizer's torch-op math on the touched rows)."""
    if device.type != "cpu":  # weight decay: fbgemm's SGD and Adagrad have none; the torch-op math applies it
        return _on_device(device, kind in fbgemm.CUDA_UPDATE_KINDS and not weight_decay)
    candidates = [Impl.NATIVE]
    if kind in fbgemm.UPDATE_KINDS and not weight_decay:  # fbgemm-gpu-cpu ignores weight decay
        candidates.append(Impl.FBGEMM)
    return _pick(candidates, f"update_{kind}", device)


def choice_code(device: torch.device) -> int:
    """What this process would run on ``device``, as one integer for a lookup's agreement: bit 0 the native
    kernels built, bit 1 fbgemm's installed, then one bit per calibrated kind (:data:`_CALIBRATED`):
    ours measured faster here. Off the CPU: bit 1 alone, fbgemm's CUDA build installed."""
    if device.type != "cpu":
        return int(device.type == "cuda" and fbgemm.cuda_available()) << 1
    code = int(_local(Impl.NATIVE)) | int(_local(Impl.FBGEMM)) << 1
    if code == 3 and _forced() is None:
        for k, what in enumerate(_CALIBRATED):
            code |= int(calibrated(what) is Impl.NATIVE) << (2 + k)
    return code


def settle(device: torch.device, codes: list[int]) -> None:
    """Every rank's :func:`choice_code` (in rank order), from a lookup's agreement: until the next one, an
    implementation runs only when every rank has it, and where both C kernels can do the work, the first
    rank's calibration decides, so that every rank runs the same kernels."""
    both = 3
    for c in codes:
        both &= c
    _agreed[device.type] = both | (codes[0] & ~3 if codes else 0)


# --- step 3: calibration -------------------------------------------------------------------------------------

_ROWS, _DIM, _BAGS, _PER_BAG, _REPS = 1 << 18, 128, 4096, 20, 9


def _record_path() -> str:
    lib = native.kernel()
    ident = "-".join((lib.path.stem if lib is not None else "none", getattr(fbgemm._module(), "__version__", "?"),
                      str(torch.get_num_threads())))
    home = lib.path.parent if lib is not None else build.cache_dir()  # beside the library: a trusted directory
    return str(home / f"calibration-{ident}.json")


@functools.lru_cache(maxsize=None)
def calibrated(what: str) -> Impl:
    """:attr:`Impl.NATIVE` or :attr:`Impl.FBGEMM`, whichever ran ``what`` faster on this machine (step 3)."""
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
    weights = torch.rand(_ROWS * _DIM, generator=gen)
    ids = torch.randint(0, _ROWS, (_BAGS * _PER_BAG,), generator=gen)
    offsets = torch.arange(0, ids.numel() + 1, _PER_BAG)
    grad = torch.rand(_BAGS, _DIM, generator=gen) * 1e-3
    kind = what.removeprefix("update_")
    state = None if kind == "sgd" else torch.zeros(_ROWS if kind == "rowwise_adagrad" else _ROWS * _DIM)
    state2 = torch.zeros(_ROWS * _DIM) if kind == "adam" else None

    def run(which: Impl) -> Callable[[], object]:
        if what == "pool":
            return lambda: impl.pool_sum(which, weights, [0], [_DIM], [_ROWS], ids, offsets, None)
        return lambda: impl.sparse_update(which, weights, [0], [_DIM], [_ROWS], grad, ids, offsets, None, kind,
                                              state, [0], state2, [0], 0.01, 1e-8, 0.0, 0, 0.9, 0.999, 1)

    jobs = {Impl.NATIVE: run(Impl.NATIVE), Impl.FBGEMM: run(Impl.FBGEMM)}
    times: dict[Impl, list[float]] = {k: [] for k in jobs}
    for _ in range(_REPS):
        for which, job in jobs.items():
            t0 = time.perf_counter()
            job()
            times[which].append(time.perf_counter() - t0)
    return min(times[Impl.NATIVE]), min(times[Impl.FBGEMM])
