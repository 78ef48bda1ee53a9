"""The README's quickstart: a TorchRec model's tables as DTensors, a lookup, a checkpoint, on 2 gloo ranks.

Run it with::

    .venv/bin/python -m torch.distributed.run --standalone --nproc_per_node=2 examples/readme_quickstart.py

The README quotes the whole program, the region between ``# [readme:quickstart]`` and
``# [/readme:quickstart]`` (``tests/distributed/test_readme.py`` keeps the two equal and runs
the program). Its asserts check it against unsharded torch; torchrun exits non-zero if any fails.
"""

# [readme:quickstart]
import shutil
import tempfile

import torch
import torch.distributed as dist
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.distributed.shard import shard
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise, table_wise
from torchrec.distributed.types import ShardingEnv

import torchrec_dtensor_bridge as tdb

dist.init_process_group("gloo")  # 2 CPU ranks under torchrun
rank = dist.get_rank()
ebc = EmbeddingBagCollection(tables=[  # two tables: 13 users and 10 ads, 8 columns each
    EmbeddingBagConfig(name=n, num_embeddings=rows, embedding_dim=8, feature_names=[n])
    for n, rows in (("user", 13), ("ad", 10))])
plan = construct_module_sharding_plan(ebc, {"user": row_wise(), "ad": table_wise(rank=1)},
                                      local_size=2, world_size=2, device_type="cpu")
model = shard(ebc, plan=plan, env=ShardingEnv.from_process_group(dist.group.WORLD), device=torch.device("cpu"))

dts = tdb.state_dict_to_dtensor(model.state_dict())      # DTensors; their shards ARE the module's storage
user = dts["embedding_bags.user.weight"]
tdb.visualize_sharding(user, name="user", print=True)   # rank 0 prints: rows 0:7 on rank 0, 7:13 on rank 1
table = tdb.full_tensor(user)                            # collective: the whole 13 x 8 table on every rank

ids = torch.randint(0, 13, (4, 3))                       # each rank its own batch: 4 bags of 3 ids
out = tdb.sharded_embedding_bag(ids, user, mode="sum")   # collective: this rank's 4 x 8 output
assert torch.allclose(out, torch.nn.functional.embedding_bag(ids, table, mode="sum"))

where = [tempfile.mkdtemp() if rank == 0 else None]
dist.broadcast_object_list(where)                        # one directory that both ranks see
tdb.checkpoint.save({"model": model}, f"{where[0]}/step1")  # collective, atomic, checksummed
user.zero_()                                             # in place, on every shard
tdb.checkpoint.load({"model": model}, f"{where[0]}/step1")  # in place; into any plan or world size
assert torch.equal(tdb.full_tensor(user), table)
if rank == 0:
    print(tdb.checkpoint.format_report(f"{where[0]}/step1"))
    shutil.rmtree(where[0])
dist.destroy_process_group()
# [/readme:quickstart]
