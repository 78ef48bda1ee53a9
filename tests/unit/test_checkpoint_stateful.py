"""DCP ``Stateful`` values in ``checkpoint.save`` / ``load``, in one process: a module and a ``torch.optim``
optimizer saved and resumed in one call, an optimizer before its first step (over a subclass of
``nn.Parameter`` too), refusals that modify nothing (state no optimizer state can be created to load into)."""

import pytest
import torch

from tests.layout import committed
import torch.distributed.checkpoint as dcp
from torch import nn

import torchrec_dtensor_bridge as tdb


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 1))


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> list[float]:
    losses = []
    for step in steps:
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(step))
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _saved_keys(path) -> list[str]:
    return sorted(dcp.FileSystemReader(str(committed(path))).read_metadata().state_dict_metadata)


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_model_and_optimizer_resume_in_one_call(tmp_path):
    model, opt = _model(0), None
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    _train(model, opt, range(2))
    tdb.checkpoint.save({"model": model, "optim": opt, "meta": {"step": 2}}, tmp_path / "ck")
    want = _train(model, opt, range(2, 4))  # the uninterrupted run

    fresh = _model(1)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.05, weight_decay=0.1)
    assert not fresh_opt.state  # before its first step: no state to load into
    state = {"model": fresh, "optim": fresh_opt, "meta": {"step": 0}}
    tdb.checkpoint.load(state, tmp_path / "ck")
    assert state["meta"]["step"] == 2  # plain values are written back
    assert len(fresh_opt.state) == 4 and all(s["step"] == 2 for s in fresh_opt.state.values())
    assert _train(fresh, fresh_opt, range(2, 4)) == want
    for k, v in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k


def test_optimizer_state_is_keyed_by_parameter_names(tmp_path):
    model = _model(0)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    _train(model, opt, range(1))
    tdb.checkpoint.save({"model": model, "optim": opt}, tmp_path / "named")
    keys = _saved_keys(tmp_path / "named")
    assert "optim.state.0.weight.exp_avg" in keys and "optim.state.2.bias.exp_avg_sq" in keys, keys
    assert "optim.param_groups.0.lr" in keys and "optim.param_groups.0.params" in keys, keys
    # without the module, by position (as Optimizer.state_dict numbers them)
    tdb.checkpoint.save({"optim": opt}, tmp_path / "numbered")
    assert "optim.state.3.exp_avg" in _saved_keys(tmp_path / "numbered")


def test_a_checkpoint_saved_before_the_first_step_leaves_a_fresh_optimizer_fresh(tmp_path):
    model = _model(0)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    tdb.checkpoint.save({"model": model, "optim": opt}, tmp_path / "ck")
    assert not opt.state, "saving created optimizer state"
    fresh = _model(1)
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.3)
    tdb.checkpoint.load({"model": fresh, "optim": fresh_opt}, tmp_path / "ck")
    assert not fresh_opt.state
    assert fresh_opt.param_groups[0]["lr"] == 0.1  # hyper-parameters come from the checkpoint
    assert _train(fresh, fresh_opt, range(2)) == _train(model, opt, range(2))


def test_a_refused_load_modifies_nothing(tmp_path):
    model = _model(0)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    _train(model, opt, range(1))
    tdb.checkpoint.save({"model": model, "optim": opt}, tmp_path / "ck")
    wider = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 1))
    wider_opt = torch.optim.Adam(wider.parameters(), lr=0.1)
    before = _params(wider)
    with pytest.raises(ValueError, match=r"key 'model.0.weight': saved shape \[3, 4\], destination shape \[5, 4\]"):
        tdb.checkpoint.load({"model": wider, "optim": wider_opt}, tmp_path / "ck")
    assert not wider_opt.state, "the state created for the load was left behind"
    for k, v in before.items():
        assert torch.equal(wider.state_dict()[k], v), k
    assert all(p.grad is None for p in wider.parameters())


def _two_groups(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    return torch.optim.Adam([{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 2 * lr}],
                            lr=lr)


def test_parameter_groups_load_by_index_and_another_number_of_them_is_refused_naming_the_key(tmp_path):
    model = _model(0)
    opt = _two_groups(model, 0.1)
    _train(model, opt, range(1))
    tdb.checkpoint.save({"model": model, "optim": opt}, tmp_path / "two")
    fresh = _model(1)
    fresh_opt = _two_groups(fresh, 0.3)
    tdb.checkpoint.load({"model": fresh, "optim": fresh_opt}, tmp_path / "two")
    assert [g["lr"] for g in fresh_opt.param_groups] == [0.1, 0.2]  # each group its own saved values
    assert _train(fresh, fresh_opt, range(1, 3)) == _train(model, opt, range(1, 3))

    one = _model(1)
    one_opt = torch.optim.Adam(one.parameters(), lr=0.3)
    before = _params(one)
    with pytest.raises(ValueError, match=r"key 'optim.param_groups.1.\w+' is only in the checkpoint: the checkpoint "
                                         r"holds 2 parameter groups under 'optim.param_groups', the optimizer has 1"):
        tdb.checkpoint.load({"model": one, "optim": one_opt}, tmp_path / "two")
    assert not one_opt.state and one_opt.param_groups[0]["lr"] == 0.3, "a refused load modified the optimizer"
    assert all(torch.equal(one.state_dict()[k], v) for k, v in before.items())

    tdb.checkpoint.save({"model": one, "optim": torch.optim.Adam(one.parameters())}, tmp_path / "one")
    with pytest.raises(ValueError, match=r"key 'optim.param_groups.1' is only in the destination") as refused:
        tdb.checkpoint.load({"model": fresh, "optim": _two_groups(fresh, 0.3)}, tmp_path / "one")
    # the group's dozen keys are counted in one line, the first few named, every one on the exception
    assert "keys of the state_dict are not in the checkpoint: 'optim.param_groups.1.lr'" in str(refused.value), \
        refused.value
    assert "optim.param_groups.1.lr" in refused.value.missing_keys, refused.value.missing_keys


class _NotAMapping:
    def state_dict(self) -> list[int]:
        return [1, 2]

    def load_state_dict(self, state_dict) -> None:
        raise AssertionError("never called")


def test_a_state_dict_that_is_not_a_mapping_is_a_type_error_naming_the_key(tmp_path):
    with pytest.raises(TypeError, match=r"key 'extra.bad': _NotAMapping.state_dict\(\) returned a list, not a mapping"):
        tdb.checkpoint.save({"w": torch.ones(2), "extra": {"bad": _NotAMapping()}}, tmp_path / "ck")
    assert not (tmp_path / "ck").exists()
    model = _model(0)
    opt = torch.optim.Adam(model.parameters())
    _train(model, opt, range(1))
    tdb.checkpoint.save({"w": torch.ones(2), "optim": opt}, tmp_path / "ck")
    fresh = torch.optim.Adam(model.parameters())
    w = torch.zeros(2)
    with pytest.raises(TypeError, match="key 'extra.bad'"):
        tdb.checkpoint.load({"w": w, "optim": fresh, "extra": {"bad": _NotAMapping()}}, tmp_path / "ck")
    assert torch.equal(w, torch.zeros(2)) and not fresh.state


def test_a_stateful_inside_a_list_is_refused(tmp_path):
    opt = torch.optim.SGD(_model(0).parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"key 'opts': a list holding objects with state_dict\(\)"):
        tdb.checkpoint.save({"opts": [opt]}, tmp_path / "ck")


def test_per_block_row_states_combine_weighted_by_the_blocks_widths():
    """Blocks of 3 and 5 columns (TorchRec cuts evenly; other cuts need not): each row's value is
    (3 * a + 5 * b) / 8, the mean over all 8 columns; the destination is put back in the view."""
    from torch.distributed.checkpoint.metadata import Metadata, TensorProperties, TensorStorageMetadata

    from torchrec_dtensor_bridge.checkpoint.keyed import RowConversion, combine_row_states
    from torchrec_dtensor_bridge.checkpoint.stateful import Expanded

    rows = 6
    dest = torch.full((rows,), -1.0)
    holder = {"s": dest}
    ex = Expanded(view={"opt": holder}, row_states={"opt.s": (holder, "s")})
    md = Metadata(state_dict_metadata={"opt.s": TensorStorageMetadata(
        TensorProperties(dtype=torch.float32), torch.Size([2 * rows]), [])})
    combine, undo = combine_row_states(ex.row_states, {"opt.s": RowConversion((3, 5), 1)}, md)
    buf = holder["s"]
    assert buf is not dest and buf.shape == (2 * rows,)
    a, b = torch.arange(rows, dtype=torch.float32), torch.arange(rows, dtype=torch.float32) * 10 + 1
    buf.copy_(torch.cat([a, b]))  # what the load reads: block 0's rows, then block 1's
    combine()
    assert holder["s"] is dest
    assert torch.equal(dest, ((3 * a.double() + 5 * b.double()) / 8).float()), dest
    combine2, undo2 = combine_row_states(ex.row_states, {"opt.s": RowConversion((3, 5), 1)}, md)
    undo2()
    assert holder["s"] is dest  # a failed load puts the destination back untouched


def test_a_save_walks_the_state_dict_once(tmp_path, monkeypatch):
    """Every step of a save (the default group, the signature the ranks agree on, the row records, the objects'
    summary) reads one list of the state_dict's leaves: the walk over them runs once a save, full or
    incremental (DCP's own walk inside ``dcp.save`` aside)."""
    import sys

    from torchrec_dtensor_bridge.checkpoint import common

    walks = []
    original = common.leaves

    def counted(sd, prefix=""):
        if prefix == "":
            walks.append(1)
        return original(sd, prefix)

    for name, module in list(sys.modules.items()):
        if name.startswith("torchrec_dtensor_bridge.checkpoint") and getattr(module, "leaves", None) is original:
            monkeypatch.setattr(module, "leaves", counted)
    model = _model(0)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    _train(model, opt, range(2))
    state = {"model": model, "optim": opt, "meta": {"step": 2, "note": "x"}, "t": torch.arange(12.0).view(4, 3)}
    tdb.checkpoint.save(state, tmp_path / "full")
    assert len(walks) == 1
    state["t"][1] += 1
    tdb.checkpoint.save(state, tmp_path / "link", base=tmp_path / "full")
    assert len(walks) == 2
    dest = {"model": _model(1), "optim": None, "meta": {"step": 0, "note": ""}, "t": torch.zeros(4, 3)}
    dest["optim"] = torch.optim.Adam(dest["model"].parameters(), lr=0.1)
    tdb.checkpoint.load(dest, tmp_path / "link")
    assert torch.equal(dest["t"], state["t"]) and dest["meta"] == {"step": 2, "note": "x"}
    assert tdb.checkpoint.inspect(tmp_path / "link")["meta.note"]["value"] == "'x'"


class _Slice(nn.Parameter):
    """A subclass of ``nn.Parameter`` over plain memory, as TorchRec hands a data-parallel table (its
    ``TableBatchedEmbeddingSlice``) to the dense optimizer."""


class _Tagged(torch.Tensor):
    """A tensor subclass that is no Parameter: no optimizer state can be created for it."""


def _trained_adam(param: torch.Tensor) -> torch.optim.Adam:
    opt = torch.optim.Adam([param], lr=0.1)
    for step in range(2):
        param.grad = torch.randn(param.shape, generator=torch.Generator().manual_seed(step))
        opt.step()
    return opt


def test_the_state_of_a_parameter_subclass_loads(tmp_path):
    """Before: state was created for no parameter of an optimizer holding one such subclass, so the load
    restored nothing and said nothing."""
    plain = nn.Parameter(torch.ones(4, 3))
    param = _Slice(torch.ones(4, 3))
    opt = torch.optim.Adam([plain, param], lr=0.1)
    for step in range(2):
        plain.grad = param.grad = torch.randn(4, 3, generator=torch.Generator().manual_seed(step))
        opt.step()
    tdb.checkpoint.save({"optim": opt}, tmp_path / "ck")
    fresh_plain, fresh = nn.Parameter(torch.zeros(4, 3)), _Slice(torch.zeros(4, 3))
    fresh_opt = torch.optim.Adam([fresh_plain, fresh], lr=0.1)
    tdb.checkpoint.load({"optim": fresh_opt}, tmp_path / "ck")
    assert type(fresh) is _Slice and fresh.grad is None and torch.equal(fresh, torch.zeros(4, 3))
    for mine, theirs in ((fresh_plain, plain), (fresh, param)):
        assert sorted(fresh_opt.state[mine]) == sorted(opt.state[theirs])
        for k, v in opt.state[theirs].items():
            assert torch.equal(fresh_opt.state[mine][k], v), k


def test_state_that_nothing_could_load_into_is_refused_naming_it(tmp_path):
    opt = _trained_adam(torch.ones(4, 3).as_subclass(_Tagged).requires_grad_())
    tdb.checkpoint.save({"optim": opt}, tmp_path / "ck")
    fresh = torch.zeros(4, 3).as_subclass(_Tagged).requires_grad_()
    fresh_opt = torch.optim.Adam([fresh], lr=0.3)
    with pytest.raises(TypeError, match=r"key 'optim.state.0': the checkpoint holds this optimizer state.*_Tagged"):
        tdb.checkpoint.load({"optim": fresh_opt}, tmp_path / "ck")
    assert not fresh_opt.state and fresh_opt.param_groups[0]["lr"] == 0.3  # nothing modified
    tdb.checkpoint.save({"optim": torch.optim.Adam([fresh], lr=0.3)}, tmp_path / "fresh")
    tdb.checkpoint.load({"optim": fresh_opt}, tmp_path / "fresh")  # a checkpoint without such state: loads
