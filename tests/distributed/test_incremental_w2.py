"""Incremental checkpoints on 2 gloo ranks: chains saved under one plan, loaded bit-exact under others and in one
process; only the changed rows written; broken, damaged and foreign links refused on every rank, nothing modified."""

import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import torchrec_dtensor_bridge as tdb
from torchrec_dtensor_bridge import cli
from tests.layout import committed
from torchrec_dtensor_bridge.checkpoint.format.manifest import read_manifest
from torchrec_dtensor_bridge.layout import ShardLayout

from .checks import reference_table
from .harness import make_pool_fixture

pool = make_pool_fixture(2)

SAVED = {  # key -> layout the chain is saved under
    "rw": ShardLayout.row_wise((97, 36), [60, 37]),
    "cw": ShardLayout.column_wise((13, 16), [4, 4, 4, 4], ranks=[0, 1, 0, 1]),
    "tw": ShardLayout.table_wise((9, 5), 1),
    "grid": ShardLayout.grid((10, 8), [3, 7], [5, 3], [1, 0, 0, 1]),
    "mom": ShardLayout.row_wise((97,), [60, 37]),  # one value per row (row-wise Adagrad's state)
}
LOADED = {  # the same tables, another plan
    "rw": ShardLayout.column_wise((97, 36), [20, 16]),
    "cw": ShardLayout.row_wise((13, 16), [6, 7]),
    "tw": ShardLayout.table_wise((9, 5), 0),
    "grid": ShardLayout.grid((10, 8), [6, 4], [2, 6], [0, 1, 1, 0]),
    "mom": ShardLayout.row_wise((97,), [10, 87]),
}
LINKS = 5


def _tables(link):
    """Every table as it is at ``link`` (0: the full save): a few rows changed per link, the same on every rank."""
    tables = {k: reference_table(lay.global_shape, seed=i) for i, (k, lay) in enumerate(sorted(SAVED.items()))}
    changed = {}
    for n in range(1, link + 1):
        g = torch.Generator().manual_seed(n)
        changed = {}
        for k, t in tables.items():
            rows = torch.unique(torch.randint(0, t.shape[0], (3,), generator=g))
            t[rows] += n * 0.5
            changed[k] = set(rows.tolist())
    return tables, changed


def _state(layouts, tables, rank, link):
    sd = {k: tdb.convert.dtensor_from_local_shards(lay.with_name(k), [tables[k][s.slices()].clone()
                                                                      for s in lay.shards_on(rank)])
          for k, lay in layouts.items()}
    sd["step"] = torch.tensor(float(link))
    sd["epoch"] = link
    return sd


def _save_chain(rank, world_size, root):
    for link in range(LINKS + 1):
        tables, _ = _tables(link)
        base = f"{root}/l{link - 1}" if link else None
        tdb.checkpoint.save(_state(SAVED, tables, rank, link), f"{root}/l{link}", base=base)


def _load_other_plan(rank, world_size, root, links):
    for link in links:
        want, _ = _tables(link)
        dest = _state(LOADED, {k: torch.zeros_like(t) for k, t in want.items()}, rank, 0)
        tdb.checkpoint.load(dest, f"{root}/l{link}")
        for k, t in want.items():
            assert torch.equal(tdb.full_tensor(dest[k]), t), (link, k)
        assert dest["epoch"] == link and torch.equal(dest["step"], torch.tensor(float(link)))


def _save_under_another_plan(rank, world_size, root):
    """The chain's state loaded under another plan, saved incrementally against the chain's head: blocks of
    the same columns compare with the base's digests row by row whatever the row cuts (``mom``: nothing
    changed, nothing written); blocks of other columns are written whole. The new link loads exactly."""
    want, _ = _tables(LINKS)
    dest = _state(LOADED, {k: torch.zeros_like(t) for k, t in want.items()}, rank, 0)
    tdb.checkpoint.load(dest, f"{root}/l{LINKS}")
    tdb.checkpoint.save(dest, f"{root}/moved", base=f"{root}/l{LINKS}")
    pieces = read_manifest(committed(Path(root) / "moved"))["link"]["pieces"]
    assert "mom" not in pieces and "tw" not in pieces, sorted(pieces)  # same columns, nothing changed
    assert sum(p[4] for p in pieces["cw"]) == 13 and all(p[5] for p in pieces["cw"])  # other columns: whole
    again = _state(SAVED, {k: torch.zeros_like(t) for k, t in want.items()}, rank, 0)
    tdb.checkpoint.load(again, f"{root}/moved")
    for k, t in want.items():
        assert torch.equal(tdb.full_tensor(again[k]), t), k


def test_chain_saves_changed_rows_and_loads_under_any_plan_and_world(pool, tmp_path):
    pool.run(_save_chain, str(tmp_path))
    for link in range(1, LINKS + 1):  # each link holds exactly the rows that changed since its base
        manifest = read_manifest(committed(tmp_path / f"l{link}"))
        _, changed = _tables(link)
        assert manifest["link"]["base"]["name"] == f"l{link - 1}" and manifest["link"]["depth"] == link
        for k, rows in changed.items():
            held = {p[0][0] + r for p in manifest["link"]["pieces"][k] for r in range(p[4]) if p[5]}
            ids = []
            for p in manifest["link"]["pieces"][k]:
                if not p[5]:
                    raw = (committed(tmp_path / f"l{link}") / p[2]).read_bytes()[p[3] : p[3] + 8 * p[4]]
                    ids += [p[0][0] + int(i) for i in torch.frombuffer(bytearray(raw), dtype=torch.int64)]
            assert held | set(ids) == rows, (link, k, sorted(held | set(ids)), sorted(rows))
        assert "step" not in manifest["link"]["pieces"] or link  # the 0-d value changed: one row
    pool.run(_load_other_plan, str(tmp_path), [1, 3, LINKS])
    pool.run(_save_under_another_plan, str(tmp_path))
    for link in (2, LINKS):  # one process, no process group: plain tensors
        want, _ = _tables(link)
        dest = {k: torch.zeros_like(t) for k, t in want.items()}
        dest.update(step=torch.tensor(0.0), epoch=0)
        stats = tdb.checkpoint.load(dest, str(tmp_path / f"l{link}"))
        assert stats.verified
        for k, t in want.items():
            assert torch.equal(dest[k], t), (link, k)
        assert dest["epoch"] == link
    # inspect shows every link; compact makes the chain one checkpoint; export reads the chain
    info = tdb.checkpoint.inspect(str(tmp_path / f"l{LINKS}"))
    assert [link["name"] for link in info["rw"]["links"]] == [f"l{i}" for i in range(LINKS, -1, -1)]
    assert [link["base"] for link in info["rw"]["links"]][:2] == [f"l{LINKS - 1}", f"l{LINKS - 2}"]
    assert info["rw"]["links"][-1]["rows"] == 97 and 0 < info["rw"]["links"][0]["rows"] <= 3
    report = tdb.checkpoint.format_report(str(tmp_path / f"l{LINKS}"))
    assert f"a chain of {LINKS + 1} links" in report and "l0  save" in report, report
    want, _ = _tables(LINKS)
    tdb.checkpoint.export(str(tmp_path / f"l{LINKS}"), str(tmp_path / "chain.pt"), format="torch", progress=False)
    exported = torch.load(tmp_path / "chain.pt")
    for k, t in want.items():
        assert torch.equal(exported[k], t), k
    assert cli.main(["compact", str(tmp_path / f"l{LINKS}"), str(tmp_path / "flat")]) == 0
    shutil.rmtree(committed(tmp_path / "l1"))  # the compacted checkpoint depends on no link
    dest = {k: torch.zeros_like(t) for k, t in want.items()}
    dest.update(step=torch.tensor(0.0), epoch=0)
    tdb.checkpoint.load(dest, str(tmp_path / "flat"), strict=True)
    for k, t in want.items():
        assert torch.equal(dest[k], t), k
    assert "links" not in tdb.checkpoint.inspect(str(tmp_path / "flat"))["rw"]
    with pytest.raises(tdb.checkpoint.BrokenChainError, match="link l1 .*is gone"):
        tdb.checkpoint.export(str(tmp_path / f"l{LINKS}"), str(tmp_path / "chain.pt"), format="torch",
                              progress=False)


def _refused(rank, world_size, root, case):
    tables, _ = _tables(0)
    tdb.checkpoint.save(_state(SAVED, tables, rank, 0), f"{root}/full")
    layouts, base = dict(SAVED), f"{root}/full"
    if case == "shape":
        layouts["rw"] = ShardLayout.row_wise((98, 36), [60, 38])
        tables["rw"] = reference_table((98, 36))
    elif case == "key":
        layouts["extra"] = ShardLayout.row_wise((4, 4), [2, 2])
        tables["extra"] = reference_table((4, 4))
    elif case == "missing":
        base = f"{root}/nothing"
    elif case == "elsewhere":
        (Path(root) / "sub").mkdir(exist_ok=True)
        base = f"{root}/sub/full"
    dist.barrier()
    with pytest.raises(ValueError) as e:
        tdb.checkpoint.save(_state(layouts, tables, rank, 1), f"{root}/inc", base=base)
    dist.barrier()
    assert not (Path(root) / "inc").exists()
    return str(e.value)


@pytest.mark.parametrize("case, needle", [
    ("shape", r"key 'rw': shape \[98, 36\] torch.float32, base .* holds shape \[97, 36\]"),
    ("key", "key 'extra' is not in base"),
    ("missing", "base='.*nothing' is not a checkpoint"),
    ("elsewhere", "the links of a chain live in one directory"),
])
def test_bad_base_refused_on_every_rank_before_anything_is_written(pool, tmp_path, case, needle):
    import re

    for message in pool.run(_refused, str(tmp_path), case):
        assert re.search(needle, message), message


def _load_refused(rank, world_size, root, error, needle):
    want, _ = _tables(LINKS)
    dest = _state(LOADED, {k: torch.full_like(t, -1.0) for k, t in want.items()}, rank, 0)
    with pytest.raises(getattr(tdb.checkpoint, error), match=needle):
        tdb.checkpoint.load(dest, f"{root}/l{LINKS}")
    for k, t in want.items():  # nothing modified
        assert torch.equal(tdb.full_tensor(dest[k]), torch.full_like(t, -1.0)), k
    assert dest["epoch"] == 0


def _resave_base(rank, world_size, root):
    tables, _ = _tables(0)
    for _ in range(2):  # the second save reuses the spare: link l1's base generation
        tdb.checkpoint.save(_state(SAVED, tables, rank, 0), f"{root}/l1")


def test_broken_damaged_or_foreign_links_refused_on_every_rank(pool, tmp_path):
    pool.run(_save_chain, str(tmp_path))
    root = str(tmp_path)
    # a flipped byte in a middle link's changed rows
    gen = committed(tmp_path / "l3")
    piece = read_manifest(gen)["link"]["pieces"]["rw"][0]
    rows = gen / piece[2]
    data = bytearray(rows.read_bytes())
    data[piece[3] + 8 * piece[4] + 70] ^= 0xFF  # past the ids (aligned to 64 bytes): a row's bytes
    backup = rows.read_bytes()
    rows.write_bytes(bytes(data))
    pool.run(_load_refused, root, "CorruptCheckpointError", r"rows_\d.tdb is corrupt or from another save: link l3 ")
    rows.write_bytes(backup)
    # a link from another job: the generation directory holds another save's files
    other = tmp_path / "other"
    tdb.checkpoint.save({"x": torch.zeros(3)}, str(other))
    gen2 = committed(tmp_path / "l2")
    moved = tmp_path / "l2-moved"
    shutil.move(gen2, moved)
    shutil.copytree(committed(other), gen2)
    pool.run(_load_refused, root, "BrokenChainError", r"link l2 .*was replaced: .* now holds save")
    shutil.rmtree(gen2)
    # a link that is gone
    pool.run(_load_refused, root, "BrokenChainError", r"link l2 .*is gone")
    shutil.move(moved, gen2)
    pool.run(_load_other_plan, root, [LINKS])  # whole again: loads
    # later saves to a base's own path replace the generation a link depends on: said clearly
    pool.run(_resave_base, root)
    pool.run(_load_refused, root, "BrokenChainError", r"link l1 .*(is gone|was replaced)")


FUSED = {"a": (ShardLayout.row_wise((40, 8), [25, 15]), ShardLayout.column_wise((40, 8), [3, 5])),
         "b": (ShardLayout.column_wise((30, 8), [4, 4]), ShardLayout.row_wise((30, 8), [10, 20]))}


def _fused_job(rank, plan):
    weights = {n: tdb.convert.dtensor_from_local_shards(
        lays[plan].with_name(n), [reference_table(lays[0].global_shape, seed=i)[s.slices()].clone() * 1e-3
                                  for s in lays[plan].shards_on(rank)]) for i, (n, lays) in enumerate(FUSED.items())}
    for w in weights.values():
        w.requires_grad_()
    return weights, tdb.FusedOptimizer(weights, "rowwise_adagrad", lr=0.05)


def _fused_step(rank, weights, opt, step):
    g = torch.Generator().manual_seed(100 * step + rank)
    for n, w in weights.items():
        ids = torch.randint(0, w.shape[0], (6,), generator=g)
        out = tdb.sharded_embedding_bag(ids, w, torch.tensor([0, 3]), mode="sum", optimizer=opt)
        (out * (step + 1)).sum().backward()


def _fused_snapshot(weights, opt):
    sd = {f"w.{n}": w for n, w in weights.items()} | {f"opt.{k}": v for k, v in opt.state_dict().items()
                                                       if isinstance(v, torch.Tensor)}
    return {k: (v if type(v) is torch.Tensor else tdb.full_tensor(v)).clone() for k, v in sd.items()}


def _fused_chain(rank, world_size, root):
    """A FusedOptimizer job saved as a chain (row-wise and column-wise tables), resumed under the other plan."""
    weights, opt = _fused_job(rank, 0)
    _fused_step(rank, weights, opt, 0)
    tdb.checkpoint.save({"w": weights, "opt": opt}, f"{root}/f0")
    for link in range(1, 4):
        _fused_step(rank, weights, opt, link)
        tdb.checkpoint.save({"w": weights, "opt": opt}, f"{root}/f{link}", base=f"{root}/f{link - 1}")
    saved = _fused_snapshot(weights, opt)
    _fused_step(rank, weights, opt, 4)
    after = _fused_snapshot(weights, opt)
    resumed_w, resumed_opt = _fused_job(rank, 1)
    tdb.checkpoint.load({"w": resumed_w, "opt": resumed_opt}, f"{root}/f3")
    got = _fused_snapshot(resumed_w, resumed_opt)
    assert sorted(got) == sorted(saved) and any("momentum1" in k for k in got), sorted(got)
    for k, v in saved.items():
        assert torch.equal(got[k], v), k
    _fused_step(rank, resumed_w, resumed_opt, 4)  # the same step as the uninterrupted run, under another plan
    for k, v in _fused_snapshot(resumed_w, resumed_opt).items():
        torch.testing.assert_close(v, after[k], rtol=1e-6, atol=1e-7)  # column cuts sum per-row squares in parts


def test_fused_optimizer_job_resumes_from_a_chain_under_another_plan(pool, tmp_path):
    pool.run(_fused_chain, str(tmp_path))


def _async_saves(rank, world_size, root):
    states = {link: _state(SAVED, _tables(link)[0], rank, link) for link in (0, 1, 2)}
    full = tdb.checkpoint.save(states[0], f"{root}/a0", asynchronous=True)  # a full save: everything copied
    first = tdb.checkpoint.save(states[1], f"{root}/a1", base=f"{root}/a0", asynchronous=True)  # waits for a0
    second = tdb.checkpoint.save(states[2], f"{root}/a2", base=f"{root}/a1", asynchronous=True)  # waits for a1
    for state in states.values():  # training goes on at once: the saves copied what they write
        for k in SAVED:
            for t in tdb.convert.local_shards_of(state[k]):
                t.fill_(-7.0)
        state["epoch"] = -7
    ids = [full.result(timeout=60), first.result(timeout=60), second.result(timeout=60)]
    assert ids == [read_manifest(committed(Path(root) / f"a{i}"))["save_id"] for i in (0, 1, 2)], ids
    for link in (0, 1, 2):
        want, _ = _tables(link)
        dest = _state(LOADED, {k: torch.zeros_like(t) for k, t in want.items()}, rank, 0)
        tdb.checkpoint.load(dest, f"{root}/a{link}")
        for k, t in want.items():
            assert torch.equal(tdb.full_tensor(dest[k]), t), (link, k)
        assert dest["epoch"] == link


def test_asynchronous_saves_return_once_copied_and_commit_in_order(pool, tmp_path):
    pool.run(_async_saves, str(tmp_path))


TRACKED = {"rw": ShardLayout.row_wise((50, 8), [30, 20]),
           "grid": ShardLayout.grid((24, 8), [10, 14], [4, 4], [0, 1, 1, 0]),
           "cw": ShardLayout.column_wise((40, 8), [4, 4])}


def _tracked_job(rank, kind, track):
    weights = {n: tdb.convert.dtensor_from_local_shards(
        lay.with_name(n), [reference_table(lay.global_shape, seed=i)[s.slices()].clone() * 1e-2
                           for s in lay.shards_on(rank)]).requires_grad_()
               for i, (n, lay) in enumerate(TRACKED.items())}
    return weights, tdb.FusedOptimizer(weights, kind, lr=0.05, track_changed_rows=track)


def _tracked_step(rank, weights, opt, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    ids = [torch.randint(0, w.shape[0], (4, 2), generator=g) for w in weights.values()]
    outs = tdb.sharded_embedding_bags(ids, list(weights.values()), mode="sum", optimizer=opt)
    sum((o * (step + 1)).sum() for o in outs).backward()


def _known(state, rank, base_id):
    """Per key of ``state``, whether every block of this rank is known to the tracker since save ``base_id``."""
    from torchrec_dtensor_bridge import tracking
    from torchrec_dtensor_bridge.checkpoint.common import leaves
    from torchrec_dtensor_bridge.checkpoint.incremental.rows import local_blocks

    out = {}
    for fqn, v in leaves(state):
        if isinstance(v, torch.Tensor) and v.dim():
            blocks = [(o, t) for o, t in local_blocks(v, rank) if t.numel()]
            out[fqn] = all(tracking.written_since(t, base_id, (fqn, o, tuple(t.shape))) is not None for o, t in blocks)
    return out


def _tracked_saves(rank, world_size, root, kind):
    """The same job with and without tracking: equal links (the same changed rows), equal loads. A write the
    tracker was not told of (through torch, link 2) and a base that is not the last save (link 4) fall back to
    the scan; an asynchronous save (link 3) marks what it copied, before the steps that follow it."""
    jobs = {track: _tracked_job(rank, kind, track) for track in (True, False)}
    for flag in ("track_changed_rows", "stochastic_rounding"):  # refused before any state is built
        with pytest.raises(ValueError, match=f"FusedOptimizer: {flag} must be True or False, got 1"):
            tdb.FusedOptimizer(jobs[True][0], kind, lr=0.05, **{flag: 1})
    save_ids = {(track, 0): tdb.checkpoint.save({"w": w, "opt": opt}, f"{root}/{track}0")
                for track, (w, opt) in jobs.items()}
    for link in range(1, 6):
        base = link - 2 if link == 4 else link - 1
        live = {}
        for track, (w, opt) in jobs.items():
            _tracked_step(rank, w, opt, link)
            if link == 2:  # written through torch, not by the optimizer
                with torch.no_grad():
                    tdb.convert.local_shards_of(w["rw"])[0][1] += 1.0
            if track:
                known = _known({"w": w, "opt": opt.state_dict()}, rank, save_ids[(True, base)])
                one_pass = kind == "adam"  # row-wise Adagrad on column cuts needs the exchange: not reported
                want = {k: link != 4 and (one_pass or k.endswith("rw") or ".rw." in k) for k in known}
                if link == 2:  # the write voids the weights written (their state has a base of its own)
                    want["w.rw"] = False
                assert known == want, (link, known, want)
            live[track] = _fused_snapshot(w, opt)
            saved = tdb.checkpoint.save({"w": w, "opt": opt}, f"{root}/{track}{link}", base=f"{root}/{track}{base}",
                                        asynchronous=link == 3)
            if link == 3:  # training goes on while it writes
                _tracked_step(rank, w, opt, 30)
                saved = saved.result(timeout=60)
            save_ids[(track, link)] = saved
        links = {track: tdb.checkpoint.inspect(f"{root}/{track}{link}") for track in jobs}
        assert {k: v["links"][0]["rows"] for k, v in links[True].items() if "links" in v} == \
               {k: v["links"][0]["rows"] for k, v in links[False].items() if "links" in v}, link
        for track in jobs:
            w2, opt2 = _tracked_job(rank, kind, False)
            tdb.checkpoint.load({"w": w2, "opt": opt2}, f"{root}/{track}{link}")
            got = _fused_snapshot(w2, opt2)
            assert sorted(got) == sorted(live[track])
            for k, v in live[track].items():
                assert torch.equal(got[k], v), (track, link, k)
    # an older link loaded into the live tables (a rewind): the next save against the last link finds every row
    # the load changed (the load writes through torch: the tracker's record is void, the save scans)
    w, opt = jobs[True]
    tdb.checkpoint.load({"w": w, "opt": opt}, f"{root}/True2")
    rewound = _fused_snapshot(w, opt)
    assert _known({"w": w, "opt": opt.state_dict()}, rank, save_ids[(True, 5)]) == dict.fromkeys(known, False)
    tdb.checkpoint.save({"w": w, "opt": opt}, f"{root}/True6", base=f"{root}/True5")
    w2, opt2 = _tracked_job(rank, kind, False)
    tdb.checkpoint.load({"w": w2, "opt": opt2}, f"{root}/True6")
    got = _fused_snapshot(w2, opt2)
    for k, v in rewound.items():
        assert torch.equal(got[k], v), ("rewound", k)


@pytest.mark.parametrize("kind", ["adam", "rowwise_adagrad"])
def test_tracked_rows_give_the_scanned_links(pool, tmp_path, kind):
    pool.run(_tracked_saves, str(tmp_path), kind)
