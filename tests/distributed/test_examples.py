"""``examples/torchrec_sharding_example.py``: the real program under torchrun, and its pictures.

The program is launched as a user would (``python -m torch.distributed.run
--standalone --nproc_per_node=4 ... -e all``) once per module; its rank-0
output is parsed, not compared with a golden string. Expected shard boxes are
computed here from the layouts' definitions (README, "Examples"), independently of the library.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import torchrec_dtensor_bridge as tdb

from .harness import ROOT, launch

SCRIPT = ROOT / "examples" / "torchrec_sharding_example.py"
NAMES = ["row-wise-even", "row-wise-uneven", "table-wise", "column-wise", "grid"]
CLI_TIMEOUT = 150  # seconds for one launch; the test marks allow a little more


# ------------------------------------------------------------------ helpers
def run_cli(args: list[str], *, nproc: int | None = 4, timeout: float = CLI_TIMEOUT) -> subprocess.CompletedProcess:
    """Run the example under torchrun with ``nproc`` ranks (plain python for ``None``)."""
    return launch(SCRIPT, args, nproc=nproc, timeout=timeout)


def sections(stdout: str) -> dict[str, str]:
    """Rank 0's output split at its ``=== NAME: ... ===`` headers."""
    found = {}
    parts = re.split(r"^=== ([\w-]+): .* ===$", stdout, flags=re.M)
    for name, body in zip(parts[1::2], parts[2::2]):
        found[name] = body
    return found


PICTURE_TITLE = re.compile(r"^(\S+): (\d+(?:x\d+)*)(?: [^,]*)?, (\w+), (\d+) shard\(s\)$")
PICTURE_ROW = re.compile(r"^(\d+)\s+(\d+:\d+|-)\s+(\d+:\d+|-)\s+(\d+(?:x\d+)*)$")
PICTURE_BAND = re.compile(r"^\s+rows\s+(\d+):(\d+)\s+\|(.*)\|$")


def parse_pictures(text: str) -> dict[str, dict]:
    """Every ``visualize_sharding`` picture in ``text``: title fields, table rows and block map."""
    pictures: dict[str, dict] = {}
    current = None
    for line in text.splitlines():
        if m := PICTURE_TITLE.match(line):
            current = pictures[m[1]] = {"shape": m[2], "kind": m[3], "count": int(m[4]), "rows": [], "bands": []}
        elif current is not None and (m := PICTURE_ROW.match(line)):
            current["rows"].append((int(m[1]), m[2], m[3], m[4]))
        elif current is not None and (m := PICTURE_BAND.match(line)):
            current["bands"].append((int(m[1]), int(m[2]), m[3]))
    return pictures


def box(rank: int, r0: int, h: int, c0: int, w: int) -> tuple[int, str, str, str]:
    """A picture row as the expectation: rank, half-open rows and cols, ``HxW``."""
    return (rank, f"{r0}:{r0 + h}", f"{c0}:{c0 + w}", f"{h}x{w}")


def by_rank(boxes: list[tuple[int, str, str, str]]) -> list[tuple[int, str, str, str]]:
    """Boxes in the picture's order: by rank, then by row and column offset."""
    return sorted(boxes, key=lambda b: (b[0], int(b[1].split(":")[0]), int(b[2].split(":")[0])))


def expected_block_map(boxes: list[tuple[int, str, str, str]], n_rows: int, n_cols: int) -> list[tuple[int, int, str]]:
    """The block map drawn from boxes: one band per stretch of rows between cuts, one
    character per column (the owning rank)."""
    spans = [(r, *map(int, rows.split(":")), *map(int, cols.split(":"))) for r, rows, cols, _ in boxes]
    cuts = sorted({0, n_rows} | {a for _, a, _, _, _ in spans} | {b for _, _, b, _, _ in spans})
    bands = []
    for lo, hi in itertools.pairwise(cuts):
        cells = "".join(
            next(str(r) for r, a, b, c, d in spans if a <= lo < b and c <= col < d) for col in range(n_cols)
        )
        bands.append((lo, hi, cells))
    return bands


# Expected boxes from the layouts' definitions (an 8x16 table, 4 ranks).
ROW_UNEVEN = [box(r, r0, h, 0, 16) for r, (r0, h) in enumerate([(0, 1), (1, 3), (4, 1), (5, 3)])]
ROW_EVEN = [box(r, 2 * r, 2, 0, 16) for r in range(4)]
COL_4 = [box(r, 0, 8, 4 * r, 4) for r in range(4)]
COL_2_PER_RANK = [box(i % 4, 0, 8, 2 * i, 2) for i in range(8)]  # 8 shards of width 2 on ranks 0..3, 0..3
GRID_2X2 = [box(2 * bi + bj, 4 * bi, 4, 8 * bj, 8) for bi in range(2) for bj in range(2)]
TABLE_WISE = {f"table_{i}": [box(i, 0, 8, 0, 16)] for i in range(4)}


@pytest.fixture(scope="module")
def example_module():
    """The example program imported as a module (it is not in a package)."""
    spec = importlib.util.spec_from_file_location("torchrec_sharding_example", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up here
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


@pytest.fixture(scope="module")
def all_examples():
    """One torchrun launch of ``-e all`` on 4 ranks, shared by the tests that read its output."""
    return run_cli(["-e", "all"])


# ------------------------------------------------------------ the real program
@pytest.mark.timeout(180)
def test_all_examples_pass(all_examples):
    res = all_examples
    assert res.returncode == 0, f"exit {res.returncode}\n--- stdout\n{res.stdout}\n--- stderr\n{res.stderr}"
    found = sections(res.stdout)
    assert list(found) == NAMES, f"sections printed: {list(found)}"
    for name, body in found.items():
        assert f"{name}: ok on all 4 ranks" in body, body
    assert "All checks passed on 4 ranks" in res.stdout
    assert "FAILED" not in res.stdout + res.stderr


@pytest.mark.timeout(180)
def test_row_wise_uneven_picture(all_examples):
    pictures = parse_pictures(sections(all_examples.stdout)["row-wise-uneven"])
    assert list(pictures) == ["row_uneven"]
    pic = pictures["row_uneven"]
    assert (pic["shape"], pic["kind"], pic["count"]) == ("8x16", "row_wise", 4)
    # rank 0 rows 0:1, rank 1 rows 1:4, rank 2 rows 4:5, rank 3 rows 5:8, all columns
    assert pic["rows"] == ROW_UNEVEN
    assert pic["bands"] == expected_block_map(ROW_UNEVEN, 8, 16)


@pytest.mark.timeout(180)
def test_every_printed_picture_matches_spec(all_examples):
    found = sections(all_examples.stdout)
    expected = {
        "row-wise-even": {"row_even": ROW_EVEN},
        "row-wise-uneven": {"row_uneven": ROW_UNEVEN},
        "table-wise": TABLE_WISE,
        "column-wise": {"col_4": COL_4, "col_2_per_rank": by_rank(COL_2_PER_RANK)},
    }
    for name, tables in expected.items():
        pictures = parse_pictures(found[name])
        assert {t: p["rows"] for t, p in pictures.items()} == tables, name
    grid = parse_pictures(found["grid"])
    assert grid["grid_2x2"]["rows"] == GRID_2X2
    # Two 4x4 blocks per rank: every rank appears twice and the blocks tile the table.
    two = grid["grid_2_per_rank"]["rows"]
    assert sorted(r for r, *_ in two) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert sorted((rows, cols) for _, rows, cols, _ in two) == sorted(
        (f"{4 * i}:{4 * i + 4}", f"{4 * j}:{4 * j + 4}") for i in range(2) for j in range(4)
    )


@pytest.mark.slow  # four interpreters; the example's own checks run in test_all_examples_pass
@pytest.mark.timeout(180)
def test_mismatch_fails_on_every_rank_with_a_clear_message():
    res = run_cli(["-e", "row-wise-uneven", "--inject-mismatch"])
    assert res.returncode != 0
    # Rank 1's mismatch is gathered and reported by rank 0, naming example, table and rank.
    assert "row-wise-uneven / row_uneven: rank 1: full_tensor differs" in res.stderr, res.stderr
    assert "row-wise-uneven: FAILED" in res.stdout
    assert "All checks passed" not in res.stdout


def _names_listed(stderr: str) -> None:
    errors = [line for line in stderr.splitlines() if "invalid choice" in line]
    assert errors and "diagonal" in errors[0], stderr
    for name in [*NAMES, "all"]:
        assert re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", errors[0]), name


@pytest.mark.slow  # four interpreters for a usage error; the same parser runs in-process below
@pytest.mark.timeout(180)
def test_unknown_name_is_an_error_listing_the_valid_names():
    res = run_cli(["-e", "diagonal"])
    assert res.returncode != 0
    _names_listed(res.stderr)
    assert "===" not in res.stdout, "nothing may run for an unknown name"


@pytest.mark.slow  # two interpreters for a usage error of the example script
@pytest.mark.timeout(180)
def test_wrong_world_size_is_a_clear_error():
    res = run_cli(["-e", "row-wise-even"], nproc=2)
    assert res.returncode != 0
    assert "need exactly 4 ranks, but WORLD_SIZE is 2" in res.stderr, res.stderr
    assert f'{SCRIPT.name}", line' not in res.stderr, "a usage error, not a traceback from the example"
    assert "===" not in res.stdout


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_help_lists_every_example():
    res = run_cli(["--help"], nproc=None)
    assert res.returncode == 0, res.stderr
    listed = dict(re.findall(r"^  ([a-z-]+)\s{2,}(\S.*)$", res.stdout, flags=re.M))
    assert set(listed) >= {*NAMES, "all"}, res.stdout
    assert all(listed[n] for n in NAMES)  # each with its explanation


# ------------------------------------------------------ one process, no launch
def test_unknown_name_is_a_usage_error_listing_the_valid_names(example_module, capsys):
    assert example_module.main(["-e", "diagonal"]) == 2
    out = capsys.readouterr()
    _names_listed(out.err)
    assert "===" not in out.out, "nothing may run for an unknown name"


def test_without_torchrun_is_a_usage_error(example_module, monkeypatch, capsys):
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    assert example_module.main(["-e", "grid"]) == 2
    assert "launch it with torchrun" in capsys.readouterr().err


def test_main_reports_unknown_name_as_status_2(example_module, monkeypatch, capsys):
    monkeypatch.delenv("RANK", raising=False)
    assert example_module.main(["-e", "nope"]) == 2
    assert "invalid choice" in capsys.readouterr().err


@pytest.mark.parametrize(
    "shape, offsets",
    [
        ((2, 16), (0, 16)),  # the upstream bug: column offset == embedding dim of an 8x16 table
        ((3, 16), (1, 16)),  # the same bug on the uneven row-wise example's rank 1
        ((8, 4), (0, 14)),  # a column shard running past the last column
    ],
)
def test_out_of_bounds_offsets_are_rejected(shape, offsets):
    with pytest.raises(ValueError, match=r"exceeds global_shape \[8, 16\] in dim 1"):
        tdb.LocalShardsWrapper([torch.zeros(shape)], [offsets], global_shape=(8, 16))
    with pytest.raises(ValueError, match="out of bounds in dim 1"):
        tdb.ShardLayout.from_shards((8, 16), [(0, offsets, shape)], validate=True)


def _layouts(example_module, name: str) -> dict[str, tdb.ShardLayout]:
    return {t.name: t.layout for t in example_module.EXAMPLES[name].tables()}


@pytest.mark.parametrize(
    "example, table, expected",
    [
        ("row-wise-uneven", "row_uneven", ROW_UNEVEN),
        ("column-wise", "col_2_per_rank", COL_2_PER_RANK),
        ("table-wise", "table_2", TABLE_WISE["table_2"]),
        ("grid", "grid_2x2", GRID_2X2),
    ],
)
def test_visualize_sharding_of_layout(example_module, example, table, expected):
    layout = _layouts(example_module, example)[table]
    assert isinstance(layout, tdb.ShardLayout)
    text = tdb.visualize_sharding(layout, name="pic")
    pic = parse_pictures(text)["pic"]
    assert pic["shape"] == "8x16" and pic["count"] == len(expected)
    # Rows are listed by rank, then offsets.
    assert pic["rows"] == by_rank(expected)
    assert pic["bands"] == expected_block_map(expected, 8, 16)


def test_example_layouts_follow_spec(example_module):
    def boxes(layout):
        return by_rank([box(s.rank, s.offsets[0], s.sizes[0], s.offsets[1], s.sizes[1]) for s in layout.shards])

    assert list(example_module.EXAMPLES) == NAMES
    assert boxes(_layouts(example_module, "row-wise-even")["row_even"]) == ROW_EVEN
    assert boxes(_layouts(example_module, "row-wise-uneven")["row_uneven"]) == ROW_UNEVEN
    assert {t: boxes(lay) for t, lay in _layouts(example_module, "table-wise").items()} == TABLE_WISE
    cw = _layouts(example_module, "column-wise")
    assert boxes(cw["col_4"]) == COL_4 and boxes(cw["col_2_per_rank"]) == by_rank(COL_2_PER_RANK)
    assert boxes(_layouts(example_module, "grid")["grid_2x2"]) == GRID_2X2


def test_local_shards_are_own_storage_in_layout_order(example_module):
    table = example_module.EXAMPLES["column-wise"].tables()[1]  # two shards per rank
    shards, offsets = example_module.local_shards_for(table, 1)
    assert offsets == [(0, 2), (0, 10)]
    assert torch.equal(shards[0], table.full[:, 2:4]) and torch.equal(shards[1], table.full[:, 10:12])
    assert all(s.is_contiguous() and s.untyped_storage().data_ptr() != table.full.untyped_storage().data_ptr()
               for s in shards)
    assert example_module.local_shards_for(example_module.EXAMPLES["table-wise"].tables()[3], 0) == ([], [])
