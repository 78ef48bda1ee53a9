"""Quickstart: a TorchRec model on 2 gloo ranks, through the package's public API.

Run it with::

    .venv/bin/python -m torch.distributed.run --standalone --nproc_per_node=2 examples/quickstart.py

The documentation's code blocks (``docs/*.md``) are the regions of this file between
``# [readme:NAME]`` and ``# [/readme:NAME]``, dedented (``tests/distributed/test_readme.py``
keeps the two equal). In file order the regions make a complete program; ``main`` runs them
one after another and, between them, checks each step against unsharded torch
(``F.embedding_bag`` on the whole table, ``torch.optim.Adagrad``). The ranks
gather their failures: the exit status is 1 on any mismatch, on every rank (2, with
the command to use, when not launched on 2 ranks).

1. imports, setup: an ``EmbeddingBagCollection`` of 4 tiny tables in a
   ``DistributedModelParallel`` with a hand-written plan (table-wise, row-wise,
   column-wise, table-row-wise), every table on TorchRec's fused kernel;
2. tour: its state_dict as DTensors and back, a picture, DCP metadata, a plain
   DCP save and load, ``tdb.checkpoint.migrate`` and ``inspect``;
3. lookups: ``sharded_embedding_bag`` / ``sharded_embedding`` /
   ``sharded_embedding_bags`` with gradients, replicated DTensor ids, ``shard_module``;
4. training: a ``FusedOptimizer`` over the module's tables, TorchRec's optimizer
   state in and out, a checkpoint of weights and state loaded into another plan;
5. interop: our DTensors into TorchRec's ``load_state_dict``, TorchRec's own
   DTensors through our API;
6. checkpoints: a DMP's state_dict saved and loaded into another plan, a whole job
   (the DMP, its fused optimizer, a step count) in one call, and one sub-module's
   state out of a whole model's checkpoint.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import sys
import warnings
from collections.abc import Callable

# [readme:imports]
import dataclasses
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    row_wise,
    table_row_wise,
    table_wise,
)
from torchrec.distributed.types import ShardingEnv, ShardingPlan

import torchrec_dtensor_bridge as tdb
# [/readme:imports]

# for the checks only
import torch.nn.functional as F
from torch.distributed.tensor import Partial, Shard

WORLD = 2  # the plans name ranks 0 and 1


class Checks:
    """This rank's failed checks; :meth:`verdict` gathers every rank's (a collective)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.failures: list[str] = []

    def that(self, ok: bool, what: str) -> None:
        if not ok:
            self.failures.append(f"rank {self.rank}: {what}")

    def equal(self, got: torch.Tensor, want: torch.Tensor, what: str) -> None:
        self.that(got.shape == want.shape and torch.equal(got, want), f"{what} differs")

    def close(self, got: torch.Tensor, want: torch.Tensor, what: str) -> None:
        if got.shape != want.shape:
            self.that(False, f"{what}: shape {list(got.shape)}, expected {list(want.shape)}")
            return
        worst = (got - want).abs().max().item() if got.numel() else 0.0
        self.that(torch.allclose(got, want, rtol=1e-5, atol=1e-6), f"{what} differs (max |difference| {worst:.2e})")

    def verdict(self) -> list[str]:
        return [f for per_rank in gathered(self.failures) for f in per_rank]


def gathered(value: object) -> list:
    """``value`` of every rank, in rank order (a collective)."""
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def full_tables(dts: dict, names) -> dict[str, torch.Tensor]:
    """The whole tables, by table name (a collective per table)."""
    return {n: tdb.full_tensor(dts[f"ebc.embedding_bags.{n}.weight"]) for n in names}


def torchrec_state(dmp: DistributedModelParallel, tables: dict) -> dict[str, torch.Tensor]:
    """TorchRec's fused Adagrad state (``momentum1``: one value per weight), whole, by table name.

    Assembled from every rank's local shards (TorchRec leaves a table's state out on ranks
    that hold none of the table, so not every rank could call ``full_tensor`` on it).
    """
    mine = [(key.rpartition(".")[0], s.metadata.shard_offsets, s.tensor)
            for per_table in dmp.fused_optimizer.state_dict()["state"].values()
            for key, st in per_table.items() if key.endswith(".momentum1") for s in st.local_shards()]
    whole = {n: torch.full(shape, float("nan")) for n, shape in tables.items()}
    for name, offsets, t in (piece for per_rank in gathered(mine) for piece in per_rank):
        whole[name][tuple(slice(o, o + z) for o, z in zip(offsets, t.shape))] = t
    return whole


def adagrad(tables: dict, state: dict, batches: list, names) -> tuple[dict, dict]:
    """``torch.optim.Adagrad`` on the whole tables: the tables and state after one step with the gradient
    of every rank's batch (``batches[rank][t]``: 2-D ids of table ``t``; loss: the sum of the summed bags)."""
    new_tables, new_state = {}, {}
    for t, n in enumerate(names):
        table = tables[n].clone().requires_grad_()
        for per_rank in batches:
            F.embedding_bag(per_rank[t], table, mode="sum").sum().backward()
        opt = torch.optim.Adagrad([table], lr=0.1, eps=1e-8)
        opt.state[table]["sum"] = state[n].clone()
        opt.step()
        new_tables[n], new_state[n] = table.detach(), opt.state[table]["sum"]
    return new_tables, new_state


def main() -> int:
    if os.environ.get("WORLD_SIZE") != str(WORLD):
        print(f"quickstart: launch it on {WORLD} ranks: .venv/bin/python -m torch.distributed.run --standalone "
              f"--nproc_per_node={WORLD} examples/quickstart.py", file=sys.stderr)
        return 2
    for noisy in ("torchrec", "torch.fx._symbolic_trace"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)

    # [readme:setup]
    dist.init_process_group("gloo")  # 2 CPU ranks under torchrun
    rank, world = dist.get_rank(), dist.get_world_size()
    # 4 tiny tables, one per sharding type, on TorchRec's fused kernel (its optimizer runs in
    # backward). TorchRec's plan generators pick the dense kernel unless told otherwise, and
    # row_wise(sizes_placement=...) picks the quantized (inference) kernel and puts every
    # shard on rank 0: name compute_kernel="fused" and let row_wise cut evenly.
    tables = {"t_tw": (10, 8), "t_rw": (13, 8), "t_cw": (9, 16), "t_trw": (11, 4)}  # rows, dim

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ebc = EmbeddingBagCollection(tables=[
                EmbeddingBagConfig(name=n, num_embeddings=r, embedding_dim=d, feature_names=[n])
                for n, (r, d) in tables.items()], device=torch.device("meta"))  # DMP initialises it

        def forward(self, kjt: KeyedJaggedTensor):
            return self.ebc(kjt)

    def fused(generator):  # table_row_wise() takes no compute_kernel
        return lambda *args: dataclasses.replace(generator(*args), compute_kernel="fused")

    plan_a = {"t_tw": table_wise(rank=1, compute_kernel="fused"), "t_rw": row_wise(compute_kernel="fused"),
              "t_cw": column_wise(ranks=[0, 1], compute_kernel="fused"), "t_trw": fused(table_row_wise(host_index=0))}
    sharder = EmbeddingBagCollectionSharder(
        fused_params={"optimizer": EmbOptimType.EXACT_ADAGRAD, "learning_rate": 0.1, "eps": 1e-8})

    def shard_model(per_table: dict, *, output_dtensor: bool = False) -> DistributedModelParallel:
        model = Model()
        plan = construct_module_sharding_plan(model.ebc, per_param_sharding=per_table, sharder=sharder,
                                              local_size=world, world_size=world, device_type="cpu")  # one node
        env = ShardingEnv(world, rank, dist.group.WORLD, output_dtensor=output_dtensor)
        return DistributedModelParallel(model, env=env, device=torch.device("cpu"),
                                        plan=ShardingPlan({"ebc": plan}), sharders=[sharder])

    dmp = shard_model(plan_a)
    shared = [tempfile.mkdtemp(prefix="tdb-quickstart-") if rank == 0 else None]
    dist.broadcast_object_list(shared)  # rank 0's directory for everyone's checkpoints (one machine)
    root = shared[0]
    # [/readme:setup]
    if rank == 0 and root is not None:  # removed at exit, also when a step raises
        atexit.register(shutil.rmtree, root, ignore_errors=True)
    say: Callable[..., None] = print if rank == 0 else (lambda *a, **k: None)
    check = Checks(rank)

    # [readme:tour]
    sd = dmp.state_dict()                        # TorchRec: ShardedTensors
    dts = tdb.state_dict_to_dtensor(sd)          # DTensors; local shards ARE the module's storage
    key = "ebc.embedding_bags.t_rw.weight"
    w = tdb.full_tensor(dts[key])                # collective; the whole table, right for uneven layouts
    tdb.visualize_sharding(dts[key], name="t_rw", print=True)   # printed on rank 0
    md = tdb.storage_metadata(dts[key])          # DCP metadata of all shards, every rank's
    sd2 = tdb.state_dict_to_sharded_tensor(dts)  # back; same storage, TorchRec's metadata

    dcp.save(dts, checkpoint_id=f"{root}/plain")  # plain DCP: uneven layouts save correct chunk metadata
    dcp.load(dts, checkpoint_id=f"{root}/plain")  # loads in place into the module's shards
    if rank == 0:  # not collective: plain DCP -> a committed, checksummed checkpoint
        tdb.checkpoint.migrate(f"{root}/plain", f"{root}/migrated", progress=False)
    dist.barrier()
    saved = tdb.checkpoint.inspect(f"{root}/migrated")  # {key: shape, dtype, shards, bytes}; no process group
    # [/readme:tour]
    for k, st in sd.items():
        ours = [t.data_ptr() for t in tdb.convert.local_shards_of(dts[k])]
        check.that(sorted(ours) == sorted(s.tensor.data_ptr() for s in st.local_shards()), f"{k}: a copy was made")
        meta = [(m.shard_offsets, m.shard_sizes, str(m.placement)) for m in st.metadata().shards_metadata]
        back = [(m.shard_offsets, m.shard_sizes, str(m.placement)) for m in sd2[k].metadata().shards_metadata]
        check.that(meta == back, f"{k}: ShardedTensor metadata after the round trip")
        check.that(saved[k]["shape"] == list(st.size()) and len(saved[k]["shards"]) == len(meta),
                   f"{k}: inspect says {saved[k]}")
    check.equal(w, tdb.full_tensor(sd[key]), "full_tensor of the DTensor vs of the ShardedTensor")
    check.that(sorted(c.offsets[0] for c in md.chunks) == [0, 7], f"storage_metadata chunks {md.chunks}")
    before = full_tables(dts, tables)
    say("tour: the state_dict as DTensors and back (zero-copy), a plain DCP save and load, migrate, inspect")

    # [readme:lookups]
    g = torch.Generator().manual_seed(rank)      # each rank looks up its own batch
    w = dts["ebc.embedding_bags.t_rw.weight"].requires_grad_()  # state_dict DTensors do not require grad
    ids = torch.randint(0, 13, (10 + 2 * rank,), generator=g)
    offsets = torch.tensor([0, 3, 3, 7])         # 4 bags (one empty) on every rank
    out = tdb.sharded_embedding_bag(ids, w, offsets, mode="mean")  # collective; this rank's batch
    out.sum().backward()                         # w.grad: a DTensor of w's layout, every rank's batch
    rows = tdb.sharded_embedding(ids, w)         # (len(ids), 8)

    w_tw, w_cw, w_trw = (dts[f"ebc.embedding_bags.{n}.weight"] for n in ("t_tw", "t_cw", "t_trw"))
    bags = [torch.randint(0, t.shape[0], (3 + rank, 2), generator=g) for t in (w_tw, w_cw, w_trw)]  # 2-D: bags of 2
    outs = tdb.sharded_embedding_bags(bags, [w_tw, w_cw, w_trw], mode=["sum", "mean", "max"])  # ONE exchange

    # DTensor ids: Replicate() = the same batch on every rank (DTensor's contract: the caller
    # guarantees it); Shard(0) ids (each rank its part of the batch) give a Shard(0) output.
    mesh = init_device_mesh("cpu", (world,))
    same = DTensor.from_local(torch.tensor([[0, 1], [2, 8]]), mesh, [Replicate()], run_check=False)
    cols = tdb.sharded_embedding_bag(same, w_cw, mode="sum")  # Shard(1): each rank its columns, no collective
    part = tdb.sharded_embedding_bag(same, w, mode="sum")  # Partial(): one all-reduce when redistributed

    # A module's tables sharded from rank 0's values (nn.EmbeddingBag, nn.Embedding, TorchRec's EBC):
    bag = tdb.shard_module(nn.EmbeddingBag(10, 4, mode="sum"),
                           {"weight": tdb.ShardLayout.row_wise((10, 4), [6, 4])}, mesh, src_rank=0)
    pooled = bag(torch.tensor([1, 7, 9, 5]), torch.tensor([0, 2]))  # collective; sharded lookups
    # [/readme:lookups]
    table = before["t_rw"].clone().requires_grad_()
    for i, o in gathered((ids, offsets)):
        F.embedding_bag(i, table, o, mode="mean").sum().backward()
    check.close(out, F.embedding_bag(ids, before["t_rw"], offsets, mode="mean"), "sharded_embedding_bag")
    assert w.grad is not None and table.grad is not None
    check.close(tdb.full_tensor(w.grad), table.grad, "the gradient of sharded_embedding_bag")
    check.equal(rows, F.embedding(ids, before["t_rw"]), "sharded_embedding")
    for o, i, n, m in zip(outs, bags, ("t_tw", "t_cw", "t_trw"), ("sum", "mean", "max")):
        check.close(o, F.embedding_bag(i, before[n], mode=m), f"sharded_embedding_bags, table {n}")
    check.that(cols.placements == (Shard(1),) and part.placements == (Partial(),),
               f"placements {cols.placements}, {part.placements}")
    check.close(cols.full_tensor(), F.embedding_bag(same.to_local(), before["t_cw"], mode="sum"), "Shard(1) output")
    check.close(part.full_tensor(), F.embedding_bag(same.to_local(), before["t_rw"], mode="sum"), "Partial() output")
    sharded = bag.weight
    assert isinstance(sharded, DTensor), type(sharded)
    check.close(pooled, F.embedding_bag(torch.tensor([1, 7, 9, 5]), tdb.full_tensor(sharded),
                                        torch.tensor([0, 2]), mode="sum"), "a shard_module'd nn.EmbeddingBag")
    say("lookups: equal to F.embedding_bag / F.embedding on the whole tables, gradients too")

    # A step of TorchRec's own fused Adagrad first, so that its optimizer has state to hand over.
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=list(tables), values=torch.tensor([1, 2, 3, 4, 5, 6, 7, 8]),
                                              lengths=torch.ones(8, dtype=torch.int64))
    dmp(kjt).values().sum().backward()
    start = full_tables(tdb.state_dict_to_dtensor(dmp.state_dict()), tables)
    theirs = torchrec_state(dmp, tables)

    # [readme:training]
    dts = tdb.state_dict_to_dtensor(dmp.state_dict())  # the module's tables, trained in place
    weights = {n: dts[f"ebc.embedding_bags.{n}.weight"].requires_grad_() for n in tables}
    opt = tdb.FusedOptimizer(weights, "adagrad", lr=0.1, eps=1e-8)  # as TorchRec's EXACT_ADAGRAD
    opt.load_torchrec_state_dict(dmp.fused_optimizer.state_dict())  # TorchRec's state in (any plan)
    batch = [torch.randint(0, t.shape[0], (4 + rank, 3), generator=g) for t in weights.values()]
    outs = tdb.sharded_embedding_bags(batch, list(weights.values()), mode="sum", optimizer=opt)
    torch.cat(outs, 1).sum().backward()          # updates the tables in place; .grad stays None
    opt.copy_to_torchrec_state_dict(dmp.fused_optimizer.state_dict())  # and out: TorchRec trains on

    tdb.checkpoint.save({**dts, **opt.state_dict()}, f"{root}/step1")  # weights and state: DTensors
    plan_b = {"t_tw": row_wise(compute_kernel="fused"), "t_rw": column_wise(ranks=[1, 0], compute_kernel="fused"),
              "t_cw": table_wise(rank=0, compute_kernel="fused"), "t_trw": table_wise(rank=1, compute_kernel="fused")}
    dmp_b = shard_model(plan_b)                  # every table in another layout
    dts_b = tdb.state_dict_to_dtensor(dmp_b.state_dict())
    opt_b = tdb.FusedOptimizer({n: dts_b[f"ebc.embedding_bags.{n}.weight"].requires_grad_() for n in tables},
                               "adagrad", lr=0.1, eps=1e-8)
    tdb.checkpoint.load({**dts_b, **opt_b.state_dict()}, f"{root}/step1")  # reshards weights and state
    opt_b.copy_to_torchrec_state_dict(dmp_b.fused_optimizer.state_dict())
    # [/readme:training]
    want, want_state = adagrad(start, theirs, gathered(batch), tables)
    state, out_a, out_b = opt.state_dict(), torchrec_state(dmp, tables), torchrec_state(dmp_b, tables)
    trained_tables = {}  # what the interop below must carry over exactly
    for n in tables:
        trained = trained_tables[n] = tdb.full_tensor(weights[n]).detach().clone()
        check.that(weights[n].grad is None, f"{n}: .grad set under a FusedOptimizer")
        check.close(trained, want[n], f"{n}: the table after a step vs torch's Adagrad")
        check.close(tdb.full_tensor(state[f"{n}.momentum1"]), want_state[n], f"{n}: the state after a step")
        check.equal(out_a[n], tdb.full_tensor(state[f"{n}.momentum1"]), f"{n}: the state copied to TorchRec")
        check.equal(tdb.full_tensor(dts_b[f"ebc.embedding_bags.{n}.weight"]), trained, f"{n}: loaded into plan B")
        check.equal(out_b[n], tdb.full_tensor(state[f"{n}.momentum1"]), f"{n}: the state loaded into plan B")
    forward_a, forward_b = dmp(kjt).to_dict(), dmp_b(kjt).to_dict()
    for n in tables:
        check.close(forward_b[n], forward_a[n], f"{n}: plan B's forward vs plan A's")
    with torch.no_grad():  # the interop checkpoint below must bring these back
        for n in tables:
            for t in tdb.convert.local_shards_of(dts_b[f"ebc.embedding_bags.{n}.weight"]):
                t.zero_()
    say("training: the FusedOptimizer's step == torch's Adagrad on the whole tables; state to and from "
        "TorchRec; weights and state loaded into another plan")

    # [readme:interop]
    # Our DTensors into TorchRec's own load_state_dict (same plan; a module with
    # output_dtensor=True, as here, or a default one), no hook of ours needed:
    dmp_c = shard_model(plan_a, output_dtensor=True)  # its state_dict holds TorchRec's own DTensors
    dmp_c.load_state_dict(tdb.state_dict_to_dtensor(dmp.state_dict()))
    # TorchRec's own DTensors (output_dtensor=True, or a 2-D DMPCollection's) through our whole API:
    sd_c = dmp_c.state_dict()
    k = "ebc.embedding_bags.t_cw.weight"
    whole = tdb.full_tensor(sd_c[k])
    md = tdb.storage_metadata(sd_c[k])
    picture = tdb.visualize_sharding(sd_c[k], name="t_cw")
    w = tdb.to_dtensor(sd_c[k])    # collective once: attaches the whole layout, zero-copy, same mesh
    out = tdb.sharded_embedding_bag(bags[1], w, mode="sum")
    dmp.load_state_dict(tdb.state_dict_to_sharded_tensor(sd_c))  # back into a ShardedTensor module
    tdb.checkpoint.save(sd_c, f"{root}/torchrec")
    tdb.checkpoint.load(dts_b, f"{root}/torchrec")  # in place, into any plan
    # [/readme:interop]
    for n in tables:
        k = f"ebc.embedding_bags.{n}.weight"
        check.equal(tdb.full_tensor(sd_c[k]), trained_tables[n], f"{n}: TorchRec's load_state_dict of our DTensors")
        check.equal(tdb.full_tensor(dts_b[k]), trained_tables[n], f"{n}: TorchRec's DTensors saved, loaded into plan B")
    check.equal(whole, trained_tables["t_cw"], "full_tensor of TorchRec's DTensor")
    check.that(sorted(c.offsets[1] for c in md.chunks) == [0, 8], f"storage_metadata chunks {md.chunks}")
    check.that("t_cw: 9x16" in picture, f"the picture of TorchRec's DTensor: {picture}")
    check.close(out, F.embedding_bag(bags[1], want["t_cw"], mode="sum"), "a lookup on TorchRec's DTensor")
    say("interop: TorchRec's load_state_dict takes our DTensors; its own DTensors go through our API")

    # [readme:checkpoints]
    model = tdb.enable_dtensor_state_dict(dmp)  # state_dict() -> DTensors; load_state_dict() reshards
    tdb.checkpoint.save(model.state_dict(), f"{root}/step100")  # collective, atomic, checksummed
    tdb.checkpoint.load(tdb.state_dict_to_dtensor(dmp_b.state_dict()), f"{root}/step100")  # any plan, world size
    info = tdb.checkpoint.inspect(f"{root}/step100")  # {key: shape, dtype, shards, bytes}; no process group

    # A TorchRec job in one call: the DMP and its optimizers are DCP Stateful values.
    state = {"model": dmp, "fused": dmp.fused_optimizer, "step": 100}
    tdb.checkpoint.save(state, f"{root}/latest")
    resumed = {"model": dmp_b, "fused": dmp_b.fused_optimizer, "step": 0}  # another plan (or world size)
    tdb.checkpoint.load(resumed, f"{root}/latest")  # all or nothing, resharded; resumed["step"] == 100
    # [/readme:checkpoints]
    final = full_tables(tdb.state_dict_to_dtensor(dmp.state_dict()), tables)
    final_state = torchrec_state(dmp, tables)
    resumed_tables = full_tables(tdb.state_dict_to_dtensor(dmp_b.state_dict()), tables)
    resumed_state = torchrec_state(dmp_b, tables)
    check.that(resumed["step"] == 100, f"the step after a one-call load: {resumed['step']}")
    check.that(info["ebc.embedding_bags.t_rw.weight"]["shape"] == [13, 8], f"inspect: {info}")
    for n in tables:
        check.equal(resumed_tables[n], final[n], f"{n}: the table resumed in one call under plan B")
        check.equal(resumed_state[n], final_state[n], f"{n}: TorchRec's fused state resumed in one call")
    say("checkpoints: a DMP's state_dict as DTensors saved and loaded into another plan; the DMP and its "
        "fused optimizer saved and resumed in one call")

    # [readme:submodule]
    # One sub-module's state out of a whole model's checkpoint (a new model's tables warm-started from
    # a trained job's): the sub-module goes under the key its state was saved under, "model" + "." +
    # its path in the model; nothing else of the checkpoint is read.
    fresh = shard_model(plan_b)                  # another model: any plan, any world size
    tdb.checkpoint.load({"model.ebc": fresh.module.ebc}, f"{root}/latest")
    # [/readme:submodule]
    warm = full_tables(tdb.state_dict_to_dtensor(fresh.state_dict()), tables)
    for n in tables:
        check.equal(warm[n], final[n], f"{n}: the sub-module loaded from the whole model's checkpoint")
    say("submodule: a sub-module's tables loaded from a whole model's checkpoint")

    # [readme:tracking]
    # Incremental checkpoints of a job trained by TorchRec's fused kernel: the rows its steps write are
    # recorded, so a save against the previous one digests only those rows (no scan of the tables).
    tracking = tdb.track_changed_rows(dmp)       # on every rank, between steps
    tdb.checkpoint.save(state, f"{root}/s0")     # the first save after it scans: it starts the record
    dmp(kjt).values().sum().backward()           # a step: TorchRec's fused Adagrad writes the rows looked up
    tdb.checkpoint.save(state, f"{root}/s1", base=f"{root}/s0")  # the rows written since s0
    still_scanned = tracking.scanned              # {key: why} of what this rank still scans
    # [/readme:tracking]
    tracking.remove()
    stepped = full_tables(tdb.state_dict_to_dtensor(dmp.state_dict()), tables)
    check.that(bool(tracking.tracked), "track_changed_rows tracks the fused tables")
    tdb.checkpoint.load(resumed, f"{root}/s1")  # the chain s1 -> s0, into plan B
    chained = full_tables(tdb.state_dict_to_dtensor(dmp_b.state_dict()), tables)
    for n in tables:
        check.equal(chained[n], stepped[n], f"{n}: the tracked incremental chain loaded into plan B")
    say("tracking: an incremental save of the DMP's fused training from the rows its step wrote")

    failures = check.verdict()
    if rank == 0:
        if failures:
            print("FAILED:\n  " + "\n  ".join(failures), file=sys.stderr)
        else:
            print(f"quickstart: every check passed on {world} ranks")
    dist.barrier()  # nobody tears the group down while a peer still uses it
    dist.destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
