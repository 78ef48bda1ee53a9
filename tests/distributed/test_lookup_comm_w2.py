"""Communication counts of the sharded lookups on 2 gloo ranks: a regression that adds a collective fails.

Counted with torch's ``CommDebugMode`` (``torch.distributed.tensor.debug``): it
is a dispatch mode, and the c10d functions the library calls
(``dist.all_gather``, ``dist.reduce_scatter``, ``dist.all_to_all_single``,
``dist.all_reduce``) dispatch ``c10d.allgather_``, ``c10d.reduce_scatter_``,
``c10d.alltoall_base_`` and ``c10d.allreduce_``, which it counts like the
functional collectives DTensor uses (``test_counter_sees_c10d_calls`` keeps
that assumption honest; backward runs on the calling thread on CPU, so the
mode sees it too).

The expected counts are the design documented in ``lookup/strategies/`` and
``lookup/functional.py``. Every plain-tensor call starts with ONE agreement
``all_gather`` (verdicts, batch sizes, options); then, unless the weight is
replicated, ONE ``all_to_all`` of all ranks' ids to the ranks that compute
for the table (row cuts: each id to the rank holding its row; the counts ride
in the agreement step) - a second one only for ``per_sample_weights``; then
per strategy:

* LOCAL (replicated weight): nothing in forward; backward one ``all_reduce`` of the gradient;
* REDUCE (row-wise, grid): forward one reduce-scatter, made of ONE ``all_to_all`` (gloo's own
  ``reduce_scatter`` is slower: ``collectives.py``) (max: one ``all_reduce(MAX)``, plus one
  ``all_reduce(MIN)`` picking the winning rank when a gradient is tracked); backward one all-gather of the
  output gradients, also ONE ``all_to_all``;
* COLUMNS (column-wise, table-wise): forward one ``all_to_all``; backward one ``all_to_all``;
* ``max_norm`` on column-cut rows: one more ``all_reduce`` of partial norms.

What the lookups promise beyond this - no data collective for column-wise
with a REPLICATED input, and a row-wise output that stays ``Partial`` and is
completed by one ``all_reduce`` - needs a ``Replicate`` DTensor input:
``test_spec_replicated_dtensor_input`` checks it. Its forward still runs the
agreement step (ONE small ``all_gather``): a rank whose "replicated" batch,
kind or options differ from the others' must make every rank raise.
A plain tensor is always "this rank's own batch": identical batches on every
rank are NOT recognised as replicated (``column_wise_same_batch`` below).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from torchrec_dtensor_bridge.layout import ShardLayout

from .checks import layouts_w2
from .harness import make_pool_fixture

pool = make_pool_fixture(2)

_NAMES = {
    "allgather_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "_allgather_base_": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "allreduce_": "all_reduce",
    "all_reduce": "all_reduce",
    "reduce_scatter_": "reduce_scatter",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "alltoall_base_": "all_to_all",
    "alltoall_": "all_to_all",
    "all_to_all_single": "all_to_all",
    "broadcast_": "broadcast",
    "broadcast": "broadcast",
    "send": "send",
    "recv_": "recv",
    "barrier": "barrier",
}


class CommCounter:
    """Collectives issued inside ``with``: ``{"all_gather": n, ...}`` (zero counts left out)."""

    def __enter__(self) -> CommCounter:
        from torch.distributed.tensor.debug import CommDebugMode

        self._mode = CommDebugMode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._mode.__exit__(*exc)
        counts: Counter[str] = Counter()
        for op, n in self._mode.get_comm_counts().items():
            name = str(op).split(".")[-1]
            counts[_NAMES.get(name, name)] += n
        self.counts = {k: v for k, v in counts.items() if v}


def _table(shape: tuple[int, int]) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(7))


def _weight(layout: ShardLayout, table: torch.Tensor, rank: int):
    from torchrec_dtensor_bridge.convert import dtensor_from_local_shards

    return dtensor_from_local_shards(layout, [table[s.slices()].clone() for s in layout.shards_on(rank)]).requires_grad_()


SHAPE = (12, 8)

LAYOUTS = layouts_w2(SHAPE)

AGREE = {"all_gather": 1}  # the agreement step of every call
GATHER_IDS = {"all_to_all": 1}  # all ranks' ids to the computing ranks, for every strategy but LOCAL


def _plus(*parts: dict[str, int]) -> dict[str, int]:
    out: Counter[str] = Counter()
    for p in parts:
        out.update(p)
    return dict(out)


LOCAL = (AGREE, {"all_reduce": 1})
REDUCE = (_plus(AGREE, GATHER_IDS, {"all_to_all": 1}), {"all_to_all": 1})
COLUMNS = (_plus(AGREE, GATHER_IDS, {"all_to_all": 1}), {"all_to_all": 1})

# name: (layout, call, options, same batch on every rank, (forward counts, backward counts))
CASES: dict[str, tuple[str, str, dict, bool, tuple[dict, dict]]] = {
    # the strategies, mode="sum"
    "replicated": ("replicated", "bag", {}, False, LOCAL),
    "row_wise": ("row_wise", "bag", {}, False, REDUCE),
    "row_wise_two_per_rank": ("row_wise_two_per_rank", "bag", {}, False, REDUCE),
    "grid": ("grid", "bag", {}, False, REDUCE),
    "column_wise": ("column_wise", "bag", {}, False, COLUMNS),
    "column_wise_two_per_rank": ("column_wise_two_per_rank", "bag", {}, False, COLUMNS),
    "table_wise": ("table_wise", "bag", {}, False, COLUMNS),
    # mean divides locally after the exchange: no extra collective
    "row_wise_mean": ("row_wise", "bag", {"mode": "mean"}, False, REDUCE),
    "column_wise_mean": ("column_wise", "bag", {"mode": "mean"}, False, COLUMNS),
    # max: all_reduce(MAX) instead of the reduce-scatter, plus all_reduce(MIN) for the winners (grad tracked)
    "row_wise_max": ("row_wise", "bag", {"mode": "max"}, False,
                     (_plus(AGREE, GATHER_IDS, {"all_reduce": 2}), {"all_to_all": 1})),
    "column_wise_max": ("column_wise", "bag", {"mode": "max"}, False, COLUMNS),
    # per_sample_weights travel in a second all_to_all
    "row_wise_psw": ("row_wise", "bag", {"mode": "sum", "psw": True}, False,
                     (_plus(AGREE, GATHER_IDS, GATHER_IDS, {"all_to_all": 1}), {"all_to_all": 1})),
    # max_norm: whole rows local -> no collective; column-cut rows -> one all_reduce of partial norms;
    # a replicated weight gathers the ids so every replica renormalises the same rows
    "row_wise_max_norm": ("row_wise", "bag", {"max_norm": 1.0}, False, REDUCE),
    "column_wise_max_norm": ("column_wise", "bag", {"max_norm": 1.0}, False,
                             (_plus(COLUMNS[0], {"all_reduce": 1}), COLUMNS[1])),
    "replicated_max_norm": ("replicated", "bag", {"max_norm": 1.0}, False, (_plus(AGREE, GATHER_IDS), LOCAL[1])),
    # un-pooled lookups follow the same strategies
    "embedding_row_wise": ("row_wise", "embedding", {}, False, REDUCE),
    "embedding_column_wise": ("column_wise", "embedding", {}, False, COLUMNS),
    # the same plain batch on every rank is still "each rank's own batch" (the zero-communication
    # replicated-input path needs a DTensor input: see test_spec_replicated_dtensor_input)
    "column_wise_same_batch": ("column_wise", "bag", {}, True, COLUMNS),
}


def _ids(rank: int, same: bool) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0 if same else 11 + rank)
    n_bags = 4 if same else 3 + rank
    ids = torch.randint(0, SHAPE[0], (3 * n_bags,), generator=g)
    return ids, torch.arange(0, ids.numel(), 3)


def count_case(rank: int, world_size: int, name: str) -> tuple[dict, dict, dict]:
    """Counts of one lookup's forward and backward, and (no_grad) forward, on this rank."""
    from torchrec_dtensor_bridge.lookup import sharded_embedding, sharded_embedding_bag

    layout_name, call, opts, same, _ = CASES[name]
    layout = LAYOUTS[layout_name].with_name(layout_name)
    opts = dict(opts)
    ids, offsets = _ids(rank, same)
    if opts.pop("psw", False):
        opts["per_sample_weights"] = torch.rand(ids.shape, generator=torch.Generator().manual_seed(rank))

    def lookup(weight):
        if call == "embedding":
            return sharded_embedding(ids.view(-1, 3), weight, **opts)
        return sharded_embedding_bag(ids, weight, offsets, **opts)

    weight = _weight(layout, _table(SHAPE), rank)
    with CommCounter() as fwd:
        out = lookup(weight)
    with CommCounter() as bwd:
        out.sum().backward()
    assert weight.grad is not None
    with torch.no_grad(), CommCounter() as fwd_no_grad:
        lookup(_weight(layout, _table(SHAPE), rank))
    return fwd.counts, bwd.counts, fwd_no_grad.counts


@pytest.mark.parametrize("name", sorted(CASES))
def test_comm_counts(pool, name):
    want_fwd, want_bwd = CASES[name][-1]
    for rank, (fwd, bwd, fwd_no_grad) in enumerate(pool.run(count_case, name)):
        assert fwd == want_fwd, f"{name} forward on rank {rank}: {fwd}, design says {want_fwd}"
        assert bwd == want_bwd, f"{name} backward on rank {rank}: {bwd}, design says {want_bwd}"
        # without a gradient to track, the forward is the same - except max's winner all_reduce
        want_ng = dict(want_fwd)
        if CASES[name][2].get("mode") == "max" and "all_reduce" in want_ng:
            want_ng["all_reduce"] -= 1
        assert fwd_no_grad == want_ng, f"{name} no_grad forward on rank {rank}: {fwd_no_grad}, design says {want_ng}"


# ------------------------------------------------------------ the counter itself
def counter_self_check(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    t = torch.ones(4)
    with CommCounter() as c:
        dist.all_reduce(t)
        dist.all_gather([torch.empty(4) for _ in range(world_size)], t)
        dist.reduce_scatter(torch.empty(2), list(t.split(2)))
        dist.all_to_all_single(torch.empty(4), t)
    with CommCounter() as idle:
        torch.ones(3).sum()
    return {"c10d": c.counts, "idle": idle.counts}


def test_counter_sees_c10d_calls(pool):
    """CommDebugMode counts the plain c10d calls the library makes (else every count above would be 0)."""
    for got in pool.run(counter_self_check):
        assert got["c10d"] == {"all_reduce": 1, "all_gather": 1, "reduce_scatter": 1, "all_to_all": 1}, got
        assert got["idle"] == {}


# ------------------------------------------------------------ replicated DTensor input
def spec_replicated_input(rank: int, world_size: int) -> dict:
    """With a ``Replicate`` DTensor input: column-wise lookups communicate nothing in forward or
    backward (the output stays sharded on the embedding dim until gathered); a row-wise output stays
    ``Partial`` and one all_reduce completes it. Returns the counts."""
    from torch.distributed.tensor import DTensor, Replicate

    import torchrec_dtensor_bridge as tdb
    from torchrec_dtensor_bridge.lookup import sharded_embedding_bag

    ids, offsets = _ids(0, True)  # the same batch everywhere
    table = _table(SHAPE)
    ref = torch.nn.functional.embedding_bag(ids, table, offsets, mode="sum")
    got: dict = {}
    for name in ("column_wise", "row_wise"):
        weight = _weight(LAYOUTS[name], table, rank)
        mesh = weight.device_mesh
        d_ids = DTensor.from_local(ids, mesh, [Replicate()], run_check=False)
        d_off = DTensor.from_local(offsets, mesh, [Replicate()], run_check=False)
        with CommCounter() as fwd:
            out = sharded_embedding_bag(d_ids, weight, d_off, mode="sum")
        assert isinstance(out, DTensor), f"{name}: a DTensor input must give a DTensor output, got {type(out)}"
        with CommCounter() as bwd:
            out.to_local().sum().backward()  # local grads only: no collective may be needed
        with CommCounter() as complete:
            full = out.full_tensor()
        torch.testing.assert_close(full, ref, rtol=1e-5, atol=1e-5)
        got[name] = {"fwd": fwd.counts, "bwd": bwd.counts, "complete": complete.counts,
                     "placements": [str(p) for p in out.placements]}
        assert tdb.layout_of(weight.grad).shards == LAYOUTS[name].shards
    return got


def test_spec_replicated_dtensor_input(pool):
    results = pool.run(spec_replicated_input)
    for rank, got in enumerate(results):
        cw, rw = got["column_wise"], got["row_wise"]
        assert cw["fwd"] == {} and cw["bwd"] == {}, (
            f"rank {rank}: column-wise with replicated input communicated (DTensor's contract: nothing): {cw}"
        )
        assert rw["complete"] == {"all_reduce": 1}, f"rank {rank}: row-wise partial output completed by {rw}"
        assert cw["placements"] == ["S(1)"], cw
        assert rw["placements"] == ["P(sum)"], rw
        assert rw["fwd"] == {}, (
            f"rank {rank}: row-wise lookup with replicated input reduced before the output was asked for: {rw}"
        )


# ------------------------------------------------------------ several tables in one call
_TW = [ShardLayout.table_wise(SHAPE, t % 2).with_name(f"tw{t}") for t in range(20)]

# name: (layouts, forward counts, backward counts) - independent of the number of tables
MULTI: dict[str, tuple[list[ShardLayout], dict, dict]] = {
    # one table: exactly the single-table call (one agreement all_gather, ids, one all_to_all)
    "table_wise_x1": (_TW[:1], COLUMNS[0], COLUMNS[1]),
    # ONE agreement all_gather (up to 16 tables), ONE ids exchange and ONE all_to_all for all tables
    "table_wise_x2": (_TW[:2], COLUMNS[0], COLUMNS[1]),
    "table_wise_x16": (_TW[:16], COLUMNS[0], COLUMNS[1]),
    # more than 16 tables: a second agreement all_gather for the others
    "table_wise_x20": (_TW, _plus(COLUMNS[0], AGREE), COLUMNS[1]),
    # every strategy at once: one all_to_all (table/column-wise), one all_to_all reduce-scatter (row-wise,
    # grid); the replicated table needs no ids and, in backward, all-reduces its gradient
    "mixed": ([_TW[0], LAYOUTS["column_wise_two_per_rank"], LAYOUTS["row_wise"], LAYOUTS["grid"],
               LAYOUTS["replicated"], _TW[1]],
              _plus(AGREE, GATHER_IDS, {"all_to_all": 2}),
              {"all_to_all": 2, "all_reduce": 1}),
}


def count_multi(rank: int, world_size: int, name: str) -> tuple[dict, dict]:
    import torchrec_dtensor_bridge as tdb

    layouts = MULTI[name][0]
    weights = [_weight(lay, _table(SHAPE), rank) for lay in layouts]
    ids, offsets = _ids(rank, False)
    with CommCounter() as fwd:
        outs = tdb.sharded_embedding_bags([ids] * len(weights), weights, [offsets] * len(weights), mode="sum")
    with CommCounter() as bwd:
        torch.stack(outs).sum().backward()
    assert all(w.grad is not None for w in weights)
    return fwd.counts, bwd.counts


@pytest.mark.parametrize("name", sorted(MULTI))
def test_comm_counts_several_tables(pool, name):
    _, want_fwd, want_bwd = MULTI[name]
    for rank, (fwd, bwd) in enumerate(pool.run(count_multi, name)):
        assert fwd == want_fwd, f"{name} forward on rank {rank}: {fwd}, design says {want_fwd}"
        assert bwd == want_bwd, f"{name} backward on rank {rank}: {bwd}, design says {want_bwd}"
