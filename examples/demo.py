"""End-to-end demo: a TorchRec model sharded on local gloo ranks, seen as DTensors.

Run with ``make demo`` (4 ranks) or
``torchrun --standalone --nproc_per_node=N examples/demo.py`` (N >= 2).
On several nodes (or several launchers on one machine), every launcher runs
``torchrun --nnodes=2 --nproc_per_node=2 --rdzv_backend=c10d
--rdzv_endpoint=HOST:PORT --rdzv_id=demo examples/demo.py --checkpoint-dir DIR``
with ``DIR`` on storage every node sees.

1. Builds an EmbeddingBagCollection with one table per TorchRec sharding type
   and shards it with a hand-written plan (row-wise runs on CPU this way).
2. Converts its state_dict to DTensors (zero-copy) and prints each layout.
3. Checks every table: ``full_tensor`` equals the unsharded table, the local
   shards are the module's own storage, and the way back gives TorchRec's
   ShardedTensor metadata.
4. Saves the DTensor state_dict with ``tdb.checkpoint.save`` (atomic,
   checksummed), then loads it into the same model sharded by a DIFFERENT plan
   on FEWER ranks (a subgroup), and checks tables and forward outputs against
   the unsharded model. Exits non-zero on any mismatch.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path
import warnings

import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.tensor import DTensor
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.distributed.comm import get_local_size
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


TABLES = {"user_rw": (1000, 32), "item_tw": (500, 16), "ad_cw": (300, 64), "geo_trw": (250, 8),
          "page_twc": (120, 32), "hour_dp": (24, 8)}


def plan_a(world_size: int) -> dict:
    """One table per TorchRec sharding type."""
    last = world_size - 1
    return {
        "user_rw": row_wise(),
        "item_tw": table_wise(rank=last),
        "ad_cw": column_wise(ranks=[r % world_size for r in range(4)]),
        "geo_trw": table_row_wise(host_index=0),
        "page_twc": _table_column_wise([last, 0]),
        "hour_dp": data_parallel(),
    }


def plan_b(world_size: int) -> dict:
    """Every table moved to another layout."""
    return {
        "user_rw": column_wise(ranks=[r % world_size for r in range(4)]),
        "item_tw": row_wise(),
        "ad_cw": table_wise(rank=0),
        "geo_trw": _table_column_wise([world_size - 1]),
        "page_twc": row_wise(),
        "hour_dp": table_wise(rank=world_size - 1),
    }


def build_model(seed: int = 0) -> EmbeddingBagCollection:
    """The unsharded model (same seed on every rank)."""
    torch.manual_seed(seed)
    ebc = EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(name=n, num_embeddings=r, embedding_dim=d, feature_names=[n])
            for n, (r, d) in TABLES.items()
        ],
        device=torch.device("cpu"),
    )
    return ebc


def _local_size(world: int) -> int:
    """TorchRec's ranks per node for a group of ``world`` ranks: ``get_local_size``'s answer (torchrun's
    LOCAL_WORLD_SIZE when it divides ``world``), or ``world`` for a group inside one node that it does not
    divide (the reload on ``world - 1`` ranks), which TorchRec also falls back to, but with a warning."""
    n = int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
    return get_local_size(world) if n > 0 and world % n == 0 else world


def shard_model(ebc: EmbeddingBagCollection, generators: dict, group: dist.ProcessGroup):
    """Shard ``ebc`` over ``group`` with a hand-written TorchRec plan (row-wise works on CPU this way)."""
    world = dist.get_world_size(group)
    # The ranks per node TorchRec itself assumes (torchrun's LOCAL_WORLD_SIZE when it divides
    # ``world``): table-row-wise tables are cut within a node, so plan and runtime must agree.
    plan = construct_module_sharding_plan(
        ebc, per_param_sharding=generators, local_size=_local_size(world), world_size=world, device_type="cpu"
    )
    env = ShardingEnv(world, dist.get_rank(group), group)
    return shard(ebc, plan=plan, env=env, device=torch.device("cpu"))


def sample_batch(seed: int) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (len(TABLES) * 8,), generator=g)
    chunks = [torch.randint(0, rows, (int(n),), generator=g)
              for (rows, _), n in zip(TABLES.values(), lengths.view(len(TABLES), 8).sum(1))]
    return KeyedJaggedTensor.from_lengths_sync(keys=list(TABLES), values=torch.cat(chunks), lengths=lengths)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--checkpoint-dir", default=None,
        help="where to save the checkpoint (a fresh temporary directory by default); on several nodes, "
        "a directory on storage every node sees",
    )
    args = parser.parse_args(argv)
    logging.getLogger("torchrec").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    say = print if rank == 0 else (lambda *a, **k: None)

    reference = build_model()
    full = {k: v.detach().clone() for k, v in reference.state_dict().items()}
    sharded = shard_model(build_model(seed=1), plan_a(world), dist.group.WORLD)
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
    say(f"== TorchRec EmbeddingBagCollection on {world} gloo ranks, state_dict as DTensors ==")
    nodes: list = [None] * world  # torchrun's node rank (GROUP_RANK) of every rank
    dist.all_gather_object(nodes, os.environ.get("GROUP_RANK", "0"))
    per_node = {n: [r for r, m in enumerate(nodes) if m == n] for n in sorted(set(nodes), key=int)}
    say(f"{len(per_node)} node(s): " + "; ".join(f"node {n}: ranks {rs}" for n, rs in per_node.items()) + "\n")
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

    say(f"{'table':<10} {'layout':<30} {'placements':<22} parity (this rank)")
    for name, kind, placements, ok in rows:
        say(f"{name:<10} {kind:<30} {placements:<22} {'ok' if ok else 'MISMATCH'}")
    failures += lookup_phase(dts, full, rank, say)
    failures += checkpoint_phase(dts, reference, full, rank, world, say, args.checkpoint_dir)

    verdicts = [None] * world
    dist.all_gather_object(verdicts, failures)
    all_failures = [f for v in verdicts for f in v]
    say("\n== summary ==")
    if all_failures:
        say("FAILED:\n  " + "\n  ".join(all_failures))
    else:
        say(
            f"OK on all {world} ranks: {len(rows)} tables as DTensors with full_tensor == the unsharded table, "
            "shards that are the module's own storage (same data_ptr), TorchRec's metadata on the way back; "
            "a checkpoint that reloads bit-exact into another plan on fewer ranks."
        )
    dist.barrier()  # nobody tears the group down while a peer still uses it
    dist.destroy_process_group()
    return 1 if all_failures else 0


def lookup_phase(dts: dict, full: dict, rank: int, say) -> list[str]:
    """``sharded_embedding_bag`` on every sharded table, each rank with its own batch size; then all
    tables in one ``sharded_embedding_bags`` call."""
    failures: list[str] = []
    say("\n== lookups: tdb.sharded_embedding_bag on the sharded tables vs F.embedding_bag on the full ones ==")
    g = torch.Generator().manual_seed(100 + rank)
    for key, value in dts.items():
        if not isinstance(value, DTensor):
            continue
        rows = value.shape[0]
        batch = 5 + 3 * rank  # ranks pass different batch sizes, as in TorchRec
        ids = torch.randint(0, rows, (batch * 4,), generator=g)
        offsets = torch.arange(0, batch * 4, 4)
        worst = 0.0
        for mode in ("sum", "mean", "max"):
            got = tdb.sharded_embedding_bag(ids, value, offsets, mode=mode)
            want = torch.nn.functional.embedding_bag(ids, full[key], offsets, mode=mode)
            worst = max(worst, (got - want).abs().max().item())
            if not torch.allclose(got, want, rtol=1e-5, atol=1e-5):
                failures.append(f"{key}: sharded_embedding_bag(mode={mode}) differs on rank {rank}")
        say(f"  {key.split('.')[-2]:<10} {tdb.layout_of(value).kind.value:<12} sum/mean/max: "
            f"max |difference| {worst:.1e} on rank {rank}")
    # every table at once: one fused exchange, a mode per table
    keys = [k for k, v in dts.items() if isinstance(v, DTensor)]
    modes = [("sum", "mean", "max")[i % 3] for i in range(len(keys))]
    ids = [torch.randint(0, dts[k].shape[0], (4 + rank + i, 3), generator=g) for i, k in enumerate(keys)]
    outs = tdb.sharded_embedding_bags(ids, [dts[k] for k in keys], mode=modes)
    bad = [k for k, i, m, o in zip(keys, ids, modes, outs)
           if not torch.allclose(o, torch.nn.functional.embedding_bag(i, full[k], mode=m), rtol=1e-5, atol=1e-5)]
    failures += [f"{k}: sharded_embedding_bags differs on rank {rank}" for k in bad]
    say(f"  all {len(keys)} tables in ONE tdb.sharded_embedding_bags call (modes {', '.join(modes)}): "
        f"{'equal' if not bad else 'DIFFERENT'} to F.embedding_bag on rank {rank}")
    return failures


def checkpoint_phase(
    dts: dict, reference: EmbeddingBagCollection, full: dict, rank: int, world: int, say, where: str | None = None
) -> list[str]:
    """Save on every rank; load into plan B on a subgroup of ``world - 1`` ranks; verify.

    The ranks that load (``0 .. world - 2``) read blocks other ranks wrote, across nodes
    when there are several."""
    failures: list[str] = []
    # one temporary directory, made by rank 0 (the one whose path every rank uses) and removed by it below
    root = where if where is not None else (tempfile.mkdtemp(prefix="tdb-demo-") if rank == 0 else None)
    path = [str(Path(root) / "ckpt") if rank == 0 else None]
    dist.broadcast_object_list(path)
    tdb.checkpoint.save(dts, path[0])
    say(f"\n== checkpoint: saved on {world} ranks to {path[0]} ==")
    say(tdb.checkpoint.format_report(path[0]))
    load_world = max(world - 1, 1)
    group = dist.new_group(list(range(load_world)))
    if rank < load_world:
        other = shard_model(build_model(seed=2), plan_b(load_world), group)
        dest = tdb.state_dict_to_dtensor(other.state_dict())
        tdb.checkpoint.load(dest, path[0], process_group=group)
        for key, value in dest.items():
            got = tdb.full_tensor(value, process_group=group) if isinstance(value, DTensor) else value
            if not torch.equal(got, full[key]):
                failures.append(f"{key}: differs after loading into plan B on {load_world} ranks")
        kjt = sample_batch(seed=rank)
        got, want = other(kjt).wait().to_dict(), reference(kjt).to_dict()  # sharded output orders keys its own way
        for key in want:
            if not torch.allclose(got[key], want[key], rtol=1e-5, atol=1e-6):
                failures.append(f"{key}: forward of the plan-B model differs from the unsharded model on rank {rank}")
        if rank == 0:
            for key, value in dest.items():
                if isinstance(value, DTensor):
                    kind = tdb.layout_of(value).kind.value
                    say(f"  {key.split('.')[-2]:<10} now {kind}")
    dist.barrier()
    if rank == 0 and where is None:  # a directory the user named keeps its checkpoint
        shutil.rmtree(Path(path[0]).parent, ignore_errors=True)
    say(f"loaded into plan B on {load_world} ranks: "
        + ("tables bit-exact, forward == unsharded model" if not failures else "MISMATCH"))
    return failures


if __name__ == "__main__":
    sys.exit(main())
