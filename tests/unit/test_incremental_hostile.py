"""Incremental checkpoints as hostile input, in one process: a link's manifest (re-checksummed, so only its
meaning is wrong) that points its base outside the directory, at another checkpoint's generation, or its pieces
outside the tensor; a link whose rows file lost its checksums; row digests computed by the compiled kernel and
by torch ops alike. Each is refused naming the link, with nothing modified."""

import copy

import pytest
import torch

import torchrec_dtensor_bridge as tdb
from torchrec_dtensor_bridge.checkpoint.incremental import digests
from tests.layout import committed
from torchrec_dtensor_bridge.checkpoint.format.manifest import read_manifest

from ..checkpoint_writers import rewrite_manifest
from ..distributed.checks import reference_table


def _chain(tmp_path):
    state = {"a": reference_table((40, 6)), "m": reference_table((40,), seed=1), "epoch": 0}
    tdb.checkpoint.save(state, tmp_path / "l0")
    state["a"][[3, 17]] += 1
    state["m"][5] = -1
    state["epoch"] = 1
    tdb.checkpoint.save(state, tmp_path / "l1", base=tmp_path / "l0")
    tdb.checkpoint.save({"x": torch.zeros(2)}, tmp_path / "other")
    return state


def _refused(tmp_path, error, needle):
    dest = {"a": torch.full((40, 6), -1.0), "m": torch.full((40,), -1.0), "epoch": -1}
    with pytest.raises(error, match=needle):
        tdb.checkpoint.load(dest, tmp_path / "l1")
    assert torch.equal(dest["a"], torch.full((40, 6), -1.0)) and dest["epoch"] == -1


def _edit(tmp_path, change):
    root = committed(tmp_path / "l1")
    body = copy.deepcopy(read_manifest(root))
    change(body)
    rewrite_manifest(root, body)


CASES = {
    "base outside": (lambda b: b["link"]["base"].update(generation="../../etc"), tdb.checkpoint.CorruptCheckpointError,
                     "not a plain file name"),
    "base of another name": (lambda b: b["link"]["base"].update(generation=".other.tdb-1"),
                             tdb.checkpoint.CorruptCheckpointError, "is not one of 'l0''s"),
    "base renamed": (lambda b: b["link"]["base"].update(name="other"), tdb.checkpoint.BrokenChainError,
                     "is gone"),
    "another save's id": (lambda b: b["link"]["base"].update(save_id="0" * 32), tdb.checkpoint.BrokenChainError,
                          "was replaced"),
    "piece beyond the rows": (lambda b: b["link"]["pieces"]["a"][0].__setitem__(4, 41),
                              tdb.checkpoint.CorruptCheckpointError, "lies outside shape"),
    "piece of an unknown key": (lambda b: b["link"]["pieces"].update(z=b["link"]["pieces"]["a"]),
                                tdb.checkpoint.CorruptCheckpointError, "pieces of key 'z'"),
    "rows file without checksums": (lambda b: b["files"].pop("rows_0.tdb"), tdb.checkpoint.CorruptCheckpointError,
                                    "has no checksums"),
    "a cycle": (lambda b: b["link"]["base"].update(name="l1", generation=resolve_name(b), save_id=b["save_id"]),
                tdb.checkpoint.CorruptCheckpointError, "more than"),
}


def resolve_name(body):
    return f"gen-{body['save_id']}"


@pytest.mark.parametrize("case", sorted(CASES))
def test_malformed_link_refused_with_nothing_modified(tmp_path, case, monkeypatch):
    from torchrec_dtensor_bridge.checkpoint.incremental import chain

    monkeypatch.setattr(chain, "MAX_LINKS", 20)
    _chain(tmp_path)
    change, error, needle = CASES[case]
    _edit(tmp_path, change)
    _refused(tmp_path, error, needle)


def test_ids_out_of_order_refused(tmp_path):
    _chain(tmp_path)
    root = committed(tmp_path / "l1")
    piece = read_manifest(root)["link"]["pieces"]["a"][0]
    f = root / piece[2]
    data = bytearray(f.read_bytes())
    data[piece[3] : piece[3] + 16] = torch.tensor([17, 3]).numpy().tobytes()  # descending ids
    f.write_bytes(bytes(data))
    body = read_manifest(root)  # re-checksummed blocks: the bytes are "valid", their meaning is not
    from torchrec_dtensor_bridge.checkpoint.format.manifest import BlockHasher

    h = BlockHasher(body["block"])
    h.update(bytes(data))
    body["files"][piece[2]] = {"size": len(data), "blocks": h.finish().blocks}
    rewrite_manifest(root, body)
    _refused(tmp_path, tdb.checkpoint.CorruptCheckpointError, "are not ascending rows")


def test_native_and_torch_digests_agree_and_see_every_change():
    g = torch.Generator().manual_seed(0)
    for shape, dtype in [((300, 37), torch.float32), ((64, 3), torch.float32), ((10, 128), torch.bfloat16),
                         ((5, 2, 9), torch.float16), ((9,), torch.float64), ((), torch.float32)]:
        t = torch.randn(shape, generator=g).to(dtype)
        rows = digests._as_rows(t)
        native = digests.row_digests(t)
        if rows.shape[1] > digests.DIGEST_BYTES:
            assert torch.equal(native, digests._torch_digests(rows)), shape
        for r in range(rows.shape[0]):  # one bit of one byte of a row: only its digest changes
            u = t.clone()
            flat = digests._as_rows(u)
            flat[r, (7 * r) % flat.shape[1]] ^= 1
            changed = (digests.row_digests(u) != native)
            changed = changed.any(1) if changed.dim() > 1 else changed
            assert changed.nonzero().flatten().tolist() == [r], (shape, r)


def test_compact_of_a_broken_chain_fails_naming_the_link(tmp_path, capsys):
    import shutil

    from torchrec_dtensor_bridge import cli

    _chain(tmp_path)
    assert cli.main(["compact", str(tmp_path / "l1"), str(tmp_path / "whole")]) == 0
    assert "links" not in tdb.checkpoint.inspect(tmp_path / "whole")["a"]
    shutil.rmtree(committed(tmp_path / "l0"))
    assert cli.main(["compact", str(tmp_path / "l1"), str(tmp_path / "again")]) == 1
    assert "link l0 " in capsys.readouterr().err and not (tmp_path / "again").exists()
    assert cli.main(["inspect", str(tmp_path / "l1")]) == 1
