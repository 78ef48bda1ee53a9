"""A TorchRec plan made for more ranks than the group has is refused by name, before TorchRec sees it.

TorchRec takes a plan made for 2 ranks on a group of 1 as far as building the sharded module and fails there
with a bare ``IndexError: list index out of range`` (``tw_sharding._shard`` indexes its list of the group's
ranks by the plan's). The package's functions that take a plan refuse it first, naming every table, its ranks
and the group's size; ``check_plan_ranks`` is the same check for a plan about to be handed to TorchRec.
"""

import pytest
import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_wise,
)
from torchrec.distributed.types import ShardingPlan

from torchrec_dtensor_bridge.torchrec_plan import (
    check_plan_ranks,
    layout_from_parameter_sharding,
    layouts_from_module_plan,
)

TABLES = {"t_rw": (13, 8), "t_tw": (7, 12), "t_cw": (9, 16), "t_dp": (6, 4)}
ON_TWO = ("table 't_rw' on ranks [0, 1]; table 't_tw' on ranks [1]; table 't_cw' on ranks [0, 1]; table 't_dp' on "
          "ranks [0, 1], but the group has 1 rank (rank 0): the plan was made for at least 2 ranks; make it for this "
          "group's size (e.g. construct_module_sharding_plan(..., world_size=1)")


def _plan(world: int):
    ebc = EmbeddingBagCollection(tables=[
        EmbeddingBagConfig(name=n, embedding_dim=d, num_embeddings=r, feature_names=[f"f_{n}"])
        for n, (r, d) in TABLES.items()], device=torch.device("meta"))
    per = {"t_rw": row_wise(), "t_tw": table_wise(rank=world - 1), "t_cw": column_wise(ranks=[0, world - 1]),
           "t_dp": data_parallel()}
    return construct_module_sharding_plan(ebc, per_param_sharding=per, local_size=world, world_size=world,
                                          device_type="cpu")


def test_a_two_rank_plan_on_one_rank_is_refused_naming_every_table_its_ranks_and_the_group():
    plan = _plan(2)
    with pytest.raises(ValueError) as refused:
        layouts_from_module_plan(plan, TABLES, world_size=1)
    assert f"the sharding plan puts {ON_TWO}" in str(refused.value), refused.value
    with pytest.raises(ValueError) as refused:
        check_plan_ranks(ShardingPlan({"ebc": plan}), 1)  # the plan DistributedModelParallel takes
    assert "table 'ebc.t_tw' on ranks [1]" in str(refused.value) and "the group has 1 rank" in str(refused.value)
    with pytest.raises(ValueError, match=r"table 't_tw' on ranks \[1\], but the group has 1 rank \(rank 0\)"):
        layout_from_parameter_sharding(plan["t_tw"], TABLES["t_tw"], world_size=1, name="t_tw")


def test_a_plan_that_fits_is_taken_and_a_three_rank_plan_on_two_is_refused():
    plan = _plan(2)
    check_plan_ranks(plan, 2)
    check_plan_ranks(ShardingPlan({"": plan}), 4)  # fewer ranks than the group: every table fits
    layouts = layouts_from_module_plan(plan, TABLES, world_size=2)
    assert [s.rank for s in layouts["t_tw"].shards] == [1]
    with pytest.raises(ValueError) as refused:
        check_plan_ranks(_plan(3), 2)
    text = str(refused.value)
    assert "table 't_tw' on ranks [2]" in text and "the group has 2 ranks (ranks 0..1)" in text, text
    assert "made for at least 3 ranks" in text and "world_size=2" in text, text


def test_what_is_not_a_plan_or_a_size_is_named():
    with pytest.raises(TypeError, match="expected a torchrec ShardingPlan, a module's plan or a ParameterSharding, "
                                        "got int"):
        check_plan_ranks(3, 2)
    with pytest.raises(TypeError, match="table 't0': expected a torchrec ParameterSharding, got str"):
        check_plan_ranks({"t0": "row_wise"}, 2)
    with pytest.raises(ValueError, match="world_size must be a positive int, got 0"):
        check_plan_ranks(_plan(2), 0)
