"""``shard_module`` on 2 gloo ranks: nn.EmbeddingBag / nn.Embedding / TorchRec EBC parity, src_rank, refusals.

Every rank builds the module with DIFFERENT initial values (only ``src_rank``'s
count) and passes its own batch; outputs are compared with the unsharded
module holding ``src_rank``'s table, gradients with the unsharded gradient of
the sum over all ranks' batches.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from torchrec_dtensor_bridge.layout import ShardLayout

from .checks import expect_raises
from .harness import make_pool_fixture

pool = make_pool_fixture(2)

TOL = dict(rtol=1e-5, atol=1e-5)
ROWS, DIM = 10, 6

LAYOUTS = {
    "row_wise_uneven": ShardLayout.row_wise((ROWS, DIM), [3, 7]),
    "row_wise_two_per_rank": ShardLayout.row_wise((ROWS, DIM), [2, 3, 4, 1], ranks=[1, 0, 1, 0]),
    "column_wise": ShardLayout.column_wise((ROWS, DIM), [2, 4]),
    "table_wise": ShardLayout.table_wise((ROWS, DIM), 1),
    "grid": ShardLayout.grid((ROWS, DIM), [4, 6], [2, 4], [0, 1, 1, 0]),
}


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dist.get_world_size(),))


def _everyone(obj: object) -> list:
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _seeded(module: nn.Module, rank: int, src_rank: int, sharded: tuple[str, ...] | None = None) -> nn.Module:
    """``module`` with the source's values on ``src_rank`` and other values elsewhere in the
    parameters to be ``sharded`` (default: all); returns the unsharded reference (a copy holding
    the source's values) on every rank."""
    torch.manual_seed(1234)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_()
    reference = copy.deepcopy(module)
    if rank != src_rank:
        with torch.no_grad():
            for name, p in module.named_parameters():
                if sharded is None or name in sharded:
                    p.fill_(100.0 + rank)
    return reference


def _bag_batch(rank: int, seed: int, include_last_offset: bool) -> dict:
    """This rank's own batch: 3 + 2 * rank bags of 0-4 ids (one bag empty)."""
    g = torch.Generator().manual_seed(seed * 31 + rank)
    lengths = torch.randint(1, 5, (3 + 2 * rank,), generator=g)
    lengths[1] = 0
    ids = torch.randint(0, ROWS, (int(lengths.sum()),), generator=g)
    ids[::4] = 2  # the padding row, where a case sets padding_idx=2
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    return {"input": ids, "offsets": offsets if include_last_offset else offsets[:-1]}


BAG_CASES = [
    ("sum-padding", dict(mode="sum", padding_idx=2)),
    ("mean-last-offset", dict(mode="mean", include_last_offset=True)),
    ("max", dict(mode="max")),
    ("sum-max-norm", dict(mode="sum", max_norm=1.0)),
]


def _check_grad(module_weight: nn.Parameter, ref_weight: torch.Tensor, what: str) -> None:
    import torchrec_dtensor_bridge as tdb
    from torch.distributed.tensor import DTensor

    grad = module_weight.grad
    assert isinstance(grad, DTensor), f"{what}: weight.grad is {type(grad).__name__}, not a DTensor"
    torch.testing.assert_close(tdb.full_tensor(grad), ref_weight.grad, **TOL, msg=lambda m: f"{what} grad: {m}")


def check_module_parity(rank: int, world_size: int, layout: ShardLayout) -> int:
    """nn.EmbeddingBag in every case of ``BAG_CASES`` and nn.Embedding: outputs and gradients."""
    import torchrec_dtensor_bridge as tdb
    from torch.distributed.tensor import DTensor

    mesh = _mesh()
    n = 0
    for k, (name, opts) in enumerate(BAG_CASES):
        what = f"{layout.name}/{name} rank {rank}"
        bag = nn.EmbeddingBag(ROWS, DIM, **opts)
        ref = _seeded(bag, rank, src_rank=0)
        weight_before = bag.weight
        assert tdb.shard_module(bag, {"weight": layout}, mesh) is bag
        assert isinstance(bag.weight, nn.Parameter) and isinstance(bag.weight, DTensor) and bag.weight.requires_grad
        assert bag.weight is not weight_before and isinstance(bag, nn.EmbeddingBag)
        mine = _bag_batch(rank, k, opts.get("include_last_offset", False))
        out = bag(mine["input"], mine["offsets"])
        out.sum().backward()
        for q, theirs in enumerate(_everyone(mine)):
            expect = ref(theirs["input"], theirs["offsets"])
            if q == rank:
                torch.testing.assert_close(out, expect.detach(), **TOL, msg=lambda m: f"{what}: {m}")
            expect.sum().backward()
        _check_grad(bag.weight, ref.weight, what)
        if "max_norm" in opts:  # renormalised in place, as torch does
            torch.testing.assert_close(tdb.full_tensor(bag.weight.detach()), ref.weight.detach(), **TOL)
        n += 1
    for opts in ({}, {"padding_idx": 2}):
        what = f"{layout.name}/embedding{opts} rank {rank}"
        emb = nn.Embedding(ROWS, DIM, **opts)
        ref = _seeded(emb, rank, src_rank=0)
        tdb.shard_module(emb, {"weight": layout}, mesh)
        ids = torch.randint(0, ROWS, (2 + rank, 3), generator=torch.Generator().manual_seed(rank))
        ids[0, 0] = 2
        out = emb(ids)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        for q, theirs in enumerate(_everyone(ids)):
            expect = ref(theirs)
            if q == rank:
                torch.testing.assert_close(out, expect.detach(), **TOL, msg=lambda m: f"{what}: {m}")
            (expect * torch.linspace(-1, 1, expect.numel()).view_as(expect)).sum().backward()
        _check_grad(emb.weight, ref.weight, what)
        n += 1
    return n


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_module_parity(pool, name):
    assert pool.run(check_module_parity, LAYOUTS[name].with_name(name)) == [len(BAG_CASES) + 2] * 2


# ------------------------------------------------------------------ a submodule in a bigger model
class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.EmbeddingBag(ROWS, DIM, mode="sum")
        self.proj = nn.Linear(DIM, 2)

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.proj(self.emb(ids, offsets))


def check_submodule_and_gather_output(rank: int, world_size: int) -> None:
    """A plan naming ``emb.weight`` of a bigger model; the ``gather_output`` hook; an optimizer step."""
    import torchrec_dtensor_bridge as tdb

    model = _Model()
    ref = _seeded(model, rank, src_rank=0, sharded=("emb.weight",))
    tdb.shard_module(model, {"emb.weight": ShardLayout.row_wise((ROWS, DIM), [6, 4])}, _mesh(), gather_output=True)
    assert type(model.emb).__name__ == "ShardedEmbeddingBag"
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in ref.named_parameters()]
    mine = _bag_batch(rank, 7, False)
    out = model(mine["input"], mine["offsets"])  # every rank's bags, in rank order
    batches = _everyone(mine)
    expect = torch.cat([ref(b["input"], b["offsets"]) for b in batches])
    torch.testing.assert_close(out, expect.detach(), **TOL)
    out.sum().backward()
    (expect.sum() * world_size).backward()  # every rank's loss covers every rank's bags
    _check_grad(model.emb.weight, ref.emb.weight, f"gathered rank {rank}")
    for opt_model in (model, ref):
        torch.optim.SGD(opt_model.emb.parameters(), lr=0.5).step()
    torch.testing.assert_close(tdb.full_tensor(model.emb.weight.detach()), ref.emb.weight.detach(), **TOL)


def test_submodule_and_gather_output(pool):
    pool.run(check_submodule_and_gather_output)


# ------------------------------------------------------------------ src_rank
def check_src_rank(rank: int, world_size: int) -> None:
    """``src_rank=1``: every rank's blocks hold rank 1's values, in new storage."""
    import torchrec_dtensor_bridge as tdb
    from torchrec_dtensor_bridge.convert import layout_of, local_shards_of

    table = torch.arange(ROWS * DIM, dtype=torch.float32).view(ROWS, DIM) * (rank + 1)
    emb = nn.Embedding(ROWS, DIM)
    with torch.no_grad():
        emb.weight.copy_(table)
    old = emb.weight
    layout = ShardLayout.row_wise((ROWS, DIM), [1, 3, 2, 4], ranks=[0, 1, 1, 0])
    tdb.shard_module(emb, {"weight": layout}, _mesh(), src_rank=1)
    want = torch.arange(ROWS * DIM, dtype=torch.float32).view(ROWS, DIM) * 2
    torch.testing.assert_close(tdb.full_tensor(emb.weight.detach()), want)
    assert layout_of(emb.weight).shards == layout.shards
    for spec, shard in zip(layout.shards_on(rank), local_shards_of(emb.weight)):
        torch.testing.assert_close(shard, want[spec.slices()])
        assert shard.untyped_storage().data_ptr() != old.untyped_storage().data_ptr()


def test_src_rank_scatters_its_values(pool):
    pool.run(check_src_rank)


# ------------------------------------------------------------------ TorchRec EmbeddingBagCollection
EBC_TABLES = {  # name: (rows, dim, features, pooling)
    "t0": (11, 4, ["f0"], "SUM"),
    "t1": (7, 8, ["f1a", "f1b"], "SUM"),
    "t2": (9, 4, ["f2"], "MEAN"),
    "t3": (5, 4, ["f3"], "SUM"),  # not in the plan: stays a local table
}


def _build_ebc(weighted: bool = False):
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, PoolingType

    configs = [
        EmbeddingBagConfig(name=n, num_embeddings=r, embedding_dim=d, feature_names=list(fs),
                           pooling=getattr(PoolingType, p))
        for n, (r, d, fs, p) in EBC_TABLES.items()
        if p == "SUM" or not weighted  # torch weighs samples with sum pooling only
    ]
    return EmbeddingBagCollection(tables=configs, is_weighted=weighted, device=torch.device("cpu"))


def _kjt(rank: int, keys_order: list[str], weighted: bool = False):
    from torchrec import KeyedJaggedTensor

    g = torch.Generator().manual_seed(50 + rank)
    batch = 2 + rank
    rows = {f: r for r, _, fs, _ in EBC_TABLES.values() for f in fs}
    lengths = [torch.randint(0, 4, (batch,), generator=g) for _ in keys_order]
    values = [torch.randint(0, rows[k], (int(n.sum()),), generator=g) for k, n in zip(keys_order, lengths)]
    ids = torch.cat(values)
    weights = torch.rand(ids.shape, generator=g) if weighted else None
    return KeyedJaggedTensor.from_lengths_sync(keys=keys_order, values=ids, lengths=torch.cat(lengths), weights=weights)


EBC_PLAN = {
    "embedding_bags.t0.weight": ShardLayout.row_wise((11, 4), [4, 7]),
    "embedding_bags.t1.weight": ShardLayout.row_wise((7, 8), 2),
    "embedding_bags.t2.weight": ShardLayout.row_wise((9, 4), [2, 3, 4], ranks=[1, 0, 1]),
}


def check_ebc_row_wise(rank: int, world_size: int, weighted: bool, gather: bool) -> None:
    """Row-wise plan on CPU (TorchRec refuses one there): pooled KeyedTensor values per key and
    gradients like the unsharded EBC; t1 has two features; t3 is not in the plan."""
    import torchrec_dtensor_bridge as tdb

    ebc = _build_ebc(weighted)
    plan = {k: v for k, v in EBC_PLAN.items() if k in dict(ebc.named_parameters())}
    ref = _seeded(ebc, rank, src_rank=0, sharded=tuple(plan))
    tdb.shard_module(ebc, plan, _mesh(), gather_output=gather)
    assert type(ebc).__name__ == "ShardedEmbeddingBagCollection"
    want_keys = ["f0", "f1a", "f1b", "f3"] if weighted else ["f0", "f1a", "f1b", "f2", "f3"]
    keys = want_keys[::-1] if rank else want_keys  # the input's key order does not matter
    kjt = _kjt(rank, keys, weighted)
    out = ebc(kjt)
    assert out.keys() == want_keys
    v = out.values()
    (v * torch.linspace(-1, 1, v.numel()).view_as(v)).sum().backward()
    expects = [ref(theirs) for theirs in _everyone(kjt)]
    if gather:  # every rank's bags, in rank order
        want = {key: torch.cat([e.to_dict()[key] for e in expects]) for key in want_keys}
        v = torch.cat([e.values() for e in expects])
        (v * torch.linspace(-1, 1, v.numel()).view_as(v)).sum().backward()
        for p in ref.parameters():  # each rank's loss covered every rank's bags
            if p.grad is not None:
                p.grad.mul_(world_size)
    else:
        want = expects[rank].to_dict()
        for e in expects:
            v = e.values()
            (v * torch.linspace(-1, 1, v.numel()).view_as(v)).sum().backward()
    got = out.to_dict()
    for key in want_keys:
        torch.testing.assert_close(got[key], want[key].detach(), **TOL, msg=lambda m: f"key {key}: {m}")
    for name in plan:
        table = name.split(".")[1]
        _check_grad(ebc.embedding_bags[table].weight, ref.embedding_bags[table].weight, f"ebc {table}")


@pytest.mark.parametrize("weighted,gather", [(False, False), (True, False), (False, True)])
def test_ebc_row_wise_on_cpu(pool, weighted, gather):
    pool.run(check_ebc_row_wise, weighted, gather)


def check_ebc_forward_is_one_fused_lookup(rank: int, world_size: int) -> dict:
    """A sharded EBC's forward over its three row-wise tables costs what ONE table's lookup costs: one
    agreement all_gather, one ids all_to_all, one reduce-scatter (an all_to_all; not three of each)."""
    import torchrec_dtensor_bridge as tdb

    from .test_lookup_comm_w2 import CommCounter

    ebc = _build_ebc()
    tdb.shard_module(ebc, EBC_PLAN, _mesh())
    kjt = _kjt(rank, ["f0", "f1a", "f1b", "f2", "f3"])
    with torch.no_grad(), CommCounter() as fwd:
        ebc(kjt)
    return fwd.counts


def test_ebc_forward_is_one_fused_lookup(pool):
    for rank, counts in enumerate(pool.run(check_ebc_forward_is_one_fused_lookup)):
        assert counts == {"all_gather": 1, "all_to_all": 2}, f"rank {rank}: {counts}"


def check_ebc_bad_input(rank: int, world_size: int) -> None:
    """A KeyedJaggedTensor missing a feature on ONE rank: every rank raises, the group stays in step."""
    import torchrec_dtensor_bridge as tdb

    ebc = _build_ebc()
    tdb.shard_module(ebc, {"embedding_bags.t1.weight": ShardLayout.row_wise((7, 8), 2)}, _mesh())
    keys = ["f0", "f1a", "f1b", "f2", "f3"]
    bad = _kjt(rank, keys[:-1] if rank == 1 else keys)
    want = "lacks features ['f3']" if rank == 1 else "rank 1 rejected its arguments"
    expect_raises(ValueError, want, lambda: ebc(bad))
    assert ebc(_kjt(rank, keys)).values().shape[0] == 2 + rank
    good = _kjt(rank, keys)
    values = good.values().clone()
    if rank == 1:  # an id past table t1's 7 rows, in feature f1a: the message names the table
        at = int(sum(int(good[k].lengths().sum()) for k in keys[: keys.index("f1a")]))
        values[at] = 7
        assert int(good["f1a"].lengths().sum()) > 0
    from torchrec import KeyedJaggedTensor

    bad_id = KeyedJaggedTensor.from_lengths_sync(keys=keys, values=values, lengths=good.lengths())
    want = "sharded_embedding_bags (table 't1'): input holds id 7" if rank == 1 else "rank 1 rejected"
    expect_raises(ValueError, want, lambda: ebc(bad_id))


def test_ebc_bad_input_raises_on_every_rank(pool):
    pool.run(check_ebc_bad_input)


# ------------------------------------------------------------------ refused calls

class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Embedding(ROWS, DIM)
        self.b = nn.Embedding(ROWS, DIM)
        self.b.weight = self.a.weight
        self.c = self.a  # the same module under a second name


def _refusals(rank: int) -> list[tuple[str, type[Exception], str, object]]:
    """(case, exception, text every rank's message contains, make-call) for each refused call."""
    rw = ShardLayout.row_wise((ROWS, DIM), [4, 6])
    other = ShardLayout.row_wise((ROWS, DIM), [5, 5])
    return [
        ("plans differ", ValueError, "different plans; entries that differ: ['weight']",
         lambda m, mesh: ({"weight": rw if rank == 0 else other}, {})),
        ("src_rank differs", ValueError, "different src_rank values [0, 1]",
         lambda m, mesh: ({"weight": rw}, {"src_rank": rank})),
        ("wrong shape", ValueError, "global_shape [10, 5] differs from the parameter's shape [10, 6]",
         lambda m, mesh: ({"weight": ShardLayout.row_wise((ROWS, 5), 2)}, {})),
        ("missing parameter", ValueError, "'emb.weight': the module has no submodule 'emb'",
         lambda m, mesh: ({"emb.weight": rw}, {})),
        ("missing attribute", ValueError, "'bias': the module has no parameter of that name",
         lambda m, mesh: ({"bias": rw}, {})),
        ("not a tensor", TypeError, "'mode': is not a tensor parameter (it is a str)",
         lambda m, mesh: ({"mode": rw}, {})),
        ("rank outside the world", ValueError, "shard 1 (offsets [4, 0], sizes [6, 6]) is on rank 2, outside",
         lambda m, mesh: ({"weight": ShardLayout.row_wise((ROWS, DIM), [4, 6], ranks=[0, 2])}, {})),
        ("layout not covering", ValueError, "cover 24 of 60 elements",
         lambda m, mesh: ({"weight": ShardLayout.from_shards((ROWS, DIM), [(0, (0, 0), (4, DIM))], validate=False)},
                          {})),
        ("not a layout", TypeError, "expected a ShardLayout, got str", lambda m, mesh: ({"weight": "row_wise"}, {})),
        ("bad src_rank", ValueError, "src_rank must be a rank in [0, 2), got 5",
         lambda m, mesh: ({"weight": rw}, {"src_rank": 5})),
    ]


def _call(module: nn.Module, make, mesh) -> None:
    import torchrec_dtensor_bridge as tdb

    plan, kw = make(module, mesh)
    tdb.shard_module(module, plan, mesh, **kw)


def _unchanged(module: nn.Module, before: dict, cls: type) -> None:
    assert type(module) is cls, type(module)
    now = dict(module.named_parameters())
    assert now.keys() == before.keys()
    for k, (p, values) in before.items():
        assert now[k] is p and torch.equal(p, values), k


def check_refusals(rank: int, world_size: int) -> int:
    """Each refused call, on every rank (or caused by ONE rank): every rank raises; the module is unchanged."""
    import torchrec_dtensor_bridge as tdb

    mesh = _mesh()
    bag = nn.EmbeddingBag(ROWS, DIM, mode="sum")
    before = {k: (p, p.detach().clone()) for k, p in bag.named_parameters()}
    n = 0
    for case, exc, match, make in _refusals(rank):
        try:
            expect_raises(exc, match, lambda: _call(bag, make, mesh))
        except AssertionError as e:
            raise AssertionError(f"case {case!r}: {e}") from None
        _unchanged(bag, before, nn.EmbeddingBag)
        n += 1
    # a non-contiguous parameter on rank 1 only: rank 0 hears of it
    emb = nn.Embedding(DIM, ROWS)
    if rank == 1:
        emb.weight = nn.Parameter(torch.randn(ROWS, DIM).t())
    before = {k: (p, p.detach().clone()) for k, p in emb.named_parameters()}
    want = "'weight': the parameter is not contiguous (stride [1, 6])"
    expect_raises(ValueError, want if rank == 1 else f"rank 1 refused the call: shard_module: plan entry {want}",
                  lambda: tdb.shard_module(emb, {"weight": ShardLayout.row_wise((DIM, ROWS), 2)}, mesh))
    _unchanged(emb, before, nn.Embedding)
    # a parameter missing on rank 0 only
    model = _Model() if rank == 1 else nn.Module()
    expect_raises(ValueError, "no submodule 'emb'",
                  lambda: tdb.shard_module(model, {"emb.weight": ShardLayout.row_wise((ROWS, DIM), 2)}, mesh))
    # not an embedding module's weight
    expect_raises(ValueError, "'proj.weight': belongs to a Linear",
                  lambda: tdb.shard_module(_Model(), {"proj.weight": ShardLayout.row_wise((2, DIM), 2)}, mesh))
    # aliases and tied weights
    tied = _Tied()
    before = {k: (p, p.detach().clone()) for k, p in tied.named_parameters()}
    rw = ShardLayout.row_wise((ROWS, DIM), 2)
    expect_raises(ValueError, "plan entries 'a.weight' and 'c.weight' name the same parameter",
                  lambda: tdb.shard_module(tied, {"a.weight": rw, "c.weight": rw}, mesh))
    expect_raises(ValueError, "'a.weight': the parameter is tied to ['a.weight', 'b.weight']",
                  lambda: tdb.shard_module(tied, {"a.weight": rw}, mesh))
    _unchanged(tied, before, _Tied)
    # unsupported module options
    expect_raises(NotImplementedError, "scale_grad_by_freq=True",
                  lambda: tdb.shard_module(nn.Embedding(ROWS, DIM, scale_grad_by_freq=True), {"weight": rw}, mesh))
    # already sharded
    emb = nn.Embedding(ROWS, DIM)
    tdb.shard_module(emb, {"weight": rw}, mesh)
    expect_raises(ValueError, "already a DTensor", lambda: tdb.shard_module(emb, {"weight": rw}, mesh))
    # the group is still in step
    out = emb(torch.tensor([[0, 9]]))
    assert out.shape == (1, 2, DIM)
    return n


def test_refusals_raise_on_every_rank(pool):
    counts = pool.run(check_refusals)
    assert counts == [len(_refusals(0))] * 2
