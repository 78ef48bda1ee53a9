"""Which kernels the ranks of one lookup run when their kernel settings differ (2 gloo ranks).

The contract (``kernels/choose.py``): a lookup's ranks exchange what each of them can run, so that "an
implementation runs only where every rank has it", and where both C kernels can do the work a fixed rule
decides, the same on every rank. Ranks disagree only when made to; here one rank's worker changes the
environment it reads around one training step (restored after):

- ``TDB_NATIVE_KERNELS=0``: this rank has no native kernels (as where they could not be built);
- ``TDB_KERNELS=native|fbgemm``: this rank forces an implementation.

A rank that forces an implementation offers that one alone in the agreement. What this module checks:

1. what one rank lacks no rank runs: with rank 1 lacking the native kernels, rank 0 does not run them under
   ``auto``; when rank 0 forces them, the ranks have no C kernel in common and both run torch's math;
2. what one rank forces every rank runs: rank 0 or rank 1 forcing ours or fbgemm's kernels, the other rank
   under ``auto`` runs the same, whatever the rule prefers (for these small tables it prefers fbgemm's
   pooled sum and our row-wise Adagrad update, so forcing either kernel changes what one pass runs).

Which kernels ran is read from torch's profiler (``tdb::native_*`` for ours,
``fbgemm::split_embedding_*`` for fbgemm's; both C implementations are expected here, as the package's
other kernel tests expect them); in every case the outputs, weights and optimizer state equal
an unsharded reference, and the replicated table's copies are equal bitwise across the ranks.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist

import torchrec_dtensor_bridge as tdb
from torchrec_dtensor_bridge.convert import dtensor_from_local_shards, local_shards_of
from torchrec_dtensor_bridge.layout import ShardLayout

from .harness import make_pool_fixture
from .sparse_reference import SparseReference

pool = make_pool_fixture(2)

KIND = "rowwise_adagrad"  # both C implementations have its pooling and its update
HYPER = {"lr": 0.1, "eps": 1e-3}
SHAPE = (16, 8)
LAYOUTS = {"rw": ShardLayout.row_wise(SHAPE, 2), "rep": ShardLayout.replicated(SHAPE, [0, 1])}
STEPS = 2
ENV_VARS = ("TDB_KERNELS", "TDB_NATIVE_KERNELS")

# case -> (rank 0's environment, rank 1's environment)
CASES = {
    "alike": ({}, {}),
    "rank1_without_native": ({}, {"TDB_NATIVE_KERNELS": "0"}),
    "rank0_forces_native_rank1_without": ({"TDB_KERNELS": "native"}, {"TDB_NATIVE_KERNELS": "0"}),
    "rank0_forces_fbgemm": ({"TDB_KERNELS": "fbgemm"}, {}),
    "rank1_forces_fbgemm": ({}, {"TDB_KERNELS": "fbgemm"}),
    "rank0_forces_native": ({"TDB_KERNELS": "native"}, {}),
    "rank1_forces_native": ({}, {"TDB_KERNELS": "native"}),
}
FBGEMM_ONLY = {"forward": ["fbgemm"], "backward": ["fbgemm"]}
NATIVE_ONLY = {"forward": ["native"], "backward": ["native"]}
BY_RULE = {"forward": ["fbgemm"], "backward": ["native"]}  # kernels/choose.py's RULE for small fp32 tables
TORCH_ONLY: dict[str, list[str]] = {"forward": [], "backward": []}


@contextmanager
def _environment(values: Mapping[str, str]) -> Iterator[None]:
    """The kernel variables set to ``values`` (the others unset) inside, as they were after."""
    saved = {k: os.environ.get(k) for k in ENV_VARS}
    for k in ENV_VARS:
        os.environ.pop(k, None)
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _table(t: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(t))


def _batch(rank: int, step: int, t: int) -> dict:
    """Rank ``rank``'s bags of table ``t`` at ``step`` (sizes differ per rank; row 3 in every batch)."""
    g = torch.Generator().manual_seed(100 * step + 10 * t + rank)
    lengths = torch.randint(1, 4, (3 + rank,), generator=g)
    ids = torch.randint(0, SHAPE[0], (int(lengths.sum()),), generator=g)
    ids[0] = 3
    return {"input": ids, "offsets": torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)[:-1]])}


def _scale(rank: int, step: int, t: int) -> torch.Tensor:
    return torch.randn(3 + rank, SHAPE[1], generator=torch.Generator().manual_seed(7 + 100 * step + 10 * t + rank))


def _ran(prof: torch.profiler.profile) -> set[str]:
    """Which C implementations the profiled code ran: ``native`` (events ``tdb::native_*``), ``fbgemm``
    (``fbgemm::split_embedding_*``); neither: torch's ops."""
    names = {e.name for e in prof.events()}
    prefixes = {"native": "tdb::native_", "fbgemm": "fbgemm::split_embedding"}
    return {impl for impl, prefix in prefixes.items() if any(n.startswith(prefix) for n in names)}


def check_kernels_agree(rank: int, world: int, case: str) -> dict[str, list[str]]:
    """Two steps of one ``sharded_embedding_bags`` call over a row-wise and a replicated table with a fused
    optimizer, this rank's environment as ``case`` says; returns what ran in forward and in backward."""
    names = list(LAYOUTS)
    weights = {}
    for t, n in enumerate(names):
        lay = LAYOUTS[n].with_name(n)
        shards = [_table(t)[s.slices()].clone() for s in lay.shards_on(rank)]
        weights[n] = dtensor_from_local_shards(lay, shards).requires_grad_()
    refs = {n: SparseReference(_table(t), KIND, **HYPER) for t, n in enumerate(names)}
    opt = tdb.FusedOptimizer(weights, KIND, **HYPER)
    pooled: set[str] = set()
    updated: set[str] = set()
    with _environment(CASES[case][rank]):
        for step in range(STEPS):
            batches = [_batch(rank, step, t) for t in range(len(names))]
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                outs = tdb.sharded_embedding_bags([b["input"] for b in batches], list(weights.values()),
                                                  [b["offsets"] for b in batches], mode="sum", optimizer=opt)
            pooled |= _ran(prof)
            for t, n in enumerate(names):
                want = torch.nn.functional.embedding_bag(batches[t]["input"], refs[n].w, batches[t]["offsets"],
                                                         mode="sum")
                torch.testing.assert_close(outs[t], want, msg=lambda m, n=n: f"{case} step {step} {n}: {m}")
            loss = sum((o * _scale(rank, step, t)).sum() for t, o in enumerate(outs))
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                loss.backward()
            updated |= _ran(prof)
            for t, n in enumerate(names):
                refs[n].train([_batch(r, step, t) for r in range(world)], [_scale(r, step, t) for r in range(world)])
    for n, w in weights.items():
        torch.testing.assert_close(tdb.full_tensor(w), refs[n].w, msg=lambda m, n=n: f"{case}: {n}: {m}")
    for key, value in opt.state_dict().items():
        n = key.split(".")[0]
        torch.testing.assert_close(tdb.full_tensor(value), refs[n].state(n)[key], msg=lambda m, k=key: f"{k}: {m}")
    mine = [s.clone() for s in local_shards_of(weights["rep"])]
    every: list = [None] * world
    dist.all_gather_object(every, mine)
    for r, theirs in enumerate(every):
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs)), (
            f"{case}: the replicated table's copy on rank {r} differs bitwise from rank {rank}'s")
    return {"forward": sorted(pooled), "backward": sorted(updated)}


SLOW_CASES = ("rank0_forces_fbgemm", "rank1_forces_native")
"""Cases the default run leaves to the slow one: each mirrors a default case on the other rank."""


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW_CASES else c for c in CASES])
def test_ranks_run_what_every_rank_has_as_the_rule_chooses(pool, case):
    ran = pool.run(check_kernels_agree, case)
    if case == "alike":  # the rule (docs/kernels.md): fbgemm's pooled sum, our row-wise Adagrad update
        assert ran == [BY_RULE, BY_RULE], ran
    elif case == "rank1_without_native":  # rank 0 may run what the rule prefers only where rank 1 has it
        assert ran == [FBGEMM_ONLY, FBGEMM_ONLY], ran
    elif case == "rank0_forces_native_rank1_without":  # no C kernel in common: torch's math on both
        assert ran == [TORCH_ONLY, TORCH_ONLY], ran
    elif case.endswith("forces_fbgemm"):  # the other rank follows, whatever the rule prefers
        assert ran == [FBGEMM_ONLY, FBGEMM_ONLY], ran
    else:
        assert ran == [NATIVE_ONLY, NATIVE_ONLY], ran
