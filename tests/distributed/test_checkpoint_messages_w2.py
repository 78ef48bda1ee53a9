"""Errors that must reach every rank with the same words: a path that is no checkpoint, a save under a
regular file, and TorchRec optimizer state missing for a table planned with the dense kernel."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import torchrec_dtensor_bridge as tdb
from torchrec_dtensor_bridge.layout import ShardLayout

from .harness import make_pool_fixture

pool = make_pool_fixture(2)


def _outcome(fn) -> tuple[str, str]:
    """(exception class name, message) of what ``fn()`` raised; a collective after it still works."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - what it raised is the subject of the test
        out = (type(e).__name__, str(e))
    else:
        out = ("nothing", "")
    dist.barrier()  # the refused call left no collective waiting
    return out


def _load_not_a_checkpoint(rank, world_size, path):
    dest = {"w": torch.full((6, 2), float(rank))}
    got = _outcome(lambda: tdb.checkpoint.load(dest, path))
    assert torch.equal(dest["w"], torch.full((6, 2), float(rank))), "a refused load modified the destination"
    return got


def test_a_directory_without_a_checkpoint_is_refused_on_every_rank(pool, tmp_path):
    path = tmp_path / "step100"
    path.mkdir()
    (path / "README").write_text("results of run 7")
    outcomes = pool.run(_load_not_a_checkpoint, str(path))
    assert outcomes[0] == outcomes[1], outcomes
    name, message = outcomes[0]
    assert name == "NotACheckpointError", outcomes
    assert f"{path} is not a checkpoint: the directory holds only README" in message, message
    assert "expected a checkpoint written by tdb.checkpoint.save" in message, message


def _save_under(rank, world_size, path):
    return _outcome(lambda: tdb.checkpoint.save({"w": torch.ones(3)}, path))


def test_saving_under_a_regular_file_is_refused_on_every_rank(pool, tmp_path):
    blocker = tmp_path / "runs"
    blocker.write_text("a file")
    outcomes = pool.run(_save_under, str(blocker / "step100"))
    assert outcomes[0] == outcomes[1], outcomes
    name, message = outcomes[0]
    assert name == "NotADirectoryError", outcomes
    assert f"cannot save to {blocker / 'step100'}: {blocker} is a file, not a directory" in message, message
    assert sorted(os.listdir(tmp_path)) == ["runs"] and blocker.read_text() == "a file"


# ------------------------------------------------------------------ TorchRec state of a dense-kernel table
TABLES = {"t_fused": (10, 4), "t_dense": (8, 4)}


def _dense_kernel_table(rank, world_size):
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.shard import shard
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
    from torchrec.distributed.types import ShardingEnv

    from .torchrec_models import build_ebc

    sharder = EmbeddingBagCollectionSharder(
        fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.1})
    ebc = build_ebc({n: (r, d, "row_wise") for n, (r, d) in TABLES.items()})
    kernels = {"t_fused": row_wise(compute_kernel="fused"), "t_dense": row_wise(compute_kernel="dense")}
    plan = construct_module_sharding_plan(ebc, per_param_sharding=kernels, sharder=sharder, local_size=world_size,
                                          world_size=world_size, device_type="cpu")
    model = shard(ebc, plan=plan, env=ShardingEnv.from_process_group(dist.group.WORLD), device=torch.device("cpu"),
                  sharder=sharder)
    osd = model.fused_optimizer.state_dict()
    weights = {}
    for n, shape in TABLES.items():
        lay = ShardLayout.row_wise(shape, world_size, dtype=torch.float32)
        weights[n] = tdb.convert.dtensor_from_local_shards(
            lay, [torch.zeros(s.sizes) for s in lay.shards_on(rank)]).requires_grad_()
    opt = tdb.FusedOptimizer(weights, "rowwise_adagrad", lr=0.1)
    return _outcome(lambda: opt.load_torchrec_state_dict(osd)), _outcome(lambda: opt.copy_to_torchrec_state_dict(osd))


def test_torchrec_state_of_a_dense_kernel_table_names_the_table_and_the_fused_kernel(pool):
    results = pool.run(_dense_kernel_table)
    assert results[0] == results[1], results
    for name, message in results[0]:  # importing and exporting say the same
        assert name == "ValueError", (name, message)
        assert "table 't_dense': TorchRec's fused_optimizer.state_dict() has no momentum1 for it" in message, message
        assert "it holds state for tables ['t_fused']" in message, message
        assert "only for tables with the FUSED compute kernel" in message, message
        assert 'compute_kernel="fused" (EmbeddingComputeKernel.FUSED)' in message, message
        assert "t_fused" not in message.split("it holds state for tables ['t_fused']")[1], message  # t_fused matches



# ------------------------------------------------------------------ a TorchRec job resumed under another plan
# An EBC of four tables (row-wise, table-wise on each rank, column-wise over both ranks), trained by TorchRec's
# fused row-wise Adagrad, saved on 2 ranks and loaded into a model that differs from it.
FOUR = {"t_rw": (13, 8), "t_tw": (7, 12), "t_cw": (9, 16), "t_tw0": (6, 4)}


def _dmp(tables: dict[str, tuple[int, int]], cut: str = "saved"):
    """A DistributedModelParallel of ``tables`` on every rank: ``cut="saved"`` the plan of the save, else every
    table whole on the last rank."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed import sharding_plan as sp
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv, ShardingPlan

    world = dist.get_world_size()
    ebc = EmbeddingBagCollection(tables=[
        EmbeddingBagConfig(name=n, embedding_dim=d, num_embeddings=r, feature_names=[f"f_{n}"])
        for n, (r, d) in tables.items()], device=torch.device("meta"))
    sharder = EmbeddingBagCollectionSharder(
        fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.1})
    if cut == "saved":
        per = {"t_rw": sp.row_wise(compute_kernel="fused"), "t_tw": sp.table_wise(rank=1, compute_kernel="fused"),
               "t_cw": sp.column_wise(ranks=[0, 1], compute_kernel="fused"),
               "t_tw0": sp.table_wise(rank=0, compute_kernel="fused")}
    else:
        per = {n: sp.table_wise(rank=world - 1, compute_kernel="fused") for n in tables}
    plan = sp.construct_module_sharding_plan(ebc, per_param_sharding=per, sharder=sharder, local_size=world,
                                             world_size=world, device_type="cpu")
    return DistributedModelParallel(ebc, env=ShardingEnv.from_process_group(dist.group.WORLD),
                                    device=torch.device("cpu"), plan=ShardingPlan({"": plan}), sharders=[sharder])


def _snapshot(state) -> dict[str, list[torch.Tensor]]:
    """This rank's values of every tensor of ``state`` (its models' and optimizers' state_dicts), copied."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    from torchrec_dtensor_bridge.checkpoint.common import leaves

    out = {}
    for key, v in leaves({k: m.state_dict() for k, m in state.items()}):
        if isinstance(v, ShardedTensor):
            out[key] = [s.tensor.clone() for s in v.local_shards()]
        elif isinstance(v, torch.Tensor):
            out[key] = [v.clone()]
    return out


def _refused_load(state, path, **kwargs) -> tuple[str, str, tuple[list[str], ...]]:
    """(exception class name, message, its key lists) of a load that must be refused, and nothing modified."""
    before = _snapshot(state)
    try:
        tdb.checkpoint.load(state, path, **kwargs)
    except Exception as e:  # noqa: BLE001 - what it raised is the subject of the test
        got = (type(e).__name__, str(e), tuple(getattr(e, a, None) for a in
                                               ("missing_keys", "unexpected_keys", "mismatched_keys")))
    else:
        got = ("nothing", "", ())
    after = _snapshot(state)
    assert before.keys() == after.keys() and all(
        torch.equal(a, b) for k in before for a, b in zip(before[k], after[k])), "a refused load modified its state"
    dist.barrier()  # the refusal left no collective waiting
    return got


def _save_four(rank, world_size, path, optimizer_itself):
    dmp = _dmp(FOUR)
    optim = dmp.fused_optimizer if optimizer_itself else dmp.fused_optimizer.state_dict()
    tdb.checkpoint.save({"model": dmp, "optim": optim}, path)


def _load_grown(rank, world_size, path):
    dmp = _dmp({**FOUR, "t_cw": (10, 16)}, cut="whole")  # t_cw has one row more, and is no longer cut by columns
    return _refused_load({"model": dmp, "optim": dmp.fused_optimizer}, path)


def _load_whole(rank, world_size, path):
    dmp = _dmp(FOUR, cut="whole")
    return _refused_load({"model": dmp, "optim": dmp.fused_optimizer}, path)


MOMENTUM = "optim.state.embedding_bags.t_cw.weight.t_cw.momentum1"


def _refusal_after_save(pool, tmp_path, with_optimizer, load):
    """Save the four tables (``_save_four``), then ``load`` on every rank: the one outcome every rank gave."""
    path = str(tmp_path / "ck")
    pool.run(_save_four, path, with_optimizer)
    outcomes = pool.run(load, path)
    assert outcomes[0] == outcomes[1], outcomes
    return outcomes[0]


def test_a_table_of_another_shape_is_named_with_its_shapes_and_the_recorded_column_blocks(pool, tmp_path):
    """The checkpoint records t_cw's column blocks: the refusal says the table had 9 rows and has 10 (not that
    the widths were never recorded), on every rank, with the keys on the exception."""
    outcome = _refusal_after_save(pool, tmp_path, True, _load_grown)
    name, message, (missing, unexpected, mismatched) = outcome
    assert name == "ValueError", outcome
    assert "key 'model.embedding_bags.t_cw.weight': saved shape [9, 16], destination shape [10, 16] (ranks 0, 1)" \
        in message, message
    assert (f"key {MOMENTUM!r}: saved shape [18], destination shape [10] (row-wise optimizer state of table "
            "'embedding_bags.t_cw.weight', [10, 16] in the destination: the checkpoint holds one value per row for "
            "each of 2 column blocks (widths [8, 8]) of a 9-row table, the destination one value per row: the table "
            "had 9 rows when saved and has 10 now") in message, message
    assert "recorded" not in message, "the checkpoint records the widths: no word of them being unrecorded"
    assert mismatched == sorted(["model.embedding_bags.t_cw.weight", MOMENTUM]) and missing == unexpected == []


def test_widths_absent_from_a_state_dict_save_are_not_blamed_on_an_older_version(pool, tmp_path):
    """The optimizer saved as its state_dict() (a plain dict): no widths for t_cw, and the refusal of its
    per-block state into a whole table says why - not 'written before they were recorded'."""
    outcome = _refusal_after_save(pool, tmp_path, False, _load_whole)
    name, message, (_, _, mismatched) = outcome
    assert name == "ValueError" and mismatched == [MOMENTUM], outcome
    assert f"key {MOMENTUM!r}: saved shape [18], destination shape [9]" in message, message
    assert "does not record for this key (a save records them for a column-cut table saved with its optimizer " \
           "itself, not its state_dict()" in message, message
    assert "before" not in message, message


def _load_other_names(rank, world_size, path):
    dmp = _dmp(FOUR)
    return _refused_load({"net": dmp, "opt": dmp.fused_optimizer}, path)


def test_another_models_names_are_counted_on_every_rank_not_listed_a_line_each(pool, tmp_path):
    outcome = _refusal_after_save(pool, tmp_path, True, _load_other_names)
    name, message, (missing, unexpected, mismatched) = outcome
    assert name == "ValueError", outcome
    lines = message.splitlines()
    assert len(lines) == 4, message  # the call, the missing keys, the checkpoint's, where every key is
    # each rank's fused optimizer holds the state of its own tables: 7 keys on each rank, 8 on the exception
    assert lines[1].startswith("  7 keys of the state_dict are not in the checkpoint: 'net.embedding_bags.") \
        and lines[1].endswith(" and 2 more (ranks 0, 1)"), lines[1]
    assert "the checkpoint holds 9 keys the state_dict does not name: 'model.embedding_bags." in lines[2], lines[2]
    assert f"tdb.checkpoint.inspect({str(tmp_path / 'ck')!r})" in lines[3], lines[3]
    assert len(missing) == 8 and all(k.startswith(("net.", "opt.")) for k in missing), missing
    assert unexpected == mismatched == []


# ------------------------------------------------------------------ a TorchRec plan made for more ranks
def _plan_for_three(rank, world_size):
    """A plan made for 3 ranks, on the 2 ranks of the default group: refused by the package's functions that
    take it (the group's size read from the default group), alike on every rank, with nothing communicated."""
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed import sharding_plan as sp
    from torchrec.distributed.types import ShardingPlan

    from torchrec_dtensor_bridge.torchrec_plan import check_plan_ranks, layouts_from_module_plan

    ebc = EmbeddingBagCollection(tables=[
        EmbeddingBagConfig(name=n, embedding_dim=d, num_embeddings=r, feature_names=[f"f_{n}"])
        for n, (r, d) in FOUR.items()], device=torch.device("meta"))
    per = {"t_rw": sp.row_wise(), "t_tw": sp.table_wise(rank=2), "t_cw": sp.column_wise(ranks=[0, 1]),
           "t_tw0": sp.table_wise(rank=0)}
    plan = sp.construct_module_sharding_plan(ebc, per_param_sharding=per, local_size=3, world_size=3,
                                             device_type="cpu")
    return (_outcome(lambda: layouts_from_module_plan(plan, FOUR)),
            _outcome(lambda: check_plan_ranks(ShardingPlan({"ebc": plan}))))


def test_a_plan_for_three_ranks_on_two_is_refused_on_every_rank_naming_the_tables(pool):
    outcomes = pool.run(_plan_for_three)
    assert outcomes[0] == outcomes[1], outcomes
    (name, message), (name2, message2) = outcomes[0]
    assert name == name2 == "ValueError", outcomes[0]
    assert ("the sharding plan puts table 't_rw' on ranks [0, 1, 2]; table 't_tw' on ranks [2], but the group has 2 "
            "ranks (ranks 0..1): the plan was made for at least 3 ranks") in message, message
    assert "'t_cw'" not in message and "'t_tw0'" not in message, "the tables that fit are not named"
    assert "table 'ebc.t_tw' on ranks [2]" in message2, message2
