"""TorchRec sharding plans -> :class:`ShardLayout` (the package's only ``torchrec`` import)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .layout import ShardLayout, ShardSpec

__all__ = ["embedding_bag_collection_type", "jagged_types", "layout_from_parameter_sharding", "layouts_from_module_plan"]


def embedding_bag_collection_type() -> type | None:
    """TorchRec's ``EmbeddingBagCollection`` class if torchrec is already loaded, else ``None``.

    An EBC can only be in a module tree once torchrec is imported, so a caller
    looking for EBCs never needs to import torchrec itself.
    """
    import sys

    mod = sys.modules.get("torchrec.modules.embedding_modules")
    return None if mod is None else mod.EmbeddingBagCollection


def jagged_types() -> tuple[type, type]:
    """``(KeyedJaggedTensor, KeyedTensor)``, imported on first use."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

    return KeyedJaggedTensor, KeyedTensor


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
    ``global_shape`` is required for data parallel, checked otherwise.
    """
    from torchrec.distributed.types import ParameterSharding, ShardingType

    if not isinstance(ps, ParameterSharding):
        raise TypeError(f"table {name!r}: expected a torchrec ParameterSharding, got {type(ps).__name__}")
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
    """Layouts of every table of a TorchRec ``EmbeddingModuleShardingPlan`` (name -> layout)."""
    shapes = shapes or {}
    return {
        name: layout_from_parameter_sharding(
            ps, shapes.get(name), world_size=world_size, dtype=dtype, name=name
        )
        for name, ps in plan.items()  # type: ignore[attr-defined]
    }
