"""Lookup benchmark on ONE CUDA GPU: fbgemm-gpu's TBE vs ``torch.nn.functional.embedding_bag`` vs ours.

The workload of ``bench_lookup.py`` (4 tables x 200,000 rows x dim 64 fp32,
2048 bags of 20 ids per table, ``mode="sum"``) on one GPU, forward only, all
paths interleaved in the same run (medians of ``--reps`` after a warm-up,
``torch.cuda.synchronize()`` around each timing), each checked once against
``F.embedding_bag``:

* ``torch``: ``F.embedding_bag`` once per table;
* ``fbgemm_tbe``: one ``SplitTableBatchedEmbeddingBagsCodegen`` over the 4
  tables (``EmbeddingLocation.DEVICE``, ``ComputeDevice.CUDA``) - one fused
  kernel for all tables; reported as "not available" when ``fbgemm_gpu`` (the
  CUDA build) does not import;
* ``ours``: ``sharded_embedding_bags`` on the 4 tables as replicated DTensors on
  a one-rank NCCL group (the local path of the library on CUDA shards);
* ``copy``: ``dst.copy_(src)`` of 1 GiB, the device's copy bandwidth.

Without a CUDA device the script records ``{"skipped": reason}`` under
``lookup_gpu`` in the results file and exits 0, so ``make bench`` runs
everywhere.

    python scripts/bench_lookup_gpu.py --reps 20 --out bench/results.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench_results import record

TABLES, ROWS, DIM, BATCH, BAG = 4, 200_000, 64, 2048, 20


def _skip_reason() -> str | None:
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    return None


def _timed(fn: Callable[[], Any], inner: int) -> float:
    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / inner


def _fbgemm_tbe(tables: list[Any]) -> tuple[Callable[..., Any] | None, str]:
    """A forward over all tables through one fbgemm TBE module, or (None, why not)."""
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
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(ROWS, DIM, EmbeddingLocation.DEVICE, ComputeDevice.CUDA) for _ in tables],
        optimizer=EmbOptimType.EXACT_SGD, learning_rate=0.0, pooling_mode=PoolingMode.SUM,
        device=torch.device("cuda"),
    )
    with torch.no_grad():
        for w, full in zip(tbe.split_embedding_weights(), tables):
            w.copy_(full)

    def forward(ids: list[Any]) -> Any:
        flat = torch.cat([i.reshape(-1) for i in ids])
        offsets = torch.arange(0, flat.numel() + 1, BAG, device=flat.device, dtype=torch.int64)
        return tbe(flat, offsets)  # (BATCH, TABLES * DIM)

    return forward, "SplitTableBatchedEmbeddingBagsCodegen (one fused kernel, 4 tables)"


def run(reps: int, warmup: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    from torchrec_dtensor_bridge.convert import dtensor_from_local_shards
    from torchrec_dtensor_bridge.layout import ShardLayout
    from torchrec_dtensor_bridge.lookup import sharded_embedding_bags

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    tables = [torch.randn(ROWS, DIM, device=dev, generator=g) for _ in range(TABLES)]
    ids = [torch.randint(0, ROWS, (BATCH, BAG), device=dev, generator=g) for _ in range(TABLES)]
    ref = torch.cat([F.embedding_bag(i, w, mode="sum") for i, w in zip(ids, tables)], 1)

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("nccl", rank=0, world_size=1)
    mesh = init_device_mesh("cuda", (1,))
    weights = [dtensor_from_local_shards(ShardLayout.replicated((ROWS, DIM), [0], name=f"t{t}"), [w],
                                         device_mesh=mesh) for t, w in enumerate(tables)]
    paths: dict[str, Callable[[], Any]] = {
        "torch": lambda: torch.cat([F.embedding_bag(i, w, mode="sum") for i, w in zip(ids, tables)], 1),
        "ours": lambda: torch.cat(sharded_embedding_bags(ids, weights, mode="sum"), 1),
    }
    tbe, tbe_note = _fbgemm_tbe(tables)
    if tbe is not None:
        paths["fbgemm_tbe"] = lambda: tbe(ids)
    with torch.no_grad():
        for name, fn in paths.items():
            got = fn()
            if not torch.allclose(got, ref, rtol=1e-4, atol=1e-4):
                raise RuntimeError(f"{name} differs from F.embedding_bag by {(got - ref).abs().max().item()}")
        src = torch.empty(2**28, device=dev)
        dst = torch.empty_like(src)
        paths["copy"] = lambda: dst.copy_(src)
        samples: dict[str, list[float]] = {k: [] for k in paths}
        for rep in range(warmup + reps):
            for k in (list(paths) if rep % 2 == 0 else list(paths)[::-1]):
                dt = _timed(paths[k], 10)
                if rep >= warmup:
                    samples[k].append(dt)
    dist.destroy_process_group()
    row_bytes = TABLES * BATCH * BAG * DIM * 4
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                           "tbe": tbe_note, "row_bytes": row_bytes, "copy_bytes": 2 * src.numel() * 4}
    for k, xs in samples.items():
        nbytes = out["copy_bytes"] if k == "copy" else row_bytes
        med = statistics.median(xs)
        out[k] = {"median": med, "min": min(xs), "max": max(xs), "gb_s": nbytes / med / 1e9}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench/results.json"))
    args = parser.parse_args(argv)
    reason = _skip_reason()
    res: dict[str, Any] = {"skipped": reason} if reason else run(args.reps, args.warmup)
    if reason:
        print(f"bench_lookup_gpu: skipped: {reason}")
    else:
        print(f"lookup on {res['device']} (torch {res['torch']}; {res['tbe']}), forward, "
              f"{TABLES} x {ROWS:,} x {DIM}, batch {BATCH}, bag {BAG}:")
        for k in ("torch", "fbgemm_tbe", "ours", "copy"):
            if k in res:
                s = res[k]
                print(f"  {k:<11} {s['median'] * 1e3:8.3f} ms  [{s['min'] * 1e3:.3f} .. {s['max'] * 1e3:.3f}]  "
                      f"{s['gb_s']:7.1f} GB/s")
    record(args.out, "lookup_gpu", res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
