"""TorchRec's embedding-table shardings as DTensors, on 4 gloo ranks.

Run with ``torchrun --standalone --nproc_per_node=4 examples/torchrec_sharding_example.py -e NAME``.

For every table of the chosen example, each rank:

1. builds its local shards the way TorchRec holds them: one contiguous tensor
   per block, cut from a deterministic full table (``torch.arange``, identical
   on every rank), in the order the layout lists this rank's blocks;
2. wraps them in ``tdb.LocalShardsWrapper(shards, offsets, global_shape)``,
   which rejects offsets outside the table (the widely copied upstream version
   of this example passes a column offset equal to the embedding dim);
3. makes the DTensor with ``dtensor_from_local_shards`` (zero-copy; the library
   picks mesh and placements);
4. checks the DTensor's global shape and stride, the round trip back to local
   shards (the same storage, ``data_ptr`` for ``data_ptr``, at the same
   offsets) and that ``tdb.full_tensor`` gives back the full table exactly.

Rank 0 prints each table's sharding picture (``tdb.visualize_sharding``).
Every rank's failures are gathered after each table, so all ranks agree on
the verdict: the exit status is 0 when every check passed on every rank and 1
otherwise (2 for a usage error such as an unknown name or a world size
other than 4).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import textwrap
import warnings
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TextIO

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import torchrec_dtensor_bridge as tdb
from torchrec_dtensor_bridge import ShardLayout
from torchrec_dtensor_bridge.convert import dtensor_from_local_shards, local_shards_of

WORLD_SIZE = 4
"""Every example is written for exactly this many ranks."""

ALL = "all"
"""The ``-e`` value that runs every example in turn."""

EXIT_OK, EXIT_MISMATCH, EXIT_USAGE = 0, 1, 2


# --------------------------------------------------------------------- tables
@dataclasses.dataclass(frozen=True)
class Table:
    """One embedding table of an example: its layout and its full contents.

    Attributes:
        layout: which rank holds which block (the layout's ``name`` names the table).
        full: the unsharded table, identical on every rank; shards are cut from it.
    """

    layout: ShardLayout
    full: torch.Tensor

    @property
    def name(self) -> str:
        """The table's name, as printed in pictures and failure messages."""
        return self.layout.name


@dataclasses.dataclass(frozen=True)
class Example:
    """A named sharding example.

    Attributes:
        name: the ``-e`` value selecting it.
        summary: one line for ``--help`` and the section header.
        tables: builds the example's tables (same result on every rank).
    """

    name: str
    summary: str
    tables: Callable[[], list[Table]]


def reference_table(shape: Sequence[int], first: int = 0) -> torch.Tensor:
    """A deterministic float32 table: ``first, first + 1, ...`` in row-major order.

    Args:
        shape: the table's shape, e.g. ``(8, 16)``.
        first: value of element ``[0, 0]``, so several tables of one example differ.

    Returns:
        A contiguous tensor of ``shape`` whose values are exact in float32.
    """
    numel = 1
    for d in shape:
        numel *= int(d)
    return torch.arange(first, first + numel, dtype=torch.float32).reshape(tuple(shape))


def row_wise_even_tables() -> list[Table]:
    """An 8x16 table cut by rows into 4 blocks of 2x16: rank ``r`` holds rows ``2r:2r+2``.

    This is ``torch.chunk``'s split, so DTensor's ``Shard(0)`` describes it exactly
    and each rank's local tensor is its plain shard.

    Returns:
        The example's single table.
    """
    return [Table(ShardLayout.row_wise((8, 16), WORLD_SIZE, name="row_even"), reference_table((8, 16)))]


def row_wise_uneven_tables() -> list[Table]:
    """An 8x16 table cut by rows into blocks of 1, 3, 1 and 3 rows (row offsets 0, 1, 4, 5).

    ``Shard(0)`` would assume 2 rows each, so the local shards travel in a
    ``LocalShardsWrapper`` with the true global shape.

    Returns:
        The example's single table.
    """
    return [Table(ShardLayout.row_wise((8, 16), [1, 3, 1, 3], name="row_uneven"), reference_table((8, 16)))]


def table_wise_tables() -> list[Table]:
    """Four 8x16 tables; table ``i`` lives wholly on rank ``i``.

    Each becomes a DTensor on the mesh of every rank with ``Shard(0)``: its
    owner's wrapper holds the table, the other ranks' wrappers hold nothing.

    Returns:
        The four tables, with different contents.
    """
    return [
        Table(ShardLayout.table_wise((8, 16), i, name=f"table_{i}"), reference_table((8, 16), first=1000 * i))
        for i in range(WORLD_SIZE)
    ]


def column_wise_tables() -> list[Table]:
    """An 8x16 table cut into 4 column blocks of width 4 (rank ``r`` holds columns
    ``4r:4r+4``), and one cut into 8 blocks of width 2 placed round-robin on ranks
    0, 1, 2, 3, 0, 1, 2, 3, as TorchRec places more column shards than ranks: rank
    ``r`` then holds columns ``2r:2r+2`` and ``8+2r:10+2r``.

    Returns:
        The two tables.
    """
    return [
        Table(ShardLayout.column_wise((8, 16), [4] * 4, name="col_4"), reference_table((8, 16))),
        Table(
            ShardLayout.column_wise((8, 16), [2] * 8, ranks=[0, 1, 2, 3] * 2, name="col_2_per_rank"),
            reference_table((8, 16), first=1000),
        ),
    ]


def grid_tables() -> list[Table]:
    """An 8x16 table in 2x2 blocks of 4x8 on ranks 0..3 (row-major), and one in
    2x4 blocks of 4x4 where each rank holds two blocks that differ in both rows
    and columns (ranks 0, 1, 2, 3 on the top band, 1, 0, 3, 2 below).

    Returns:
        The two tables.
    """
    return [
        Table(ShardLayout.grid((8, 16), [4, 4], [8, 8], [0, 1, 2, 3], name="grid_2x2"), reference_table((8, 16))),
        Table(
            ShardLayout.grid((8, 16), [4, 4], [4] * 4, [0, 1, 2, 3, 1, 0, 3, 2], name="grid_2_per_rank"),
            reference_table((8, 16), first=1000),
        ),
    ]


EXAMPLES: dict[str, Example] = {
    e.name: e
    for e in (
        Example(
            "row-wise-even",
            "8x16 table, 4 row blocks of 2x16 (rank r: rows 2r:2r+2); exactly Shard(0)",
            row_wise_even_tables,
        ),
        Example(
            "row-wise-uneven",
            "8x16 table, row blocks of 1, 3, 1, 3 rows (row offsets 0, 1, 4, 5)",
            row_wise_uneven_tables,
        ),
        Example(
            "table-wise",
            "4 tables of 8x16, table i wholly on rank i",
            table_wise_tables,
        ),
        Example(
            "column-wise",
            "8x16 table in 4 column blocks of width 4; and in 8 blocks of width 2, two per rank",
            column_wise_tables,
        ),
        Example(
            "grid",
            "8x16 table in 2x2 blocks of 4x8 on ranks 0..3; and in 2x4 blocks of 4x4, two per rank",
            grid_tables,
        ),
    )
}
"""Every example, in the order ``-e all`` runs them."""


# ----------------------------------------------------------- shards and checks
@dataclasses.dataclass
class Built:
    """What one rank made of one table.

    Attributes:
        shards: this rank's shard tensors (the storage the DTensor must reuse).
        offsets: their global offsets, in the same order.
        wrapper: the ``LocalShardsWrapper`` over ``shards``.
        dtensor: the DTensor made by the library.
    """

    shards: list[torch.Tensor]
    offsets: list[tuple[int, ...]]
    wrapper: tdb.LocalShardsWrapper
    dtensor: DTensor


def local_shards_for(table: Table, rank: int) -> tuple[list[torch.Tensor], list[tuple[int, ...]]]:
    """This rank's shards as TorchRec holds them: one contiguous tensor per block.

    Args:
        table: the table and its layout.
        rank: global rank.

    Returns:
        The shard tensors (copies of the table's blocks, each its own storage) and
        their offsets, in ``table.layout.shards_on(rank)`` order. Both are empty on
        a rank that holds nothing of the table.
    """
    mine = table.layout.shards_on(rank)
    return [table.full[s.slices()].clone() for s in mine], [s.offsets for s in mine]


def build(table: Table, rank: int) -> Built:
    """Cut, wrap and convert one table on this rank (not collective, zero-copy).

    Args:
        table: the table and its layout.
        rank: global rank.

    Returns:
        The shards, their offsets, the wrapper and the DTensor.

    Raises:
        ValueError: when the shards do not fit the table or the layout.
    """
    shards, offsets = local_shards_for(table, rank)
    wrapper = tdb.LocalShardsWrapper(shards, offsets, table.layout.global_shape)
    dtensor = dtensor_from_local_shards(table.layout, wrapper.local_shards())
    return Built(shards, offsets, wrapper, dtensor)


def contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    """The row-major stride of ``shape`` (what the unsharded table has).

    Args:
        shape: a tensor shape.

    Returns:
        One stride per dim.
    """
    return torch.empty(tuple(shape), device="meta").stride()


def describe_difference(got: torch.Tensor, expected: torch.Tensor) -> str:
    """A short account of how two tensors differ.

    Args:
        got: the tensor produced.
        expected: the tensor it should equal.

    Returns:
        Shapes if they differ, else the number of differing elements and the first one.
    """
    if got.shape != expected.shape or got.dtype != expected.dtype:
        return f"got {got.dtype} {list(got.shape)}, expected {expected.dtype} {list(expected.shape)}"
    bad = (got != expected).nonzero()
    if not len(bad):
        return "the tensors differ"
    first = tuple(int(i) for i in bad[0])
    return (
        f"{len(bad)} of {expected.numel()} elements differ, first at {list(first)}: "
        f"got {got[first].item()}, expected {expected[first].item()}"
    )


def check_local(table: Table, built: Built, rank: int) -> list[str]:
    """The checks one rank can make alone: shape, stride, layout and the zero-copy round trip.

    Args:
        table: the table and its layout.
        built: what :func:`build` made on this rank.
        rank: global rank.

    Returns:
        One message per mismatch (empty when all is well).
    """
    dt, layout = built.dtensor, table.layout
    failures = []
    if tuple(dt.shape) != layout.global_shape:
        failures.append(f"global shape is {list(dt.shape)}, expected {list(layout.global_shape)}")
    if tuple(dt.stride()) != contiguous_stride(layout.global_shape):
        failures.append(f"global stride is {dt.stride()}, expected {contiguous_stride(layout.global_shape)}")
    if dt.dtype != table.full.dtype:
        failures.append(f"dtype is {dt.dtype}, expected {table.full.dtype}")
    # a rank holding nothing reports one empty block at the origin (TorchRec's convention, as local_sizes())
    expected = [torch.Size(o) for o in built.offsets] or [torch.Size([0] * len(layout.global_shape))]
    if list(built.wrapper.local_offsets()) != expected:
        failures.append(f"wrapper offsets are {built.wrapper.local_offsets()}, expected {expected}")

    back = local_shards_of(dt)
    got_ptrs = [t.data_ptr() for t in back]
    want_ptrs = [t.data_ptr() for t in built.shards]
    if got_ptrs != want_ptrs:
        failures.append(
            f"round trip is not zero-copy: local_shards_of gives {len(back)} tensor(s) at data_ptr "
            f"{[hex(p) for p in got_ptrs]}, the original {len(built.shards)} shard(s) are at "
            f"{[hex(p) for p in want_ptrs]}"
        )
    local = dt.to_local()
    if isinstance(local, tdb.LocalShardsWrapper):
        wrapped = [tuple(o) for o in local.local_offsets()]
        # a wrapper holding nothing reports one all-zero offset (the convention of torch's own wrapper)
        want = built.offsets or [(0,) * len(layout.global_shape)]
        if wrapped != want:
            failures.append(f"the DTensor's LocalShardsWrapper has offsets {wrapped}, expected {want}")
    recovered = tdb.layout_of(dt)
    got_offsets = [s.offsets for s in recovered.shards_on(rank)]
    if got_offsets != built.offsets:
        failures.append(f"local shard offsets after the round trip are {got_offsets}, expected {built.offsets}")
    if sorted(recovered.shards, key=_key) != sorted(layout.shards, key=_key):
        failures.append(f"layout of the DTensor is {_blocks(recovered)}, expected {_blocks(layout)}")
    for i, (t, spec) in enumerate(zip(back, layout.shards_on(rank))):
        block = table.full[spec.slices()]
        if not torch.equal(t, block):
            failures.append(f"local shard {i} at {list(spec.offsets)}: {describe_difference(t, block)}")
    return failures


def _key(s: tdb.ShardSpec) -> tuple:
    return (-1 if s.rank is None else s.rank, s.offsets, s.sizes)


def _blocks(layout: ShardLayout) -> list[str]:
    return [f"rank {s.rank}: {list(s.offsets)}+{list(s.sizes)}" for s in sorted(layout.shards, key=_key)]


def check_full_tensor(table: Table, built: Built, expected: torch.Tensor) -> list[str]:
    """``tdb.full_tensor`` gives back the whole table exactly; *collective*.

    Args:
        table: the table.
        built: what :func:`build` made on this rank.
        expected: the table this rank compares with (``table.full`` unless a
            mismatch is being injected).

    Returns:
        One message on a mismatch, else nothing.
    """
    got = tdb.full_tensor(built.dtensor)
    if got.shape == expected.shape and torch.equal(got, expected):
        return []
    return [f"full_tensor differs from the full table: {describe_difference(got, expected)}"]


def gather_failures(mine: list[str]) -> list[str]:
    """Every rank's failures, the same list on every rank; *collective*.

    Args:
        mine: this rank's messages, each already naming the rank.

    Returns:
        All ranks' messages in rank order.
    """
    everyone: list[list[str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return [m for msgs in everyone for m in (msgs or [])]


def run_table(example: Example, table: Table, rank: int, *, inject_mismatch: bool = False,
              out: TextIO | None = None) -> list[str]:
    """Build, picture and check one table; *collective* (every rank must call it).

    The local checks are agreed on first; ``full_tensor`` (a collective) only
    runs when every rank built its DTensor, so a failure never leaves a rank
    waiting.

    Args:
        example: the example the table belongs to (for messages).
        table: the table.
        rank: global rank.
        inject_mismatch: compare rank 1's ``full_tensor`` with a table that has one
            element changed (exercises the failure path).
        out: where rank 0 prints the picture (``None``: stdout).

    Returns:
        Every rank's failure messages (the same on every rank).
    """
    where = f"{example.name} / {table.name}: rank {rank}"
    mine: list[str] = []
    built, picture = None, None
    try:
        built = build(table, rank)
        picture = tdb.visualize_sharding(built.dtensor, name=table.name)
        mine += check_local(table, built, rank)
    except Exception as e:  # noqa: BLE001 - reported with the rank, all ranks then stop this table
        mine.append(f"raised {type(e).__name__}: {e}")
    if rank == 0 and built is not None and picture is not None:
        dt = built.dtensor
        print(
            f"{table.name}: DTensor {list(dt.shape)} stride {dt.stride()} on mesh "
            f"{dt.device_mesh.mesh.tolist()} with {tuple(dt.placements)}; rank 0's local tensor: "
            f"{type(dt.to_local()).__name__}",
            file=out,
        )
        print(picture, file=out)
    failures = gather_failures([f"{where}: {m}" for m in mine])
    if failures:
        return failures  # a rank failed already: skip the collective check on every rank
    expected = table.full
    if inject_mismatch and rank == 1:
        expected = expected.clone()
        expected.view(-1)[0] += 1
    try:
        mine = check_full_tensor(table, built, expected)
    except Exception as e:  # noqa: BLE001
        mine = [f"full_tensor raised {type(e).__name__}: {e}"]
    return gather_failures([f"{where}: {m}" for m in mine])


def run_example(example: Example, rank: int, *, inject_mismatch: bool = False,
                out: TextIO | None = None) -> list[str]:
    """Run every table of one example; *collective*.

    Args:
        example: the example.
        rank: global rank.
        inject_mismatch: see :func:`run_table`.
        out: where rank 0 prints (``None``: stdout).

    Returns:
        Every rank's failure messages (the same on every rank).
    """
    if rank == 0:
        print(f"=== {example.name}: {example.summary} ===", file=out)
    failures: list[str] = []
    for table in example.tables():
        failures += run_table(example, table, rank, inject_mismatch=inject_mismatch, out=out)
    if rank == 0:
        if failures:
            print(f"{example.name}: FAILED ({len(failures)} mismatch(es), listed on stderr)\n", file=out)
        else:
            print(
                f"{example.name}: ok on all {dist.get_world_size()} ranks (global shape and stride, "
                "zero-copy round trip to the local shards at their offsets, full_tensor == table)\n",
                file=out,
            )
    return failures


# ------------------------------------------------------------------------ CLI
def _launch_rank() -> int | None:
    """This process's rank as torchrun sets it, or ``None`` outside torchrun."""
    value = os.environ.get("RANK")
    return int(value) if value is not None and value.isdigit() else None


def _is_rank_zero() -> bool:
    return (_launch_rank() or 0) == 0


class _RankZeroParser(argparse.ArgumentParser):
    """An argument parser whose help and errors only rank 0 prints (every rank
    still exits with argparse's status, so no rank is left waiting)."""

    def print_help(self, file: TextIO | None = None) -> None:
        if _is_rank_zero():
            super().print_help(file)

    def print_usage(self, file: TextIO | None = None) -> None:
        if _is_rank_zero():
            super().print_usage(file)

    def exit(self, status: int = 0, message: str | None = None) -> None:  # type: ignore[override]
        if message and _is_rank_zero():
            sys.stderr.write(message)
        raise SystemExit(status)


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser; ``--help`` lists and explains every example.

    Returns:
        The parser.
    """
    width = max(len(n) for n in [*EXAMPLES, ALL])
    listing = "\n".join(f"  {e.name:<{width}}  {e.summary}" for e in EXAMPLES.values())
    listing += f"\n  {ALL:<{width}}  run every example above in turn"
    parser = _RankZeroParser(
        prog="torchrun --standalone --nproc_per_node=4 examples/torchrec_sharding_example.py",
        description=__doc__.split("\n\n", 1)[0]
        + "\n\n"
        + textwrap.fill(
            "Each rank builds its shards as TorchRec holds them, wraps them in a LocalShardsWrapper, "
            "makes the DTensor (zero-copy) and checks its shape and stride, the round trip back to "
            "the same local storage at the same offsets, and full_tensor; rank 0 prints the "
            "sharding. Exit status: 0 when every check passed on every rank, 1 on a mismatch, 2 "
            "on a usage error (unknown name, world size other than 4).",
            width=88,
        ),
        epilog=f"examples (-e NAME):\n{listing}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "-e",
        "--example",
        metavar="NAME",
        choices=[*EXAMPLES, ALL],
        default=ALL,
        help=f"the example to run, from the list below (default: {ALL})",
    )
    # Exercises the failure path in the tests: rank 1 compares full_tensor with a wrong table.
    parser.add_argument("--inject-mismatch", action="store_true", help=argparse.SUPPRESS)
    return parser


def world_size_error() -> str | None:
    """Why this process cannot run the examples, judged from torchrun's environment.

    Returns:
        A message when not launched by torchrun or when the world size is not
        :data:`WORLD_SIZE`; ``None`` when all is well.
    """
    world = os.environ.get("WORLD_SIZE")
    if world is None or _launch_rank() is None:
        return (
            "error: this example runs on 4 ranks; launch it with torchrun, e.g.\n"
            "  torchrun --standalone --nproc_per_node=4 examples/torchrec_sharding_example.py -e row-wise-uneven"
        )
    if not world.isdigit() or int(world) != WORLD_SIZE:
        return (
            f"error: these examples need exactly {WORLD_SIZE} ranks, but WORLD_SIZE is {world}; "
            f"run with torchrun --nproc_per_node={WORLD_SIZE}"
        )
    return None


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, run the chosen examples on 4 gloo ranks and report.

    Args:
        argv: command-line arguments (default: ``sys.argv[1:]``).

    Returns:
        0 when every check passed on every rank, 1 on any mismatch (the same
        status on every rank), 2 for a usage error.
    """
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help, or an unknown example name
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    problem = world_size_error()
    if problem is not None:
        # every rank says it: the launcher ends the others as soon as one rank exits, which could be before
        # rank 0 has printed anything
        print(problem, file=sys.stderr)
        return EXIT_USAGE

    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    try:
        status = run_chosen(args.example, inject_mismatch=args.inject_mismatch)
        dist.barrier()  # leave together: a rank exiting early makes torchrun kill the others mid-teardown
        return status
    finally:
        dist.destroy_process_group()


def run_chosen(name: str, *, inject_mismatch: bool = False) -> int:
    """Run example ``name`` (or every example for ``all``) and report; *collective*.

    Args:
        name: an example name or ``all``.
        inject_mismatch: see :func:`run_table`.

    Returns:
        The exit status, the same on every rank: 0 all checks passed, 1 a mismatch.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != WORLD_SIZE:  # ruled out before init; same answer on every rank
        if rank == 0:
            print(f"error: need {WORLD_SIZE} ranks, the process group has {world}", file=sys.stderr)
        return EXIT_USAGE
    chosen = list(EXAMPLES.values()) if name == ALL else [EXAMPLES[name]]
    failures: list[str] = []
    for example in chosen:
        failures += run_example(example, rank, inject_mismatch=inject_mismatch)
    if rank == 0:
        if failures:
            print(f"FAILED: {len(failures)} mismatch(es)", file=sys.stderr)
            for message in failures:
                print(f"  {message}", file=sys.stderr)
        else:
            names = ", ".join(e.name for e in chosen)
            print(f"All checks passed on {world} ranks: {names}.")
    return EXIT_MISMATCH if failures else EXIT_OK

if __name__ == "__main__":
    sys.exit(main())
