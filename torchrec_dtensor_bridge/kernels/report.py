"""What runs each kind of kernel work in this install, and why: ``python -m torchrec_dtensor_bridge kernels``.

In the spirit of ``torch.utils.collect_env``: the versions that decide (torch, fbgemm_gpu, this package's
extension), the machine (CPU model, torch's threads) and the settings in effect (``TDB_KERNELS``,
``TDB_NATIVE_KERNELS``), then one line per kind of work, dtype and device: what runs it and why (the rule,
an override, a missing extension or fbgemm_gpu, what a kernel cannot do). It asks :mod:`.choose` as the ops
ask it, so what it prints is what a process of this install runs (before a lookup's ranks agree: a rank
that lacks something makes every rank of its lookups do without it); nothing is measured.

Steps of :func:`report`:

1. :func:`versions`: the installed versions and settings.
2. :func:`lines`: per device (CPU, CUDA), dtype and kind of work (the pooled sum, each registered optimizer
   kind's fused update, the dense gradient, a checkpoint's row digests), :mod:`.choose`'s choice for small
   and for large tables; a rule with a size threshold shows both sides.

Example::

    >>> print(format_report())  # doctest: +SKIP
    torch                 2.13.0+cpu (CUDA: none)
    ...
    pool                  fp32          cpu   ours     rule: ours (pool fp32: ...)
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
from dataclasses import asdict, dataclass

import torch

from ..optim_kinds import REGISTERED
from . import choose, fbgemm, native
from .choose import Choice, Impl

__all__ = ["Line", "format_report", "lines", "report", "versions"]

_NAMES = {Impl.NATIVE: "ours", Impl.FBGEMM: "fbgemm", Impl.TORCH: "torch"}
_DTYPES = {"fp32": (torch.float32, False), "fp16": (torch.float16, True),
           "fp16 nearest": (torch.float16, False), "bf16": (torch.bfloat16, True)}
"""Per label, a dtype and whether its updates round stochastically (the default for half-precision tables)."""
_SMALL = 1 << 20  # bytes: a table inside every cache (the small side of every rule)


@dataclass(frozen=True)
class Line:
    """One kind of work on one device and dtype: what runs it (``ours``, ``fbgemm``, ``torch``, or the two
    sides of a size threshold) and why."""

    work: str
    dtype: str
    device: str
    runs: str
    why: str


def _fbgemm_version() -> str:
    for dist in ("fbgemm-gpu-cpu", "fbgemm-gpu", "fbgemm-gpu-nightly", "fbgemm-gpu-genai"):
        try:
            found = f"{importlib.metadata.version(dist)} ({dist})"
        except importlib.metadata.PackageNotFoundError:
            continue
        state = ("CUDA kernels" if fbgemm.cuda_available() else "CPU kernels" if fbgemm.available()
                 else "installed but does not load")
        return f"{found}, {state}"
    return "not installed"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def versions() -> dict[str, str]:
    """Step 1: the versions and settings that decide what runs, by name."""
    why = native.missing()
    extension = (f"tdb_native version {native.VERSION} ({native.extension_file()})" if why is None
                 else f"{why}; {native.BUILD_HINT}")
    try:
        package = importlib.metadata.version("torchrec_dtensor_bridge")
    except importlib.metadata.PackageNotFoundError:
        package = "not installed (run from a source tree)"
    return {
        "torchrec_dtensor_bridge": package,
        "extension": extension,
        "torch": f"{torch.__version__} (CUDA: {torch.version.cuda or 'none'}, "
                 f"{'a device' if torch.cuda.is_available() else 'no device'})",
        "fbgemm_gpu": _fbgemm_version(),
        "python": platform.python_version(),
        "cpu": f"{_cpu_model()} ({platform.machine()}), torch threads {torch.get_num_threads()}",
        "TDB_KERNELS": os.environ.get("TDB_KERNELS", "auto (unset)"),
        "TDB_NATIVE_KERNELS": os.environ.get("TDB_NATIVE_KERNELS", "1 (unset)"),
    }


def _line(work: str, dtype: str, device: torch.device, small: Choice, large: Choice) -> Line:
    if small.impl is large.impl:
        return Line(work, dtype, device.type, _NAMES[large.impl], large.why)
    return Line(work, dtype, device.type, f"{_NAMES[small.impl]} (small) / {_NAMES[large.impl]} (large)", large.why)


def lines() -> list[Line]:
    """Step 2: what runs each kind of work, per device and dtype, and why."""
    out: list[Line] = []
    for device in (torch.device("cpu"), torch.device("cuda")):
        for label, (dtype, stochastic) in _DTYPES.items():
            if label != "fp16 nearest":
                out.append(_line("pool", label, device, choose.explain_pool(device, dtype, _SMALL),
                                 choose.explain_pool(device, dtype)))
            for kind in REGISTERED.values():
                small, large = (choose.explain_update(device, kind, 0.0, dtype, stochastic=stochastic, nbytes=n)
                                for n in (_SMALL, None))
                out.append(_line(f"update {kind.name}", label, device, small, large))
        dense = choose.explain_dense(device)
        out.append(_line("dense gradient", "fp32", device, dense, dense))
        ours = device.type == "cpu" and native.kernel() is not None
        out.append(Line("row digests", "any", device.type, "ours" if ours else "torch",
                        "the extension's row_digests" if ours else
                        "torch ops where the rows are" if device.type != "cpu" else
                        f"torch ops: the extension is {native.missing()}"))
    return out


def report() -> dict[str, object]:
    """:func:`versions` and :func:`lines`, as one JSON-ready dict."""
    return {"versions": versions(), "kernels": [asdict(line) for line in lines()]}


def format_report(*, as_json: bool = False) -> str:
    """:func:`report` as text (aligned columns), or as JSON."""
    if as_json:
        return json.dumps(report(), indent=2)
    head = [f"{k:<24}{v}" for k, v in versions().items()]
    rows = [(line.work, line.dtype, line.device, line.runs, line.why) for line in lines()]
    names = ("work", "dtype", "device", "runs")
    widths = [max(len(names[i]), *(len(r[i]) for r in rows)) for i in range(4)]
    title = "  ".join(h.ljust(w) for h, w in zip(names, widths)) + "  why"
    table = ["  ".join(r[i].ljust(widths[i]) for i in range(4)) + "  " + r[4] for r in rows]
    return "\n".join([*head, "", title, *table])
