"""Command line: ``python -m torchrec_dtensor_bridge {inspect,migrate,export,compact,gc,kernels}``.

A thin argparse shell over :mod:`torchrec_dtensor_bridge.checkpoint` (and, for ``kernels``,
:mod:`torchrec_dtensor_bridge.kernels.report`); every failure prints ``error: ...`` to stderr
and exits non-zero.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from . import checkpoint
from .checkpoint.common import format_mib
from .kernels import report

__all__ = ["main"]

_MIGRATE_HELP = """\
Convert a ShardedTensor-era checkpoint at SRC into a DTensor-layout DCP
checkpoint at DST (committed atomically, with block checksums of every data file).

Accepted SRC:
  * a DCP directory (one with a .metadata file), e.g. written by
    torch.distributed.checkpoint.save of a TorchRec state_dict of ShardedTensors,
    or any plain DCP directory (DST then loads with checksums verified);
    its chunks must cover every tensor exactly (a missing row is an error);
  * a directory of per-rank torch.save files of state_dicts, one per rank, named
    like rank0.pt, model_rank_1.pt (extensions .pt/.pth/.bin). One local gloo
    process per file loads it (ShardedTensors need their process group), with
    torch.load(weights_only=True): no code in the files runs; --trusted-pickles
    lifts that for files you trust.
SRC is untrusted input: only regular files inside SRC are read (no absolute or
.. paths, no symlinks), only DST's new generation is written.
DST must not exist, or be a checkpoint written by this tool (it is replaced atomically).
"""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m torchrec_dtensor_bridge",
        description="Inspect, migrate, export and compact checkpoints of TorchRec sharded tables (DTensor / DCP).",
    )
    parser.epilog = ("Every PATH, SRC and DST may be an s3://bucket/prefix/name URL of an S3-compatible store, "
                     "configured by the standard AWS variables (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, "
                     "AWS_SECRET_ACCESS_KEY, AWS_REGION).")
    sub = parser.add_subparsers(dest="command", required=True,
                                metavar="{inspect,migrate,export,compact,gc,kernels}")
    p = sub.add_parser("inspect", help="print a checkpoint's tables, shapes, dtypes and shard layouts",
                       description="Print every key of a checkpoint: dtype, shape, shard cuts and size.")
    p.add_argument("path", help="a checkpoint written by checkpoint.save, or any DCP directory")
    p.add_argument("--json", action="store_true", help="print checkpoint.inspect's dict as JSON")
    m = sub.add_parser("migrate", help="convert a ShardedTensor-era checkpoint to a DTensor-layout DCP one",
                       description=_MIGRATE_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    m.add_argument("src")
    m.add_argument("dst")
    m.add_argument("--no-progress", action="store_true", help="no progress bar")
    m.add_argument("--trusted-pickles", action="store_true",
                   help="load per-rank files with weights_only=False (they can run code: trusted files only)")
    e = sub.add_parser("export", help="write a checkpoint's tensors, unsharded, to one safetensors or torch file",
                       description="Write the tensors of a checkpoint as plain, unsharded tensors in one file, in "
                       "this process alone (no process group), verified as a load verifies them, holding a bounded "
                       "buffer in memory (never a whole table). Non-tensor values are left out.")
    e.add_argument("src", help="a checkpoint written by checkpoint.save")
    e.add_argument("dst", help="the file to write (replaced whole)")
    e.add_argument("--format", choices=checkpoint.FORMATS, default="safetensors")
    e.add_argument("--keys", action="append", metavar="GLOB",
                   help="only the keys matching this glob pattern (repeatable; default: every tensor)")
    e.add_argument("--no-progress", action="store_true", help="no progress bar")
    c = sub.add_parser("compact", help="write an incremental checkpoint's chain as one self-contained checkpoint",
                       description="Load the checkpoint SRC, following its chain of incremental links (every link "
                       "verified), and save it whole to DST: a full checkpoint that depends on no other (its links "
                       "may then be deleted) and can be the base of later incremental saves. Holds the "
                       "checkpoint's tensors in memory; no process group.")
    c.add_argument("src", help="a checkpoint written by checkpoint.save (full or incremental)")
    c.add_argument("dst", help="the checkpoint to write (a new path, or one written by checkpoint.save)")
    g = sub.add_parser("gc", help="remove what interrupted saves left under a checkpoint's name",
                       description="Remove the generations of a checkpoint that no save committed (left by "
                       "interrupted saves), listing each; never the committed generation, one a reader holds, or a "
                       "superseded one within its grace period (object stores). Refused while a save to the same "
                       "name runs.")
    g.add_argument("path", help="a checkpoint written by checkpoint.save (a local path or s3:// URL)")
    g.add_argument("--dry-run", action="store_true", help="list what would be removed, remove nothing")
    k = sub.add_parser("kernels", help="print which kernels run each kind of work here, and why",
                       description="Print the versions of torch, fbgemm_gpu and this package's extension, then, per "
                       "kind of work (pooled sum, fused update per optimizer kind, dense gradient, checkpoint row "
                       "digests), dtype and device, which implementation runs it (ours, fbgemm's, torch's) and why: "
                       "the rule (docs/kernels.md), the TDB_KERNELS override, a missing extension or fbgemm_gpu.")
    k.add_argument("--json", action="store_true", help="print the report as JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        text = _run(args)
    except (ValueError, TypeError, OSError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    try:
        print(text)
        sys.stdout.flush()  # a reader that went away is found here, not at the interpreter's exit
    except BrokenPipeError:
        # the reader stopped reading (``inspect ... | head``): it has what it wanted; say nothing more, and
        # keep the interpreter's own flush at exit from failing on the closed pipe
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def _run(args: argparse.Namespace) -> str:
    """What the command prints."""
    if args.command == "inspect":
        if args.json:
            return json.dumps(checkpoint.inspect(args.path), indent=2)
        return checkpoint.format_report(args.path)
    if args.command == "kernels":
        return report.format_report(as_json=args.json)
    if args.command == "gc":
        removed = checkpoint.collect(args.path, dry_run=args.dry_run)
        verb = "would remove" if args.dry_run else "removed"
        return "\n".join([f"{verb} {name}" for name in removed] + [f"{args.path}: {verb} {len(removed)} "
                                                                   "uncommitted generation(s)"])
    if args.command == "compact":
        save_id = checkpoint.compact(args.src, args.dst)
        return f"compacted {args.src} into {args.dst} (save id {save_id})"
    if args.command == "export":
        done = checkpoint.export(args.src, args.dst, format=args.format, keys=args.keys,
                                 progress=not args.no_progress)
        skipped = f"; left out {len(done.skipped)} non-tensor keys" if done.skipped else ""
        return (f"exported {len(done.keys)} tensors ({format_mib(done.bytes)} MiB) from {args.src} to {done.path} "
                f"({args.format}){skipped}")
    summary = checkpoint.migrate(args.src, args.dst, progress=not args.no_progress,
                                 trusted_pickles=args.trusted_pickles)
    return (f"migrated {summary['keys']} keys ({format_mib(summary['bytes'])} MiB of tensors) from "
            f"{summary['source']} {args.src} to {args.dst} (save id {summary['save_id']})")
