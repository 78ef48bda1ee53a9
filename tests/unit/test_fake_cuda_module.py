"""The CUDA argument lists of the kernel ops, checked against fbgemm's own training modules: fake ``cuda:0``
tensors, in one subprocess (the machinery of ``test_fake_cuda.py``: :func:`.test_fake_cuda.run_checks`).

``test_fake_cuda.py`` checks what this package hands fbgemm against expectations written here; this module takes
its expectations from fbgemm itself. For the same tables and batch, fbgemm_gpu's
``SplitTableBatchedEmbeddingBagsCodegen`` (``EmbeddingLocation.DEVICE``, ``ComputeDevice.CUDA``, on ``cuda:0``,
with a fused optimizer) runs its forward and its backward, and every argument its lookup function
(``split_embedding_codegen_lookup_{kind}_function_pt2``), its forward op
(``split_embedding_codegen_forward_{unweighted,weighted}_pt2_wrapper``) and its backward op
(``split_embedding_backward_codegen_{kind}_{unweighted,weighted}_pt2_wrapper``) receive is compared, by name,
with what ``torch.ops.tdb.pool_sum`` and ``torch.ops.tdb.sparse_update`` hand the same functions: dtypes,
devices, shapes, the values of the small constant tensors, the scalars and the optimizer's arguments
(Adam's ``iter``: fbgemm's module at its N-th step against ours at step N). For the dense gradient, fbgemm's
``DenseTableBatchedEmbeddingBagsCodegen`` gives its lookup function's arguments, which its CUDA autograd hands
unchanged to ``split_embedding_backward_codegen_dense_{unweighted,weighted}_exact_cuda``
(``embedding_backward_split_host_template.cpp``); ``torch.ops.tdb.pool_sum_backward``'s call of that op is
compared with them.

How fbgemm's module runs here (a CPU-only torch with fbgemm's CPU build):

* its lookup function is C++ registered at the Autograd key, so no dispatch mode sees its call: the
  ``torch.ops.fbgemm`` attribute its invoker looks up is replaced, while the module runs, by a recording
  wrapper (:func:`_module_lookups`);
* an autograd graph over fake CUDA tensors aborts the process (its nodes ask for a CUDA device guard), so the
  wrapper runs fbgemm's C++ autograd function with the module's own arguments except its placeholder
  autograd tensor, which is a fake CPU tensor requiring grad, and the forward op's output handed back to it
  is a fake CPU stand-in of the output's shape: every node of the graph is on the CPU, while everything the
  forward and backward ops receive is the module's own (fake CUDA) tensors. ``backward()`` on that output
  runs fbgemm's C++ backward, whose call of the backward op the mode :class:`_ModuleMode` records;
* the module counts its steps in a CPU tensor it reads back (``iter_cpu.item()``), and asks
  ``get_infos_metadata`` (whose meta kernel answers placeholders) for its bit split: :class:`_ModuleMode`
  tracks the first and answers the second with fbgemm's CPU kernel, as the module would get on a GPU.

Where the two sides differ by design, the derived quantity is compared:

* the tables' rows: ours live at element offsets of the caller's storage, with gaps, fbgemm's module packs its
  own buffers; so ``dev_weights`` (and each ``{state}_dev``) is the caller's storage on our side, alike in
  dtype, device and rank, and on both sides every table's ``rows x dims`` elements (``rows`` for a row-wise
  state) lie at ``weights_offsets[t]`` (``{state}_offsets[t]``) inside the buffer, none overlapping
  (:func:`_laid_out`);
* ``mixed_D``: fbgemm's module hands its row-wise Adagrad ``False`` for tables of one width (a faster kernel):
  the backward op's must be equal; the lookup function's (ours pools through SGD's, whose ``True``, the
  general kernels, is right for any widths) may differ only for tables of one width;
* a memory kind the tables do not use (``host_weights``, ``{state}_host``, an unweighted call's
  ``indice_weights``): fbgemm's autograd passes an undefined tensor, ours an empty one on the device (Python
  hands a ``Tensor`` argument no ``None``); the CUDA kernels read neither;
* the batch: fbgemm's module hands on its caller's tensors; ours the caller's own when contiguous, else a
  contiguous copy of their shape (the per-sample weights are given strided here);
* ``grad_output``: fbgemm's comes out of its autograd over CPU nodes: alike but for the device (ours:
  contiguous, on the device);
* the lookup function: ours runs it for its forward alone (SGD's, under ``no_grad``), so its ``iter``
  (``aux_int[0]``), ``stochastic_rounding`` (``aux_bool[5]``) and learning rate, which only a backward reads,
  are compared in the backward op's arguments instead (:data:`_NOT_COMPARED`);
* the dense module is built on the CPU (:func:`dense_module_lookup`): its devices are not compared (ours are
  checked to be ``cuda:0`` by the fakes of ``test_fake_cuda``).

Arguments a C++ caller leaves at their defaults reach Python without them: both sides' calls are completed
with the schema's defaults before they are compared (:func:`_with_defaults`).

Also here: a table of 4096 columns (fbgemm's CUDA kernels take at most 2048: its fakes refuse it, as fbgemm's
own module run here shows) never reaches fbgemm from this package's ops.
"""

from __future__ import annotations

import enum
import itertools
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from torchrec_dtensor_bridge.kernels import fbgemm

from .test_fake_cuda import (BAGS, CASES, DEV, GAP, KINDS, Call, Recorder, Tables, _arrangements, _place, choices,
                             fbgemm_refuses, given)

pytestmark = pytest.mark.skipif(not fbgemm.available(), reason="needs fbgemm_gpu")

DTYPES = ("fp32", "fp16", "bf16")
"""The weights' dtypes compared with fbgemm's module; fp16 and bf16 join by name (:data:`_OURS_REFUSE`)."""
_TORCH_DTYPE = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_OURS_REFUSE: frozenset[str] = frozenset()
"""Weight dtypes this package's ops refuse today (``tdb::pool_sum: weights must be a flat contiguous float32
tensor``): fbgemm's module runs them, our side's comparison is expected to fail with that refusal (strict: a
pass means the dtype is supported, and it leaves this set)."""
_REFUSAL = "contiguous float32 tensor, got torch."


class RefusedByOurOps(Exception):
    """Our ops refused the weights' dtype (after fbgemm's module ran with it)."""
WEIGHTED = (False, True)
LR, EPS, BETA1, BETA2 = 0.1, 1e-8, 0.9, 0.999
STEPS = 2  # fbgemm's module's steps per case (Adam's iter compared at each)

_OPTIM = {"sgd": "EXACT_SGD", "rowwise_adagrad": "EXACT_ROWWISE_ADAGRAD", "adagrad": "EXACT_ADAGRAD", "adam": "ADAM"}
_STATES = {"sgd": 0, "rowwise_adagrad": 1, "adagrad": 1, "adam": 2}

_NOT_COMPARED = {
    # the lookup function: ours runs it for its forward alone (no_grad, SGD), fbgemm's module for training
    "learning_rate_tensor@lookup": "our forward-only lookup passes lr 0 (no update runs); compared in the backward",
    "aux_int[0]@lookup": "iter: read by the backward only (our forward-only lookup passes 0); compared there",
    "aux_bool[5]@lookup": "stochastic_rounding: read by the backward only; compared there",
}


# --- the subprocess: fbgemm's module --------------------------------------------------------------------------

@dataclass
class ModuleRun:
    """What fbgemm's module handed fbgemm's functions over one step."""

    lookup: Call | None = None
    forward: Call | None = None
    backward: Call | None = None
    dense_lookup: Call | None = None


@dataclass
class _Twin:
    """fbgemm's autograd function running over CPU nodes (``active``), and its forward op's real output."""

    active: bool = False
    output: torch.Tensor | None = None


@dataclass
class _Scalars:
    """Values of the module's step counters (CPU tensors it reads back), by ``id``."""

    values: dict[int, int] = field(default_factory=dict)
    keep: list[torch.Tensor] = field(default_factory=list)


def _module_mode(rec: Recorder, run: ModuleRun, scalars: _Scalars, twin: _Twin) -> Any:
    """The dispatch mode fbgemm's module runs under (above the recording mode of ``test_fake_cuda``): its step
    counters, its bit split, and, while ``twin.active`` (its autograd function running over CPU nodes), the
    forward op's output replaced by a CPU stand-in and the backward op recorded instead of run."""
    from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

    aten = torch.ops.aten

    class ModuleMode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            known = scalars.values
            if args and isinstance(args[0], torch.Tensor) and id(args[0]) in known:
                if func is aten._local_scalar_dense.default:
                    return known[id(args[0])]
                if func in (aten.add_.Tensor, aten.add_.Scalar):
                    other = args[1]
                    known[id(args[0])] += known[id(other)] if isinstance(other, torch.Tensor) else other
                elif func is aten.fill_.Scalar:
                    known[id(args[0])] = args[1]
                elif func in (aten._to_copy.default, aten.clone.default, aten.detach.default):
                    out = func(*args, **kwargs)
                    known[id(out)] = known[id(args[0])]
                    scalars.keep.append(out)
                    return out
            if func.namespace != "fbgemm":
                return func(*args, **kwargs)
            name = func._schema.name.split("::")[1]
            named = {**dict(zip([a.name for a in func._schema.arguments], args)), **kwargs}
            if name == "get_infos_metadata":  # fbgemm's CPU kernel: its meta kernel answers placeholders
                with _disable_current_modes():
                    return torch.ops.fbgemm.get_infos_metadata(torch.empty(0), named["B"], named["T"])
            if twin.active and name.startswith("split_embedding_codegen_forward_"):
                out = func(*args, **kwargs)  # recorded, checked and refused by test_fake_cuda's kernel fakes
                run.forward = Call(name, named)
                twin.output = out
                return torch.empty(out.shape, dtype=out.dtype, device="cpu")
            if twin.active and name.startswith("split_embedding_backward_codegen_"):
                run.backward = Call(name, named)
                width = rec.value(named["D_offsets"])[-1]
                fbgemm_refuses(width, named["max_D"], named["indices"], named["offsets"], named["indice_weights"])
                return torch.empty(0, device="cpu")
            if twin.active and "grad_indice_weights" in name:  # the per-sample weights' gradient (weighted)
                return torch.empty(named["indices"].shape, device="cpu")
            return func(*args, **kwargs)

    return ModuleMode()


LOOKUP_FUNCTIONS = [f"split_embedding_codegen_lookup_{k}_function_pt2" for k in KINDS]


@contextmanager
def _module_lookups(run: ModuleRun, twin: _Twin) -> Iterator[None]:
    """fbgemm's lookup functions, as fbgemm's modules' invokers find them (``torch.ops.fbgemm.<name>``), each
    replaced by a wrapper that records its arguments and runs it: the split ones with autograd over CPU nodes
    and its backward (see the module docstring), the dense one recorded alone."""
    ns = torch.ops.fbgemm
    saved = {name: getattr(ns, name) for name in [*LOOKUP_FUNCTIONS, "dense_embedding_codegen_lookup_function"]}

    def split(op: Any) -> Callable[..., torch.Tensor]:
        def lookup(*args: Any, **kwargs: Any) -> torch.Tensor:
            named = {**dict(zip([a.name for a in op._schema.arguments], args)), **kwargs}
            run.lookup = Call(op._schema.name.split("::")[1], named)
            kw = {**named, "placeholder_autograd_tensor": torch.zeros(0, device="cpu", requires_grad=True)}
            twin.active, twin.output = True, None
            try:
                with torch.enable_grad():
                    out = op(**kw)
                    out.backward(torch.empty_like(out))
            finally:
                twin.active = False
            assert twin.output is not None, "fbgemm's lookup function ran no forward op"
            return twin.output
        return lookup

    def dense(op: Any) -> Callable[..., torch.Tensor]:
        def lookup(*args: Any, **kwargs: Any) -> torch.Tensor:
            named = {**dict(zip([a.name for a in op._schema.arguments], args)), **kwargs}
            run.dense_lookup = Call("dense_embedding_codegen_lookup_function", named)
            return named["dev_weights"].new_empty(0)  # its arguments are all it is asked for
        return lookup

    for name, packet in saved.items():
        setattr(ns, name, dense(packet.default) if name.startswith("dense") else split(packet.default))
    try:
        yield
    finally:
        for name, packet in saved.items():
            setattr(ns, name, packet)


class FbgemmModule:
    """fbgemm's training module for some tables on fake ``cuda:0``, stepped by :meth:`step`."""

    def __init__(self, rec: Recorder, shapes: list[tuple[int, int]], kind: str, dtype: str) -> None:
        from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice, SplitTableBatchedEmbeddingBagsCodegen)

        self.rec, self.scalars, self.twin = rec, _Scalars(), _Twin()
        self.steps = 0
        with self._mode(ModuleRun()):
            self.module = SplitTableBatchedEmbeddingBagsCodegen(
                [(r, d, EmbeddingLocation.DEVICE, ComputeDevice.CUDA) for r, d in shapes],
                optimizer=getattr(EmbOptimType, _OPTIM[kind]), device=torch.device(DEV),
                weights_precision=getattr(SparseType, dtype.upper()), output_dtype=SparseType.FP32,
                # its cache refuses bf16 (no cache is used here: every table on the device)
                cache_precision=SparseType.FP32 if dtype == "bf16" else None,
                pooling_mode=PoolingMode.SUM, learning_rate=LR, eps=EPS, beta1=BETA1, beta2=BETA2, weight_decay=0.0,
                stochastic_rounding=True)
        self.scalars.values.update({id(self.module.iter_cpu): 0, id(self.module.iter): 0})

    @contextmanager
    def _mode(self, run: ModuleRun) -> Iterator[None]:
        with _module_mode(self.rec, run, self.scalars, self.twin):
            yield

    def step(self, ids: torch.Tensor, offsets: torch.Tensor, psw: torch.Tensor | None) -> ModuleRun:
        """One forward and backward of the module (its fused update): what it handed fbgemm."""
        run = ModuleRun()
        with self._mode(run), _module_lookups(run, self.twin):
            self.module(ids, offsets, psw)
        self.steps += 1
        assert run.lookup and run.forward and run.backward, "fbgemm's module made no lookup, forward or backward"
        return run


def dense_module_lookup(shapes: list[tuple[int, int]], weighted: bool) -> Call:
    """The arguments fbgemm's dense training module hands its lookup function, the module built on the CPU,
    outside the fake mode: its constructor slices its ``nn.Parameter`` and reads back values of tensors it built
    on its device, which neither fake CUDA tensors (an autograd view) nor fake tensors (values) allow. Its
    constants are made by the same code whatever its device (``device=self.current_device``)."""
    from torch.utils._python_dispatch import _disable_current_modes

    from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import DenseTableBatchedEmbeddingBagsCodegen

    run = ModuleRun()
    with _disable_current_modes(), torch.no_grad():
        module = DenseTableBatchedEmbeddingBagsCodegen(shapes, pooling_mode=PoolingMode.SUM, use_cpu=True)
        ids = torch.zeros(3 * BAGS * len(shapes), dtype=torch.int64)
        offsets = torch.arange(0, ids.numel() + 1, 3, dtype=torch.int64)
        with _module_lookups(run, _Twin()):
            module(ids, offsets, torch.ones(ids.numel()) if weighted else None)
    assert run.dense_lookup is not None
    return run.dense_lookup


# --- the subprocess: the comparison ------------------------------------------------------------------------------

@dataclass
class Compare:
    """The differences found between our call's arguments and fbgemm's module's, by argument."""

    rec: Recorder
    where: str
    dims: list[int] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def fail(self, name: str, why: str) -> None:
        self.problems.append(f"{self.where} {name}: {why}")

    def tensor(self, name: str, ours: torch.Tensor, theirs: torch.Tensor, *, values: bool = False,
               device: bool = True) -> None:
        """Same dtype, device and shape; with ``values``, the same (known) values."""
        for what, x, y in (("dtype", ours.dtype, theirs.dtype), ("shape", tuple(ours.shape), tuple(theirs.shape)),
                           ("device", ours.device, theirs.device if device else torch.device(DEV))):
            if x != y:
                self.fail(name, f"{what} {x} (ours) != {y} (fbgemm's module)")
        if values and (ours.numel() or theirs.numel()):
            a, b = self.known(ours), self.known(theirs)
            if a is None or b is None or not _close(a, b):
                self.fail(name, f"values {a} (ours) != {b} (fbgemm's module)")

    def known(self, t: torch.Tensor) -> list[Any] | None:
        """``t``'s values: recorded for a fake tensor made from Python values, read for a real CPU tensor."""
        from torch._subclasses.fake_tensor import FakeTensor

        if isinstance(t, FakeTensor):
            return self.rec.values.get(id(t))
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes():
            return t.tolist()

    def scalar(self, name: str, ours: Any, theirs: Any) -> None:
        kinds = {type(x) if not isinstance(x, enum.Enum) else type(x.value) for x in (ours, theirs)}
        if len(kinds) > 1 or not _close(ours, theirs):
            self.fail(name, f"{ours!r} (ours) != {theirs!r} (fbgemm's module)")

    def value(self, name: str, t: torch.Tensor) -> list[Any] | None:
        v = self.rec.values.get(id(t))
        if v is None:
            self.fail(name, "values unknown")
        return v

    def laid_out(self, name: str, buffer: torch.Tensor, at: torch.Tensor, sizes: list[int], ours: bool) -> None:
        """``at``'s values (int64, ``(T,)``, on the buffer's device) put table ``t``'s ``sizes[t]`` elements
        inside ``buffer`` without overlapping another's."""
        side = "ours" if ours else "fbgemm's module"
        starts = self.value(name, at)
        if at.dtype != torch.int64 or at.device != buffer.device or tuple(at.shape) != (len(sizes),):
            self.fail(name, f"{side}: {at.dtype} {tuple(at.shape)} on {at.device}")
        if starts is not None and not _laid_out(starts, sizes, buffer.numel()):
            self.fail(name, f"{side}: tables of {sizes} elements at {starts} in {buffer.numel()}")


def _close(a: Any, b: Any) -> bool:
    if isinstance(a, enum.Enum) or isinstance(b, enum.Enum):  # fbgemm's module passes its IntEnums (PoolingMode)
        return _close(getattr(a, "value", a), getattr(b, "value", b))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    if isinstance(a, float) or isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-6, abs_tol=0.0)
    return bool(a == b)


def _laid_out(starts: list[int], sizes: list[int], numel: int) -> bool:
    """Whether tables of ``sizes`` elements at ``starts`` fit in ``numel`` elements, none overlapping."""
    spans = sorted(zip(starts, sizes))
    ends = [s + n for s, n in spans]
    return all(s >= 0 for s, _ in spans) and ends[-1] <= numel and all(
        e <= s for e, (s, _) in zip(ends, spans[1:]))


def _with_defaults(op: Any, args: dict[str, Any]) -> dict[str, Any]:
    """``args`` of a call of ``op`` by name, with the schema's default of each argument it leaves out (a call
    from C++ reaches Python without its trailing arguments that equal their defaults)."""
    out = {}
    for arg in op._schema.arguments:
        if arg.name in args:
            out[arg.name] = args[arg.name]
        elif arg.has_default_value():
            out[arg.name] = arg.default_value
    return out


def _compare_common(c: Compare, name: str, ours: Any, theirs: Any) -> None:
    """An argument neither side lays out differently: tensors alike (small constants by value), scalars equal."""
    if name == "mixed_D":  # the backward op's: fbgemm's module's row-wise Adagrad asks for its one-width kernels
        if ours is not theirs:
            c.fail(name, f"{ours!r} (ours) != {theirs!r} (fbgemm's module) for dims {c.dims}")
    elif name in _MIXED_D:
        # the lookup function's: ours pools through SGD's, whose general ``True`` is right for any dims; fbgemm's
        # module hands its row-wise Adagrad's ``dims differ``: alike wherever it needs the general kernels
        if ours is not True or (theirs is not True and len(set(c.dims)) > 1):
            c.fail(name, f"{ours!r} (ours) / {theirs!r} (fbgemm's module) for dims {c.dims}")
    elif isinstance(ours, torch.Tensor) and isinstance(theirs, torch.Tensor):
        small = name in ("D_offsets", "hash_size_cumsum") or name.endswith("_placements")
        c.tensor(name, ours, theirs, values=small)
    elif isinstance(ours, (list, tuple)) and isinstance(theirs, (list, tuple)):
        if len(ours) != len(theirs):
            c.fail(name, f"{len(ours)} items (ours) != {len(theirs)} (fbgemm's module)")
        for i, (a, b) in enumerate(zip(ours, theirs)):
            if f"{name}[{i}]{c.where}" not in _NOT_COMPARED:
                _compare_common(c, f"{name}[{i}]", a, b)
    elif ours is None or theirs is None:
        if ours is not theirs:
            c.fail(name, f"{ours!r} (ours) != {theirs!r} (fbgemm's module)")
    else:
        c.scalar(name, ours, theirs)


@dataclass
class Side:
    """One side's tables: their buffer's element offsets and each state's, and the element count per table."""

    tables: Tables
    kind: str
    sizes: list[int] = field(init=False)
    state_sizes: list[int] = field(init=False)

    def __post_init__(self) -> None:
        t = self.tables
        self.sizes = [r * d for r, d in zip(t.rows, t.dims)]
        self.state_sizes = list(t.rows) if self.kind == "rowwise_adagrad" else self.sizes


def _compare_layout(c: Compare, ours: dict[str, Any], theirs: dict[str, Any], buffer: str, offsets: str,
                    sizes: list[int], our_buffer: torch.Tensor) -> None:
    """The tables' rows in a buffer: ours in the caller's storage (``our_buffer``), at the caller's offsets, with
    gaps; fbgemm's module's in its own, packed. Compared: dtype and device alike, and on each side every table
    inside its buffer at its offsets, none overlapping (:func:`_laid_out`)."""
    a, b = ours[buffer], theirs[buffer]
    if a is not our_buffer:
        c.fail(buffer, "not the caller's storage")
    if a.dtype != b.dtype or a.device != b.device or a.dim() != b.dim():
        c.fail(buffer, f"{a.dtype} {a.dim()}-d on {a.device} (ours) != {b.dtype} {b.dim()}-d on {b.device}")
    c.laid_out(offsets, a, ours[offsets], sizes, ours=True)
    c.laid_out(offsets, b, theirs[offsets], sizes, ours=False)


_BATCH = ("indices", "offsets", "indice_weights")
_MIXED_D = ("mixed_D", "aux_bool[6]")  # the lookup's aux_bool: ..., stochastic_rounding, mixed_D


def _compare_batch(c: Compare, name: str, ours: Any, theirs: Any, passed: torch.Tensor | None) -> None:
    """The batch: fbgemm's module hands its caller's tensors (``theirs``); ours, the caller's own when contiguous,
    else a contiguous copy (``passed``: what our caller passed). An unweighted call: fbgemm's autograd passes an
    undefined tensor (``None``), ours an empty one (a ``Tensor`` argument takes no ``None`` from Python): the
    unweighted kernels read neither."""
    if theirs is None or (isinstance(theirs, torch.Tensor) and theirs.numel() == 0 and name == "indice_weights"):
        if not (ours is None or (ours.numel() == 0 and ours.device == torch.device(DEV))):
            c.fail(name, f"fbgemm's module passes none, ours {tuple(ours.shape)}")
        return
    try:
        given(ours, passed)
    except AssertionError as e:
        c.fail(name, str(e))
    c.tensor(name, ours, theirs)


def compare_lookup(rec: Recorder, ours: Call, theirs: Call, ours_fwd: Call, theirs_fwd: Call, our_tables: Tables,
                   kind: str, batch: dict[str, torch.Tensor | None]) -> list[str]:
    """Our lookup function's arguments (a forward alone, SGD's) against fbgemm's module's (its optimizer's), and
    the forward op's arguments each hands on, argument by argument."""
    c = Compare(rec, "@lookup", list(our_tables.dims))
    side = Side(our_tables, kind)
    a, b = ours.args, theirs.args
    missing = sorted(set(a) - set(b))
    if missing:
        c.fail("arguments", f"ours has {missing} that fbgemm's module's lookup has not")
    for name in a:
        if name in missing or name in _NOT_COMPARED or f"{name}@lookup" in _NOT_COMPARED:
            continue
        if name == "weights":  # [dev, uvm, placements, offsets, lxu_cache]
            wa, wb = a[name], b[name]
            if len(wa) != len(wb):
                c.fail(name, f"{len(wa)} tensors (ours) != {len(wb)}")
                continue
            pa = dict(zip(("dev_weights", "uvm", "weights_placements", "weights_offsets", "lxu_cache"), wa))
            pb = dict(zip(pa, wb))
            _compare_layout(c, pa, pb, "dev_weights", "weights_offsets", side.sizes, our_tables.storage)
            for k in ("uvm", "weights_placements", "lxu_cache"):
                _compare_common(c, k, pa[k], pb[k])
        elif name in _BATCH:
            _compare_batch(c, name, a[name], b[name], batch[name])
        else:
            _compare_common(c, name, a[name], b[name])
    if ours_fwd.op != theirs_fwd.op:
        c.fail("forward op", f"{ours_fwd.op} (ours) != {theirs_fwd.op}")
    forward = getattr(torch.ops.fbgemm, theirs_fwd.op).default
    fa, fb = _with_defaults(forward, ours_fwd.args), _with_defaults(forward, theirs_fwd.args)
    for name in [x.name for x in forward._schema.arguments]:
        if name not in fa or name not in fb:
            c.fail(f"forward op {name}", f"not given by {'fbgemm s module' if name in fa else 'ours'}")
            continue
        if name in ("dev_weights", "weights_offsets"):
            if name == "dev_weights":
                _compare_layout(c, fa, fb, "dev_weights", "weights_offsets", side.sizes, our_tables.storage)
        elif name in _BATCH:
            _compare_batch(c, f"forward op {name}", fa[name], fb[name], batch[name])
        else:
            _compare_common(c, f"forward op {name}", fa[name], fb[name])
    return c.problems


def compare_backward(rec: Recorder, ours: Call, theirs: Call, our_tables: Tables, kind: str,
                     batch: dict[str, torch.Tensor | None], states: list[torch.Tensor]) -> list[str]:
    """Our fused update's backward op call against fbgemm's module's, every argument of the op's schema."""
    c = Compare(rec, "@backward", list(our_tables.dims))
    side = Side(our_tables, kind)
    if ours.op != theirs.op:
        c.fail("op", f"{ours.op} (ours) != {theirs.op} (fbgemm's module)")
        return c.problems
    op = getattr(torch.ops.fbgemm, ours.op).default
    a, b = _with_defaults(op, ours.args), _with_defaults(op, theirs.args)
    for arg in op._schema.arguments:
        name = arg.name
        if name not in a or name not in b:
            c.fail(name, f"not given by {'fbgemm s module' if name in a else 'ours'}")
            continue
        x, y = a[name], b[name]
        if name == "dev_weights":
            _compare_layout(c, a, b, name, "weights_offsets", side.sizes, our_tables.storage)
        elif name.endswith("_dev") and name.startswith("momentum"):
            state = states[int(name[8]) - 1]
            _compare_layout(c, a, b, name, f"{name[:9]}_offsets", side.state_sizes, state)
        elif name in ("weights_offsets", "momentum1_offsets", "momentum2_offsets"):
            continue  # with its buffer, just above
        elif name in _BATCH:
            _compare_batch(c, name, x, y, batch[name])
        elif name == "grad_output":
            # fbgemm's module's comes from its autograd, here over CPU nodes (see the module docstring): alike
            # but for the device; ours is the caller's gradient, contiguous, on the device
            c.tensor(name, x, y, device=False)
            if not x.is_contiguous():
                c.fail(name, "ours is not contiguous")
        elif name in ("host_weights", "momentum1_host", "momentum2_host"):
            # fbgemm's autograd passes an undefined tensor for a memory kind its tables do not use, ours an
            # empty one (Python hands a Tensor argument no None); CUDA's kernels read neither
            if y is not None and y.numel() != 0 or x is None or x.numel() != 0 or x.device != torch.device(DEV):
                c.fail(name, f"{x} (ours) / {y} (fbgemm's module): an unused memory kind")
        elif name == "learning_rate_tensor":
            c.tensor(name, x, y, values=True)
        else:
            _compare_common(c, name, x, y)
    return c.problems


# --- the subprocess: the cases -----------------------------------------------------------------------------------

def _batch(tables: int, psw: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """ids, bag boundaries, and (``psw``) per-sample weights: contiguous for fbgemm's module, strided (every
    other element of a longer tensor) for this package's ops."""
    n = 3 * BAGS * tables
    ids = torch.empty(n, dtype=torch.int64, device=DEV)
    offsets = torch.empty(BAGS * tables + 1, dtype=torch.int64, device=DEV)
    if not psw:
        return ids, offsets, None, None
    return ids, offsets, torch.empty(n, device=DEV), torch.empty(2 * n, device=DEV).as_strided((n,), (2,))


def _ours_tables(shapes: list[tuple[int, int]], dtype: str) -> Tables:
    size, at = _place(shapes)
    return Tables(torch.empty(size, dtype=_TORCH_DTYPE[dtype], device=DEV), at, [d for _, d in shapes],
                  [r for r, _ in shapes])


def _calls(rec: Recorder, before: int, prefix: str) -> list[Call]:
    return [c for c in rec.calls[before:] if c.op.startswith(prefix)]


def _check_split(rec: Recorder, shapes: list[tuple[int, int]], kind: str, dtype: str) -> None:
    """fbgemm's module for ``shapes`` with ``kind``, a step unweighted then one weighted, against our ops."""
    t = _ours_tables(shapes, dtype)
    module = FbgemmModule(rec, shapes, kind, dtype)
    problems: list[str] = []
    side = Side(t, kind)
    states = [torch.empty(_place([(n, 1) for n in side.state_sizes], GAP)[0], device=DEV)
              for _ in range(_STATES[kind])]
    state_at = _place([(n, 1) for n in side.state_sizes], GAP)[1]
    for weighted in WEIGHTED:
        ids, offsets, theirs_psw, our_psw = _batch(len(shapes), weighted)
        run = module.step(ids, offsets, theirs_psw)
        step = module.steps  # fbgemm's module's iter at this step
        batch = {"indices": ids, "offsets": offsets, "indice_weights": our_psw}
        before, kernels = len(rec.calls), len(rec.kernel_args)
        torch.ops.tdb.pool_sum(t.storage, t.at, t.dims, t.rows, ids, offsets, our_psw)
        lookups = _calls(rec, before, "split_embedding_codegen_lookup_")
        assert len(lookups) == 1 and len(rec.kernel_args) == kernels + 1, [c.op for c in rec.calls[before:]]
        # the forward op our lookup function called (test_fake_cuda's fake of it recorded its arguments)
        forward = Call(f"split_embedding_codegen_forward_{'weighted' if weighted else 'unweighted'}_pt2_wrapper",
                       rec.kernel_args[-1])
        assert run.lookup is not None and run.forward is not None and run.backward is not None
        problems += compare_lookup(rec, lookups[0], run.lookup, forward, run.forward, t, kind, batch)
        grad = torch.empty(BAGS, sum(t.dims), device=DEV)
        m = states + [None, None]
        before = len(rec.calls)
        torch.ops.tdb.sparse_update(t.storage, t.at, t.dims, t.rows, grad, ids, offsets, our_psw, kind, m[0],
                                    state_at if m[0] is not None else [], m[1], state_at if m[1] is not None else [],
                                    LR, EPS, 0.0, 0, BETA1, BETA2, step)
        backwards = _calls(rec, before, "split_embedding_backward_codegen_")
        assert len(backwards) == 1, [c.op for c in rec.calls[before:]]
        problems += compare_backward(rec, backwards[0], run.backward, t, kind, batch, states)
    assert not problems, "\n".join(problems)


def _check_dense(rec: Recorder, shapes: list[tuple[int, int]]) -> None:
    """Our dense gradient's call of fbgemm's CUDA dense backward against the arguments fbgemm's dense module's
    lookup function hands that op (``embedding_backward_split_host_template.cpp``, ``dense``: ``grad_output,
    dev_weights, weights_offsets, D_offsets, max_D, mixed_D, hash_size_cumsum, total_hash_size_bits, indices,
    offsets, pooling_mode[, indice_weights], BT_block_size, max_segment_length_per_warp, 0``, with its NVIDIA
    constants 32 and 32). Both lay the gradient out packed (ours: every table's back to back), so the offsets
    are the same. fbgemm's module is built on the CPU (:func:`dense_module_lookup`): devices are not compared
    with it (ours: every tensor on ``cuda:0``, checked by test_fake_cuda's fake of the op)."""
    problems: list[str] = []
    dims, rows = [d for _, d in shapes], [r for r, _ in shapes]
    for weighted in WEIGHTED:
        ids, offsets, _, our_psw = _batch(len(shapes), weighted)
        theirs = dense_module_lookup(shapes, weighted)
        grad = torch.empty(BAGS, sum(dims), device=DEV)
        before = len(rec.calls)
        torch.ops.tdb.pool_sum_backward(grad, dims, rows, ids, offsets, our_psw)
        calls = _calls(rec, before, "split_embedding_backward_codegen_dense_")
        assert len(calls) == 1, [c.op for c in rec.calls[before:]]
        ours = calls[0]
        c = Compare(rec, "@dense")
        which = "weighted" if weighted else "unweighted"
        if ours.op != f"split_embedding_backward_codegen_dense_{which}_exact_cuda":
            c.fail("op", ours.op)
        a, b = ours.args, theirs.args
        for name in ("dev_weights", "weights_offsets", "D_offsets", "max_D", "hash_size_cumsum",
                     "total_hash_size_bits", "indices", "offsets", "pooling_mode", "indice_weights"):
            x, y = a.get(name), b[name]
            if x is None:
                if name != "indice_weights" or weighted:
                    c.fail(name, "not given by ours")
            elif isinstance(y, torch.Tensor):
                small = name in ("weights_offsets", "D_offsets", "hash_size_cumsum")
                c.tensor(name, x, y, values=small, device=False)
            else:
                c.scalar(name, x, y)
        given(a["indices"], ids)
        given(a["offsets"], offsets)
        given(a.get("indice_weights"), our_psw)
        c.scalar("mixed_D", a["mixed_D"], True)  # the dense lookup function's default, saved for its backward
        c.scalar("BT_block_size", a["unused_"], 32)
        c.scalar("max_segment_length_per_warp", a["max_segment_length_per_warp"], 32)
        c.tensor("grad_output", a["grad_output"], grad)
        problems += c.problems
    assert not problems, "\n".join(problems)


def _check_wide_table(rec: Recorder) -> None:
    """A table of 4096 columns: fbgemm's module (its CUDA kernels: ``TORCH_CHECK_LE(max_D, 2048)``) refuses it
    under these fakes; our ops never hand it to fbgemm: pooling and the dense gradient take torch's ops, the
    fused update is refused before any call."""
    shapes = [(6, 4096)]
    module = FbgemmModule(rec, shapes, "sgd", "fp32")
    ids, offsets, _, _ = _batch(1, False)
    try:
        module.step(ids, offsets, None)
    except AssertionError as e:
        assert "max_D" in str(e), e
    else:
        raise AssertionError("fbgemm's module ran a table of 4096 columns: the fakes do not refuse max_D > 2048")
    t = _ours_tables(shapes, "fp32")
    before = len(rec.calls)
    with choices() as chosen:
        torch.ops.tdb.pool_sum(t.storage, t.at, t.dims, t.rows, ids, offsets, None)
        grad = torch.empty(BAGS, 4096, device=DEV)
        torch.ops.tdb.pool_sum_backward(grad, t.dims, t.rows, ids, offsets, None)
        try:
            torch.ops.tdb.sparse_update(t.storage, t.at, t.dims, t.rows, grad, ids, offsets, None, "sgd", None, [],
                                        None, [], LR, EPS, 0.0, 0, BETA1, BETA2, 1)
        except ValueError as e:
            assert "4096" in str(e), e
        else:
            raise AssertionError("an update of a table of 4096 columns was not refused")
    assert chosen == ["TORCH", "TORCH"], chosen
    assert [c.op for c in rec.calls[before:] if c.op != "get_infos_metadata"] == [], "fbgemm got a 4096-wide table"


def _groups(case: str) -> list[list[tuple[int, int]]]:
    """The table shapes of each kernel call of a layout case of ``test_fake_cuda``, duplicates dropped."""
    name, arrangement = case.rsplit("-", 1)
    out: list[list[tuple[int, int]]] = []
    for arr, shapes in _arrangements(name):
        if arr == arrangement and shapes not in out:
            out.append(shapes)
    return out


def _split_case(case: str, kind: str, dtype: str) -> Callable[[Recorder], None]:
    def check(rec: Recorder) -> None:
        for shapes in _groups(case):
            _check_split(rec, shapes, kind, dtype)
    return check


def _dense_case(case: str) -> Callable[[Recorder], None]:
    def check(rec: Recorder) -> None:
        for shapes in _groups(case):
            _check_dense(rec, shapes)
    return check


def checks() -> dict[str, Callable[[Recorder], None]]:
    out: dict[str, Callable[[Recorder], None]] = {}
    for case in CASES:
        for kind in KINDS:
            for dtype in DTYPES:
                out[f"{case}-{kind}-{dtype}"] = _split_case(case, kind, dtype)
        out[f"{case}-dense"] = _dense_case(case)
    out["wide_table"] = _check_wide_table
    return out


# --- the tests ---------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def results(fake_cuda_results: dict[str, dict[str, str | None]]) -> dict[str, str | None]:
    return fake_cuda_results[__name__]


def _split_params() -> list[Any]:
    params = []
    for case, kind, dtype in itertools.product(CASES, KINDS, DTYPES):
        refused = pytest.mark.xfail(strict=True, raises=RefusedByOurOps, reason=f"our ops refuse {dtype} weights")
        marks = [refused] if dtype in _OURS_REFUSE else []
        params.append(pytest.param(f"{case}-{kind}-{dtype}", marks=marks, id=f"{case}-{kind}-{dtype}"))
    return params


@pytest.mark.parametrize("check", _split_params())
def test_matches_fbgemm_module(results, check):
    """Our lookup, forward and fused-update calls against fbgemm's training module's, argument by argument."""
    got = results[check]
    if got is not None and _REFUSAL in got:
        raise RefusedByOurOps(got)
    assert got is None, got


@pytest.mark.parametrize("case", CASES)
def test_dense_grad_matches_fbgemm_module(results, case):
    """Our dense gradient's call of fbgemm's CUDA dense backward against fbgemm's dense module's arguments."""
    assert results[f"{case}-dense"] is None, results[f"{case}-dense"]


def test_wide_table_never_reaches_fbgemm(results):
    assert results["wide_table"] is None, results["wide_table"]

