"""Tables in CUDA unified memory (TorchRec's ``EmbeddingLocation.MANAGED`` / ``MANAGED_CACHING``) are refused by the
lookups, naming the table and the location, on every rank alike (through the agreement step).

On CPU no tensor is in unified memory: fbgemm's ``is_uvm_tensor`` (``kernels.in_unified_memory``) is answered
``True`` for one shard's storage here; ``tests/gpu/test_cuda_tables.py`` makes real managed and host-mapped
tensors with fbgemm on a GPU. Without the refusal the lookups would read and update that storage as device
memory, past ``MANAGED_CACHING``'s cache of newer rows.
"""

from __future__ import annotations

import pytest
import torch

import torchrec_dtensor_bridge as tdb
from torchrec_dtensor_bridge import kernels
from torchrec_dtensor_bridge.layout import ShardLayout

from ..gpu.tables import batch, dtensors, table

CPU = torch.device("cpu")
SHAPE = (20, 8)


pytestmark = pytest.mark.usefixtures("own_kernel_choices")


@pytest.mark.parametrize("call", ["bag", "bags", "embedding"])
def test_table_in_unified_memory_refused(one_rank, monkeypatch, call):
    (weight,) = dtensors([ShardLayout.row_wise(SHAPE, [8, 12], ranks=[0, 0]).with_name("user_ids")],
                         [table(SHAPE, 1)], CPU, shared=False)
    managed = weight.to_local().local_shards()[1]  # the second block "in unified memory"
    monkeypatch.setattr(kernels, "in_unified_memory",
                        lambda t: t.untyped_storage().data_ptr() == managed.untyped_storage().data_ptr())
    ids, offsets = batch(SHAPE[0], 2, CPU)
    with pytest.raises(NotImplementedError) as e:
        if call == "bag":
            tdb.sharded_embedding_bag(ids, weight, offsets, mode="sum")
        elif call == "bags":
            tdb.sharded_embedding_bags([ids], [weight], [offsets], mode="sum")
        else:
            tdb.sharded_embedding(ids, weight)
    said = str(e.value)
    assert "table 'user_ids'" in said and "unified memory" in said, said
    assert "EmbeddingLocation.MANAGED or MANAGED_CACHING" in said and "EmbeddingLocation.DEVICE" in said, said


def test_device_and_host_tables_pass(one_rank):
    """Without unified memory (CPU tables here) the same lookup runs."""
    (weight,) = dtensors([ShardLayout.row_wise(SHAPE, [8, 12], ranks=[0, 0]).with_name("user_ids")],
                         [table(SHAPE, 1)], CPU, shared=False)
    assert not any(kernels.in_unified_memory(s) for s in weight.to_local().local_shards())
    ids, offsets = batch(SHAPE[0], 2, CPU)
    out = tdb.sharded_embedding_bag(ids, weight, offsets, mode="sum")
    torch.testing.assert_close(out, torch.nn.functional.embedding_bag(ids, table(SHAPE, 1), offsets, mode="sum"))
