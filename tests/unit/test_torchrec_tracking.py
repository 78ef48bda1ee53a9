"""What ``tdb.track_changed_rows`` trusts, held to fbgemm's own CPU kernels, and how it reads a TBE call's ids.

* Every kind and weight-decay mode it tracks (``QUALIFIED`` x ``DECAY_MODES``): fbgemm's training TBE on the CPU,
  several steps of random ids over two tables: the rows that changed - weights and every
  optimizer state - are among the rows ``_rows_looked_up`` reads from the call's arguments.
* The kinds it does not track and fbgemm does not build for CPU are still refused there (a build that adds one
  is to be verified before it is listed).
* The ids split per table (features mapped by ``feature_table_map``, variable batch sizes), out-of-range ids and
  offsets that do not split the ids count as every row.
* On a TBE under a stand-in sharded module: rows recorded when backward writes them, a write through torch voids
  the record, nothing recorded after ``remove()``.
"""

from __future__ import annotations

import inspect
import itertools

import pytest
import torch
from torch import nn

import torchrec_dtensor_bridge as tdb
from torchrec_dtensor_bridge.torchrec_tracking import DECAY_MODES, QUALIFIED, _rows_looked_up, _why_not

fbgemm = pytest.importorskip("fbgemm_gpu")
from fbgemm_gpu.split_embedding_configs import EmbOptimType  # noqa: E402
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode  # noqa: E402
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (  # noqa: E402
    ComputeDevice,
    SplitTableBatchedEmbeddingBagsCodegen,
)
from fbgemm_gpu.tbe.config.optimizer_config import (  # noqa: E402
    CounterBasedRegularizationDefinition,
    CowClipDefinition,
    WeightDecayMode,
)

ROWS = (30, 20)
FEATURES = [0, 1, 0]  # feature 2 reads table 0 too (fbgemm's CPU row-wise Adagrad and un-pooled lookups take one
TRAINED = [0, 1]      # feature a table: the kinds are checked with these)


def _tbe(kind: str, mode: str, pooling: PoolingMode = PoolingMode.SUM) -> SplitTableBatchedEmbeddingBagsCodegen:
    extra = {"COUNTER": {"counter_based_regularization": CounterBasedRegularizationDefinition()},
             "COWCLIP": {"cowclip_regularization": CowClipDefinition()}}.get(mode, {})
    return SplitTableBatchedEmbeddingBagsCodegen(
        [(r, 8, EmbeddingLocation.HOST, ComputeDevice.CPU) for r in ROWS], feature_table_map=TRAINED,
        optimizer=getattr(EmbOptimType, kind), learning_rate=0.1, eps=1e-3, weight_decay=0.01,
        weight_decay_mode=getattr(WeightDecayMode, mode), pooling_mode=pooling, **extra)


def _rows_changed(before: list[torch.Tensor], after: list[torch.Tensor]) -> set[int]:
    out: set[int] = set()
    for b, a in zip(before, after):
        differ = (b != a).reshape(b.shape[0], -1).any(1) if b.dim() else (b != a).reshape(1)
        out |= set(differ.nonzero().flatten().tolist())
    return out


@pytest.mark.parametrize("kind,mode,pooling", [
    *((k, m, PoolingMode.SUM) for k, m in itertools.product(sorted(QUALIFIED), sorted(DECAY_MODES))),
    *((k, "NONE", PoolingMode.NONE) for k in sorted(QUALIFIED))])
def test_a_qualified_update_writes_only_the_rows_looked_up(kind, mode, pooling):
    torch.manual_seed(0)
    tbe = _tbe(kind, mode, pooling)
    assert _why_not(tbe) is None
    signature = inspect.signature(tbe.forward)
    weights = tbe.split_embedding_weights()
    states = tbe.split_optimizer_states() or [[] for _ in ROWS]
    with torch.no_grad():
        for w in weights:
            w.copy_(torch.randn(w.shape))
    written = 0
    for step in range(2):
        tensors = [[w, *s] for w, s in zip(weights, states)]
        before = [[t.clone() for t in ts] for ts in tensors]
        lengths = (torch.randint(0, 3, (len(TRAINED) * 4,)) if pooling == PoolingMode.SUM
                   else torch.ones(len(TRAINED) * 4, dtype=torch.int64))
        features = torch.arange(len(TRAINED)).repeat_interleave(4).repeat_interleave(lengths)
        ids = torch.cat([torch.randint(0, ROWS[TRAINED[f]], (1,)) for f in features.tolist()])
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        looked_up = _rows_looked_up(signature.bind(ids, offsets).arguments, TRAINED, list(ROWS))
        out = tbe(ids, offsets)
        (out * torch.randn(out.shape)).sum().backward()
        for table, (b, ts) in enumerate(zip(before, tensors)):
            changed = _rows_changed(b, ts)
            assert changed <= set(looked_up[table].tolist()), (step, table, changed, looked_up[table])
            written += len(changed)
    assert written > 4  # the check can fail: the steps change rows


@pytest.mark.parametrize("kind", ["ADAM", "PARTIAL_ROWWISE_ADAM", "LAMB", "PARTIAL_ROWWISE_LAMB", "LARS_SGD",
                                  "SGD", "ROWWISE_ADAGRAD"])
def test_the_kinds_left_out_are_not_built_for_cpu(kind):
    with pytest.raises(AssertionError, match="not supported in CPU mode|deprecated"):
        _tbe(kind, "NONE")


def test_what_does_not_qualify_says_why():
    assert "EMAINPLACE_ROWWISE_ADAGRAD" in _why_not(_tbe("EMAINPLACE_ROWWISE_ADAGRAD", "NONE"))
    assert "not fbgemm's training TBE" in _why_not(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="holds no TorchRec sharded embedding module"):
        tdb.track_changed_rows(nn.Linear(2, 2))


def _call(ids: list[int], offsets: list[int], per_rank: list[list[int]] | None = None) -> dict:
    return {"indices": torch.tensor(ids), "offsets": torch.tensor(offsets), "batch_size_per_feature_per_rank": per_rank}


def test_the_ids_split_by_feature_into_tables():
    # 3 features, 2 bags each: feature 0 -> table 0 reads 1, 2; feature 1 -> table 1 reads 5; feature 2 -> table 0
    got = _rows_looked_up(_call([1, 2, 5, 7, 7], [0, 1, 2, 3, 3, 4, 5]), FEATURES, list(ROWS))
    assert [t.tolist() for t in got] == [[1, 2, 7, 7], [5]]
    # variable batch sizes: feature 0 has 1 bag (rank 0) + 2 (rank 1), feature 1 one bag, feature 2 none
    got = _rows_looked_up(_call([1, 2, 3, 4], [0, 1, 2, 3, 4], [[1, 2], [1, 0], [0, 0]]), FEATURES, list(ROWS))
    assert [t.tolist() for t in got] == [[1, 2, 3], [4]]


def test_ids_it_cannot_place_count_as_every_row():
    got = _rows_looked_up(_call([1, 25, 5], [0, 1, 2, 3]), [0, 1, 0], list(ROWS))  # 25: out of table 1's rows
    assert [t.tolist() for t in got] == [[1, 5], list(range(ROWS[1]))]
    got = _rows_looked_up(_call([-1, 2, 5], [0, 1, 2, 3]), [0, 1, 0], list(ROWS))
    assert got[0].tolist() == list(range(ROWS[0])) and got[1].tolist() == [2]
    for offsets in ([0, 2, 1, 3], [0, 1, 2, 9], [0, 1, 3]):  # not ascending, past the ids, not 3 features
        got = _rows_looked_up(_call([1, 2, 5], offsets), [0, 1, 0], list(ROWS))
        assert [t.tolist() for t in got] == [list(range(n)) for n in ROWS], offsets


class _Sharded(nn.Module):
    """What track_changed_rows looks for, as a sharded TorchRec module holds it: a lookup (here fbgemm's TBE
    itself) in ``_lookups``, and a state_dict of its tables' views."""

    def __init__(self, tbe: nn.Module) -> None:
        super().__init__()
        self._lookups = [tbe]
        self.tables = {f"t{i}": w for i, w in enumerate(tbe.split_embedding_weights())}

    def state_dict(self, *args, **kwargs):
        return dict(self.tables)


def test_the_record_follows_the_backward_and_stops_with_remove():
    """Rows are recorded when backward runs the update (a save between a forward and its backward does not
    absorb them); a write through torch voids the record; after ``remove()`` nothing is recorded, not even by
    the backward of a forward run before it."""
    from torchrec_dtensor_bridge import tracking
    from torchrec_dtensor_bridge.checkpoint.incremental.digests import row_digests

    tbe = _tbe("EXACT_ROWWISE_ADAGRAD", "NONE")
    model = _Sharded(tbe)
    report = tdb.track_changed_rows(model)
    assert report.tracked == ["t0", "t1"] and report.scanned == {}
    with pytest.raises(ValueError, match="tracked already"):
        tdb.track_changed_rows(model)
    w0 = model.tables["t0"]

    def mark(save_id: str) -> None:
        for k, w in model.tables.items():
            tracking.mark(w, save_id, (k,), row_digests(w))

    def written(save_id: str) -> list[int] | None:
        known = tracking.written_since(w0, save_id, ("t0",))
        return None if known is None else known.rows.tolist()

    ids, offsets = torch.tensor([3, 7, 3, 5]), torch.tensor([0, 2, 3, 4, 4])  # table 0: 3, 7, 3; table 1: 5
    mark("s0")
    out = tbe(ids, offsets)
    mark("s1")  # a save between the forward and its backward
    out.sum().backward()
    assert written("s1") == [3, 7]
    mark("s2")
    with torch.no_grad():
        w0[1] += 1.0  # through torch, not reported
    tbe(ids, offsets).sum().backward()
    assert written("s2") is None
    mark("s3")
    out = tbe(ids, offsets)
    report.remove()
    out.sum().backward()
    assert not tracking.is_tracked(w0) and written("s3") is None
    tdb.track_changed_rows(model).remove()  # on again after remove()
