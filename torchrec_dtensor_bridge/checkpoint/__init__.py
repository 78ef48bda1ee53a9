"""Checkpoints: DCP save/load with atomic commits, validation and checksums; inspection.

    import torchrec_dtensor_bridge as tdb
    tdb.checkpoint.save(state_dict, "/ckpt/step100")   # collective, atomic
    tdb.checkpoint.load(state_dict, "/ckpt/step100")   # collective, validated, reshards
    tdb.checkpoint.inspect("/ckpt/step100")            # no process group needed
    tdb.checkpoint.export("/ckpt/step100", "t.safetensors")  # one process, unsharded, bounded memory
    tdb.checkpoint.save(state_dict, "/ckpt/step110", base="/ckpt/step100")  # incremental: changed rows only
    tdb.checkpoint.compact("/ckpt/step110", "/ckpt/step110-full")  # a chain -> one self-contained checkpoint
    tdb.checkpoint.save(state_dict, "s3://bucket/ckpt/step100")  # an S3-compatible store: the same guarantees
    tdb.checkpoint.collect("/ckpt/step100")            # what interrupted saves left (the CLI's ``gc``)

Values may be DCP ``Stateful`` objects (a TorchRec DMP, its ``fused_optimizer``,
a ``torch.optim`` optimizer, a ``FusedOptimizer``): see :mod:`.stateful`.
"""

from .api import load, save
from .commit import collect as _collect
from .storage import locate
from .tools.compact import compact
from .errors import (
    BrokenChainError,
    CheckpointBusyError,
    CheckpointError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    NotACheckpointError,
)
from .tools.export import FORMATS, ExportSummary, export
from .tools.inspect import format_report, inspect
from .tools.migrate import migrate

__all__ = [
    "BrokenChainError",
    "collect",
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


def collect(path: str, *, dry_run: bool = False, storage_options: dict | None = None) -> list[str]:
    """Remove the generations of the checkpoint at ``path`` (a path or ``s3://`` URL) that no save committed
    (interrupted saves); never the committed one, one a reader holds, nor a superseded one within its grace
    period. Returns the names removed (``dry_run``: that would be). Raises ``CheckpointBusyError`` while a save
    to ``path`` runs.

    Example::

        >>> tdb.checkpoint.collect("/ckpt/step100")
        ['gen-3f1c...']
    """
    return _collect(locate(path, storage_options), dry_run=dry_run)
