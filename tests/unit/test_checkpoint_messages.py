"""What a checkpoint error tells its reader, in one process: the exception class, the path, and what to do.

A path that holds no checkpoint, a plain DCP directory loaded with verification, a save under a regular
file, the sizes ``inspect`` and ``migrate`` print, ``ReadStats``' repr.
"""

import os
import re

import pytest
import torch
import torch.distributed.checkpoint as dcp

import torchrec_dtensor_bridge as tdb
from torchrec_dtensor_bridge import cli
from torchrec_dtensor_bridge.checkpoint import errors
from torchrec_dtensor_bridge.checkpoint.common import format_bytes, format_mib
from torchrec_dtensor_bridge.checkpoint.format.reader import ReadStats

from ..distributed.checks import reference_table
from tests.layout import committed

EXPECTED = ("expected a checkpoint written by tdb.checkpoint.save", "or a plain DCP directory holding .metadata",
            "torch.distributed.checkpoint.save")


def _blank():
    return {"w": torch.full((30, 4), -1.0)}


def _state():
    return {"w": reference_table((30, 4), seed=1)}


def _raised(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - what it raised is the subject of the test
        return e
    raise AssertionError("nothing raised")


def _load_error(path):
    dest = _blank()
    err = _raised(lambda: tdb.checkpoint.load(dest, path))
    assert torch.equal(dest["w"], _blank()["w"]), "a refused load modified the destination"
    return err


def _plain_dcp(path, sd=None):
    sd = _state() if sd is None else sd
    dcp.save(sd, checkpoint_id=str(path), no_dist=True)
    return sd


# ------------------------------------------------------------------ not a checkpoint / incomplete / corrupt
@pytest.mark.parametrize("contents", [[], ["notes.txt", "model.onnx"]], ids=["empty", "unrelated_files"])
def test_a_directory_without_a_checkpoint_is_not_a_checkpoint(tmp_path, contents):
    path = tmp_path / "step100"
    path.mkdir()
    for name in contents:
        (path / name).write_text("not a checkpoint")
    err = _load_error(path)
    assert type(err) is tdb.checkpoint.NotACheckpointError, (type(err), err)
    text = str(err)
    assert f"{path} is not a checkpoint" in text and all(e in text for e in EXPECTED), text
    assert ("the directory is empty" in text) if not contents else ("holds only model.onnx, notes.txt" in text), text
    assert ".metadata is missing" not in text
    for fn in (tdb.checkpoint.inspect, tdb.checkpoint.format_report):  # the same answer without a process group
        err = _raised(lambda fn=fn: fn(path))
        assert type(err) is tdb.checkpoint.NotACheckpointError and f"{path} is not a checkpoint" in str(err), err


def test_a_directory_of_many_unrelated_files_names_a_few(tmp_path):
    for i in range(8):
        (tmp_path / f"f{i}.txt").write_text("x")
    err = _load_error(tmp_path)
    assert type(err) is tdb.checkpoint.NotACheckpointError
    assert "holds only f0.txt, f1.txt, f2.txt, f3.txt, f4.txt and 3 more" in str(err), err


def test_the_directory_above_checkpoints_names_them(tmp_path):
    for name in ("step100", "step200"):
        tdb.checkpoint.save(_state(), tmp_path / name)
    err = _load_error(tmp_path)
    assert type(err) is tdb.checkpoint.NotACheckpointError, (type(err), err)
    assert "; it holds the checkpoints step100, step200: pass one of those paths (rank 0)" in str(err), err


def test_a_regular_file_is_not_a_checkpoint(tmp_path):
    path = tmp_path / "step100.pt"
    torch.save(_state(), path)
    err = _load_error(path)
    assert type(err) is tdb.checkpoint.NotACheckpointError, (type(err), err)
    assert f"{path} is not a checkpoint: it is a file, not a directory" in str(err), err
    assert all(e in str(err) for e in EXPECTED), err


def test_nothing_saved_yet_is_incomplete(tmp_path):
    err = _load_error(tmp_path / "step100")
    assert type(err) is tdb.checkpoint.IncompleteCheckpointError, (type(err), err)
    assert f"no committed checkpoint at {tmp_path / 'step100'}" in str(err), err


def test_an_unfinished_plain_dcp_save_is_incomplete(tmp_path):
    """DCP writes ``.metadata`` last: data files without it are a save that did not finish."""
    path = tmp_path / "plain"
    _plain_dcp(path)
    (path / ".metadata").unlink()
    err = _load_error(path)
    assert type(err) is tdb.checkpoint.IncompleteCheckpointError, (type(err), err)
    assert f"{path} holds DCP data files (__0_0.distcp) but no .metadata" in str(err), err
    assert "did not finish" in str(err), err


def test_damaged_checkpoints_stay_corrupt(tmp_path):
    saved = tmp_path / "ck"
    tdb.checkpoint.save(_state(), saved)
    (committed(saved) / ".metadata").unlink()  # a committed generation without its .metadata
    err = _load_error(saved)
    assert type(err) is tdb.checkpoint.CorruptCheckpointError, (type(err), err)
    assert ".metadata is missing" in str(err), err

    manifest_only = tmp_path / "manifest_only"  # a manifest of ours, its .metadata gone
    tdb.checkpoint.save(_state(), tmp_path / "ck2")
    os.rename(committed((tmp_path / "ck2")), manifest_only)
    (manifest_only / ".metadata").unlink()
    err = _load_error(manifest_only)
    assert type(err) is tdb.checkpoint.CorruptCheckpointError and ".metadata is missing" in str(err), (type(err), err)

    garbage = tmp_path / "plain"  # a plain DCP directory whose .metadata is not DCP's
    _plain_dcp(garbage)
    (garbage / ".metadata").write_bytes(b"not a pickle")
    err = _raised(lambda: tdb.checkpoint.load(_blank(), garbage, verify=False))
    assert type(err) is tdb.checkpoint.CorruptCheckpointError and "cannot be read" in str(err), (type(err), err)


def test_not_a_checkpoint_error_is_public_and_documented():
    cls = tdb.checkpoint.NotACheckpointError
    assert cls is errors.NotACheckpointError and "NotACheckpointError" in tdb.checkpoint.__all__
    assert issubclass(cls, tdb.checkpoint.CheckpointError)
    assert not issubclass(cls, (tdb.checkpoint.IncompleteCheckpointError, tdb.checkpoint.CorruptCheckpointError))
    for name in ("NotACheckpointError", "IncompleteCheckpointError", "CorruptCheckpointError"):
        assert name in errors.__doc__, name


# ------------------------------------------------------------------ a plain DCP directory, verified
def test_a_plain_dcp_directory_says_how_to_load_it_and_both_ways_work(tmp_path, capsys):
    src, dst = tmp_path / "plain", tmp_path / "converted"
    want = _plain_dcp(src)
    err = _load_error(src)
    assert type(err) is tdb.checkpoint.CorruptCheckpointError, (type(err), err)
    text = str(err)
    assert f"{src} is a plain DCP directory" in text and "not written by tdb.checkpoint.save" in text, text
    assert "tdb.checkpoint.load(..., verify=False)" in text, text
    assert f"python -m torchrec_dtensor_bridge migrate {src} NEW_PATH" in text, text

    dest = _blank()  # the first way: unverified
    stats = tdb.checkpoint.load(dest, src, verify=False)
    assert torch.equal(dest["w"], want["w"]) and not stats.verified

    assert cli.main(["migrate", str(src), str(dst), "--no-progress"]) == 0, capsys.readouterr().err  # the second
    dest = _blank()
    stats = tdb.checkpoint.load(dest, dst)
    assert torch.equal(dest["w"], want["w"]) and stats.verified


def test_a_generation_without_its_manifest_is_not_called_a_plain_directory(tmp_path):
    path = tmp_path / "ck"
    tdb.checkpoint.save(_state(), path)
    (committed(path) / "tdb_manifest.json").unlink()
    err = _load_error(path)
    assert type(err) is tdb.checkpoint.CorruptCheckpointError, (type(err), err)
    assert "has no checksum manifest" in str(err) and "plain DCP directory" not in str(err), err
    assert "tdb.checkpoint.load(..., verify=False)" in str(err), err


# ------------------------------------------------------------------ saving under a regular file
@pytest.mark.parametrize("below", [["ck"], ["a", "b", "ck"]], ids=["parent", "ancestor"])
def test_saving_under_a_regular_file_names_it_and_writes_nothing(tmp_path, below):
    blocker = tmp_path / "notes.txt"
    blocker.write_text("a file, not a directory")
    path = blocker.joinpath(*below)
    before = sorted(os.listdir(tmp_path))
    err = _raised(lambda: tdb.checkpoint.save(_state(), path))
    assert type(err) is NotADirectoryError, (type(err), err)
    text = str(err)
    assert f"cannot save to {path}: {blocker} is a file, not a directory" in text, text
    assert "nothing was written" in text and "EEXIST" not in text, text
    assert sorted(os.listdir(tmp_path)) == before and blocker.read_text() == "a file, not a directory"


def test_saving_under_a_broken_link_names_it(tmp_path):
    link = tmp_path / "runs"
    link.symlink_to(tmp_path / "gone")
    err = _raised(lambda: tdb.checkpoint.save(_state(), link / "ck"))
    assert type(err) is NotADirectoryError, (type(err), err)
    assert f"{link} is a broken symbolic link, not a directory" in str(err), err
    assert not (tmp_path / "gone").exists()


def test_migrating_under_a_regular_file_names_it(tmp_path, capsys):
    src, blocker = tmp_path / "plain", tmp_path / "notes.txt"
    _plain_dcp(src)
    blocker.write_text("x")
    err = _raised(lambda: tdb.checkpoint.migrate(src, blocker / "ck", progress=False))
    assert type(err) is NotADirectoryError and f"{blocker} is a file, not a directory" in str(err), (type(err), err)
    assert cli.main(["migrate", str(src), str(blocker / "ck"), "--no-progress"]) == 1
    assert f"error: cannot save to {blocker / 'ck'}: {blocker} is a file" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["notes.txt", "plain"]


# ------------------------------------------------------------------ sizes, reprs, inspect of a migrated checkpoint
def test_sizes_read_in_binary_units():
    assert [format_bytes(n) for n in (0, 1, 1023, 1024, 1536, 5 << 20, 3 << 30, 1 << 40)] == [
        "0 bytes", "1 byte", "1023 bytes", "1.00 KiB", "1.50 KiB", "5.00 MiB", "3.00 GiB", "1.00 TiB"]
    assert format_mib(1032192) == "0.98" and format_mib(1 << 20) == "1.00"


def test_read_stats_repr_says_what_was_read():
    assert repr(ReadStats(1258291, 3, verified=True)) == (
        "ReadStats(read 1.20 MiB from 3 data files on this rank, checksums verified)")
    assert repr(ReadStats(512, 1)) == (
        "ReadStats(read 512 bytes from 1 data file on this rank, not verified (verify=False))")


def test_load_returns_read_stats_that_read_well(tmp_path):
    path = tmp_path / "ck"
    tdb.checkpoint.save(_state(), path)
    stats = tdb.checkpoint.load(_blank(), path)
    assert stats.verified and stats.files_opened == 1 and stats.bytes_read > 30 * 4 * 4
    assert repr(stats) == (
        f"ReadStats(read {format_bytes(stats.bytes_read)} from 1 data file on this rank, checksums verified)")
    assert "object at 0x" not in repr(stats)


def test_inspect_and_migrate_agree_on_a_migrated_checkpoint(tmp_path, capsys):
    """258,048 float32 values: 0.98 MiB of tensor, 0.99 MiB of data file (the zip's framing)."""
    src, dst = tmp_path / "plain", tmp_path / "converted"
    _plain_dcp(src, {"t": torch.ones(258048)})
    assert sum(p.stat().st_size for p in src.glob("*.distcp")) / 2**20 >= 0.985  # the two figures differ
    assert cli.main(["migrate", str(src), str(dst), "--no-progress"]) == 0
    said = capsys.readouterr().out
    assert "migrated 1 keys (0.98 MiB of tensors)" in said, said
    report = tdb.checkpoint.format_report(dst)
    assert "1 keys, 0.98 MiB of tensors" in report, report
    assert "None" not in report and f"migrated from {src}" in report, report
    assert re.search(r"^t\s+float32\s+258048\s+1 \(whole\)\s+0\.98$", report, re.M), report
    summary = tdb.checkpoint.migrate(src, tmp_path / "again", progress=False)
    assert summary["bytes"] == sum(r["bytes"] for r in tdb.checkpoint.inspect(dst).values()) == 258048 * 4


def test_inspect_of_a_saved_checkpoint_counts_its_ranks(tmp_path):
    tdb.checkpoint.save(_state(), tmp_path / "ck")
    report = tdb.checkpoint.format_report(tmp_path / "ck")
    assert "written by 1 rank(s)" in report and "None" not in report, report


def test_inspect_gives_every_key_the_same_fields_and_names_objects(tmp_path):
    """Objects have ``shape`` and ``dtype`` (``None``) like tensors, their pickle's bytes, and what ``save``
    recorded of them: their type, and the value of a plain scalar or short string (nothing is unpickled)."""
    state = {"w": reference_table((30, 4), seed=1), "step": 100, "run": "seven", "lr": 0.05,
             "cfg": {"long": "x" * 200}, "when": ReadStats}
    tdb.checkpoint.save(state, tmp_path / "ck")
    info = tdb.checkpoint.inspect(tmp_path / "ck")
    for key, rec in info.items():
        assert {"type", "shape", "dtype", "shards", "bytes"} <= set(rec), (key, rec)
    assert info["w"]["dtype"] == "float32" and info["step"]["dtype"] is None and info["step"]["shape"] is None
    assert info["step"]["object_type"] == "int" and info["step"]["value"] == "100"
    assert info["run"]["value"] == "'seven'" and info["lr"]["value"] == "0.05"
    assert info["cfg.long"]["object_type"] == "str" and "value" not in info["cfg.long"]  # too long to show
    assert info["when"]["object_type"] == "type" and "value" not in info["when"]
    assert all(info[k]["bytes"] > 0 for k in ("step", "run", "lr"))
    report = tdb.checkpoint.format_report(tmp_path / "ck")
    assert re.search(r"^step\s+object \(int\)\s+-\s+= 100\s+-$", report, re.M), report
    assert "4 keys" not in report and "6 keys, 0.00 MiB of tensors" in report, report


def test_inspect_piped_into_a_reader_that_stops_early_exits_quietly(tmp_path):
    """``python -m torchrec_dtensor_bridge inspect --json PATH | head -1``: no traceback, no 'Broken pipe',
    status 0 (the reader has what it wanted)."""
    import subprocess
    import sys

    tdb.checkpoint.save({f"t{i:04d}": torch.zeros(2) for i in range(600)}, tmp_path / "ck")  # > 64 KiB of JSON
    proc = subprocess.Popen([sys.executable, "-m", "torchrec_dtensor_bridge", "inspect", "--json",
                             str(tmp_path / "ck")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert proc.stdout is not None and proc.stderr is not None
    first = proc.stdout.readline()
    proc.stdout.close()  # what `head -1` does
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 0, err
    assert first.strip() == b"{" and "Broken pipe" not in err and "Traceback" not in err, err


def test_a_dtype_change_loads_only_when_asked(tmp_path):
    """An fp32 checkpoint into fp16 tables: refused, naming the opt-in, nothing modified; converted with
    ``convert_dtypes=True`` exactly as ``Tensor.to`` rounds; an integer into a float table stays refused."""
    saved = {"w": reference_table((30, 4), seed=1) / 7, "n": torch.arange(5)}
    tdb.checkpoint.save(saved, tmp_path / "ck")
    dest = {"w": torch.full((30, 4), -1.0, dtype=torch.float16), "n": torch.arange(5)}
    err = _raised(lambda: tdb.checkpoint.load(dest, tmp_path / "ck"))
    assert isinstance(err, ValueError), err
    assert "key 'w': saved dtype torch.float32, destination dtype torch.float16; load(..., convert_dtypes=True)" \
        in str(err), err
    assert torch.equal(dest["w"], torch.full((30, 4), -1.0, dtype=torch.float16)), "a refused load wrote"
    tdb.checkpoint.load(dest, tmp_path / "ck", convert_dtypes=True)
    assert torch.equal(dest["w"], saved["w"].to(torch.float16))
    floats = {"w": saved["w"], "n": torch.zeros(5)}
    err = _raised(lambda: tdb.checkpoint.load(floats, tmp_path / "ck", convert_dtypes=True))
    assert isinstance(err, ValueError) and "key 'n': saved dtype torch.int64, destination dtype torch.float32" \
        in str(err) and "convert_dtypes" not in str(err), err


# ------------------------------------------------------------------ many keys that do not match: counted, a few named
def _tables(prefix, n=8, rows=6):
    return {f"{prefix}.t{i}.weight": reference_table((rows + i, 4), seed=i) for i in range(n)}


def _lines(err):
    return str(err).splitlines()[1:]  # the heading names the call


def test_another_models_keys_are_counted_a_few_named_and_all_kept_on_the_exception(tmp_path):
    """Loading into a model of other names: one line counts the missing keys and names the first five, one
    names a few of the checkpoint's own, one says where every key is; not a line per key."""
    tdb.checkpoint.save(_tables("model"), tmp_path / "ck")
    dest = {k: torch.zeros_like(v) for k, v in _tables("net").items()}
    err = _raised(lambda: tdb.checkpoint.load(dest, tmp_path / "ck"))
    assert type(err) is ValueError, (type(err), err)
    lines = _lines(err)
    assert len(lines) == 3, err
    assert lines[0] == ("  8 keys of the state_dict are not in the checkpoint: 'net.t0.weight', 'net.t1.weight', "
                        "'net.t2.weight', 'net.t3.weight', 'net.t4.weight' and 3 more (rank 0)"), lines[0]
    assert lines[1].startswith("  the checkpoint holds 8 keys the state_dict does not name: 'model.t0.weight', "), lines
    assert "missing_keys, unexpected_keys and mismatched_keys" in lines[2], lines[2]
    assert f"tdb.checkpoint.inspect({str(tmp_path / 'ck')!r})" in lines[2], lines[2]
    assert err.missing_keys == sorted(dest) and err.unexpected_keys == [] and err.mismatched_keys == []
    assert all(torch.equal(v, torch.zeros_like(v)) for v in dest.values()), "a refused load modified the destination"


def test_many_unexpected_and_mismatched_keys_are_counted_too(tmp_path):
    tdb.checkpoint.save({**_tables("model"), **_tables("extra")}, tmp_path / "ck")
    dest = {k: torch.zeros(v.shape[0] + 1, 4) for k, v in _tables("model").items()}  # every table one row more
    err = _raised(lambda: tdb.checkpoint.load(dest, tmp_path / "ck", strict=True))
    assert type(err) is ValueError, (type(err), err)
    lines = _lines(err)
    assert len(lines) == 8, err  # 5 shapes, the rest of them counted, the unexpected counted, where all are
    assert lines[0] == "  key 'model.t0.weight': saved shape [6, 4], destination shape [7, 4] (rank 0)", lines[0]
    assert lines[5] == ("  and 3 more keys have another shape or dtype in the checkpoint: 'model.t5.weight', "
                        "'model.t6.weight', 'model.t7.weight' (rank 0)"), lines[5]
    assert lines[6].startswith("  8 keys of the checkpoint are not in the state_dict (load(..., strict=False) ignores "
                               "them): 'extra.t0.weight', "), lines[6]
    assert lines[6].endswith(" and 3 more (rank 0)"), lines[6]
    assert err.mismatched_keys == sorted(dest) and err.unexpected_keys == sorted(_tables("extra"))
    assert err.missing_keys == []


def test_a_few_keys_keep_a_line_each_and_the_lists_on_the_exception(tmp_path):
    tdb.checkpoint.save(_tables("model", n=3), tmp_path / "ck")
    dest = {**_tables("model", n=2), "model.new.weight": torch.zeros(2, 2)}
    err = _raised(lambda: tdb.checkpoint.load(dest, tmp_path / "ck", strict=True))
    assert _lines(err) == [
        "  key 'model.new.weight' is not in the checkpoint (rank 0)",
        "  key 'model.t2.weight' is in the checkpoint, not in the state_dict (load(..., strict=False) ignores it) "
        "(rank 0)"], err
    assert (err.missing_keys, err.unexpected_keys, err.mismatched_keys) == (["model.new.weight"],
                                                                            ["model.t2.weight"], [])


def test_an_incremental_save_against_a_base_of_other_keys_counts_them(tmp_path):
    tdb.checkpoint.save(_tables("model"), tmp_path / "base")
    err = _raised(lambda: tdb.checkpoint.save(_tables("net"), tmp_path / "next", base=tmp_path / "base"))
    assert type(err) is ValueError, (type(err), err)
    lines = _lines(err)
    assert len(lines) == 3, err
    base = tmp_path / "base"
    assert lines[0].startswith(f"  8 keys of the state_dict are not in base {base} (an incremental save holds the "
                               "base's keys): 'net.t0.weight', "), lines[0]
    assert lines[1].startswith(f"  8 keys of base {base} are not in the state_dict being saved: 'model.t0.weight', "), \
        lines[1]
    assert f"the base's own keys: tdb.checkpoint.inspect({str(base)!r})" in lines[2], lines[2]
    assert err.missing_keys == sorted(_tables("net")) and err.unexpected_keys == sorted(_tables("model"))
    assert not (tmp_path / "next").exists()


# ------------------------------------------------------------------ why a row-wise optimizer state does not convert
def test_the_row_state_refusal_says_what_the_checkpoint_records_and_never_more():
    """The column blocks' widths, when recorded, tell the saved rows: a table of another number of rows is
    named as such; without them, the reason given is the one that holds for that checkpoint."""
    from torchrec_dtensor_bridge.checkpoint.keyed import ROW_STATE_COLUMNS, recorded_widths, row_state_hint

    key = "optim.state.t.weight.t.momentum1"
    why = row_state_hint("t.weight", (10, 16)).why
    grown = why((18,), (10,), recorded_widths({ROW_STATE_COLUMNS: {key: [8, 8]}}, key))
    assert "table 't.weight', [10, 16] in the destination" in grown, grown
    assert "2 column blocks (widths [8, 8]) of a 9-row table" in grown, grown
    assert "the table had 9 rows when saved and has 10 now" in grown and "recorded" not in grown, grown

    old = why((20,), (10,), recorded_widths({"format": 3}, key))  # a manifest from before the widths
    assert "written before tdb.checkpoint.save recorded them" in old, old
    migrated = why((20,), (10,), recorded_widths({"format": 3, "migrated_from": "/old/ck"}, key))
    assert "it was migrated from /old/ck, which does not record them" in migrated and "before" not in migrated
    plain = why((20,), (10,), recorded_widths(None, key))
    assert "no manifest of tdb.checkpoint.save" in plain and "before" not in plain, plain
    other = why((20,), (10,), recorded_widths({ROW_STATE_COLUMNS: {}}, key))
    assert "before" not in other and "state_dict()" in other, other

    odd = why((18,), (10,), recorded_widths({ROW_STATE_COLUMNS: {}}, key))  # 18 values: no whole number per row
    assert "neither one value per row of this 10-row table nor one per row and column block" in odd, odd
    assert "recorded" not in odd, odd
