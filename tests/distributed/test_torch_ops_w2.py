"""Tables as DTensors to all of torch, on the layouts DTensor cannot express alone (2 gloo ranks).

For each layout whose DTensor carries a ``LocalShardsWrapper`` (uneven rows, uneven columns, several
blocks on one rank, a grid, a table held by one rank of the mesh): torch's optimizers (foreach and
single-tensor), ``clip_grad_norm_``, pointwise ops (functional, in-place, ``out=``, with scalars, with a
DTensor of the same layout, with a broadcast vector), reductions and ``nn.init`` give what they give on the
unsharded table, which every rank computes itself as the reference (re-expressing the ideas of torch's
``test/distributed/tensor/test_optimizers.py``, ``test_pointwise_ops.py`` and ``test_math_ops.py``).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import torchrec_dtensor_bridge as tdb
from torchrec_dtensor_bridge.convert import dtensor_from_local_shards
from torchrec_dtensor_bridge.layout import ShardLayout

from .checks import expect_raises
from .harness import make_pool_fixture

pool = make_pool_fixture(2)

ROWS, DIM = 11, 6
LAYOUTS = {
    "row_wise_uneven": ShardLayout.row_wise((ROWS, DIM), [7, 4]),
    "column_wise_uneven": ShardLayout.column_wise((ROWS, DIM), [1, 5]),
    "two_blocks_on_a_rank": ShardLayout.row_wise((ROWS, DIM), [3, 5, 3], ranks=[0, 1, 0]),
    "grid": ShardLayout.grid((ROWS, DIM), [4, 7], [2, 4], [0, 1, 1, 0]),
    "one_rank_of_the_mesh": ShardLayout.table_wise((ROWS, DIM), 1),
}
OPTIMIZERS = {
    "sgd": lambda ps, fe: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01, foreach=fe),
    "sgd_dampening": lambda ps, fe: torch.optim.SGD(ps, lr=0.1, momentum=0.5, dampening=0.3, foreach=fe),
    "adam": lambda ps, fe: torch.optim.Adam(ps, lr=0.1, weight_decay=0.01, foreach=fe),
    "adamw": lambda ps, fe: torch.optim.AdamW(ps, lr=0.1, weight_decay=0.1, amsgrad=True, foreach=fe),
    "adagrad": lambda ps, fe: torch.optim.Adagrad(ps, lr=0.1, initial_accumulator_value=0.1, foreach=fe),
    "rmsprop": lambda ps, fe: torch.optim.RMSprop(ps, lr=0.01, momentum=0.5, centered=True, foreach=fe),
}


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dist.get_world_size(),))


def _table(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(ROWS, DIM, generator=g)


def _dt(layout: ShardLayout, full: torch.Tensor) -> DTensor:
    """A DTensor of ``layout`` over copies of ``full``'s blocks; its local tensor must be our wrapper."""
    rank = dist.get_rank()
    dt = dtensor_from_local_shards(layout, [full[s.slices()].clone() for s in layout.shards_on(rank)],
                                   device_mesh=_mesh())
    assert isinstance(dt.to_local(), tdb.LocalShardsWrapper), layout
    return dt


def _close(got, want, what):
    if isinstance(got, DTensor):
        got = got.full_tensor()
    torch.testing.assert_close(got, want, msg=lambda m: f"{what}: {m}")


def _check_optimizers(rank, world_size, name):
    layout = LAYOUTS[name]
    grads = [_table(10 + k) for k in range(3)]
    for kind, make in OPTIMIZERS.items():
        for foreach in (False, True):
            what = f"{name} {kind} foreach={foreach}"
            ref = nn.Parameter(_table(1))
            ref2 = nn.Parameter(_table(2))
            p = nn.Parameter(_dt(layout, _table(1)))
            p2 = nn.Parameter(_dt(layout, _table(2)))
            opt_ref, opt = make([ref, ref2], foreach), make([p, p2], foreach)
            for g in grads:
                ref.grad, ref2.grad = g.clone(), (2 * g).clone()
                p.grad, p2.grad = _dt(layout, g), _dt(layout, 2 * g)
                opt_ref.step()
                opt.step()
            _close(p, ref.detach(), what)
            _close(p2, ref2.detach(), what)
            for key, value in opt_ref.state[ref].items():
                mine = opt.state[p][key]
                if key == "step":
                    assert float(mine) == float(value), (what, mine, value)
                else:
                    assert isinstance(mine, DTensor) and isinstance(mine.to_local(), tdb.LocalShardsWrapper), what
                    assert tdb.layout_of(mine).shards == layout.shards, (what, key)
                    _close(mine, value, f"{what} state {key}")


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_optimizers_equal_the_unsharded_table(pool, name):
    pool.run(_check_optimizers, name)


def _check_clip(rank, world_size, name):
    layout = LAYOUTS[name]
    for foreach in (False, True):
        for norm_type in (2.0, 1.0, math.inf):
            refs = [nn.Parameter(_table(1)), nn.Parameter(_table(2))]
            ps = [nn.Parameter(_dt(layout, _table(1))), nn.Parameter(_dt(layout, _table(2)))]
            for k, (r, p) in enumerate(zip(refs, ps)):
                r.grad = _table(20 + k) * 3
                p.grad = _dt(layout, r.grad)
            want = torch.nn.utils.clip_grad_norm_(refs, 1.5, norm_type=norm_type, foreach=foreach)
            got = torch.nn.utils.clip_grad_norm_(ps, 1.5, norm_type=norm_type, foreach=foreach)
            what = f"{name} clip foreach={foreach} norm_type={norm_type}"
            _close(got, want, what)
            for r, p in zip(refs, ps):
                _close(p.grad, r.grad, what)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_clip_grad_norm_equals_the_unsharded_table(pool, name):
    pool.run(_check_clip, name)


def _check_pointwise(rank, world_size, name):
    layout = LAYOUTS[name]
    a, b = _table(1), _table(2)
    x, y = _dt(layout, a), _dt(layout, b)
    _close(x * 2, a * 2, "mul scalar")
    _close(x + y, a + b, "add")
    _close(torch.sin(x), torch.sin(a), "sin")
    _close(torch.where(x > y, x, y), torch.where(a > b, a, b), "where")
    _close(torch.lerp(x, y, 0.3), torch.lerp(a, b, 0.3), "lerp")
    _close(torch.addcdiv(x, y, y.abs() + 1, value=0.5), torch.addcdiv(a, b, b.abs() + 1, value=0.5), "addcdiv")
    _close((x > 0).sum(), (a > 0).sum(), "comparison then sum")
    out = _dt(layout, torch.zeros(ROWS, DIM))
    torch.mul(x, y, out=out)
    _close(out, a * b, "out=")
    z = _dt(layout, a)
    before = [s.data_ptr() for s in z.to_local().local_shards()]
    z.add_(y, alpha=0.5).clamp_(min=-0.5).mul_(torch.tensor(3.0))
    assert [s.data_ptr() for s in z.to_local().local_shards()] == before, "in place"
    _close(z, (a + 0.5 * b).clamp(min=-0.5) * 3, "in place chain")
    vec = torch.arange(DIM, dtype=torch.float32)
    bvec = distribute_tensor(vec, _mesh(), [Replicate()])
    if layout.nearest_shard_dim == 0:
        _close(x * bvec, a * vec, "broadcast")
    else:  # DTensor hands each rank an even chunk of the vector: no uneven column cut can be recovered
        expect_raises(ValueError, "matches neither the table nor this rank's blocks", lambda: x * bvec)
    # another layout of the same placement reaches the wrappers, which refuse it naming both layouts;
    # one of another placement is refused by DTensor's move between Shard dims
    rows, cols = ShardLayout.row_wise((ROWS, DIM), [5, 6]), ShardLayout.column_wise((ROWS, DIM), [4, 2])
    same_dim = cols if layout.nearest_shard_dim == 1 else rows
    expect_raises(ValueError, "wrappers differ in layout", lambda: x.add_(_dt(same_dim, b)))
    other_dim = rows if layout.nearest_shard_dim == 1 else cols
    y_other = _dt(other_dim, b)
    try:  # refused where DTensor moves it (our gather is exact, its even re-split is not) or where it meets x
        x.add_(y_other)
    except (ValueError, NotImplementedError) as e:
        assert "Give both operands" in str(e), e
    else:
        raise AssertionError(f"{name}: an operand of another placement was accepted")
    _close(x, a, "a refused op leaves the table as it was")
    for fn in (torch.zeros_like, torch.ones_like, lambda t: torch.full_like(t, 2.5), lambda t: t.new_zeros(t.shape),
               lambda t: t.new_ones(t.shape), lambda t: t.new_full(t.shape, -2.0)):
        _close(fn(x), fn(a), "creation")
    assert torch.empty_like(x).shape == x.shape


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_pointwise_ops_equal_the_unsharded_table(pool, name):
    pool.run(_check_pointwise, name)


def _check_operand_split_in_rank_order(rank, world_size):
    """A row-wise table cut evenly but held in the other rank order (rank 1 holds the first rows) meets a
    ``Replicate()`` DTensor, or a ``Shard(0)`` one (DTensor's own even split, in rank order): each rank's part
    of the other operand then has the shape of its own block but holds other rows. The result is the
    unsharded table's, or the error naming both layouts on every rank: never the rows of another block."""
    layout = ShardLayout.row_wise((10, DIM), [5, 5], ranks=[1, 0])
    a, b = _table(7)[:10], _table(8)[:10]
    for placement in (Replicate(), Shard(0)):
        y = distribute_tensor(b, _mesh(), [placement])
        for what, op, want in (
            ("x + y", lambda x: x + y, a + b), ("y + x", lambda x: y + x, b + a),
            ("x * y", lambda x: x * y, a * b), ("torch.maximum", lambda x: torch.maximum(x, y), torch.maximum(a, b)),
            ("x.add_(y)", lambda x: x.add_(y), a + b),
        ):
            x = _dt(layout, a)
            try:
                got = op(x)
            except ValueError as e:
                assert "matches neither the table nor this rank's blocks" in str(e), (placement, what, e)
                assert torch.equal(tdb.full_tensor(x), a), (placement, what, "a refused op wrote the table")
                continue
            assert torch.equal(tdb.full_tensor(got), want), (placement, what, rank)


def test_an_operand_split_in_rank_order_never_meets_a_block_of_other_rows(pool):
    pool.run(_check_operand_split_in_rank_order)


def _check_reductions(rank, world_size, name):
    layout = LAYOUTS[name]
    a = _table(3)
    x = _dt(layout, a)
    checks = {
        "sum": lambda t: t.sum(), "mean": lambda t: t.mean(), "amax": lambda t: t.amax(),
        "amin": lambda t: t.amin(), "max": lambda t: t.max(), "norm": lambda t: t.norm(),
        "norm1": lambda t: torch.linalg.vector_norm(t, 1), "norm_inf": lambda t: torch.linalg.vector_norm(t, math.inf),
        "sum_dtype": lambda t: t.sum(dtype=torch.float64),
        "any": lambda t: (t > 2.0).any(), "all": lambda t: (t > -5.0).all(), "not_all": lambda t: (t > 0).all(),
    }
    cut = layout.cut_dims
    p = layout.nearest_shard_dim
    for dim in (0, 1):
        if dim in cut and dim != p:
            # a grid reduced along its columns alone: each rank holds only part of a row
            expect_raises(NotImplementedError, "needs the blocks of other ranks", lambda: x.sum(dim=dim).full_tensor())
            continue
        checks.update({
            f"sum{dim}": lambda t, d=dim: t.sum(dim=d), f"mean{dim}": lambda t, d=dim: t.mean(dim=d),
            f"amax{dim}": lambda t, d=dim: t.amax(dim=d), f"norm{dim}": lambda t, d=dim: t.norm(dim=d),
            f"mean{dim}_keepdim": lambda t, d=dim: t.mean(dim=d, keepdim=True),
        })
    for what, fn in checks.items():
        _close(fn(x), fn(a), f"{name} {what}")
    _close(x.full_tensor(), a, f"{name} DTensor.full_tensor")


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_reductions_equal_the_unsharded_table(pool, name):
    pool.run(_check_reductions, name)


NORM_ORDS = (-math.inf, 0, 1, 2, 3, math.inf, 0.5)


def _check_norms(rank, world_size, name):
    """``torch.linalg.vector_norm``, ``Tensor.norm`` and ``torch._foreach_norm`` of every order - the smallest
    ``|x|`` (``-inf``), the count of non-zeros (``0``), fractional and odd orders - over the whole table and
    along each dim a rank can reduce alone, on a table without zeros and on one with some."""
    layout = LAYOUTS[name]
    a = _table(4)
    a[ROWS - 1, DIM - 1] = 1e-3  # the smallest |x|, in the table's last block
    holes = a.clone()
    holes[::3, 1::2] = 0.0
    cut, p = layout.cut_dims, layout.nearest_shard_dim
    dims = [d for d in (0, 1) if not (d in cut and d != p)]
    for table, which in ((a, "no zeros"), (holes, "zeros")):
        x, y = _dt(layout, table), _dt(layout, 2 * table.flip(0))
        for ord_ in NORM_ORDS:
            what = f"{name} {which} ord={ord_}"
            _close(torch.linalg.vector_norm(x, ord_), torch.linalg.vector_norm(table, ord_), f"{what} vector_norm")
            _close(x.norm(ord_), table.norm(ord_), f"{what} Tensor.norm")
            _close(torch.linalg.vector_norm(x, ord_, dtype=torch.float64),
                   torch.linalg.vector_norm(table, ord_, dtype=torch.float64), f"{what} vector_norm fp64")
            for d in dims:
                for keepdim in (False, True):
                    _close(torch.linalg.vector_norm(x, ord_, dim=d, keepdim=keepdim),
                           torch.linalg.vector_norm(table, ord_, dim=d, keepdim=keepdim),
                           f"{what} vector_norm dim={d} keepdim={keepdim}")
            got = torch._foreach_norm([x, y], ord_)
            want = torch._foreach_norm([table, 2 * table.flip(0)], ord_)
            for k, (g, w) in enumerate(zip(got, want)):
                _close(g, w, f"{what} _foreach_norm [{k}]")


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_norms_of_every_order_equal_the_unsharded_table(pool, name):
    pool.run(_check_norms, name)


def _check_foreach_norm_minus_inf_held_by_one_rank(rank, world_size):
    """``torch._foreach_norm(tables, -inf)`` (the smallest ``|x|`` of each table) of a table that one rank of
    the mesh holds: the other rank's part must be the identity of a minimum (``+inf``), or the minimum DTensor
    takes over the ranks is 0 whatever the table."""
    layout = LAYOUTS["one_rank_of_the_mesh"]
    a = _table(4)
    got = torch._foreach_norm([_dt(layout, a), _dt(layout, 2 * a)], -math.inf)
    want = torch._foreach_norm([a, 2 * a], -math.inf)
    for k, (g, w) in enumerate(zip(got, want)):
        _close(g, w, f"_foreach_norm(-inf) [{k}]")


def test_foreach_norm_minus_inf_of_a_table_one_rank_holds(pool):
    pool.run(_check_foreach_norm_minus_inf_held_by_one_rank)


def _check_init(rank, world_size, name):
    layout = LAYOUTS[name]
    inits = {
        "uniform_": lambda t: nn.init.uniform_(t, -0.5, 0.5),
        "normal_": lambda t: nn.init.normal_(t, 0.0, 0.02),
        "trunc_normal_": lambda t: nn.init.trunc_normal_(t, std=1.0, a=-0.5, b=0.5),
        "xavier_uniform_": nn.init.xavier_uniform_,
        "kaiming_normal_": nn.init.kaiming_normal_,
        "constant_": lambda t: nn.init.constant_(t, 0.25),
    }
    for what, init in inits.items():
        torch.manual_seed(7)
        x = _dt(layout, torch.full((ROWS, DIM), math.nan))
        init(x)
        full = tdb.full_tensor(x)
        assert not full.isnan().any(), (name, what, "an element left unwritten")
        if what == "constant_":
            _close(full, torch.full((ROWS, DIM), 0.25), what)
            continue
        if what in ("uniform_", "trunc_normal_"):
            assert full.min() >= -0.5 and full.max() <= 0.5, (name, what, full.min(), full.max())
        bound = math.sqrt(6.0 / (ROWS + DIM))  # xavier's, from the table's global fans
        if what == "xavier_uniform_":
            assert full.abs().max() <= bound, (name, full.abs().max(), bound)
        # no two blocks draw the same stream: their first rows never repeat each other
        firsts = [full[s.offsets[0], s.offsets[1]:s.offsets[1] + 1] for s in layout.unique_shards() if s.numel]
        assert len({float(v) for v in firsts}) == len(firsts), (name, what, firsts)
        # the same seed on every rank draws the same table again
        torch.manual_seed(7)
        again = _dt(layout, torch.zeros(ROWS, DIM))
        init(again)
        assert torch.equal(tdb.full_tensor(again), full), (name, what)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_init_fills_every_block_from_its_own_stream(pool, name):
    pool.run(_check_init, name)


def _train(module, opt, steps, seed, ranks):
    """``steps`` steps on the batches of ``ranks`` (a sharded module: this rank's own; the unsharded
    reference: every rank's, whose gradients the sharded lookup sums)."""
    for k in range(steps):
        loss = 0
        for r in ranks:
            ids = torch.randint(0, ROWS, (8,), generator=torch.Generator().manual_seed(1000 * r + seed + k))
            out = module(ids, torch.tensor([0, 3, 5]))
            loss = loss + (out * out).sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), 0.5)
        opt.step()
        opt.zero_grad()


def _uninterrupted(world_size, foreach):
    """The initial table and the unsharded run of 4 steps on every rank's batches."""
    torch.manual_seed(0)
    base = nn.EmbeddingBag(ROWS, DIM, mode="sum")
    reference = nn.EmbeddingBag(ROWS, DIM, mode="sum")
    reference.load_state_dict(base.state_dict())
    ref_opt = torch.optim.Adam(reference.parameters(), lr=0.05, foreach=foreach)
    _train(reference, ref_opt, 4, seed=100, ranks=range(world_size))  # 2 steps, then 2 more
    return base, reference


def _check_optimizer_state_resumes_on_another_layout(rank, world_size, path, foreach):
    """Adam state saved under one layout loads under another (and into the unsharded module); training goes
    on equal to the run that was never interrupted."""
    base, reference = _uninterrupted(world_size, foreach)
    first = tdb.shard_module(nn.EmbeddingBag(ROWS, DIM, mode="sum"), {"weight": LAYOUTS["row_wise_uneven"]},
                             _mesh())
    first.load_state_dict({"weight": _dt(LAYOUTS["row_wise_uneven"], base.weight.detach())})
    opt = torch.optim.Adam(first.parameters(), lr=0.05, foreach=foreach)
    _train(first, opt, 2, seed=100, ranks=[rank])
    tdb.checkpoint.save({"model": first, "optim": opt}, path)

    for target in ("grid", "unsharded"):
        if target == "grid":
            module = tdb.shard_module(nn.EmbeddingBag(ROWS, DIM, mode="sum"), {"weight": LAYOUTS["grid"]}, _mesh())
        else:
            module = nn.EmbeddingBag(ROWS, DIM, mode="sum")
        resumed = torch.optim.Adam(module.parameters(), lr=0.01, foreach=foreach)  # lr comes from the checkpoint
        tdb.checkpoint.load({"model": module, "optim": resumed}, path)
        assert resumed.param_groups[0]["lr"] == 0.05, resumed.param_groups[0]["lr"]
        if target == "grid":
            state = resumed.state[module.weight]["exp_avg_sq"]
            assert tdb.layout_of(state).shards == LAYOUTS["grid"].shards
            _train(module, resumed, 2, seed=102, ranks=[rank])
            _close(module.weight, reference.weight.detach(), f"resumed on {target}")
        else:  # the unsharded module trains without a process group's lookups
            w = module.weight
            ref_state = {k: v.clone() if torch.is_tensor(v) else v for k, v in resumed.state[w].items()}
            _train(module, resumed, 2, seed=102, ranks=range(world_size))
            _close(w.detach(), reference.weight.detach(), f"resumed on {target}")
            assert float(ref_state["step"]) == 2.0


@pytest.mark.parametrize("foreach", [False, True])
def test_optimizer_state_resumes_on_another_layout(pool, tmp_path, foreach):
    pool.run(_check_optimizer_state_resumes_on_another_layout, str(tmp_path / "ckpt"), foreach)
    # and in this process, with no process group at all: the 2-rank job's weights and Adam state, one table
    _, reference = _uninterrupted(2, foreach)
    module = nn.EmbeddingBag(ROWS, DIM, mode="sum")
    resumed = torch.optim.Adam(module.parameters(), lr=0.01, foreach=foreach)
    tdb.checkpoint.load({"model": module, "optim": resumed}, tmp_path / "ckpt")
    assert float(resumed.state[module.weight]["step"]) == 2.0
    _train(module, resumed, 2, seed=102, ranks=range(2))
    _close(module.weight.detach(), reference.weight.detach(), "resumed in one process")


GROUP_LAYOUTS = {"before": ("row_wise_uneven", "two_blocks_on_a_rank"), "after": ("grid", "column_wise_uneven")}


def _grouped(params, *, other_values=False, keyed=False):
    """AdamW over two tables in two parameter groups that differ in every hyper-parameter (``other_values``:
    the same groups built with other numbers, as a job that resumes from a checkpoint may be); ``keyed``:
    inside TorchRec's ``KeyedOptimizerWrapper``, keyed by the ``ParameterDict``'s names."""
    if keyed:
        from torchrec.optim.keyed import KeyedOptimizerWrapper

        return KeyedOptimizerWrapper(dict(params.items()), lambda ps: _grouped(ps, other_values=other_values))
    params = list(params.values()) if isinstance(params, nn.ParameterDict) else params
    k = 3.0 if other_values else 1.0
    return torch.optim.AdamW([
        {"params": [params[0]], "lr": 0.05 * k, "weight_decay": 0.1 * k, "betas": (0.8, 0.95 / k), "eps": 1e-6 * k},
        {"params": [params[1]], "lr": 0.02 * k, "weight_decay": 0.0, "betas": (0.6 / k, 0.9), "eps": 1e-3 * k,
         "amsgrad": True},
    ], lr=0.3, weight_decay=0.5)


def _grouped_grads(step):
    return _table(40 + step) * 3, _table(50 + step)


def _grouped_steps(params, opt, steps, shard=None):
    for k in steps:
        for p, g in zip(params, _grouped_grads(k)):
            p.grad = g if shard is None else shard(p, g)
        opt.step()
        opt.zero_grad()


def _hyperparameters(opt):
    return [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]


def _grouped_reference():
    """The unsharded run of 4 steps, and its groups' hyper-parameters."""
    ref = [nn.Parameter(_table(1)), nn.Parameter(_table(2))]
    opt = _grouped(ref)
    _grouped_steps(ref, opt, range(4))
    return ref, _hyperparameters(opt)


def _check_groups_resume_on_another_layout(rank, world_size, path, keyed):
    """Two parameter groups of different lr, weight_decay, betas, eps and amsgrad, saved under one layout and
    loaded into another: each group gets its own saved values (not another group's, nor the new job's), and
    training goes on equal to the run that was never interrupted."""
    ref, saved = _grouped_reference()
    before = [LAYOUTS[n] for n in GROUP_LAYOUTS["before"]]
    params = nn.ParameterDict({"a": _dt(before[0], _table(1)), "b": _dt(before[1], _table(2))})
    opt = _grouped(params, keyed=keyed)
    assert _hyperparameters(opt) == saved
    _grouped_steps(list(params.values()), opt, range(2), shard=lambda p, g: _dt(tdb.layout_of(p), g))
    tdb.checkpoint.save({"model": params, "optim": opt}, path)

    after = [LAYOUTS[n] for n in GROUP_LAYOUTS["after"]]
    fresh = nn.ParameterDict({"a": _dt(after[0], torch.zeros(ROWS, DIM)), "b": _dt(after[1], torch.zeros(ROWS, DIM))})
    resumed = _grouped(fresh, other_values=True, keyed=keyed)
    assert _hyperparameters(resumed) != saved
    tdb.checkpoint.load({"model": fresh, "optim": resumed}, path)
    assert _hyperparameters(resumed) == saved, (_hyperparameters(resumed), saved)
    for p, lay in zip(fresh.values(), after):
        assert tdb.layout_of(resumed.state[p]["exp_avg"]).shards == lay.shards
    _grouped_steps(list(fresh.values()), resumed, range(2, 4), shard=lambda p, g: _dt(tdb.layout_of(p), g))
    for name, p, r in zip("ab", fresh.values(), ref):
        _close(p, r.detach(), f"table {name} resumed on another layout")


@pytest.mark.parametrize("keyed", [False, True], ids=["torch_optim", "keyed_optimizer"])
def test_parameter_groups_resume_with_their_own_hyperparameters_on_another_layout(pool, tmp_path, keyed):
    path = tmp_path / "groups"
    pool.run(_check_groups_resume_on_another_layout, str(path), keyed)
    # and unsharded in this process, with no process group (another world size)
    ref, saved = _grouped_reference()
    fresh = nn.ParameterDict({"a": torch.zeros(ROWS, DIM), "b": torch.zeros(ROWS, DIM)})
    resumed = _grouped(fresh, other_values=True, keyed=keyed)
    tdb.checkpoint.load({"model": fresh, "optim": resumed}, path)
    assert _hyperparameters(resumed) == saved, (_hyperparameters(resumed), saved)
    _grouped_steps(list(fresh.values()), resumed, range(2, 4))
    for name, p, r in zip("ab", fresh.values(), ref):
        _close(p.detach(), r.detach(), f"table {name} resumed in one process")


def _check_dcp_state_dict_helpers(rank, world_size):
    """torch's ``get_/set_model_state_dict`` and ``get_/set_optimizer_state_dict``, sharded and full, on modules
    whose parameters are our DTensors; a full state dict set into another layout trains on equal to the run
    that was never interrupted."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions, get_model_state_dict, get_optimizer_state_dict, set_model_state_dict,
        set_optimizer_state_dict)

    full_opts = StateDictOptions(full_state_dict=True)
    torch.manual_seed(0)
    base = nn.EmbeddingBag(ROWS, DIM, mode="sum")

    def sharded(name):
        m = tdb.shard_module(nn.EmbeddingBag(ROWS, DIM, mode="sum"), {"weight": LAYOUTS[name]}, _mesh())
        m.load_state_dict({"weight": _dt(LAYOUTS[name], base.weight.detach())})
        return m, torch.optim.Adam(m.parameters(), lr=0.05)

    m, opt = sharded("row_wise_uneven")
    _train(m, opt, 2, seed=300, ranks=[rank])
    # copies: the sharded state dicts alias the live state, and the optimizer loads them as they are
    osd, msd = copy.deepcopy(get_optimizer_state_dict(m, opt)), copy.deepcopy(get_model_state_dict(m))
    assert isinstance(osd["state"]["weight"]["exp_avg"].to_local(), tdb.LocalShardsWrapper)
    full_osd = copy.deepcopy(get_optimizer_state_dict(m, opt, options=full_opts))  # its "step" is opt's own
    full_msd = get_model_state_dict(m, options=full_opts)
    _close(full_osd["state"]["weight"]["exp_avg"], tdb.full_tensor(opt.state[m.weight]["exp_avg"]), "full state")
    _close(full_msd["weight"], tdb.full_tensor(m.weight), "full model")

    same, same_opt = sharded("row_wise_uneven")  # sharded state dicts into the same layout
    set_model_state_dict(same, msd)
    set_optimizer_state_dict(same, same_opt, osd)
    other, other_opt = sharded("grid")  # full state dicts into another layout
    set_model_state_dict(other, full_msd, options=full_opts)
    set_optimizer_state_dict(other, other_opt, full_osd, options=full_opts)
    _close(other.weight, tdb.full_tensor(m.weight), "full model set into a grid")
    for module, optimizer in ((m, opt), (same, same_opt), (other, other_opt)):
        _train(module, optimizer, 2, seed=302, ranks=[rank])
    state = other_opt.state[other.weight]["exp_avg_sq"]
    assert tdb.layout_of(state).shards == LAYOUTS["grid"].shards, "the state follows the parameter's layout"
    _close(same.weight, tdb.full_tensor(m.weight), "resumed from sharded state dicts")
    _close(other.weight, tdb.full_tensor(m.weight), "resumed from full state dicts on a grid")

    # copy_ between two layouts of one table moves the overlaps, both ways
    a = _table(5)
    x = _dt(LAYOUTS["two_blocks_on_a_rank"], torch.zeros(ROWS, DIM))
    x.copy_(distribute_tensor(a, _mesh(), [Replicate()]).redistribute(_mesh(), x.placements))
    _close(x, a, "copy_ from DTensor's even split")
    even = distribute_tensor(torch.zeros(ROWS, DIM), _mesh(), x.placements)
    even.copy_(x)
    _close(even, a, "copy_ into DTensor's even split")


def test_dcp_state_dict_helpers_and_copy_between_layouts(pool):
    pool.run(_check_dcp_state_dict_helpers)


def _check_errors_name_the_key(rank, world_size):
    """Ranks that call full_tensor on different tables (keys met in another order) are told which key."""
    sd = tdb.state_dict_to_dtensor({
        "ebc.t0.weight": _dt(LAYOUTS["row_wise_uneven"], _table(1)),
        "ebc.t1.weight": _dt(LAYOUTS["two_blocks_on_a_rank"], _table(2)),
    })
    mine = ["ebc.t0.weight", "ebc.t1.weight"][rank]
    sd = {k: tdb.to_dtensor(v, name=k) for k, v in sd.items()}
    assert tdb.layout_of(sd[mine]).name == mine
    expect_raises(ValueError, f"table {mine!r}", lambda: tdb.full_tensor(sd[mine]))


def test_errors_name_the_state_dict_key(pool):
    pool.run(_check_errors_name_the_key)


def _check_dtype_change_on_another_layout(rank, world_size, path):
    """An fp32 uneven table saved, loaded into an fp16 grid with ``convert_dtypes=True`` (refused without)."""
    a = _table(6)
    tdb.checkpoint.save({"w": _dt(LAYOUTS["row_wise_uneven"], a)}, path)
    half = _dt(LAYOUTS["grid"], torch.zeros(ROWS, DIM)).to(torch.float16)
    expect_raises(ValueError, "convert_dtypes=True", lambda: tdb.checkpoint.load({"w": half}, path))
    tdb.checkpoint.load({"w": half}, path, convert_dtypes=True)
    assert torch.equal(tdb.full_tensor(half), a.to(torch.float16))


def test_a_dtype_change_loads_into_another_layout_when_asked(pool, tmp_path):
    pool.run(_check_dtype_change_on_another_layout, str(tmp_path / "fp32"))
