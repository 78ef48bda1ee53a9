"""``tdb.reshard`` of a ``shard_module`` model on 3 gloo ranks: every table changes layout mid-training.

A TorchRec ``EmbeddingBagCollection`` of five tables, sharded by ``tdb.shard_module`` under ``BEFORE``,
trains 4 steps (``torch.optim.Adam``, ``torch.optim.Adagrad``, or a ``FusedOptimizer`` with row-wise
Adagrad or Adam applied in backward; row-wise Adagrad on fp16 tables too), is resharded in memory to
``AFTER`` (every table changes its layout: row-wise even and uneven, table-wise, column-wise, grid, a rank
holding nothing) and trains 4 more; the same from and to data-parallel layouts (``REPLICATED_BEFORE`` ->
``REPLICATED_AFTER``: whole tables and row or column blocks held by several ranks, a replicated table
listed in another order of ranks, which must not move).
The reference is the same job saved after step 4 with ``tdb.checkpoint.save`` and loaded into a fresh
model sharded under ``AFTER``: losses, tables and every optimizer state ``torch.equal``, and every copy
of every block equal to the whole tensor's box. The bytes each rank sends are counted by wrapping
``batch_isend_irecv`` and equal those of the blocks that change owner, computed here from the two plans'
holders of every element (a rank lacking an element takes it from its first holder). Gradients pending
at the reshard move with their tables; a model on a sub-mesh reshards on its group. Refused plans
(another world size, another shape, an unknown table, overlapping blocks) and a failed transfer leave the
model and the optimizers as they were (``torch.equal``), and every rank raises.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import torchrec_dtensor_bridge as tdb
from torchrec_dtensor_bridge.convert.dtensor import local_shards_of
from torchrec_dtensor_bridge.convert.placements import world_mesh
from torchrec_dtensor_bridge.layout import ShardLayout
from torchrec_dtensor_bridge.resharding.tables import held

from .checks import expect_raises
from .harness import make_pool_fixture
from .torchrec_models import build_ebc, random_kjt

pool = make_pool_fixture(3)

TABLES = {"a": (13, 8), "b": (11, 8), "c": (9, 12), "d": (10, 6), "e": (7, 4)}
CFG = {n: (r, d, "") for n, (r, d) in TABLES.items()}
BEFORE = {
    "a": ShardLayout.row_wise((13, 8), 3),
    "b": ShardLayout.table_wise((11, 8), 2),
    "c": ShardLayout.column_wise((9, 12), [4, 8], ranks=[0, 1]),
    "d": ShardLayout.grid((10, 6), [5, 5], [3, 3], [0, 1, 2, 0]),
    "e": ShardLayout.row_wise((7, 4), [3, 0, 4]),
}
AFTER = {
    "a": ShardLayout.column_wise((13, 8), [3, 5], ranks=[2, 0]),
    "b": ShardLayout.row_wise((11, 8), [2, 5, 4], ranks=[1, 2, 0]),
    "c": ShardLayout.grid((9, 12), [4, 5], [6, 6], [2, 0, 1, 2]),
    "d": ShardLayout.table_wise((10, 6), 1),
    "e": ShardLayout.row_wise((7, 4), 3),
}
STEPS = 4
OPTIMIZERS = ["adam", "adagrad", "fused_rowwise_adagrad", "fused_adam", "fused_rowwise_adagrad_fp16"]


def _key(n: str) -> str:
    return f"embedding_bags.{n}.weight"


def _plan(layouts: dict[str, ShardLayout]) -> dict[str, ShardLayout]:
    return {_key(n): lay for n, lay in layouts.items()}


def _job(layouts: dict[str, ShardLayout], kind: str):
    ebc = build_ebc(CFG, seed=5)
    half = kind.endswith("_fp16")
    model = tdb.shard_module(ebc.half() if half else ebc, _plan(layouts), world_mesh("cpu"))
    if kind == "adam":
        opt = torch.optim.Adam(model.parameters(), lr=0.05)
    elif kind == "adagrad":
        opt = torch.optim.Adagrad(model.parameters(), lr=0.1)
    else:
        weights = {n: model.embedding_bags[n].weight for n in TABLES}
        opt = tdb.FusedOptimizer(weights, kind.removeprefix("fused_").removesuffix("_fp16"), lr=0.05, eps=1e-3,
                                 stochastic_rounding=not half)  # rounding to nearest: no random state to match
    return model, opt


def _step(model, opt, step: int, rank: int) -> torch.Tensor:
    kjt = random_kjt(CFG, batch=4, seed=100 * step + rank)
    fused = isinstance(opt, tdb.FusedOptimizer)
    out = (model(kjt, optimizer=opt) if fused else model(kjt)).to_dict()
    g = torch.Generator().manual_seed(7 + 10 * step + rank)
    loss = sum((out[k] * torch.randn(out[k].shape, generator=g)).sum() for k in sorted(out))
    loss.backward()
    if not fused:
        opt.step()
        opt.zero_grad()
    return loss.detach()


def _whole(v: object) -> object:
    return tdb.full_tensor(v) if isinstance(v, DTensor) else v.clone() if isinstance(v, torch.Tensor) else v


def _snapshot(model, opt) -> dict[str, object]:
    """Every table and optimizer state, whole (collective: every rank, the same order)."""
    out: dict[str, object] = {f"table {k}": _whole(p) for k, p in model.named_parameters()}
    if isinstance(opt, tdb.FusedOptimizer):
        out.update({f"state {k}": _whole(v) for k, v in sorted(opt.state_dict().items())})
        return out
    names = {id(p): k for k, p in model.named_parameters()}
    assert sorted(names) == sorted(id(p) for g in opt.param_groups for p in g["params"]), "groups' parameters"
    for p, state in opt.state.items():
        assert id(p) in names, "the optimizer's state is keyed by a parameter the model no longer holds"
        for k, v in state.items():
            if isinstance(v, DTensor) and v.shape == p.shape:
                assert held(tdb.layout_of(v)) == held(tdb.layout_of(p)), f"state {names[id(p)]}.{k} is not in " \
                                                                         f"its table's layout"
        out.update({f"state {names[id(p)]}.{k}": _whole(v) for k, v in sorted(state.items())})
    return out


def _assert_equal(got: dict, want: dict, what: str) -> None:
    assert sorted(got) == sorted(want), (what, sorted(got), sorted(want))
    for k, v in want.items():
        same = torch.equal(got[k], v) if isinstance(v, torch.Tensor) else got[k] == v
        assert same, f"{what}: {k} differs on rank {dist.get_rank()}"


class _Sends:
    """Counts the bytes this rank sends through ``batch_isend_irecv`` while installed."""

    def __init__(self) -> None:
        self.bytes = 0
        self._real = dist.batch_isend_irecv

    def __enter__(self) -> _Sends:
        def counting(ops):
            self.bytes += sum(op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is dist.isend)
            return self._real(ops)

        dist.batch_isend_irecv = counting
        return self

    def __exit__(self, *exc: object) -> None:
        dist.batch_isend_irecv = self._real


def _first_holders(layout: ShardLayout) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """For each element, the rank of the first block (in layout order) holding it, the copy a replicated
    element is sent from; and for each rank, which elements it holds."""
    first = torch.full(layout.global_shape, -1, dtype=torch.int64)
    for s in reversed(layout.shards):
        first[s.slices()] = s.rank
    holds: dict[int, torch.Tensor] = {}
    for s in layout.shards:
        holds.setdefault(s.rank, torch.zeros(layout.global_shape, dtype=torch.bool))[s.slices()] = True
    return first, holds


def _changing_bytes(rank: int, per_element: int, per_row: int = 0, layouts: str = "mixed") -> int:
    """The bytes of the elements (and per-row values) ``rank`` holds before that a rank not holding them
    takes after (``layouts``: a key of :data:`SCHEDULES`): each new block's elements its rank did not hold,
    sent by the first old block holding them."""
    before_plan, after_plan = SCHEDULES[layouts]
    total = 0
    for n, before in before_plan.items():
        first, holds = _first_holders(before)
        rows_sent: set[tuple[int, int]] = set()
        for s in after_plan[n].shards:
            if s.rank == rank:
                continue
            had = holds[s.rank][s.slices()] if s.rank in holds else torch.zeros(s.sizes, dtype=torch.bool)
            total += int(((first[s.slices()] == rank) & ~had).sum()) * per_element
            for r in range(s.offsets[0], s.offsets[0] + s.sizes[0]):
                if per_row and (s.rank, r) not in rows_sent:
                    holders = [b.rank for b in before.shards if b.offsets[0] <= r < b.offsets[0] + b.sizes[0]]
                    if s.rank not in holders and holders[0] == rank:
                        total += per_row
                    rows_sent.add((s.rank, r))
    return total


def _replicas_agree(model, opt, what: str) -> None:
    """Every block this rank holds of every table, gradient and optimizer state equals its box of the whole
    tensor: each copy of a replicated block was filled, not only the one a whole tensor reads (collective)."""
    values: dict[str, object] = {}
    for k, p in model.named_parameters():
        values[k] = p
        values[f"{k}.grad"] = p.grad
    if isinstance(opt, tdb.FusedOptimizer):
        values.update(opt.state_dict())
    else:
        names = {id(p): k for k, p in model.named_parameters()}
        values.update({f"{names[id(p)]}.{k}": v for p, state in opt.state.items() for k, v in state.items()})
    for k, v in values.items():
        if not isinstance(v, DTensor):
            continue
        whole = tdb.full_tensor(v)
        for s, t in zip(tdb.layout_of(v).shards_on(dist.get_rank()), local_shards_of(v), strict=True):
            assert torch.equal(t, whole[s.slices()]), f"{what}: {k}: rank {dist.get_rank()}'s block {s} differs"


# ----------------------------------------------------------------------------------------------- checks
def _live(rank: int, kind: str, schedule: list[tuple[dict, int]]) -> tuple[list[torch.Tensor], dict, list[int]]:
    """Train under each plan of ``schedule`` for its steps, resharding in memory between them; the losses, the
    final snapshot and the bytes each reshard sent."""
    model, opt = _job(schedule[0][0], kind)
    losses: list[torch.Tensor] = []
    sent = []
    step = 0
    for k, (layouts, steps) in enumerate(schedule):
        if k:
            before = _snapshot(model, opt)
            old = dict(model.named_parameters())
            storage = {n: [t.data_ptr() for t in local_shards_of(p)] for n, p in old.items()}
            with _Sends() as sends:
                assert tdb.reshard(model, _plan(layouts), optimizers=[opt]) is model
            sent.append(sends.bytes)
            for n, lay in layouts.items():
                w = model.embedding_bags[n].weight
                assert held(tdb.layout_of(w)) == held(lay), n
                assert w is old[_key(n)], f"{n}: the parameter is another object"
                if held(lay) == held(schedule[k - 1][0][n]):  # the same blocks, listed in another order
                    assert [t.data_ptr() for t in local_shards_of(w)] == storage[_key(n)], f"{n} was moved"
            _assert_equal(_snapshot(model, opt), before, f"{kind}: right after reshard {k}")
            _replicas_agree(model, opt, f"{kind}: right after reshard {k}")
        losses += [_step(model, opt, step + s, rank) for s in range(steps)]
        step += steps
    _replicas_agree(model, opt, f"{kind}: at the end")
    return losses, _snapshot(model, opt), sent


def _resumed(rank: int, kind: str, schedule: list[tuple[dict, int]], path: str) -> tuple[list[torch.Tensor], dict]:
    """The same schedule, each change of plan a checkpoint save and a load into a fresh model under the new plan."""
    model, opt = _job(schedule[0][0], kind)
    losses: list[torch.Tensor] = []
    step = 0
    for k, (layouts, steps) in enumerate(schedule):
        if k:
            tdb.checkpoint.save({"model": model, "opt": opt}, f"{path}-{k}")
            model, opt = _job(layouts, kind)
            tdb.checkpoint.load({"model": model, "opt": opt}, f"{path}-{k}")
        losses += [_step(model, opt, step + s, rank) for s in range(steps)]
        step += steps
    return losses, _snapshot(model, opt)


PER_ELEMENT = {"adam": 12, "adagrad": 8, "fused_rowwise_adagrad": 4, "fused_adam": 12,  # weight + states, bytes
               "fused_rowwise_adagrad_fp16": 2}


def _equals_a_checkpoint_resume(rank: int, world: int, kind: str, path: str, layouts: str = "mixed") -> None:
    before, after = SCHEDULES[layouts]
    losses, final, sent = _live(rank, kind, [(before, STEPS), (after, STEPS)])
    per_row = 4 if kind.startswith("fused_rowwise_adagrad") else 0
    assert sent == [_changing_bytes(rank, PER_ELEMENT[kind], per_row, layouts)], (sent, rank)
    want, want_final = _resumed(rank, kind, [(before, STEPS), (after, STEPS)], path)
    for s, (a, b) in enumerate(zip(losses, want, strict=True)):
        assert torch.equal(a, b), f"{kind}: loss of step {s} on rank {rank}: {a} != {b}"
    _assert_equal(final, want_final, f"{kind}: after {2 * STEPS} steps")


@pytest.mark.parametrize("kind", OPTIMIZERS)
def test_reshard_mid_training_equals_a_checkpoint_resume_under_the_new_plan(pool, tmp_path, kind):
    pool.run(_equals_a_checkpoint_resume, kind, str(tmp_path / kind))


def _hybrid(shape: tuple[int, int], rows: list[int], ranks: list[tuple[int, int]]) -> ShardLayout:
    """Row blocks of ``rows`` heights, each held by the two ranks of its pair (hybrid replication)."""
    starts = [sum(rows[:i]) for i in range(len(rows))]
    return ShardLayout.from_shards(shape, [(r, (o, 0), (h, shape[1])) for o, h, pair in zip(starts, rows, ranks)
                                           for r in pair])


REPLICATED_BEFORE = {  # data parallel: every table's elements on two or three ranks, or on all of them
    "a": ShardLayout.replicated((13, 8), [0, 1, 2]),
    "b": ShardLayout.row_wise((11, 8), 3),
    "c": ShardLayout.replicated((9, 12), [0, 1, 2]),
    "d": ShardLayout.replicated((10, 6), [2, 1]),
    "e": _hybrid((7, 4), [3, 4], [(0, 1), (2, 0)]),
}
REPLICATED_AFTER = {
    "a": ShardLayout.row_wise((13, 8), [2, 5, 6], ranks=[1, 2, 0]),
    "b": ShardLayout.replicated((11, 8), [2, 0, 1]),  # each rank takes the rows it lacks from their holder
    "c": ShardLayout.replicated((9, 12), [2, 0, 1]),  # the same blocks listed in another order: nothing moves
    "d": ShardLayout.from_shards((10, 6), [(0, (0, 0), (10, 2)), (2, (0, 0), (10, 2)), (1, (0, 2), (10, 4)),
                                           (0, (0, 2), (10, 4))]),  # column blocks, each on two ranks
    "e": ShardLayout.replicated((7, 4), [1, 2]),  # each row block from its first copy; rank 0 drops its rows
}
SCHEDULES = {"mixed": (BEFORE, AFTER), "replicated": (REPLICATED_BEFORE, REPLICATED_AFTER)}


@pytest.mark.parametrize("kind", ["fused_rowwise_adagrad", *(  # torch.optim's replicated states: the next test
    pytest.param(k, marks=pytest.mark.slow) for k in OPTIMIZERS if k != "fused_rowwise_adagrad")])
def test_data_parallel_tables_reshard_as_a_checkpoint_resume_moving_each_missing_block_once(pool, tmp_path, kind):
    """Replicated tables and blocks on both sides: every new copy is filled (each rank's blocks equal the
    whole tensor's), each from one holder, and the bytes sent are those a rank lacked."""
    pool.run(_equals_a_checkpoint_resume, kind, str(tmp_path / kind), "replicated")


def _gradients_pending(rank: int, world: int) -> None:
    """Resharded between backward and ``opt.step()``: the gradients (replicated ones too) move with their
    tables, each copy filled, and the step then equals the one taken before resharding; the bytes sent
    are those of weight, gradient and Adagrad's ``sum``."""
    before, after = SCHEDULES["replicated"]
    runs = []
    for reshard_first in (True, False):
        model, opt = _job(before, "adagrad")
        losses = [_step(model, opt, s, rank) for s in range(2)]
        out = model(random_kjt(CFG, batch=4, seed=999 + rank)).to_dict()
        sum(out[k].sum() * (i + 1) for i, k in enumerate(sorted(out))).backward()
        if reshard_first:
            grads = {k: tdb.full_tensor(p.grad) for k, p in model.named_parameters()}
            with _Sends() as sends:
                tdb.reshard(model, _plan(after), optimizers=[opt])
            assert sends.bytes == _changing_bytes(rank, 12, 0, "replicated"), (sends.bytes, rank)
            for k, p in model.named_parameters():
                assert held(tdb.layout_of(p.grad)) == held(tdb.layout_of(p)), k
                assert torch.equal(tdb.full_tensor(p.grad), grads[k]), k
            _replicas_agree(model, opt, "gradients pending")
        opt.step()
        opt.zero_grad()
        if not reshard_first:
            tdb.reshard(model, _plan(after), optimizers=[opt])
        losses += [_step(model, opt, s, rank) for s in range(3, 5)]
        runs.append((losses, _snapshot(model, opt)))
    (got, got_final), (want, want_final) = runs
    for s, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), f"loss of step {s} on rank {rank}: {a} != {b}"
    _assert_equal(got_final, want_final, "resharded with gradients pending")


def test_gradients_pending_move_with_their_tables(pool):
    pool.run(_gradients_pending)


DRAINED = {  # rank 2 holds nothing
    "a": ShardLayout.row_wise((13, 8), [6, 7]),
    "b": ShardLayout.table_wise((11, 8), 0),
    "c": ShardLayout.column_wise((9, 12), [4, 8], ranks=[1, 0]),
    "d": ShardLayout.grid((10, 6), [5, 5], [3, 3], [0, 1, 1, 0]),
    "e": ShardLayout.row_wise((7, 4), [3, 0, 4], ranks=[1, 0, 1]),
}


def _drain_and_return(rank: int, world: int, path: str) -> None:
    schedule = [(BEFORE, 2), (DRAINED, 2), (BEFORE, 2)]
    losses, final, _ = _live(rank, "fused_rowwise_adagrad", schedule)
    want, want_final = _resumed(rank, "fused_rowwise_adagrad", schedule, path)
    for s, (a, b) in enumerate(zip(losses, want, strict=True)):
        assert torch.equal(a, b), f"loss of step {s} on rank {rank}: {a} != {b}"
    _assert_equal(final, want_final, "drained and back")


def test_a_rank_drained_of_every_table_and_filled_again(pool, tmp_path):
    pool.run(_drain_and_return, str(tmp_path / "drain"))


SUB_BEFORE = {  # on the mesh of ranks 1 and 2; rank 0 takes no part
    "a": ShardLayout.row_wise((13, 8), [6, 7], ranks=[1, 2]),
    "b": ShardLayout.replicated((11, 8), [1, 2]),
    "c": ShardLayout.column_wise((9, 12), [4, 8], ranks=[2, 1]),
    "d": ShardLayout.table_wise((10, 6), 1),
    "e": ShardLayout.row_wise((7, 4), [3, 4], ranks=[2, 1]),
}
SUB_AFTER = {
    "a": ShardLayout.replicated((13, 8), [1, 2]),
    "b": ShardLayout.row_wise((11, 8), [5, 6], ranks=[2, 1]),
    "c": ShardLayout.table_wise((9, 12), 2),
    "d": ShardLayout.column_wise((10, 6), [2, 4], ranks=[2, 1]),
    "e": ShardLayout.row_wise((7, 4), [7, 0], ranks=[1, 2]),
}


def _on_a_sub_mesh(rank: int, world: int, kind: str, path: str) -> None:
    """A model sharded over the mesh of ranks 1 and 2 reshards on their group (peers named by global rank)
    while rank 0 does nothing; the reference saves and loads on that group."""
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh("cpu", [1, 2])  # every rank makes the group
    if rank == 0:
        return

    def job(layouts: dict[str, ShardLayout]):
        model = tdb.shard_module(build_ebc(CFG, seed=5), _plan(layouts), mesh, src_rank=1)
        if kind == "adam":
            return model, torch.optim.Adam(model.parameters(), lr=0.05)
        return model, tdb.FusedOptimizer({n: model.embedding_bags[n].weight for n in TABLES}, kind, lr=0.05)

    runs = []
    for live in (True, False):
        model, opt = job(SUB_BEFORE)
        losses = [_step(model, opt, s, rank) for s in range(2)]
        if live:
            tdb.reshard(model, _plan(SUB_AFTER), optimizers=[opt])
        else:
            tdb.checkpoint.save({"model": model, "opt": opt}, path, process_group=mesh.get_group())
            model, opt = job(SUB_AFTER)
            tdb.checkpoint.load({"model": model, "opt": opt}, path, process_group=mesh.get_group())
        losses += [_step(model, opt, s, rank) for s in range(2, 4)]
        runs.append((losses, _snapshot(model, opt)))
    (got, got_final), (want, want_final) = runs
    for s, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), f"{kind}: loss of step {s} on rank {rank}: {a} != {b}"
    _assert_equal(got_final, want_final, f"{kind}: on a sub-mesh")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["adam", "rowwise_adagrad"])
def test_a_model_on_a_sub_mesh_reshards_on_its_group(pool, tmp_path, kind):
    pool.run(_on_a_sub_mesh, kind, str(tmp_path / kind))


# ---------------------------------------------------------------------------------------------- refusals
def _refused(rank: int, world: int, case: str) -> str:
    model, opt = _job(BEFORE, "adam")
    for s in range(2):
        _step(model, opt, s, rank)
    plan = _plan(AFTER)
    if case == "another_world_size":
        plan[_key("a")] = ShardLayout.row_wise((13, 8), 4)
    elif case == "another_shape":
        plan[_key("b")] = ShardLayout.row_wise((12, 8), 3)
    elif case == "unknown_table":
        plan["embedding_bags.z.weight"] = ShardLayout.row_wise((13, 8), 3)
    elif case == "overlapping_replicas":
        plan[_key("d")] = ShardLayout.from_shards((10, 6), [(0, (0, 0), (6, 6)), (1, (0, 0), (6, 6)),
                                                            (2, (4, 0), (6, 6))], validate=False)
    elif case == "one_rank_differs" and rank == 2:
        plan[_key("c")] = ShardLayout.table_wise((9, 12), 0)
    before = _snapshot(model, opt)
    params = dict(model.named_parameters())
    with _Sends() as sends, pytest.raises(ValueError) as refused:
        tdb.reshard(model, plan, optimizers=[opt])
    assert sends.bytes == 0, "bytes moved before the refusal"
    assert all(p is params[k] for k, p in model.named_parameters()), "a table was swapped"
    _assert_equal(_snapshot(model, opt), before, f"{case}: after the refusal")
    _step(model, opt, 2, rank)  # and the job trains on
    return str(refused.value)


REFUSALS = {
    "another_world_size": "plan entry 'embedding_bags.a.weight': shard 3 (offsets [12, 0], sizes [1, 8]) is on rank 3, "
                          "outside the ranks of the table's mesh [0, 1, 2]",
    "another_shape": "plan entry 'embedding_bags.b.weight': the layout's global_shape [12, 8] differs from the table's "
                     "shape [11, 8]",
    "unknown_table": "plan entry 'embedding_bags.z.weight': the module has no table of that name",
    "one_rank_differs": "ranks disagree on the plan",
    "overlapping_replicas": "plan entry 'embedding_bags.d.weight': table 'embedding_bags.d.weight' of shape [10, 6]: "
                            "shard 0 (rank 0, offsets [0, 0], sizes [6, 6]) overlaps shard 2 (rank 2, offsets [4, 0], "
                            "sizes [6, 6])",
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_a_bad_plan_is_refused_on_every_rank_before_anything_moves(pool, case):
    messages = pool.run(_refused, case)
    for m in messages:
        assert REFUSALS[case] in m, (case, m)


def _with_fault(rank: int, world: int, fault: str, kind: str, path: str) -> str:
    """The reshard-mid-training check of :func:`_equals_a_checkpoint_resume` with one fault injected into
    ``tdb.reshard``: it must fail, on every rank (the checks compare whole tensors, so every rank sees the same
    difference). Returns the failure's message.

    * ``piece_elsewhere``: one piece rank 1 receives lands in a scratch buffer, as if sent to another rank:
      its place in the new block is never written;
    * ``state_left_behind``: the optimizer state of every table stays where it was while the table moves;
    * ``group_points_at_old_table``: the module's table becomes another parameter object after the move, so
      that the optimizer's parameter group still points at the old one.
    """
    import torchrec_dtensor_bridge.convert.reshard as moving
    from torchrec_dtensor_bridge.resharding import api

    undo = []
    if fault == "piece_elsewhere":
        real_post, spoiled = moving._post, []

        def post(ends, arena, group):
            if rank == 1 and not spoiled and any(kind == "recv" for kind, _, _ in ends):
                i = next(k for k, (kind, _, _) in enumerate(ends) if kind == "recv")
                _, view, peer = ends[i]
                spoiled.append(1)
                ends = [*ends[:i], ("recv", torch.empty_like(view).contiguous(), peer), *ends[i + 1:]]
            return real_post(ends, arena, group)

        moving._post = post
        undo.append(lambda: setattr(moving, "_post", real_post))
    elif fault == "state_left_behind":
        real_moves = api.optimizer_moves
        api.optimizer_moves = lambda *args, **kwargs: ([], [])
        undo.append(lambda: setattr(api, "optimizer_moves", real_moves))
    else:
        real_reshard = tdb.reshard

        def reshard(model, plan, **kwargs):
            out = real_reshard(model, plan, **kwargs)
            for name in plan:
                owner = model.get_submodule(name.rpartition(".")[0])
                owner.weight = torch.nn.Parameter(owner.weight.data, requires_grad=owner.weight.requires_grad)
            return out

        tdb.reshard = reshard
        undo.append(lambda: setattr(tdb, "reshard", real_reshard))
    try:
        with pytest.raises(Exception) as caught:  # noqa: PT011 - any failure of the checks will do
            _equals_a_checkpoint_resume(rank, world, kind, path)
    finally:
        for u in undo:
            u()
    return f"{type(caught.value).__name__}: {caught.value}"


FAULTS = {  # fault -> the optimizer the job trains with, what the checks must say
    "piece_elsewhere": ("adam", "right after reshard 1: table embedding_bags."),
    "state_left_behind": ("adam", "is not in its table's layout"),
    "group_points_at_old_table": ("adam", "the parameter is another object"),
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_the_checks_fail_on_an_injected_fault(pool, tmp_path, fault):
    """The reshard test above can fail: a piece received elsewhere, an optimizer state left behind, a parameter
    group pointing at the old table, each injected into ``tdb.reshard``, makes it fail on every rank."""
    kind, says = FAULTS[fault]
    for message in pool.run(_with_fault, fault, kind, str(tmp_path / fault)):
        assert says in message, (fault, message)


def _transfer_fails(rank: int, world: int) -> None:
    """Rank 1 fails after the third batch of tables arrived: every rank raises, naming the batch's tables;
    the tables moved before are moved back, one by one; everything is as it was; the next reshard works."""
    from torchrec_dtensor_bridge.resharding import api

    model, opt = _job(BEFORE, "fused_rowwise_adagrad")
    for s in range(2):
        _step(model, opt, s, rank)
    before = _snapshot(model, opt)
    params = dict(model.named_parameters())
    names = {_key(n) for n in BEFORE}
    with failing_third_move(api, rank, lambda moves: sorted({m.dst_layout.name for m in moves} & names)) as calls:
        with pytest.raises(RuntimeError, match="injected") as caught:
            tdb.reshard(model, _plan(AFTER), optimizers=[opt])
    assert len(calls) > 3 and all(calls), calls
    moved, failed, back = calls[:2], calls[2], calls[3:]
    assert all(repr(n) in str(caught.value) for n in failed), (failed, str(caught.value))
    assert back == [[n] for batch in reversed(moved) for n in reversed(batch)], ("moved back one by one", calls)
    assert all(p is params[k] for k, p in model.named_parameters()), "a table was swapped"
    _assert_equal(_snapshot(model, opt), before, "after the failed transfer")
    _step(model, opt, 2, rank)
    tdb.reshard(model, _plan(AFTER), optimizers=[opt])
    _step(model, opt, 3, rank)


@contextmanager
def failing_third_move(module: Any, rank: int, label: Callable[[list[Any]], list[str]]) -> Iterator[list[list[str]]]:
    """``module.move_pieces`` (a reshard module's reference to it) recording each call's tables (``label``
    of its moves) in the list it yields, and failing on rank 1 once the third call's pieces arrived."""
    real, calls = module.move_pieces, []

    def failing(moves: list[Any], *args: Any, **kwargs: Any) -> int:
        out = real(moves, *args, **kwargs)
        calls.append(label(moves))
        if rank == 1 and len(calls) == 3:
            raise RuntimeError("injected: a block did not arrive")
        return out

    module.move_pieces = failing
    try:
        yield calls
    finally:
        module.move_pieces = real


def test_a_failed_transfer_raises_on_every_rank_and_changes_nothing(pool):
    pool.run(_transfer_fails)


# ------------------------------------------------------------------------------------------------ memory
BIG = (2048, 1024)  # 8 MiB of float32; 4 MiB a rank
BIG_TABLES = 6


def _status(field: str) -> int:
    for line in open("/proc/self/status").read().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _peak_moves(case: str) -> tuple[tuple[int, int], int, Any, Any]:
    """``(table shape, tables, layout before, layout after)`` of each memory case: six 8 MiB tables
    row-wise on ranks 0 and 1 moved column-wise onto ranks 1 and 0 (every element but a quarter changes rank,
    every piece sent is a column half of rows: through buffers); four 16 MiB tables, table-wise on ranks 0
    and 1 in turn, moved row-wise, 30 % on rank 0 and 70 % on rank 1 (in the order given, rank 1 would hold
    the old storage of its last table and the new blocks of the others: 5 MiB past its bound)."""
    if case == "rows_to_columns":
        return BIG, BIG_TABLES, lambda i: ShardLayout.row_wise(BIG, [BIG[0] // 2] * 2), \
            lambda i: ShardLayout.column_wise(BIG, [BIG[1] // 2] * 2, ranks=[1, 0])
    shape = (2 * BIG[0], BIG[1])
    cut = shape[0] * 3 // 10
    return shape, 4, lambda i: ShardLayout.table_wise(shape, i % 2), \
        lambda i: ShardLayout.row_wise(shape, [cut, shape[0] - cut, 0])


def peak_growth(module: Any, staging: int, reshard: Callable[[], Any]) -> int:
    """This rank's peak memory above the larger of its memory before and after ``reshard()``, run once every
    rank is ready with ``module.STAGING_BYTES`` (a reshard module's) set to ``staging``."""
    real, module.STAGING_BYTES = module.STAGING_BYTES, staging
    try:
        dist.barrier()
        rss = _status("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS
        reshard()
        return _status("VmHWM") - max(rss, _status("VmRSS"))
    finally:
        module.STAGING_BYTES = real


def _peak_growth(rank: int, world: int, staging: int, case: str) -> tuple[int, int]:
    """Each rank's peak memory above the larger of its memory before and after a reshard of
    :func:`_peak_moves`'s ``case``, and the bound: its largest new share of a table + the staging bytes.
    glibc is told to map every allocation of 128 KiB or more on its own, so that resident memory follows
    what is allocated."""
    import ctypes

    import torch.nn as nn

    from torchrec_dtensor_bridge.resharding import api

    ctypes.CDLL("libc.so.6").mallopt(-3, 128 << 10)  # M_MMAP_THRESHOLD: fixed, freed blocks unmapped
    shape, tables, before, after = _peak_moves(case)
    model = nn.Module()
    for i in range(tables):
        model.add_module(f"t{i}", nn.EmbeddingBag(*shape, mode="sum"))
    tdb.shard_module(model, {f"t{i}.weight": before(i) for i in range(tables)}, world_mesh("cpu"))
    opt = tdb.FusedOptimizer({f"t{i}": getattr(model, f"t{i}").weight for i in range(tables)},
                             "rowwise_adagrad", lr=0.1)
    sums = [float(tdb.full_tensor(getattr(model, f"t{i}").weight).double().sum()) for i in range(tables)]
    peak = peak_growth(api, staging, lambda: tdb.reshard(model, {f"t{i}.weight": after(i) for i in range(tables)},
                                                         optimizers=[opt]))
    for i in range(tables):
        assert float(tdb.full_tensor(getattr(model, f"t{i}").weight).double().sum()) == sums[i], i
    share = max(sum(s.numel * 4 for s in after(i).shards_on(rank)) for i in range(tables))
    return peak, share + staging


@pytest.mark.parametrize("case", ["rows_to_columns", "tables_to_uneven_rows"])
def test_peak_memory_grows_by_one_tables_new_share_and_the_staging_bytes(pool, case):
    """Every table's new share at once would be 24 MiB above the steady state on ranks 0 and 1 (rows to
    columns); one table at a time is 4 MiB, plus the buffers of the pieces (1 MiB here), plus 2 MiB of
    slack. Tables to uneven rows: the tables that free memory on rank 1 move before those that fill it."""
    for rank, (peak, bound) in enumerate(pool.run(_peak_growth, 1 << 20, case)):
        assert peak <= bound + (2 << 20), f"rank {rank}: {peak / 2**20:.1f} MiB above the steady state, bound " \
                                          f"{bound / 2**20:.1f} MiB + 2 MiB"
