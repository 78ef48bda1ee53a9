"""End-to-end demo: a TorchRec model sharded on local gloo ranks, seen as DTensors.

Run with ``make demo`` (2 ranks) or
``torchrun --standalone --nproc_per_node=N examples/demo.py``.

1. Builds an EmbeddingBagCollection with one table per TorchRec sharding type
   and shards it with a hand-written plan (row-wise runs on CPU this way).
2. Converts its state_dict to DTensors (zero-copy) and prints each layout.
3. Checks every table: ``full_tensor`` equals the unsharded table, the local
   shards are the module's own storage, and the way back gives TorchRec's
   ShardedTensor metadata. Exits non-zero on any mismatch.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import warnings

import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.tensor import DTensor
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.distributed.shard import shard
from torchrec.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_row_wise,
    table_wise,
)
from torchrec.distributed.types import ShardingEnv

import torchrec_dtensor_bridge as tdb


def _table_column_wise(ranks: list[int]):
    gen = column_wise(ranks=ranks)

    def make(*args):
        return dataclasses.replace(gen(*args), sharding_type="table_column_wise")

    return make


def build_model(world_size: int) -> tuple[EmbeddingBagCollection, dict]:
    """The unsharded model (same seed on every rank) and a plan covering every sharding type."""
    last = world_size - 1
    specs = {
        "user_rw": (1000, 32, row_wise()),
        "item_tw": (500, 16, table_wise(rank=last)),
        "ad_cw": (300, 64, column_wise(ranks=[r % world_size for r in range(4)])),
        "geo_trw": (250, 8, table_row_wise(host_index=0)),
        "page_twc": (120, 32, _table_column_wise([last, 0])),
        "hour_dp": (24, 8, data_parallel()),
    }
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(name=n, num_embeddings=r, embedding_dim=d, feature_names=[n])
            for n, (r, d, _) in specs.items()
        ],
        device=torch.device("cpu"),
    )
    return ebc, {n: g for n, (_, _, g) in specs.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.parse_args(argv)
    logging.getLogger("torchrec").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    say = print if rank == 0 else (lambda *a, **k: None)

    reference, generators = build_model(world)
    full = {k: v.detach().clone() for k, v in reference.state_dict().items()}
    plan = construct_module_sharding_plan(
        reference, per_param_sharding=generators, local_size=world, world_size=world, device_type="cpu"
    )
    sharded = shard(reference, plan=plan, env=ShardingEnv.from_process_group(dist.group.WORLD), device=torch.device("cpu"))
    sd = sharded.state_dict()
    # TorchRec initialises shards itself; write the reference weights through its ShardedTensors.
    for key, value in sd.items():
        if isinstance(value, ShardedTensor):
            for s in value.local_shards():
                idx = tuple(slice(o, o + z) for o, z in zip(s.metadata.shard_offsets, s.metadata.shard_sizes))
                s.tensor.copy_(full[key][idx])
        else:
            value.copy_(full[key])

    dts = tdb.state_dict_to_dtensor(sd)
    say(f"== TorchRec EmbeddingBagCollection on {world} gloo ranks, state_dict as DTensors ==\n")
    failures: list[str] = []
    rows = []
    for key, value in dts.items():
        name = key.split(".")[-2]
        if not isinstance(value, DTensor):
            ok = torch.equal(value, full[key])
            rows.append((name, "data_parallel (plain tensor)", "-", ok))
            failures += [] if ok else [f"{name}: replicated table differs"]
            continue
        picture = tdb.visualize_sharding(value, name=name)
        say(picture + "\n")
        same_table = torch.equal(tdb.full_tensor(value), full[key])
        ptrs_st = [s.tensor.data_ptr() for s in sd[key].local_shards()]
        ptrs_dt = [t.data_ptr() for t in tdb.convert.local_shards_of(value)]
        zero_copy = sorted(ptrs_st) == sorted(ptrs_dt)
        back = tdb.to_sharded_tensor(value)
        same_md = [(m.shard_offsets, m.shard_sizes, str(m.placement)) for m in back.metadata().shards_metadata] == [
            (m.shard_offsets, m.shard_sizes, str(m.placement)) for m in sd[key].metadata().shards_metadata
        ]
        ok = same_table and zero_copy and same_md
        kind = tdb.layout_of(value).kind.value
        rows.append((name, kind, str(tuple(p for p in value.placements)), ok))
        for what, good in (("full_tensor", same_table), ("zero-copy", zero_copy), ("metadata", same_md)):
            if not good:
                failures.append(f"{name}: {what} check failed on rank {rank}")

    verdicts = [None] * world
    dist.all_gather_object(verdicts, failures)
    all_failures = [f for v in verdicts for f in v]
    say(f"{'table':<10} {'layout':<30} {'placements':<22} parity")
    for name, kind, placements, ok in rows:
        say(f"{name:<10} {kind:<30} {placements:<22} {'ok' if ok else 'MISMATCH'}")
    if all_failures:
        say("\nFAILED:\n  " + "\n  ".join(all_failures))
    else:
        say(
            f"\nAll {len(rows)} tables: full_tensor == unsharded table, DTensor shards are the module's own "
            "storage (same data_ptr), and to_sharded_tensor gives back TorchRec's metadata."
        )
    dist.destroy_process_group()
    return 1 if all_failures else 0


if __name__ == "__main__":
    sys.exit(main())
