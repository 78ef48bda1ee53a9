"""Lookup and training benchmark on ONE CUDA GPU: ours vs fbgemm-gpu's own TBE module vs ``F.embedding_bag``.

Workload: 8 tables x 4,000,000 rows x 128 fp32 (16 GiB of tables: a GPU-filling
size), 2048 bags of 20 ids per table, ``mode="sum"``, on one GPU (a one-rank NCCL
group). Two copies of the tables are on the device: ours (views of one buffer),
which ``F.embedding_bag`` reads too, and fbgemm's module's own; with the copy
benchmark's 2 GiB that is about 33 GiB at the default size, so a 40 GiB card holds
it. Where the free device memory (``torch.cuda.mem_get_info``) cannot hold two
copies, the optimizers' states, the copy buffers and a margin for workspaces (a
tenth of the free memory, at least 2 GiB), the default ``--rows`` shrinks to what
fits (printed and recorded as ``config.rows``, with ``rows_sized_from``); the peak
allocated memory is recorded as ``peak_gib``.

* ``fbgemm_tbe``: one ``SplitTableBatchedEmbeddingBagsCodegen`` over all tables
  (``EmbeddingLocation.DEVICE``, ``ComputeDevice.CUDA``): fbgemm's fused kernels,
  its optimizer fused into backward;
* ``ours``: ``sharded_embedding_bags`` over the tables as DTensors whose shards are
  views of ONE buffer (as a TorchRec fused module's are), with a
  ``FusedOptimizer`` for the step: one kernel op call per storage;
* ``torch``: ``F.embedding_bag`` once per table over ours' buffer (forward only:
  its dense gradient of 16 GiB is not a training step anyone runs; every forward
  is checked against it before ours trains the buffer);
* ``copy``: ``dst.copy_(src)`` of 1 GiB, the device's copy bandwidth, measured in
  the same run: the limit the lookups' bytes are compared against.

Timed, interleaved (the order alternates every repetition), ``torch.cuda.synchronize()``
around each sample of ``--inner`` calls: the forward (under ``no_grad``), and a
training step (forward, ``(out * g).sum()`` with a fixed random ``g``, backward with
the update) for ``--optimizer`` (``sgd`` = fbgemm's ``EXACT_SGD``, ``rowwise_adagrad``
= ``EXACT_ROWWISE_ADAGRAD``). Checked first: every path's forward equals
``F.embedding_bag`` (``allclose``), and one step of ours and of fbgemm's module
from the same tables leaves the same touched rows. Reported: medians, min..max,
GB/s of gathered rows, and fbgemm / ours (target: ours >= 0.9x fbgemm's module).

Without a CUDA device the script records ``{"skipped": reason}`` under
``lookup_gpu`` in the results file and exits 0, so ``make bench`` runs everywhere
(``--require-cuda``: exits 2 instead, as ``scripts/gpu_check.sh`` runs it).
``--device cpu`` runs the same comparison on CPU (fbgemm's CPU TBE, gloo) at any
size: a check of the script itself, not a GPU figure.

    python scripts/bench_lookup_gpu.py --reps 20 --out bench/results.json
    python scripts/bench_lookup_gpu.py --device cpu --rows 20000 --tables 4 --reps 3   # the script on CPU
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench_results import record

TOL = 1e-4
DEFAULT_ROWS = 4_000_000
COPY_NUMEL = 2**28  # fp32 elements of each of the copy benchmark's two buffers (1 GiB)
GIB = 2**30


def _skip_reason(device: str) -> str | None:
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    return None


def _sync(dev: Any) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize()


def _timed(fn: Callable[[], Any], inner: int, dev: Any) -> float:
    _sync(dev)
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    _sync(dev)
    return (time.perf_counter() - t0) / inner


def _tbe(cfg: dict, tables: list[Any], dev: Any) -> tuple[Any | None, str]:
    """fbgemm's own TBE module over copies of ``tables``, with the optimizer fused into its backward."""
    import torch

    try:
        from fbgemm_gpu.split_embedding_configs import EmbOptimType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice,
            SplitTableBatchedEmbeddingBagsCodegen,
        )
    except Exception as e:  # noqa: BLE001 - any import failure means "not available here"
        return None, f"fbgemm_gpu not available: {type(e).__name__}: {e}"
    where = ((EmbeddingLocation.DEVICE, ComputeDevice.CUDA) if dev.type == "cuda"
             else (EmbeddingLocation.HOST, ComputeDevice.CPU))
    kind = {"sgd": EmbOptimType.EXACT_SGD, "rowwise_adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD}[cfg["optimizer"]]
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(cfg["rows"], cfg["dim"], *where) for _ in tables], optimizer=kind, learning_rate=cfg["lr"],
        eps=cfg["eps"], pooling_mode=PoolingMode.SUM, device=dev,
    )
    with torch.no_grad():
        for w, full in zip(tbe.split_embedding_weights(), tables):
            w.copy_(full)
    return tbe, f"SplitTableBatchedEmbeddingBagsCodegen ({len(tables)} tables, {kind.name})"


def _one_buffer(n: int, rows: int, dim: int, dev: Any, g: Any) -> list[Any]:
    """``n`` tables uniform in [-1, 1), as views of one buffer, back to back (a fused module's storage).

    Filled in place: no temporary of the buffer's size, and no stacked second copy (three copies of 16 GiB
    do not fit a 40 GiB card; ours and fbgemm's module's do).
    """
    import torch

    buffer = torch.empty(n, rows, dim, device=dev)
    buffer.uniform_(-1, 1, generator=g)
    return list(buffer.unbind(0))


def bytes_needed(cfg: dict) -> int:
    """Device bytes the run allocates beyond its margin: two copies of the tables (ours, fbgemm's module), each
    with its optimizer's state (``rowwise_adagrad``: one fp32 per row), and the copy benchmark's buffers."""
    per_row = cfg["dim"] * 4 + (4 if cfg["optimizer"] == "rowwise_adagrad" else 0)
    return 2 * cfg["tables"] * cfg["rows"] * per_row + 2 * COPY_NUMEL * 4


def margin(free: int) -> int:
    """Free memory left for workspaces, the CUDA caching allocator's rounding and NCCL: a tenth, at least 2 GiB."""
    return max(2 * GIB, free // 10)


def rows_that_fit(cfg: dict, free: int) -> int:
    """The most rows per table (up to ``DEFAULT_ROWS``) whose :func:`bytes_needed` fits ``free`` bytes less the
    :func:`margin`; 0 when not even the fixed buffers fit."""
    per_table_row = bytes_needed({**cfg, "rows": 1}) - bytes_needed({**cfg, "rows": 0})
    room = free - margin(free) - bytes_needed({**cfg, "rows": 0})
    return max(0, min(DEFAULT_ROWS, room // per_table_row))


def run(cfg: dict) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    import torchrec_dtensor_bridge as tdb
    from torchrec_dtensor_bridge.convert import dtensor_from_local_shards

    dev = torch.device(cfg["device"])
    n, rows, dim, batch, bag = cfg["tables"], cfg["rows"], cfg["dim"], cfg["batch"], cfg["bag"]
    g = torch.Generator(device=dev).manual_seed(0)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    tables = _one_buffer(n, rows, dim, dev, g)  # ours trains them in place; torch's forward reads them
    ids = [torch.randint(0, rows, (batch, bag), device=dev, generator=g) for _ in range(n)]
    flat_ids = torch.cat([i.reshape(-1) for i in ids])
    flat_offsets = torch.arange(0, flat_ids.numel() + 1, bag, device=dev, dtype=torch.int64)
    grad_out = torch.rand(batch, n * dim, device=dev, generator=g)

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", rank=0, world_size=1)
    mesh = init_device_mesh(dev.type, (1,))
    ours_w = [dtensor_from_local_shards(tdb.ShardLayout.replicated((rows, dim), [0], name=f"t{t}"), [w],
                                        device_mesh=mesh).requires_grad_()
              for t, w in enumerate(tables)]
    hyper = {"eps": cfg["eps"]} if cfg["optimizer"] != "sgd" else {}
    opt = tdb.FusedOptimizer({f"t{t}": w for t, w in enumerate(ours_w)}, cfg["optimizer"], lr=cfg["lr"], **hyper)
    tbe, tbe_note = _tbe(cfg, tables, dev)

    def ours_forward() -> Any:
        return torch.cat(tdb.sharded_embedding_bags(ids, ours_w, mode="sum"), 1)

    def ours_step() -> None:
        out = torch.cat(tdb.sharded_embedding_bags(ids, ours_w, mode="sum", optimizer=opt), 1)
        (out * grad_out).sum().backward()

    def tbe_step() -> None:
        assert tbe is not None
        (tbe(flat_ids, flat_offsets) * grad_out).sum().backward()

    forward: dict[str, Callable[[], Any]] = {
        "torch": lambda: torch.cat([F.embedding_bag(i, w, mode="sum") for i, w in zip(ids, tables)], 1),
        "ours": ours_forward,
    }
    step: dict[str, Callable[[], Any]] = {"ours": ours_step}
    if tbe is not None:
        forward["fbgemm_tbe"] = lambda: tbe(flat_ids, flat_offsets)
        step["fbgemm_tbe"] = tbe_step
    with torch.no_grad():
        ref = forward["torch"]()
        for name, fn in forward.items():
            got = fn()
            if not torch.allclose(got, ref, rtol=TOL, atol=TOL):
                raise RuntimeError(f"{name} forward differs from F.embedding_bag by {(got - ref).abs().max().item()}")
    if tbe is not None:  # one step of each from the same tables: the same touched rows
        touched = [torch.unique(i) for i in ids]
        ours_step()
        tbe_step()
        for t, (w, theirs) in enumerate(zip(ours_w, tbe.split_embedding_weights())):
            mine = w.to_local()[touched[t]]
            if not torch.allclose(mine, theirs[touched[t]], rtol=TOL, atol=TOL):
                raise RuntimeError(f"table {t}: one step of ours and of fbgemm's module differ by "
                                   f"{(mine - theirs[touched[t]]).abs().max().item()}")
    src = torch.empty(COPY_NUMEL, device=dev)
    dst = torch.empty_like(src)
    samples: dict[str, dict[str, list[float]]] = {"forward": {k: [] for k in [*forward, "copy"]},
                                                  "step": {k: [] for k in step}}
    for rep in range(cfg["warmup"] + cfg["reps"]):
        with torch.no_grad():
            paths = {**forward, "copy": lambda: dst.copy_(src)}
            for k in (list(paths) if rep % 2 == 0 else list(paths)[::-1]):
                dt = _timed(paths[k], cfg["inner"], dev)
                if rep >= cfg["warmup"]:
                    samples["forward"][k].append(dt)
        for k in (list(step) if rep % 2 == 0 else list(step)[::-1]):
            dt = _timed(step[k], cfg["inner"], dev)
            if rep >= cfg["warmup"]:
                samples["step"][k].append(dt)
    dist.destroy_process_group()
    row_bytes = n * batch * bag * dim * 4
    name = torch.cuda.get_device_name(0) if dev.type == "cuda" else "CPU"
    out: dict[str, Any] = {"device": name, "torch": torch.__version__, "tbe": tbe_note, "config": cfg,
                           "row_bytes": row_bytes, "copy_bytes": 2 * src.numel() * 4}
    if dev.type == "cuda":
        out["peak_gib"] = torch.cuda.max_memory_allocated() / GIB
    for phase, by_path in samples.items():
        out[phase] = {}
        for k, xs in by_path.items():
            med = statistics.median(xs)
            nbytes = out["copy_bytes"] if k == "copy" else row_bytes
            out[phase][k] = {"median": med, "min": min(xs), "max": max(xs), "gb_s": nbytes / med / 1e9}
        if "fbgemm_tbe" in by_path:
            out[phase]["fbgemm_over_ours"] = out[phase]["fbgemm_tbe"]["median"] / out[phase]["ours"]["median"]
    return out


def _size(cfg: dict, rows_given: bool) -> str | None:
    """Fit ``cfg["rows"]`` to the device's free memory (CUDA, ``--rows`` not given): the default shrinks to
    :func:`rows_that_fit`. Returns why the run cannot start, else ``None``; a given ``--rows`` that does not
    fit is kept, with a warning."""
    import torch

    if cfg["device"] != "cuda":
        return None
    free, total = torch.cuda.mem_get_info()
    cfg["rows_sized_from"] = f"{free / GIB:.1f} GiB free of {total / GIB:.1f} GiB (torch.cuda.mem_get_info)"
    fit = rows_that_fit(cfg, free)
    if rows_given:
        if cfg["rows"] > fit:
            print(f"bench_lookup_gpu: warning: --rows {cfg['rows']:,} needs about "
                  f"{bytes_needed(cfg) / GIB:.1f} GiB plus a margin of {margin(free) / GIB:.1f} GiB; "
                  f"{cfg['rows_sized_from']}: {fit:,} rows fit")
        return None
    if fit == 0:
        return f"too little device memory for any table: {cfg['rows_sized_from']}"
    cfg["rows"] = fit
    return None


def _fbgemm_missing() -> str | None:
    """Why fbgemm's TBE module cannot be imported here, else ``None``."""
    try:
        importlib.import_module("fbgemm_gpu.split_table_batched_embeddings_ops_training")
    except Exception as e:  # noqa: BLE001 - any import failure means "not available here"
        return f"fbgemm_gpu not available: {type(e).__name__}: {e}"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tables", type=int, default=8)
    parser.add_argument("--rows", type=int, default=None,
                        help=f"rows per table (default {DEFAULT_ROWS:,}, fewer where the free device memory cannot "
                             "hold two copies: see above)")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2048, help="bags per table")
    parser.add_argument("--bag", type=int, default=20, help="ids per bag")
    parser.add_argument("--optimizer", choices=("sgd", "rowwise_adagrad"), default="rowwise_adagrad")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--eps", type=float, default=1e-8)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--inner", type=int, default=10, help="calls per timed sample")
    parser.add_argument("--out", type=Path, default=Path("bench/results.json"))
    parser.add_argument("--require-cuda", action="store_true",
                        help="without a CUDA device exit 2 (nothing recorded) instead of recording a skip")
    parser.add_argument("--require-fbgemm", action="store_true",
                        help="exit 1 before running when fbgemm's TBE module cannot be imported (no ratio)")
    args = parser.parse_args(argv)
    cfg = {k: getattr(args, k) for k in ("device", "tables", "rows", "dim", "batch", "bag", "optimizer", "lr", "eps",
                                         "reps", "warmup", "inner")}
    if cfg["rows"] is None:
        cfg["rows"] = DEFAULT_ROWS
    reason = _skip_reason(args.device)
    if reason:
        if args.require_cuda:
            print(f"bench_lookup_gpu: FAILED: {reason}")
            return 2
        print(f"bench_lookup_gpu: skipped: {reason}")
        record(args.out, "lookup_gpu", {"skipped": reason})
        return 0
    if args.require_fbgemm and (missing := _fbgemm_missing()):
        print(f"bench_lookup_gpu: FAILED: {missing}")
        return 1
    if (why := _size(cfg, rows_given=args.rows is not None)) is not None:
        print(f"bench_lookup_gpu: FAILED: {why}")
        return 1
    res = run(cfg)
    print(f"lookup on {res['device']} (torch {res['torch']}; {res['tbe']}), {cfg['tables']} x {cfg['rows']:,} x "
          f"{cfg['dim']}, batch {cfg['batch']}, bag {cfg['bag']}:")
    if "rows_sized_from" in cfg:
        print(f"  device memory: {cfg['rows_sized_from']}; peak allocated {res['peak_gib']:.1f} GiB")
    for phase in ("forward", "step"):
        for k, s in res[phase].items():
            if isinstance(s, dict):
                print(f"  {phase:<7} {k:<11} {s['median'] * 1e3:9.3f} ms  [{s['min'] * 1e3:.3f} .. "
                      f"{s['max'] * 1e3:.3f}]  {s['gb_s']:7.1f} GB/s")
        if "fbgemm_over_ours" in res[phase]:
            print(f"  {phase:<7} fbgemm / ours: {res[phase]['fbgemm_over_ours']:.2f}x (> 1: ours faster)")
    if args.device == "cuda":
        record(args.out, "lookup_gpu", res)
    else:
        print("(--device cpu checks the script; nothing recorded)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
