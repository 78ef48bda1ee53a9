"""TorchRec sharding plans -> :class:`ShardLayout` (the package's only ``torchrec`` import)."""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist

from .layout import ShardLayout, ShardSpec

__all__ = [
    "check_plan_ranks",
    "dmp_type",
    "embedding_bag_collection_type",
    "embedding_collection_type",
    "fbgemm_kernel_type",
    "fused_kernel_types",
    "jagged_types",
    "layout_from_parameter_sharding",
    "layouts_from_module_plan",
]

_NAMED = 5  # the tables a refusal names before it counts the rest


def _loaded(module: str, *names: str) -> tuple[type, ...]:
    """The classes ``names`` of ``module`` (torchrec's, or fbgemm's under it) if it is already loaded, else
    ``()``: such an object exists only once its module is, so a caller looking for one never needs to import
    torchrec itself."""
    mod = sys.modules.get(module)
    return () if mod is None else tuple(getattr(mod, n) for n in names)


def embedding_bag_collection_type() -> type | None:
    """TorchRec's ``EmbeddingBagCollection`` class if torchrec is already loaded, else ``None``.

    An EBC can only be in a module tree once torchrec is imported, so a caller
    looking for EBCs never needs to import torchrec itself.
    """
    return (_loaded("torchrec.modules.embedding_modules", "EmbeddingBagCollection") or (None,))[0]


def embedding_collection_type() -> type | None:
    """TorchRec's ``EmbeddingCollection`` class if torchrec is already loaded, else ``None`` (as
    :func:`embedding_bag_collection_type` reasons)."""
    return (_loaded("torchrec.modules.embedding_modules", "EmbeddingCollection") or (None,))[0]


def dmp_type() -> type | None:
    """TorchRec's ``DistributedModelParallel`` class if torchrec's ``model_parallel`` is already loaded, else
    ``None`` (a DMP exists only once it is, as :func:`embedding_bag_collection_type` reasons)."""
    return (_loaded("torchrec.distributed.model_parallel", "DistributedModelParallel") or (None,))[0]


def fused_kernel_types() -> tuple[type, ...]:
    """TorchRec's kernels of the ``fused`` compute kernel (``BatchedFusedEmbeddingBag`` of a pooled
    collection, ``BatchedFusedEmbedding`` of a sequence one) if its ``batched_embedding_kernel`` is already
    loaded, else ``()`` (a sharded module exists only once it is)."""
    return _loaded("torchrec.distributed.batched_embedding_kernel", "BatchedFusedEmbeddingBag", "BatchedFusedEmbedding")


def fbgemm_kernel_type() -> type | None:
    """fbgemm's ``SplitTableBatchedEmbeddingBagsCodegen`` (the kernel TorchRec's fused kernels build) if its
    module is already loaded (it is once a fused kernel exists), else ``None``."""
    return (_loaded("fbgemm_gpu.split_table_batched_embeddings_ops_training",
                    "SplitTableBatchedEmbeddingBagsCodegen") or (None,))[0]


def jagged_types() -> tuple[type, type]:
    """``(KeyedJaggedTensor, KeyedTensor)``, imported on first use."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

    return KeyedJaggedTensor, KeyedTensor


def _parameter_shardings(plan: object, name: str) -> Iterator[tuple[str, object]]:
    """(table name, ``ParameterSharding``) of a ``ShardingPlan`` (tables named ``"module.table"``), a module's
    plan (table -> ``ParameterSharding``), or one ``ParameterSharding`` (named ``name``)."""
    from torchrec.distributed.types import ParameterSharding, ShardingPlan

    if isinstance(plan, ParameterSharding):
        yield name, plan
    elif isinstance(plan, ShardingPlan):
        for path, module_plan in plan.plan.items():
            for table, ps in _parameter_shardings(module_plan, name):
                yield (f"{path}.{table}" if path else table), ps
    elif hasattr(plan, "items"):
        for table, ps in plan.items():
            if not isinstance(ps, ParameterSharding):
                raise TypeError(f"table {table!r}: expected a torchrec ParameterSharding, got {type(ps).__name__}")
            yield table, ps
    else:
        raise TypeError(f"expected a torchrec ShardingPlan, a module's plan or a ParameterSharding, got "
                        f"{type(plan).__name__}")


def _plan_ranks(ps: object) -> list[int]:
    """Every rank ``ps`` places a block of its table on: its ``ranks`` and its shards' placements."""
    ranks = set(getattr(ps, "ranks", None) or ())
    for sm in getattr(getattr(ps, "sharding_spec", None), "shards", None) or ():
        if sm.placement is not None:
            ranks.add(sm.placement.rank())
    return sorted(ranks)


def check_plan_ranks(plan: object, world_size: int | None = None, *, name: str = "table") -> None:
    """Refuse a TorchRec plan that puts a table on a rank its group does not have; no communication.

    TorchRec itself takes such a plan (one made for 2 ranks, used on 1) as far as building the sharded module,
    and fails there with a bare ``IndexError: list index out of range`` (its table-wise sharding indexes a
    list of the group's ranks by the plan's). Call this before ``DistributedModelParallel(..., plan=plan)``;
    :func:`layout_from_parameter_sharding` and :func:`layouts_from_module_plan` call it. Every rank given the
    same plan raises the same error.

    Args:
        plan: a ``ShardingPlan``, a module's plan (table name -> ``ParameterSharding``) or one
            ``ParameterSharding``.
        world_size: the number of ranks of the group the plan runs on (its ranks are ``0 .. world_size - 1``);
            ``None``: the default group's, when there is one (else nothing is checked).
        name: the table's name, for a lone ``ParameterSharding``.

    Raises:
        ValueError: a table placed on a rank outside ``0 .. world_size - 1``, naming the tables, their ranks
            and the group's size.
        TypeError: ``plan`` is none of the above.

    Example::

        >>> check_plan_ranks(plan, world_size=dist.get_world_size())
    """
    if world_size is None:
        if not (dist.is_available() and dist.is_initialized()):
            return
        world_size = dist.get_world_size()
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    placed = [(table, _plan_ranks(ps)) for table, ps in _parameter_shardings(plan, name)]
    outside = [(table, ranks) for table, ranks in placed if any(not 0 <= r < world_size for r in ranks)]
    if not outside:
        return
    needs = max(r for _, ranks in outside for r in ranks) + 1
    tables = "; ".join(f"table {table!r} on ranks {ranks}" for table, ranks in outside[:_NAMED])
    more = f"; and {len(outside) - _NAMED} more tables" if len(outside) > _NAMED else ""
    group = "1 rank (rank 0)" if world_size == 1 else f"{world_size} ranks (ranks 0..{world_size - 1})"
    raise ValueError(f"the sharding plan puts {tables}{more}, but the group has {group}: the plan was "
                     f"made for at least {needs} ranks; make it for this group's size (e.g. "
                     f"construct_module_sharding_plan(..., world_size={world_size}), or a planner whose Topology has "
                     f"world_size={world_size})")


def layout_from_parameter_sharding(
    ps: object,
    global_shape: Sequence[int] | None = None,
    *,
    world_size: int | None = None,
    dtype: torch.dtype | None = None,
    name: str = "table",
) -> ShardLayout:
    """The layout a TorchRec ``ParameterSharding`` gives one table.

    Sharded types read the shard metadata of ``ps.sharding_spec``
    (``EnumerableShardingSpec``); ``data_parallel`` has none and becomes a
    replica on each of ``ps.ranks`` (or every rank of ``world_size``).
    ``global_shape`` is required for data parallel, checked otherwise. A table placed on a rank outside
    ``0 .. world_size - 1`` (``world_size``: the default group's when not given and there is one) is refused
    (:func:`check_plan_ranks`).
    """
    from torchrec.distributed.types import ParameterSharding, ShardingType

    if not isinstance(ps, ParameterSharding):
        raise TypeError(f"table {name!r}: expected a torchrec ParameterSharding, got {type(ps).__name__}")
    check_plan_ranks(ps, world_size, name=name)
    if ps.sharding_type == ShardingType.DATA_PARALLEL.value:
        if global_shape is None:
            raise ValueError(f"table {name!r}: a data_parallel table needs global_shape")
        ranks = ps.ranks if ps.ranks else list(range(world_size or 0))
        if not ranks:
            raise ValueError(f"table {name!r}: data_parallel sharding lists no ranks and no world_size was given")
        return ShardLayout.replicated(global_shape, ranks, dtype=dtype, name=name)
    spec = ps.sharding_spec
    shards_md = getattr(spec, "shards", None)
    if not shards_md:
        raise ValueError(
            f"table {name!r}: {ps.sharding_type} sharding has no shard metadata in its sharding_spec ({spec!r})"
        )
    shards = [
        ShardSpec(
            sm.placement.rank() if sm.placement is not None else None,
            tuple(sm.shard_offsets),
            tuple(sm.shard_sizes),
            str(sm.placement.device()) if sm.placement is not None else None,
        )
        for sm in shards_md
    ]
    extent = tuple(
        max(s.offsets[d] + s.sizes[d] for s in shards) for d in range(len(shards[0].offsets))
    )
    shape = tuple(int(v) for v in global_shape) if global_shape is not None else extent
    layout = ShardLayout(shape, tuple(shards), dtype, name)
    layout.validate()
    return layout


def layouts_from_module_plan(
    plan: object,
    shapes: dict[str, Sequence[int]] | None = None,
    *,
    world_size: int | None = None,
    dtype: torch.dtype | None = None,
) -> dict[str, ShardLayout]:
    """Layouts of every table of a TorchRec ``EmbeddingModuleShardingPlan`` (name -> layout); every table placed
    on a rank outside ``0 .. world_size - 1`` is named in one refusal first (:func:`check_plan_ranks`)."""
    check_plan_ranks(plan, world_size)
    shapes = shapes or {}
    return {
        name: layout_from_parameter_sharding(
            ps, shapes.get(name), world_size=world_size, dtype=dtype, name=name
        )
        for name, ps in plan.items()  # type: ignore[attr-defined]
    }
