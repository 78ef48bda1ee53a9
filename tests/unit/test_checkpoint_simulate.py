"""scripts/simulate_reshard.py predicts exactly what a real load reads (bytes, files), on a small case."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

import torchrec_dtensor_bridge as tdb
from torchrec_dtensor_bridge.wrapper import LocalShardsWrapper

from ..distributed.checks import reference_table
from tests.layout import committed

_spec = importlib.util.spec_from_file_location(
    "simulate_reshard", Path(__file__).resolve().parents[2] / "scripts" / "simulate_reshard.py")
sim = importlib.util.module_from_spec(_spec)
sys.modules["simulate_reshard"] = sim
_spec.loader.exec_module(sim)

SHAPES = {"a": (5000, 96), "b": (3001, 40)}
SAVE_CUTS = [0, 1200, 2500, 2600]  # four saved chunks of every table (row starts)


def _wrapper(table, starts, rows_total, fill=None):
    bounds = list(starts) + [rows_total]
    shards = [(table[a:b] if fill is None else torch.full((b - a, table.shape[1]), fill)).clone()
              for a, b in zip(bounds, bounds[1:]) if b > a]
    offsets = [(a, 0) for a, b in zip(bounds, bounds[1:]) if b > a]
    return LocalShardsWrapper(shards, offsets, global_shape=table.shape)


@pytest.mark.parametrize("rows", [(0, 1700), (2550, 4100), (4999, 5000)])
def test_simulated_reads_equal_a_real_load(tmp_path, rows):
    tables = {k: reference_table(s, seed=i) for i, (k, s) in enumerate(SHAPES.items())}
    tdb.checkpoint.save({k: _wrapper(t, SAVE_CUTS, t.shape[0]) for k, t in tables.items()}, tmp_path / "ck")
    boxes = {}
    dest = {}
    for k, t in tables.items():
        a, b = min(rows[0], t.shape[0] - 1), min(rows[1], t.shape[0])
        dest[k] = LocalShardsWrapper([torch.full((b - a, t.shape[1]), -1.0)], [(a, 0)], global_shape=t.shape)
        boxes[k] = [((a, 0), (b - a, t.shape[1]))]
    stats = tdb.checkpoint.load(dest, tmp_path / "ck", staging_bytes=None)
    for k, t in tables.items():
        a, b = min(rows[0], t.shape[0] - 1), min(rows[1], t.shape[0])
        assert torch.equal(dest[k].local_shards()[0], t[a:b]), k
    saved = sim.saved_from_checkpoint(committed((tmp_path / "ck")))
    predicted = sim.rank_reads(saved, boxes, staging_bytes=None)
    assert (predicted.read, predicted.files) == (stats.bytes_read, stats.files_opened)
    assert predicted.needed == sum(int(torch.Size(s).numel()) * 4 for bx in boxes.values() for _, s in bx)


def test_zip_record_sizes_of_the_paper_model_match_real_items(tmp_path):
    """The synthetic checkpoints' zip records (measured on one row) have the sizes of real saved chunks."""
    t = reference_table((70000, 64), seed=3)
    tdb.checkpoint.save({"t": _wrapper(t, [0, 30000], 70000)}, tmp_path / "ck")
    saved = sim.saved_from_checkpoint(committed((tmp_path / "ck")))
    head, tail = sim.zip_template(torch.float32, (64,))
    for place in saved.places.values():
        assert (place.data_start, place.length - place.data_start - place.nbytes) == (head, tail)
