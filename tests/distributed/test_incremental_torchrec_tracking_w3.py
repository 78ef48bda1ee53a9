"""Change tracking for TorchRec's fused training (``tdb.track_changed_rows``), on a real DMP (gloo).

A TorchRec ``DistributedModelParallel`` over an ``EmbeddingBagCollection`` whose tables are sharded row-wise,
table-wise, column-wise and table-row-wise with TorchRec's ``fused`` kernel (fbgemm's row-wise Adagrad in
backward), and one data-parallel table, and an ``EmbeddingCollection`` (row-wise, fused), on 3 ranks, is tracked, saved in full, then trained and saved
incrementally after each step. Every block of a tracked table is digested from the tracker's record only, never
scanned (a spy on ``tracking.written_since``, which the save asks first), and each link holds exactly the rows
that changed (counted from the live tables, every tensor gathered). A write through torch the tracker is not told
of (link 2), a load of an older link into the live tables (link 4), TorchRec's own ``load_state_dict`` (link 5)
and tracking switched off (link 6) make the saves that follow scan what was written, and their links are exact
too. The chain then loads bit-exact (``torch.equal``) on 2 ranks
under another plan and on 1 rank.

A tracker that misses a row (one id dropped from its record of a step) fails the same checks: its link lacks the
row, and the chain loaded differs from the live tables.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import torchrec_dtensor_bridge as tdb
from torchrec_dtensor_bridge import torchrec_tracking, tracking

from .harness import make_pool_fixture
from .test_dlrm_resume_w3 import _snapshot

pool = make_pool_fixture(3)

TABLES = {"t_rw": (40, 8), "t_tw": (24, 8), "t_cw": (20, 16), "t_trw": (30, 8), "t_dp": (10, 4)}  # rows, dim
SEQUENCE = {"s_rw": (36, 8)}  # a table of an EmbeddingCollection (un-pooled lookups)
SAVED = {"t_rw": ("row_wise",), "t_tw": ("table_wise", 1), "t_cw": ("column_wise", [0, 2]),
         "t_trw": ("table_row_wise",), "t_dp": ("data_parallel",), "s_rw": ("row_wise",)}  # on 3 ranks
HOLDERS = {"t_rw": {0, 1, 2}, "t_tw": {1}, "t_cw": {0, 2}, "t_trw": {0, 1, 2}, "s_rw": {0, 1, 2}}  # SAVED's
AFTER = {"t_rw": ("table_wise", 0), "t_tw": ("row_wise",), "t_cw": ("column_wise", [1, 0]), "t_trw": ("row_wise",),
         "t_dp": ("data_parallel",), "s_rw": ("table_wise", 1)}  # on ranks 0-1: every table moves (table-row-wise
# needs the whole world; t_cw's row-wise state is one per column block: bit-exact under the same column cut)
ONE_RANK = {"t_rw": ("table_wise", 0), "t_tw": ("table_wise", 0), "t_cw": ("column_wise", [0, 0]),
            "t_trw": ("table_wise", 0), "t_dp": ("data_parallel",), "s_rw": ("table_wise", 0)}
FUSED = [n for n in [*TABLES, *SEQUENCE] if n != "t_dp"]
LINKS = 6
CHECKED = (3, 6)


class _Model(nn.Module):
    def __init__(self, ebc: nn.Module, ec: nn.Module) -> None:
        super().__init__()
        self.ebc = ebc
        self.ec = ec

    def forward(self, kjt: Any, sequences: Any) -> tuple[Any, Any]:
        return self.ebc(kjt), self.ec(sequences)


def _key(table: str) -> str:
    return f"ec.embeddings.{table}.weight" if table in SEQUENCE else f"ebc.embedding_bags.{table}.weight"


def _dmp(plan: dict[str, tuple], group: dist.ProcessGroup):
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig
    from torchrec.distributed import sharding_plan as sp
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv, ShardingPlan

    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name=n, embedding_dim=d, num_embeddings=r, feature_names=[f"f_{n}"])
                for n, (r, d) in TABLES.items()],
        device=torch.device("meta"))
    ec = EmbeddingCollection(
        tables=[EmbeddingConfig(name=n, embedding_dim=d, num_embeddings=r, feature_names=[f"f_{n}"])
                for n, (r, d) in SEQUENCE.items()],
        device=torch.device("meta"))
    fused = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.1, "eps": 1e-3}
    sharders = [EmbeddingBagCollectionSharder(fused_params=fused), EmbeddingCollectionSharder(fused_params=fused)]
    make = {"row_wise": lambda: sp.row_wise(compute_kernel="fused"),
            "table_wise": lambda rank: sp.table_wise(rank=rank, compute_kernel="fused"),
            "column_wise": lambda ranks: sp.column_wise(ranks=ranks, compute_kernel="fused"),
            "table_row_wise": lambda: _fused(sp.table_row_wise(host_index=0)),
            "data_parallel": lambda: sp.data_parallel()}
    world = group.size()
    plans = {}
    for name, module, sharder, tables in (("ebc", ebc, sharders[0], TABLES), ("ec", ec, sharders[1], SEQUENCE)):
        per_param = {n: make[kind](*args) for n, (kind, *args) in plan.items() if n in tables}
        plans[name] = sp.construct_module_sharding_plan(module, per_param_sharding=per_param, sharder=sharder,
                                                        local_size=world, world_size=world, device_type="cpu")
    return DistributedModelParallel(
        _Model(ebc, ec), env=ShardingEnv.from_process_group(group), device=torch.device("cpu"),
        plan=ShardingPlan(plans), sharders=sharders)


def _fused(generator):
    """``generator``'s sharding with the ``fused`` compute kernel (``table_row_wise`` takes no kernel)."""
    def make(*args: Any) -> Any:
        return dataclasses.replace(generator(*args), compute_kernel="fused")

    return make


def _dense_sgd(dmp) -> torch.optim.Optimizer:
    """SGD over what the fused kernel does not train (the data-parallel table)."""
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    return torch.optim.SGD([p for _, p in in_backward_optimizer_filter(dmp.named_parameters())], lr=0.1)


def _step(dmp, dense: torch.optim.Optimizer, step: int, rank: int) -> None:
    """One step on this rank's own batch (a few ids a table: a link holds a few rows)."""
    from torchrec import KeyedJaggedTensor

    g = torch.Generator().manual_seed(100 * step + rank)
    lengths = torch.randint(0, 3, (len(TABLES), 3), generator=g)
    values = [torch.randint(0, r, (int(lengths[i].sum()),), generator=g) for i, (r, _) in enumerate(TABLES.values())]
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=[f"f_{n}" for n in TABLES], values=torch.cat(values),
                                              lengths=lengths.reshape(-1))
    ((rows, _),) = SEQUENCE.values()
    lengths = torch.randint(0, 3, (3,), generator=g)
    sequences = KeyedJaggedTensor.from_lengths_sync(
        keys=[f"f_{n}" for n in SEQUENCE], values=torch.randint(0, rows, (int(lengths.sum()),), generator=g),
        lengths=lengths)
    pooled, seq = (o.wait() if hasattr(o, "wait") else o for o in dmp(kjt, sequences))
    looked_up = torch.cat([pooled.values().reshape(-1), *(jt.values().reshape(-1) for jt in seq.values())])
    (looked_up * torch.randn(looked_up.shape, generator=g)).sum().backward()
    dense.step()
    dense.zero_grad()


def _state(dmp) -> dict[str, Any]:
    return {"model": dmp, "fused": dmp.fused_optimizer}


class _Spy:
    """What each incremental save asked the tracker (``tracking.written_since``): per key, the rows known written
    of each of this rank's blocks, ``None`` for a block the save scanned."""

    def __init__(self) -> None:
        self.asked: dict[str, list[int | None]] = {}
        self._real = tracking.written_since

    def __enter__(self) -> _Spy:
        def spy(t: torch.Tensor, save_id: str, key: Any) -> Any:
            known = self._real(t, save_id, key)
            self.asked.setdefault(key[0], []).append(None if known is None else int(known.rows.numel()))
            return known

        tracking.written_since = spy
        return self

    def __exit__(self, *exc: Any) -> None:
        tracking.written_since = self._real


def _changed_rows(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor], info: dict[str, Any]
                  ) -> dict[str, int]:
    """Per key of an incremental checkpoint (``info``: its ``inspect``), the rows that differ between the
    snapshots, counted per block of the layout it was saved from (as its link counts them)."""
    out = {}
    for k, now in after.items():
        if "links" not in info.get(k, {}):
            continue
        differ, count = now != before[k], 0
        for s in info[k]["shards"]:
            block = differ[tuple(slice(o, o + z) for o, z in zip(s["offsets"], s["sizes"]))]
            count += int(block.reshape(block.shape[0], -1).any(1).sum()) if block.dim() else int(block)
        out[k] = count
    return out


def _assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert sorted(got) == sorted(want), sorted(set(got) ^ set(want))
    differ = [k for k in want if not torch.equal(got[k], want[k])]
    assert not differ, f"{what}: {differ} differ"


def _tracked_report(report: torchrec_tracking.FusedTracking) -> None:
    """What is tracked on this rank under plan SAVED: the blocks of every fused table it holds."""
    rank = dist.get_rank()
    tables = [n for n in FUSED if rank in HOLDERS[n]]
    assert sorted(report.tracked) == sorted([_key(n) for n in tables] +
                                            [f"state.{_key(n)}.{n}.momentum1" for n in tables]), report.tracked
    assert list(report.scanned) == [_key("t_dp")], report.scanned
    assert "not fbgemm's training TBE" in report.scanned[_key("t_dp")]


def _train_chain(rank: int, world: int, root: str, miss: bool) -> Any:
    """The chain of the module docstring on every rank; rank 0 returns the snapshots of the links ``CHECKED``
    and, per rank and link, the spy's record, and per link the rows each key's link holds against the rows that
    changed. With ``miss``, one link only, and the tracker drops one id from its record of each lookup of t_rw on
    rank 0."""
    group = dist.group.WORLD
    dmp = _dmp(SAVED, group)
    dense = _dense_sgd(dmp)
    report = tdb.track_changed_rows(dmp)
    _tracked_report(report)
    for again in (dmp, dmp.module.ebc):  # the same TBEs, through the DMP or its sharded module
        with pytest.raises(ValueError, match="tables are tracked already"):
            tdb.track_changed_rows(again)
    real = torchrec_tracking._rows_looked_up
    if miss and rank == 0:
        def dropping(arguments: dict[str, Any], features: list[int], rows: list[int]) -> list[torch.Tensor]:
            out = real(arguments, features, rows)
            if rows == [-(-TABLES["t_rw"][0] // world)] and out[0].numel():  # t_rw's TBE: drop one id's copies
                out[0] = out[0][out[0] != out[0][0]]
            return out

        torchrec_tracking._rows_looked_up = dropping
    try:
        return _links(rank, dmp, dense, report, root, group, 1 if miss else LINKS)
    finally:
        torchrec_tracking._rows_looked_up = real
        report.remove()


def _links(rank, dmp, dense, report, root, group, links) -> Any:
    _step(dmp, dense, 0, rank)
    tdb.checkpoint.save(_state(dmp), f"{root}/l0")
    last = _snapshot(_state(dmp), group)
    saved, asked, rows = {}, {}, {}
    for link in range(1, links + 1):
        if link == 4:  # an older link loaded into the live tables: the next save finds the rows it changed
            tdb.checkpoint.load(_state(dmp), f"{root}/l2")
        if link == 5:  # TorchRec's own load_state_dict, one row changed: it writes every table through torch
            other = copy.deepcopy(dmp.state_dict())
            with torch.no_grad():
                other[_key("t_trw")].local_shards()[0].tensor[0] += 1.0
            dmp.load_state_dict(other)
        if link == 6:
            report.remove()  # tracking off: the saves scan again
        _step(dmp, dense, link, rank)
        if link == 2 and rank == 0:  # a write through torch the tracker is not told of
            with torch.no_grad():
                dmp.module.ebc.embedding_bags["t_rw"].weight[1] += 1.0
        with _Spy() as spy:
            tdb.checkpoint.save(_state(dmp), f"{root}/l{link}", base=f"{root}/l{link - 1}")
        now = _snapshot(_state(dmp), group)
        info = tdb.checkpoint.inspect(f"{root}/l{link}")
        rows[link] = ({k: v["links"][0]["rows"] for k, v in info.items() if "links" in v},
                      _changed_rows(last, now, info))
        asked[link] = spy.asked
        if link in CHECKED or links == 1:
            saved[link] = now
        last = now
    everyone: list[Any] = [None] * group.size()
    dist.all_gather_object(everyone, asked, group=group)
    return (saved, everyone, rows) if rank == 0 else None


@pytest.fixture(scope="module")
def chain(pool, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("chain"))
    return (root, *pool.run(_train_chain, root, False)[0])


def _scanned(key: str, rank: int, link: int) -> bool:
    """Whether the save of ``link`` scans ``key``'s blocks on ``rank`` (see the module docstring)."""
    table = re.search(r"\.(?:embedding_bags|embeddings)\.(\w+)\.", key).group(1)
    written_through_torch = (link == 2 and rank == 0 and key == "model." + _key("t_rw")) or \
        (link == 5 and key.startswith("model."))
    return table not in FUSED or link in (4, 6) or written_through_torch


def test_tracked_links_digest_only_the_rows_written_and_hold_the_rows_that_changed(chain):
    _, _, asked, rows = chain
    for link, (held, changed) in rows.items():
        assert held == changed, (link, held, changed)  # exactly the rows that changed, as a scan finds them
        assert all(held[k] for k in held if "t_rw" in k), (link, held)
    for rank, per_link in enumerate(asked):
        for link, keys in per_link.items():
            assert any("momentum1" in k for k in keys) and any("t_dp" in k for k in keys) == (rank == 0), keys
            for key, blocks in keys.items():
                if _scanned(key, rank, link):
                    assert blocks and all(b is None for b in blocks), (rank, link, key, blocks)
                else:  # at most the ids the step looked up on every rank (3 bags of at most 2 ids a rank)
                    assert blocks and all(b is not None for b in blocks) and sum(blocks) <= 3 * 3 * 2, \
                        (rank, link, key, blocks)


def _load(rank: int, world: int, root: str, link: int, want: dict[str, torch.Tensor], plan: str) -> None:
    ranks = [0] if plan == "one rank" else [0, 1]
    group = dist.new_group(ranks)
    if rank not in ranks:
        return
    dmp = _dmp(ONE_RANK if plan == "one rank" else AFTER, group)
    tdb.checkpoint.load(_state(dmp), f"{root}/l{link}", process_group=group)
    _assert_equal(_snapshot(_state(dmp), group), want, f"link {link} loaded on {plan} (rank {rank})")


@pytest.mark.parametrize("link", CHECKED)
def test_the_chain_loads_bit_exact_on_2_ranks_under_another_plan(pool, chain, link):
    root, saved, _, _ = chain
    pool.run(_load, root, link, saved[link], "another plan")


def test_the_chain_loads_bit_exact_on_one_rank(pool, chain):
    root, saved, _, _ = chain
    pool.run(_load, root, CHECKED[-1], saved[CHECKED[-1]], "one rank")


def test_a_tracker_that_misses_a_row_fails_the_check(pool, tmp_path):
    """The injected miss: t_rw's link lacks a row the step wrote, and the link loaded differs from the live
    table: the check the tracked chain passes above fails."""
    root = str(tmp_path)
    saved, asked, rows = pool.run(_train_chain, root, True)[0]
    key = "model." + _key("t_rw")
    assert all(b is not None for b in asked[0][1][key]), asked[0][1]  # rank 0's blocks tracked, not scanned
    held, changed = rows[1]
    assert held[key] == changed[key] - 1, (held, changed)
    with pytest.raises(AssertionError, match=re.escape(f"['{key}', 'fused.state.{_key('t_rw')}.t_rw.momentum1'] "
                                                       "differ")):
        pool.run(_load, root, 1, saved[1], "one rank")
