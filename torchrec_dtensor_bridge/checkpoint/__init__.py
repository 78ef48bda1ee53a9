"""Checkpoints: DCP save/load with atomic commits, validation and checksums; inspection.

    import torchrec_dtensor_bridge as tdb
    tdb.checkpoint.save(state_dict, "/ckpt/step100")   # collective, atomic
    tdb.checkpoint.load(state_dict, "/ckpt/step100")   # collective, validated, reshards
    tdb.checkpoint.inspect("/ckpt/step100")            # no process group needed
    tdb.checkpoint.export("/ckpt/step100", "t.safetensors")  # one process, unsharded, bounded memory
    tdb.checkpoint.save(state_dict, "/ckpt/step110", base="/ckpt/step100")  # incremental: changed rows only
    tdb.checkpoint.compact("/ckpt/step110", "/ckpt/step110-full")  # a chain -> one self-contained checkpoint

Values may be DCP ``Stateful`` objects (a TorchRec DMP, its ``fused_optimizer``,
a ``torch.optim`` optimizer, a ``FusedOptimizer``): see :mod:`.stateful`.
"""

from .api import load, save
from .compact import compact
from .errors import (
    BrokenChainError,
    CheckpointBusyError,
    CheckpointError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    NotACheckpointError,
)
from .export import FORMATS, ExportSummary, export
from .inspect import format_report, inspect
from .migrate import migrate

__all__ = [
    "BrokenChainError",
    "CheckpointBusyError",
    "CheckpointError",
    "CorruptCheckpointError",
    "ExportSummary",
    "FORMATS",
    "IncompleteCheckpointError",
    "NotACheckpointError",
    "compact",
    "export",
    "format_report",
    "inspect",
    "load",
    "migrate",
    "save",
]
