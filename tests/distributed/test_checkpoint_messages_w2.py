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

