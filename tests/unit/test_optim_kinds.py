"""The optimizer kinds' registry (optim_kinds.py): the built-in records, what the registry refuses, and a kind
no kernel lists taking the torch-op math (the kernels' choice and the op both say so)."""

from __future__ import annotations

import pytest
import torch

from torchrec_dtensor_bridge import kernels, optim_kinds
from torchrec_dtensor_bridge.optim import update
from torchrec_dtensor_bridge.optim_kinds import OptimKind, StateKind, StateSpec, WeightDecayMode


def test_the_built_in_kinds():
    assert optim_kinds.names() == ["sgd", "rowwise_adagrad", "adagrad", "adam"]
    assert list(OptimKind) == [optim_kinds.SGD, optim_kinds.ROWWISE_ADAGRAD, optim_kinds.ADAGRAD, optim_kinds.ADAM]
    rowwise, adam = optim_kinds.lookup("rowwise_adagrad"), optim_kinds.lookup("adam")
    assert rowwise.row_wise and not rowwise.per_element and not rowwise.counts_steps
    assert [(s.name, s.shape) for s in rowwise.states] == [("momentum1", StateKind.ROW)]
    assert adam.counts_steps and adam.per_element and not adam.row_wise
    assert [s.name for s in adam.tensor_states] == ["momentum1", "momentum2"]
    assert [k.name for k in OptimKind if k.torchrec_mapped] == ["sgd", "rowwise_adagrad", "adagrad"]
    assert rowwise.emb_optim_type == "EXACT_ROWWISE_ADAGRAD" and rowwise.fbgemm == "rowwise_adagrad"
    assert [k.name for k in OptimKind if k.fbgemm_cpu] == ["sgd", "rowwise_adagrad", "adagrad"]
    assert adam.decay_modes == (WeightDecayMode.DECOUPLED,) and adam.default("beta2") == 0.999
    assert optim_kinds.lookup(adam) is adam


def test_the_registry_refuses_what_it_does_not_know():
    with pytest.raises(ValueError, match=r"unknown optimizer kind 'lamb'; expected one of \['sgd'"):
        optim_kinds.lookup("lamb")
    with pytest.raises(ValueError, match="registered already"):
        optim_kinds.register(OptimKind("sgd"))
    with pytest.raises(ValueError, match="built in"):
        optim_kinds.unregister("adam")
    with pytest.raises(ValueError, match="not registered"):
        optim_kinds.unregister("lamb")
    with pytest.raises(ValueError, match="native code 0 is 'sgd'"):
        optim_kinds.register(OptimKind("other", native=0))
    with pytest.raises(ValueError, match="hyper-parameters"):
        OptimKind("bad", hyper=(("momentum", 0.9),))
    with pytest.raises(ValueError, match="one per-row state"):
        OptimKind("bad", states=(StateSpec("a", StateKind.ROW), StateSpec("b", StateKind.ROW)))
    with pytest.raises(ValueError, match="fbgemm's kernels need its name"):
        OptimKind("bad", fbgemm_cpu=True)
    with pytest.raises(ValueError, match="unknown optimizer kind"):  # a record equal to none registered
        optim_kinds.lookup(OptimKind("sgd", native=7))


def test_a_kind_no_kernel_lists_takes_the_torch_math(monkeypatch):
    """A registered kind without kernels: the choice is torch's on every device (also when a kernel is forced,
    also after an agreement), the op refuses it, and without its math an optimizer cannot use it."""
    toy = optim_kinds.register(OptimKind("toy", states=(StateSpec("momentum1", StateKind.ELEMENT),)))
    try:
        cpu = torch.device("cpu")
        for forced in ("auto", "native", "fbgemm"):
            monkeypatch.setenv("TDB_KERNELS", forced)
            assert kernels.update_impl(cpu, "toy", 0.0) is kernels.Impl.TORCH, forced
            assert kernels.update_impl(torch.device("cuda"), toy, 0.0) is kernels.Impl.TORCH, forced
        try:
            kernels.settle(cpu, [kernels.choice_code(cpu)] * 2)
            assert kernels.update_impl(cpu, toy, 0.0) is kernels.Impl.TORCH
        finally:
            kernels.choose._agreed.clear()
        flat, m1 = torch.zeros(12), torch.zeros(12)
        ids, offsets = torch.tensor([0, 2]), torch.tensor([0, 2])
        with pytest.raises(ValueError, match="no one-pass kernel for kind 'toy'"):
            torch.ops.tdb.sparse_update(flat, [0], [4], [3], torch.ones(1, 4), ids, offsets, None, "toy", m1, [0],
                                        None, [], 0.1, 1e-8, 0.0, 0, 0.9, 0.999, 1)
        with pytest.raises(NotImplementedError, match="'toy' has no update math"):
            update.check_math(toy)
        with pytest.raises(ValueError, match="keeps no per-row state"):
            update.rowwise_math(toy)(lambda *args: None)
    finally:
        optim_kinds.unregister(toy)
    with pytest.raises(ValueError, match="kind must be one of"):
        torch.ops.tdb.sparse_update(torch.zeros(12), [0], [4], [3], torch.ones(1, 4), torch.tensor([0]),
                                    torch.tensor([0, 1]), None, "toy", None, [], None, [], 0.1, 1e-8, 0.0, 0, 0.9,
                                    0.999, 1)
