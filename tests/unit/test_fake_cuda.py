"""The kernel ops on CUDA tables, checked without a GPU: fake ``cuda:0`` tensors (``FakeTensorMode``), in one
subprocess (an autograd graph over fake CUDA tensors aborts the process; everything runs under ``no_grad``).

The CPU build of fbgemm_gpu registers its lookup functions for CUDA but has nothing to run under them, so
the subprocess (:func:`main`)

* pretends fbgemm's CUDA build is installed (:func:`..kernels.fbgemm.cuda_available`), so that
  :mod:`..kernels.choose` picks fbgemm's kernels for CUDA tensors, as it would on a GPU;
* sends every ``tdb`` op to its CUDA implementation (under ``FakeTensorMode`` an op's fake would stand in
  for it) and records every ``fbgemm`` op those call, with its arguments and the values of the small
  tensors built for it (they are made from Python values, which the recording mode sees);
* runs fbgemm's own lookup functions (their C++ forward unpacks our argument lists) down to their forward
  kernels, whose fakes here check the devices, dtypes and shapes they receive, refuse what fbgemm's own
  checks refuse (``max_D`` past 2048, ``total_D`` not a positive multiple of 4: its meta kernels'
  ``TORCH_SYM_CHECK``s; more than int32's ids or bag boundaries: its 32-bit accessors) and need the ids,
  bag boundaries and per-sample weights contiguous (its kernels read their ``data_ptr``); the backward that
  applies a fused update or gives the dense gradient cannot run over fake tensors: its call is recorded
  instead (:func:`..kernels.fbgemm.run_backward`);
* counts the id-range checks instead of running them: they read values
  (:func:`..kernels.ops.check_ids_on_device`).

For every layout one rank can hold (its blocks in storages of their own, or all in one storage, as
TorchRec's fused buffer) and for tables of different shapes sharing one storage, every op: the argument
lists fbgemm's CUDA functions receive (the weights as 5 tensors, optimizer state as 4, the tables'
element offsets, placements ``DEVICE``, dtypes), and that no CPU tensor reaches them but the learning
rate (a CPU scalar by fbgemm's design). Tables whose rows fbgemm's kernels cannot read (dims not a
multiple of 4) take torch's ops; a fused update with weight decay is refused. The limits of fbgemm's CUDA
kernels one by one, and the ids check the kernel calls of a lookup skip: ``test_fake_cuda_limits.py``.

The fake-CUDA modules (this one, ``test_fake_cuda_{copies,host_reads,limits,module}.py``) each give their checks
by name (``checks()``); the checks of every such module a pytest session runs run in one subprocess
(:func:`subprocess_results`, from the session fixture ``fake_cuda_results`` of ``conftest.py``), each module's
in a fake-CUDA run of its own (:func:`_fake_cuda`: its recorder, its kernel choices, what it patches restored
after it).
"""

from __future__ import annotations

import functools
import importlib
import itertools
import json
import os
import subprocess
import sys
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from torchrec_dtensor_bridge.kernels import fbgemm
from torchrec_dtensor_bridge.layout import ShardLayout

pytestmark = pytest.mark.skipif(not fbgemm.available(), reason="needs fbgemm_gpu")

DEV = "cuda:0"
SHAPE = (24, 16)
LAYOUTS = {
    "row_blocks": ShardLayout.row_wise(SHAPE, [7, 10, 7], ranks=[0, 0, 0]),
    "column_blocks": ShardLayout.column_wise(SHAPE, [4, 12], ranks=[0, 0]),
    "grid": ShardLayout.grid(SHAPE, [11, 13], [8, 8], [0, 0, 0, 0]),
    "whole": ShardLayout.table_wise(SHAPE, 0),
}
SHARED = [(30, 8), (12, 4), (50, 16)]  # tables of different shapes in one storage
KINDS = ("sgd", "rowwise_adagrad", "adagrad", "adam")
GAP = 4  # elements between tables in one storage: fbgemm's kernels read rows at multiples of 4
BAGS = 5
MARK = "FAKE-CUDA-RESULTS:"


@dataclass
class Tables:
    """One kernel call's tables: the storage, each table's element offset, columns and rows."""

    storage: torch.Tensor
    at: list[int]
    dims: list[int]
    rows: list[int]


def _arrangements(name: str) -> list[tuple[str, list[tuple[int, int]]]]:
    """(arrangement, the shapes of the tables of each call) for a case."""
    if name == "shared_storage":
        return [("one_storage", SHARED)]
    shapes = [(s.sizes[0], s.sizes[1]) for s in LAYOUTS[name].shards_on(0)]
    calls = [("own_storage", [shape]) for shape in shapes]
    return calls + ([("one_storage", shapes)] if len(shapes) > 1 else [])


CASES = [f"{name}-{arr}" for name in [*LAYOUTS, "shared_storage"]
         for arr in sorted({a for a, _ in _arrangements(name)})]


# --- the subprocess ------------------------------------------------------------------------------------------

@dataclass
class Call:
    """One fbgemm op the CUDA implementations called: its name and arguments by name."""

    op: str
    args: dict[str, Any]


@dataclass
class Recorder:
    calls: list[Call] = field(default_factory=list)
    backward: list[str] = field(default_factory=list)  # the ops whose backward would have run
    values: dict[int, list[float]] = field(default_factory=dict)  # id(fake tensor) -> its values, when known
    keep: list[torch.Tensor] = field(default_factory=list)  # keeps the tensors of ``values`` alive (ids)
    kernel_args: list[dict[str, Any]] = field(default_factory=list)  # what fbgemm's forward kernels received
    id_checks: list[str] = field(default_factory=list)  # the ops whose id-range check ran (on the device)

    def value(self, t: torch.Tensor) -> list[float]:
        assert id(t) in self.values, f"no known values for {t.dtype} {tuple(t.shape)} on {t.device}"
        return self.values[id(t)]


def _tensors(x: Any) -> Iterator[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)


def _recording_mode(rec: Recorder) -> Any:
    from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

    cuda_key = torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA)
    autograd_cuda = torch._C.DispatchKeySet(torch._C.DispatchKey.AutogradCUDA)
    aten = torch.ops.aten
    same_values = {aten._to_copy.default, aten.to.dtype_layout, aten.to.device, aten.to.dtype, aten.detach.default,
                   aten.detach_.default, aten.alias.default, aten.clone.default}

    class FakeCuda(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            kwargs = kwargs or {}
            if func.namespace == "tdb":  # its CUDA implementation, not its fake
                with self:
                    return func.redispatch(cuda_key, *args, **kwargs)
            if func.namespace == "fbgemm":
                names = [a.name for a in func._schema.arguments]
                name = func._schema.name.split("::")[1]
                rec.calls.append(Call(name, {**dict(zip(names, args)), **kwargs}))
                if name.startswith("split_embedding_backward_codegen_"):
                    return _backward_fake(rec, name, {**dict(zip(names, args)), **kwargs})
                if name.endswith("_function_pt2"):
                    # fbgemm's lookup function itself (C++, one kernel for its CUDA, Meta and Autograd keys), as
                    # on a GPU: over tensors on their device (a meta kernel sees them on "meta"), under no_grad
                    assert not torch.is_grad_enabled(), "an autograd graph over fake CUDA tensors aborts"
                    return func.redispatch(autograd_cuda, *args, **kwargs)
            out = func(*args, **kwargs)
            if func is torch.ops.aten.lift_fresh.default:  # torch.tensor(values): the values, real, on CPU
                with _disable_current_modes():
                    rec.values[id(out)] = args[0].tolist()
                rec.keep.append(out)
            elif func in same_values and args and id(args[0]) in rec.values:  # copies, moves, detached aliases
                rec.values[id(out)] = rec.values[id(args[0])]
                rec.keep.append(out)
            elif func is torch.ops.aten.full.default:
                rec.values[id(out)] = [args[1]] * out.numel()
                rec.keep.append(out)
            return out

    return FakeCuda()


INT32_MAX = 2**31 - 1


def fbgemm_refuses(total_D: int, max_D: int, indices: torch.Tensor, offsets: torch.Tensor,
                   indice_weights: torch.Tensor | None) -> None:
    """What fbgemm_gpu 1.8's CUDA forward and backward refuse, as they check it (written here from its
    sources, not from this package's): its meta kernels' ``TORCH_SYM_CHECK(total_D.sym_gt(0))``,
    ``TORCH_SYM_CHECK((total_D % 4).sym_eq(0))``, ``TORCH_SYM_CHECK(max_D.sym_le(2048))``; its 32-bit
    accessors' "numel needs to be smaller than int32_t max" (``PTA_B(indices, index_t, 1, 32)``, offsets
    alike); its kernels read the ids, boundaries and per-sample weights through ``data_ptr`` (flat)."""
    assert total_D > 0 and total_D % 4 == 0, f"fbgemm refuses total_D = {total_D}"
    assert max_D <= 2048, f"fbgemm refuses max_D = {max_D}"
    assert indices.numel() <= INT32_MAX and offsets.numel() <= INT32_MAX, "fbgemm's 32-bit accessors refuse"
    assert indices.dtype == offsets.dtype and indices.dtype in (torch.int32, torch.int64), "index dtypes"
    flat = {"indices": indices, "offsets": offsets, "indice_weights": indice_weights}
    strided = [k for k, v in flat.items() if v is not None and not v.is_contiguous()]
    assert not strided, f"fbgemm reads {strided} as flat arrays: given strided"


_RECORDING: list[Recorder] = []
"""The recorder of the fake-CUDA run in progress (:func:`_fake_cuda`): the kernel fakes, registered once per
process, record into it."""


def _register_kernel_fakes() -> None:
    """Fakes for fbgemm's forward kernels (and its dense lookup function), which the CPU build has none of:
    each records what it got into the current run's recorder, checks that its tensors are on the device and
    refuses what fbgemm refuses (:func:`fbgemm_refuses`). A fake is registered once per operator and process
    (a second registration raises), so a later run's recorder is looked up at each call."""

    def forward(host_weights, dev_weights, uvm_weights, lxu_cache_weights, weights_placements, weights_offsets,
                D_offsets, total_D, max_D, hash_size_cumsum, indices, offsets, pooling_mode, indice_weights,
                lxu_cache_locations, uvm_cache_stats, is_experimental, output_dtype):  # type: ignore[no-untyped-def]
        got = dict(locals())
        _RECORDING[-1].kernel_args.append(got)
        assert host_weights is None or host_weights.numel() == 0, "host weights given to a CUDA table"
        assert dev_weights.numel() > 0, "no device weights"
        on = {k: str(v.device) for k, v in got.items() if isinstance(v, torch.Tensor)}
        assert set(on.values()) == {DEV}, f"fbgemm's forward kernel got tensors off {DEV}: {on}"
        fbgemm_refuses(total_D, max_D, indices, offsets, indice_weights)
        tables = weights_offsets.numel()
        # the output's dtype is output_dtype's (fbgemm's SparseType: FP32 0, FP16 1, BF16 5), not the weights'
        dtype = {0: torch.float32, 1: torch.float16, 5: torch.bfloat16}[output_dtype]
        return dev_weights.new_empty((offsets.numel() - 1) // tables, total_D, dtype=dtype)

    for weighted in ("unweighted", "weighted"):
        torch.library.register_fake(f"fbgemm::split_embedding_codegen_forward_{weighted}_pt2_wrapper")(forward)

    @torch.library.register_fake("fbgemm::dense_embedding_codegen_lookup_function")
    def _(dev_weights, weights_offsets, D_offsets, total_D, max_D, hash_size_cumsum, total_hash_size_bits, indices,
          offsets, pooling_mode, indice_weights, feature_requires_grad, output_dtype=0, B_offsets=None,
          vbe_output_offsets_feature_rank=None, vbe_B_offsets_rank_per_feature=None, max_B=-1,
          max_B_feature_rank=-1, vbe_output_size=-1, mixed_D=True):  # type: ignore[no-untyped-def]
        got = {k: v for k, v in locals().items() if isinstance(v, torch.Tensor)}
        on = {k: str(v.device) for k, v in got.items()}
        assert set(on.values()) == {DEV}, f"fbgemm's dense lookup got tensors off {DEV}: {on}"
        fbgemm_refuses(total_D, max_D, indices, offsets, indice_weights)
        return dev_weights.new_empty((offsets.numel() - 1) // weights_offsets.numel(), total_D)


def _backward_fake(rec: Recorder, name: str, a: dict[str, Any]) -> torch.Tensor:
    """fbgemm's backward ops (a fused update, the dense gradient), which cannot run over fake tensors: the call
    recorded, its tensors checked to be on the device (the learning rate aside: a CPU scalar by fbgemm's
    design) and what fbgemm refuses refused; the dense gradient's shape returned."""
    rec.backward.append(name)
    on = {k: str(v.device) for k, v in a.items() if isinstance(v, torch.Tensor) and k != "learning_rate_tensor"}
    assert set(on.values()) == {DEV}, f"{name} got tensors off {DEV}: {on}"
    width = rec.value(a["D_offsets"])[-1] if id(a["D_offsets"]) in rec.values else 4
    fbgemm_refuses(width, a["max_D"], a["indices"], a["offsets"], a.get("indice_weights"))
    if "_dense_" in name:
        return a["dev_weights"].new_empty(a["dev_weights"].shape)
    return a["grad_output"].new_empty(0)


_COMMON = ("Tensor grad_output, Tensor(a!) host_weights, Tensor(b!) dev_weights, Tensor(c!) uvm_weights, "
           "Tensor(d!) lxu_cache_weights, Tensor weights_placements, Tensor weights_offsets, Tensor D_offsets, "
           "SymInt max_D, bool mixed_D, Tensor hash_size_cumsum, int total_hash_size_bits, Tensor indices, "
           "Tensor offsets, int pooling_mode, Tensor indice_weights, Tensor lxu_cache_locations, int BT_block_size, "
           "int max_segment_length_per_warp, bool stochastic_rounding, int info_B_num_bits, int info_B_mask_int64, "
           "bool use_uniq_cache_locations, bool use_homogeneous_placements, ")
CUDA_ONLY_OPS = {
    # fbgemm_gpu 1.8's CUDA build defines these; its CPU build does not (schemas from its codegen templates:
    # embedding_backward_split_template.cu for the dense backward, embedding_split_host_pt2_cuda_wrapper_template
    # .cpp with optimizers.py's adam() arguments for Adam's backward)
    **{f"split_embedding_backward_codegen_dense_{w}_exact_cuda":
       "Tensor grad_output, Tensor(a!) dev_weights, Tensor weights_offsets, Tensor D_offsets, SymInt max_D, "
       "bool mixed_D, Tensor hash_size_cumsum, int total_hash_size_bits, Tensor indices, Tensor offsets, "
       f"int pooling_mode, {'Tensor indice_weights, ' if w == 'weighted' else ''}int unused_, "
       "int max_segment_length_per_warp, float unused=0"
       for w in ("unweighted", "weighted")},
    # (the optional row_counter state comes after the learning rate, as Tensors: optimizer_args.py's reorder_args
    # puts tensors before the arguments with defaults; fbgemm's autograd passes them in that order)
    **{f"split_embedding_backward_codegen_adam_{w}_pt2_wrapper":
       _COMMON + "Tensor(g!) momentum1_host, Tensor(h!) momentum1_dev, Tensor(i!) momentum1_uvm, "
       "Tensor momentum1_placements, Tensor momentum1_offsets, Tensor(j!) momentum2_host, Tensor(k!) momentum2_dev, "
       "Tensor(l!) momentum2_uvm, Tensor momentum2_placements, Tensor momentum2_offsets, Tensor learning_rate_tensor, "
       "Tensor(p!) row_counter_host, Tensor(q!) row_counter_dev, Tensor(r!) row_counter_uvm, "
       "Tensor row_counter_placements, Tensor row_counter_offsets, float eps=0, float beta1=0, float beta2=0, "
       "float weight_decay=0, int iter=0, bool use_rowwise_bias_correction=False, int output_dtype=0"
       for w in ("unweighted", "weighted")},
}
_LIBRARIES: list[Any] = []


def _define_cuda_only_ops() -> None:
    lib = torch.library.Library("fbgemm", "FRAGMENT")  # noqa: TOR901 - a test process's own definitions
    _LIBRARIES.append(lib)
    for name, schema in CUDA_ONLY_OPS.items():
        if not hasattr(torch.ops.fbgemm, name):
            lib.define(f"{name}({schema}) -> Tensor")


def _clear_tensor_caches() -> None:
    """The tensors :mod:`..kernels.fbgemm` built and keeps per device (and learning rate) forgotten."""
    for cached in (fbgemm._table_args, fbgemm._constant, fbgemm._unused, fbgemm._learning_rate):
        cached.cache_clear()


@functools.cache
def _register_once() -> None:
    """The CUDA-only ops and the kernel fakes, once per process (a fake registered twice raises)."""
    _define_cuda_only_ops()
    _register_kernel_fakes()


@contextmanager
def _fake_cuda(rec: Recorder) -> Iterator[None]:
    """One fake-CUDA run recording into ``rec``; what it patches is restored after it, and the kernel choices it
    settles and the tensors :mod:`..kernels.fbgemm` caches per device are its own: so that the runs of several
    modules in one process do not see each other's (a cached fake tensor of another run's ``FakeTensorMode``
    fails: "Mixing fake modes"; its values are not in this run's recorder)."""
    from torch._subclasses import fake_tensor

    from torchrec_dtensor_bridge.kernels import choose, ops

    def check_ids_on_device(op: str, *args: Any) -> None:  # it reads values: fake tensors have none
        rec.id_checks.append(op)

    saved = (fake_tensor.CONSTANT_NUMEL_LIMIT, fbgemm.cuda_available, ops.check_ids_on_device, choose._agreed,
             choose._settled)
    # a one-element torch.tensor(...) would be kept as a real constant, on a device this torch has none of
    fake_tensor.CONSTANT_NUMEL_LIMIT = 0
    fbgemm.cuda_available = lambda: True  # what fbgemm's CUDA build answers
    ops.check_ids_on_device = check_ids_on_device
    choose._agreed, choose._settled = {}, {}
    _clear_tensor_caches()
    for tables in range(1, 5):  # fbgemm's bit split for T tables: its meta kernel (under fake tensors) has none
        fbgemm._infos(tables)
    _register_once()
    _RECORDING.append(rec)
    try:
        with fake_tensor.FakeTensorMode(), torch.no_grad(), _recording_mode(rec):
            yield
    finally:
        _RECORDING.pop()
        _clear_tensor_caches()
        (fake_tensor.CONSTANT_NUMEL_LIMIT, fbgemm.cuda_available, ops.check_ids_on_device, choose._agreed,
         choose._settled) = saved


def _place(shapes: list[tuple[int, int]], gap: int = GAP) -> tuple[int, list[int]]:
    """A storage's size and each table's element offset in it, tables back to back with gaps."""
    at, offs = gap, []
    for r, d in shapes:
        offs.append(at)
        at += r * d + gap
    return at, offs


def _batch(rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.empty(3 * BAGS * len(rows), dtype=torch.int64, device=DEV)
    offsets = torch.empty(BAGS * len(rows) + 1, dtype=torch.int64, device=DEV)
    return ids, offsets


def _check_lookup(rec: Recorder, call: Call, t: Tables, *, kind: str, psw: torch.Tensor | None, ids: torch.Tensor,
                  offsets: torch.Tensor, states: list[tuple[torch.Tensor, list[int]]], step: int = 0) -> None:
    a, n = call.args, len(t.dims)
    assert call.op == f"split_embedding_codegen_lookup_{kind}_function_pt2", call.op
    w = a["weights"]
    assert len(w) == 5, f"weights list of {len(w)}: the CUDA form is [dev, uvm, placements, offsets, lxu_cache]"
    assert w[0] is t.storage, "the weights are not the caller's storage"
    assert w[1].dtype == torch.float32 and w[1].numel() == 0, "uvm"
    assert w[2].dtype == torch.int32 and rec.value(w[2]) == [fbgemm.DEVICE] * n, "placements: DEVICE"
    assert w[3].dtype == torch.int64 and rec.value(w[3]) == t.at, f"weights offsets {rec.value(w[3])} != {t.at}"
    assert w[4].dtype == torch.float32 and tuple(w[4].shape) == (0, 0), "lxu_cache"
    assert a["D_offsets"].dtype == torch.int32
    assert rec.value(a["D_offsets"]) == list(itertools.accumulate(t.dims, initial=0))
    assert a["hash_size_cumsum"].dtype == torch.int64
    assert rec.value(a["hash_size_cumsum"]) == list(itertools.accumulate(t.rows, initial=0))
    assert (a["total_D"], a["max_D"]) == (sum(t.dims), max(t.dims))
    assert a["total_hash_size_bits"] == max(sum(t.rows).bit_length(), 1)
    given(a["indices"], ids)
    given(a["offsets"], offsets)
    given(a["indice_weights"], psw)
    assert a["pooling_mode"] == 0 and a["output_dtype"] == 0
    assert a["aux_tensor"][3].dtype == torch.int32 and a["aux_tensor"][3].numel() == 0, "lxu_cache_locations"
    assert a["aux_int"][0] == step, f"iter {a['aux_int'][0]} != step {step}"
    lr = a["learning_rate_tensor"]
    assert lr.device.type == "cpu" and lr.dim() == 0 and lr.dtype == torch.float32, "learning_rate_tensor"
    for name, (state, at) in zip(("momentum1", "momentum2"), states):
        m = a[name]
        assert len(m) == 4, f"{name} list of {len(m)}: the CUDA form is [dev, uvm, placements, offsets]"
        assert m[0] is state and m[1].numel() == 0
        assert m[2].dtype == torch.int32 and rec.value(m[2]) == [fbgemm.DEVICE] * n
        assert m[3].dtype == torch.int64 and rec.value(m[3]) == at, f"{name} offsets {rec.value(m[3])} != {at}"
    assert ("momentum1" in a) == (kind != "sgd") and ("momentum2" in a) == (kind == "adam")
    _no_cpu_tensor(call)


def _check_backward(rec: Recorder, call: Call, t: Tables, *, kind: str, ids: torch.Tensor, offsets: torch.Tensor,
                    states: list[tuple[torch.Tensor, list[int]]], step: int) -> None:
    """A fused update's one call: fbgemm's backward op with the CUDA form of every argument."""
    a, n = call.args, len(t.dims)
    assert call.op == f"split_embedding_backward_codegen_{kind}_unweighted_pt2_wrapper", call.op
    assert a["dev_weights"] is t.storage, "the weights are not the caller's storage"
    for name in ("host_weights", "uvm_weights", "indice_weights"):
        assert a[name].dtype == torch.float32 and a[name].numel() == 0, name
    assert tuple(a["lxu_cache_weights"].shape) == (0, 0) and a["lxu_cache_locations"].dtype == torch.int32
    assert a["weights_placements"].dtype == torch.int32 and rec.value(a["weights_placements"]) == [fbgemm.DEVICE] * n
    assert rec.value(a["weights_offsets"]) == t.at
    assert rec.value(a["D_offsets"]) == list(itertools.accumulate(t.dims, initial=0))
    assert rec.value(a["hash_size_cumsum"]) == list(itertools.accumulate(t.rows, initial=0))
    assert a["max_D"] == max(t.dims) and a["mixed_D"] is (kind != "rowwise_adagrad" or len(set(t.dims)) > 1)
    assert a["total_hash_size_bits"] == max(sum(t.rows).bit_length(), 1)
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():  # fbgemm's own answer, on CPU (its meta kernel has none)
        bits, mask = (int(x) for x in torch.ops.fbgemm.get_infos_metadata(torch.empty(0), 1, n))
    assert (a["info_B_num_bits"], a["info_B_mask_int64"]) == (bits, mask)
    assert (a["BT_block_size"], a["max_segment_length_per_warp"]) == (32, 32), "fbgemm's NVIDIA constants"
    assert a["stochastic_rounding"] is True and a["pooling_mode"] == 0
    given(a["indices"], ids)
    given(a["offsets"], offsets)
    lr = a["learning_rate_tensor"]
    assert lr.device.type == "cpu" and lr.dim() == 0 and lr.dtype == torch.float32, "learning_rate_tensor"
    for name, (state, at) in zip(("momentum1", "momentum2"), states):
        assert a[f"{name}_dev"] is state and a[f"{name}_host"].numel() == 0 and a[f"{name}_uvm"].numel() == 0
        assert rec.value(a[f"{name}_placements"]) == [fbgemm.DEVICE] * n
        assert rec.value(a[f"{name}_offsets"]) == at, f"{name} offsets {rec.value(a[f'{name}_offsets'])} != {at}"
    assert ("momentum1_dev" in a) == (kind != "sgd") and ("momentum2_dev" in a) == (kind == "adam")
    if kind == "adam":
        assert a["iter"] == step, f"iter {a['iter']} != step {step}"


def given(got: torch.Tensor | None, passed: torch.Tensor | None) -> None:
    """What reached fbgemm for a tensor of the batch: the caller's own when contiguous, else a contiguous copy
    of its shape."""
    if passed is None or passed.is_contiguous():
        assert got is passed, "not the caller's tensor"
    else:
        assert got is not None and got.is_contiguous() and got.shape == passed.shape, "not a contiguous copy"


def _no_cpu_tensor(call: Call) -> None:
    off = [(k, str(x.device)) for k, v in call.args.items() if k != "learning_rate_tensor" for x in _tensors(v)
           if str(x.device) != DEV]
    assert not off, f"{call.op}: tensors off {DEV}: {off}"


def one_call(rec: Recorder, run: Callable[[], object], *, backward: bool = False) -> Call:
    """The one fbgemm call ``run`` makes: its lookup function (pooling; its forward kernel run) or, with
    ``backward``, its backward op alone (a fused update, the dense gradient: no forward kernel)."""
    before, kernels, back = len(rec.calls), len(rec.kernel_args), len(rec.backward)
    run()
    calls = [c for c in rec.calls[before:] if "function" in c.op or c.op.startswith("split_embedding_backward_")]
    assert len(calls) == 1, f"expected one fbgemm lookup or backward call, got {[c.op for c in calls]}"
    assert len(rec.backward) - back == int(backward), "backward (update / dense gradient) not run as expected"
    assert len(rec.kernel_args) - kernels == int(not backward), "fbgemm's forward kernel ran (or did not) "
    for c in rec.calls[before:]:  # every fbgemm op (get_infos_metadata reads no tensor: its CPU one is unused)
        if c.op != "get_infos_metadata":
            _no_cpu_tensor(c)
    return calls[0]


def _check_tables(rec: Recorder, t: Tables) -> None:
    """Every op of the kernel layer over the tables ``t`` (one storage)."""
    ids, offsets = _batch(t.rows)
    n, width = ids.numel(), sum(t.dims)
    for psw in (None, torch.empty(n, device=DEV)):
        call = one_call(rec, lambda: torch.ops.tdb.pool_sum(t.storage, t.at, t.dims, t.rows, ids, offsets, psw))
        _check_lookup(rec, call, t, kind="sgd", psw=psw, ids=ids, offsets=offsets, states=[])
    grad = torch.empty(BAGS, width, device=DEV)
    call = one_call(rec, lambda: torch.ops.tdb.pool_sum_backward(grad, t.dims, t.rows, ids, offsets, None),
                     backward=True)
    a = call.args
    assert call.op == "split_embedding_backward_codegen_dense_unweighted_exact_cuda", call.op
    packed = list(itertools.accumulate([r * d for r, d in zip(t.rows, t.dims)], initial=0))
    assert rec.value(a["weights_offsets"]) == packed[:-1] and a["dev_weights"].numel() == packed[-1]
    given(a["indices"], ids)
    given(a["offsets"], offsets)
    _no_cpu_tensor(call)
    for kind in KINDS:
        per_row = kind == "rowwise_adagrad"
        size, at = _place([(r, 1 if per_row else d) for r, d in zip(t.rows, t.dims)], GAP)
        if kind == "adagrad":  # fbgemm's CPU Adagrad reads its state at the weights' offsets: one call if so
            size, at = t.storage.numel(), t.at
        states = [(torch.empty(size, device=DEV), at) for _ in range({"sgd": 0, "adam": 2}.get(kind, 1))]
        m1, m2 = (states + [(None, []), (None, [])])[:2]  # type: ignore[list-item]
        step = 3 if kind == "adam" else 0

        def update(g: torch.Tensor = grad, k: str = kind, wd: float = 0.0) -> None:
            torch.ops.tdb.sparse_update(t.storage, t.at, t.dims, t.rows, g, ids, offsets, None, k, m1[0], m1[1],
                                        m2[0], m2[1], 0.1, 1e-8, wd, 0, 0.9, 0.999, step)

        call = one_call(rec, update, backward=True)
        _check_backward(rec, call, t, kind=kind, ids=ids, offsets=offsets, states=states, step=step)
        before = len(rec.calls)
        try:
            update(wd=0.01)
        except ValueError as e:
            assert "no one-pass kernel" in str(e), e
        else:
            raise AssertionError(f"{kind} with weight decay: not refused (fbgemm's kernels would ignore it)")
        assert len(rec.calls) == before, "fbgemm called for an update it cannot do"


def _case(rec: Recorder, case: str) -> None:
    name, arrangement = case.rsplit("-", 1)
    for arr, shapes in _arrangements(name):
        if arr != arrangement:
            continue
        size, at = _place(shapes)
        t = Tables(torch.empty(size, device=DEV), at, [d for _, d in shapes], [r for r, _ in shapes])
        _check_tables(rec, t)


@contextmanager
def choices() -> Iterator[list[str]]:
    """The implementation every pooling and dense-gradient op call chose, by name, in call order; torch's (which
    reads values) stands in by an empty output of its shape and device."""
    from torchrec_dtensor_bridge import kernels
    from torchrec_dtensor_bridge.kernels import ops

    chosen: list[str] = []
    pool, dense = ops.run_pool_sum, ops.run_dense_grad

    def pool_sum(which: kernels.Impl, tables: kernels.Tables, batch: kernels.Batch) -> Any:
        chosen.append(which.name)
        if which is not kernels.Impl.TORCH:
            return pool(which, tables, batch)
        return tables.storage.new_empty((batch.offsets.numel() - 1) // len(tables.dims), sum(tables.dims))

    def dense_grad(which: kernels.Impl, grad: torch.Tensor, dims: list[int], rows: list[int], *rest: Any) -> Any:
        chosen.append(which.name)
        return grad.new_empty(sum(r * d for r, d in zip(rows, dims))) if which is kernels.Impl.TORCH else dense(
            which, grad, dims, rows, *rest)

    ops.run_pool_sum, ops.run_dense_grad = pool_sum, dense_grad  # type: ignore[assignment]
    try:
        yield chosen
    finally:
        ops.run_pool_sum, ops.run_dense_grad = pool, dense  # type: ignore[assignment]


def _check_unaligned_tables_take_torch(rec: Recorder) -> None:
    """Columns fbgemm's CUDA kernels cannot read (a dim of 6): pooling and the dense gradient on torch's ops
    (which read values: only the choice is run here), a fused update refused; the lookups do not send such
    shards to the ops (``kernels.accepts``)."""
    from torchrec_dtensor_bridge import kernels

    with choices() as chosen:
        t = Tables(torch.empty(200, device=DEV), [4, 4 + 60 + 4], [6, 4], [10, 12])
        ids, offsets = _batch(t.rows)
        before = len(rec.calls)
        out = torch.ops.tdb.pool_sum(t.storage, t.at, t.dims, t.rows, ids, offsets, None)
        assert tuple(out.shape) == (BAGS, 10) and out.device == torch.device(DEV)
        grad = torch.empty(BAGS, 10, device=DEV)
        torch.ops.tdb.pool_sum_backward(grad, t.dims, t.rows, ids, offsets, None)
        assert chosen == ["TORCH", "TORCH"], chosen
        try:
            torch.ops.tdb.sparse_update(t.storage, t.at, t.dims, t.rows, grad, ids, offsets, None, "sgd", None, [],
                                        None, [], 0.1, 1e-8, 0.0, 0, 0.9, 0.999, 1)
        except ValueError as e:
            assert "16-byte aligned" in str(e), e
        else:
            raise AssertionError("an update of rows fbgemm's kernels cannot read was not refused")
        assert [c.op for c in rec.calls[before:]] == [], "fbgemm called for rows it cannot read"
        aligned = Tables(t.storage, [4, 4 + 40 + 4], [4, 4], [10, 12])
        torch.ops.tdb.pool_sum(aligned.storage, aligned.at, aligned.dims, aligned.rows, ids, offsets, None)
        assert chosen[-1] == "FBGEMM", chosen
    assert not kernels.accepts(torch.empty(10, 6, device=DEV)) and kernels.accepts(torch.empty(10, 8, device=DEV))
    assert not kernels.accepts(torch.empty(50, device=DEV).as_strided((4, 8), (8, 1), 2)), "a misaligned start"
    assert kernels.pool_impl(torch.device(DEV)) is kernels.Impl.FBGEMM


def run_checks(checks: dict[str, Callable[[Recorder], None]]) -> dict[str, str | None]:
    """Every check, each over fake CUDA tensors with one :class:`Recorder` (one fake-CUDA run): each one's
    failure (``None``: passed)."""
    rec = Recorder()
    results: dict[str, str | None] = {}
    with _fake_cuda(rec):
        for name, check in checks.items():
            try:
                check(rec)
                results[name] = None
            except (Exception, pytest.fail.Exception) as e:  # noqa: BLE001 - reported per case to the test process
                frames = "".join(traceback.format_list(traceback.extract_tb(e.__traceback__)[-8:]))
                results[name] = f"{frames}{type(e).__name__}: {str(e)[:1500]}"
    return results


def checks() -> dict[str, Callable[[Recorder], None]]:
    """This module's checks, by name (each fake-CUDA module has its ``checks()``, run by :func:`main`)."""
    out: dict[str, Callable[[Recorder], None]] = {case: (lambda rec, c=case: _case(rec, c)) for case in CASES}
    out["unaligned"] = _check_unaligned_tables_take_torch
    return out


def main(modules: list[str]) -> None:
    """The subprocess: each named module's ``checks()`` in a fake-CUDA run of its own (:func:`run_checks`), one
    module after the other; prints their results by module for :func:`subprocess_results`."""
    results = {name: run_checks(importlib.import_module(name).checks()) for name in modules}
    print(MARK + json.dumps(results))


# --- the tests -----------------------------------------------------------------------------------------------

def subprocess_results(modules: list[str]) -> dict[str, dict[str, str | None]]:
    """Runs the fake-CUDA checks of ``modules`` (import names) in one new interpreter (:func:`main`): their
    results by module. One process for all of them: each would pay the same seconds of imports and set-up."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    code = "import sys; from tests.unit.test_fake_cuda import main; main(sys.argv[1:])"
    proc = subprocess.run([sys.executable, "-c", code, *modules], cwd=root, env=env, capture_output=True,
                          text=True, timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(MARK)]
    assert proc.returncode == 0 and lines, (
        f"the fake-CUDA process failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return json.loads(lines[-1][len(MARK):])


@pytest.fixture(scope="module")
def results(fake_cuda_results: dict[str, dict[str, str | None]]) -> dict[str, str | None]:
    return fake_cuda_results[__name__]


@pytest.mark.parametrize("case", CASES)
def test_fbgemm_cuda_arguments(results, case):
    """Every op over one layout's tables: fbgemm's CUDA argument lists, and no CPU tensor in them."""
    assert results[case] is None, results[case]


def test_unaligned_tables_take_torch(results):
    assert results["unaligned"] is None, results["unaligned"]
