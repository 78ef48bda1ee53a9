"""fbgemm's op schemas against what the kernels pass them, for every op ``kernels/fbgemm.py`` uses
(:data:`.fbgemm_ops.OPS`).

An fbgemm_gpu other than the one the lock pins (a machine without network keeps the torch and fbgemm it has)
may have renamed, retyped or added arguments; a call would then fail inside a lookup, or, for an argument with a
default, silently take the default. Checked here, before anything runs a kernel:

* the list is the source's: every ``torch.ops.fbgemm`` op ``kernels/fbgemm.py`` names (an attribute, or a name
  or f-string given to ``getattr`` / ``hasattr``) is listed, every listed op is named there, and an op the
  module only looks for is listed as a probe;
* every listed op is registered by the installed fbgemm_gpu; on its CPU build (fbgemm-gpu-cpu) the ops only the
  CUDA build registers are skipped, each named;
* every call the kernels make (their entry points run over small tables, in host memory and in a device's
  argument forms, with ``torch.ops.fbgemm`` replaced by a recording stand-in) binds to the op's schema: no
  argument the schema lacks, every argument without a default given, each value of the schema's type, and the
  positional arguments standing for the fbgemm arguments the list names;
* each optimizer's backward-with-update op takes the kind's hyper-parameters and states under the names the
  kernels give them (from the kind's record: a renamed one would silently fall back to fbgemm's default).

The device forms use CUDA tensors where a CUDA device exists, else meta tensors (the forms depend only on the
tables being off the host); nothing the recording stand-in receives runs, but ``get_infos_metadata``, a host
computation the kernels need the result of.
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata as md
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from torchrec_dtensor_bridge.kernels import fbgemm
from torchrec_dtensor_bridge.kernels.args import Batch, State, Tables
from torchrec_dtensor_bridge.optim_kinds import Hyper, OptimKind, StateKind, WeightDecayMode, lookup

from .fbgemm_ops import OPS, FbgemmOp, backward_wrapper, by_name

pytestmark = pytest.mark.skipif(not fbgemm.available(), reason="needs fbgemm_gpu (fbgemm-gpu or fbgemm-gpu-cpu)")

SOURCE = Path(fbgemm.__file__)
RUN = {"get_infos_metadata"}  # ops the recording stand-in runs: a host computation whose result the kernels use
DIMS, ROWS, GAP = (8, 4), (6, 5), 4  # two tables of one storage, a gap between them


def _build() -> str:
    """The installed fbgemm_gpu build, for messages."""
    for dist in ("fbgemm-gpu", "fbgemm-gpu-cpu"):
        try:
            return f"{dist} {md.version(dist)}"
        except md.PackageNotFoundError:
            continue
    return "fbgemm_gpu (no distribution metadata)"


def _registered(name: str) -> bool:
    return hasattr(torch.ops.fbgemm, name)


def _skip_unless_cuda_build(missing: list[str]) -> None:
    """Skips, naming ``missing``, when each is an op only fbgemm's CUDA build registers and this is not it; else
    fails."""
    listed = by_name()
    if fbgemm.cuda_available() or not all(m in listed and listed[m].cuda_only for m in missing):
        pytest.fail(f"{_build()} does not register {missing}")
    pytest.skip(f"{_build()} (a CPU build) does not register {', '.join(missing)}: only fbgemm-gpu's CUDA build "
                "does")


# --- the list against the source -------------------------------------------------------------------------------

def _is_namespace(node: ast.AST) -> bool:
    """``node`` is the expression ``torch.ops.fbgemm``."""
    return (isinstance(node, ast.Attribute) and node.attr == "fbgemm" and isinstance(node.value, ast.Attribute)
            and node.value.attr == "ops" and isinstance(node.value.value, ast.Name) and node.value.value.id == "torch")


def _pattern(node: ast.AST) -> str:
    """A regular expression for the op name ``node`` gives: a string, or an f-string whose fields are names."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return re.escape(node.value)
    if isinstance(node, ast.JoinedStr):
        return "".join(re.escape(str(part.value)) if isinstance(part, ast.Constant) else "[a-z0-9_]+"
                       for part in node.values)
    raise AssertionError(f"{SOURCE.name}:{getattr(node, 'lineno', '?')}: an op name that is neither a string nor "
                         "an f-string")


def source_references() -> dict[str, set[str]]:
    """Every op name (a regular expression) ``kernels/fbgemm.py`` gives ``torch.ops.fbgemm``, with how:
    ``"attribute"``, ``"getattr"`` or ``"hasattr"``. Fails on any other use of the namespace (an alias, say),
    which the list could miss."""
    tree = ast.parse(SOURCE.read_text())
    found: dict[str, set[str]] = {}
    used: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _is_namespace(node.value):
            found.setdefault(re.escape(node.attr), set()).add("attribute")
            used.add(id(node.value))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
              and node.args and _is_namespace(node.args[0])):
            found.setdefault(_pattern(node.args[1]), set()).add(node.func.id)
            used.add(id(node.args[0]))
    stray = [getattr(n, "lineno", "?") for n in ast.walk(tree) if _is_namespace(n) and id(n) not in used]
    assert not stray, f"{SOURCE.name}: torch.ops.fbgemm used otherwise than as op.name, getattr or hasattr at {stray}"
    return found


def test_list_is_the_sources():
    refs = source_references()
    assert refs, f"no fbgemm op found in {SOURCE}: the scan is broken"
    names = [op.name for op in OPS]
    assert len(set(names)) == len(names), "an op listed twice"
    unlisted = [p for p in refs if not any(re.fullmatch(p, n) for n in names)]
    assert not unlisted, f"{SOURCE.name} uses fbgemm ops tests/unit/fbgemm_ops.py does not list: {unlisted}"
    unused = [n for n in names if not any(re.fullmatch(p, n) for p in refs)]
    assert not unused, f"tests/unit/fbgemm_ops.py lists ops {SOURCE.name} no longer uses: {unused}"
    for op in OPS:
        how = set().union(*(h for p, h in refs.items() if re.fullmatch(p, op.name)))
        assert op.probe == (how == {"hasattr"}), f"{op.name}: {SOURCE.name} uses it by {sorted(how)}"


def test_source_scan_finds_each_form():
    """The scan itself: an attribute, a ``getattr`` with an f-string and a ``hasattr`` each found, an alias
    refused."""
    assert {"attribute", "getattr", "hasattr"} <= set().union(*source_references().values())
    assert re.fullmatch(_pattern(ast.parse('f"a_{x.y}_b"', mode="eval").body), "a_sgd_b")


# --- registered ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("op", OPS, ids=[op.name for op in OPS])
def test_op_is_registered(op: FbgemmOp):
    if not _registered(op.name):
        _skip_unless_cuda_build([op.name])
    if not op.probe:
        assert getattr(torch.ops.fbgemm, op.name).default._schema.name == f"fbgemm::{op.name}"


# --- the calls against the schemas -----------------------------------------------------------------------------

@dataclass
class Call:
    """One call of an fbgemm op, as the kernels made it."""

    op: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


@dataclass
class Recording:
    """Stands for ``torch.ops.fbgemm`` while the kernels run: hands out the installed ops wrapped so that each call
    is recorded (and not run, but :data:`RUN`'s); a name the build lacks raises ``AttributeError`` as the real
    namespace does, and is noted."""

    real: Any
    calls: list[Call] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        try:
            op = getattr(self.real, name)
        except AttributeError:
            self.missing.append(name)
            raise
        return _Recorded(name, op, self.calls)


class _Recorded:
    """One op of a :class:`Recording`: its overloads (``default._schema`` is read by the kernels' call by name),
    and a call that records."""

    def __init__(self, name: str, op: Any, calls: list[Call]) -> None:
        self.name, self.default, self._op, self._calls = name, op.default, op, calls

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._calls.append(Call(self.name, args, dict(kwargs)))
        return self._op(*args, **kwargs) if self.name in RUN else None


@contextmanager
def recording(monkeypatch: pytest.MonkeyPatch) -> Iterator[Recording]:
    fbgemm.cuda_available()  # its look-up of an op, made once: not a call of the entry point recorded
    rec = Recording(torch.ops.fbgemm)
    fbgemm._infos.cache_clear()  # its fbgemm call is made once per table count: make it again, recorded
    with monkeypatch.context() as m:
        m.setattr(torch.ops, "fbgemm", rec)
        yield rec


def _fits(t: Any, v: Any) -> bool:
    """``v`` is a value torch binds to an argument of schema type ``t`` (``None`` to a ``Tensor``: an undefined
    tensor, which fbgemm's kernels read as absent), but a ``bool`` for a number, which torch would take and no
    call of the kernels means."""
    if isinstance(t, torch.OptionalType):
        return v is None or _fits(t.getElementType(), v)
    if isinstance(t, torch.ListType):
        return isinstance(v, (list, tuple)) and all(_fits(t.getElementType(), x) for x in v)
    if isinstance(t, torch.TensorType):
        return v is None or isinstance(v, torch.Tensor)
    if isinstance(t, torch.BoolType):
        return isinstance(v, bool)
    if isinstance(t, (torch.IntType, torch.SymIntType)):
        return isinstance(v, int) and not isinstance(v, bool)
    if isinstance(t, torch.FloatType):
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    raise AssertionError(f"no rule for schema type {t}")


def binding_problems(schema: Any, call: Call, positional: tuple[str, ...]) -> list[str]:
    """What keeps ``call`` from binding to ``schema`` as meant (empty: nothing): arguments it lacks, arguments it
    does not take, values of another type, positional arguments not standing for ``positional``."""
    params = list(schema.arguments)
    problems = []
    if len(call.args) > sum(not a.kwarg_only for a in params):
        problems.append(f"{len(call.args)} positional arguments, more than the schema takes")
    at = [a.name for a in params[: len(call.args)]]
    if at != list(positional):
        problems.append(f"the positional arguments stand for {at}, the list says {list(positional)}")
    given = dict(zip(at, call.args))
    for name, v in call.kwargs.items():
        if name in given:
            problems.append(f"{name!r} given twice")
        given[name] = v
    names = {a.name for a in params}
    problems += [f"passes {n!r}, which the schema does not take" for n in given if n not in names]
    for a in params:
        if a.name in given:
            if not _fits(a.type, given[a.name]):
                problems.append(f"{a.name!r}: {type(given[a.name]).__name__} where the schema takes {a.type}")
        elif not a.has_default_value():
            problems.append(f"does not pass {a.name!r} ({a.type}), which has no default")
    return problems


def _tables(device: str) -> Tables:
    offsets = (0, ROWS[0] * DIMS[0] + GAP)
    storage = torch.randn(offsets[1] + ROWS[1] * DIMS[1], generator=torch.Generator().manual_seed(0))
    return Tables(storage.to(device), offsets, DIMS, ROWS)


def _batch(device: str, weighted: bool) -> Batch:
    """Three bags per table (one empty), every id inside its table."""
    ids = torch.tensor([0, 5, 2, 3, 4, 1, 4, 0, 3])
    offsets = torch.tensor([0, 2, 3, 6, 7, 7, 9])
    psw = torch.rand(ids.numel(), generator=torch.Generator().manual_seed(1)) if weighted else None
    return Batch(ids.to(device), offsets.to(device), None if psw is None else psw.to(device), ids_checked=True)


def _state(kind: OptimKind, tables: Tables) -> State:
    """``kind``'s state for ``tables``: a per-row state at each table's first row, a per-element one at each
    table's own offset, the first step."""
    states: list[torch.Tensor | None] = [None, None]
    offsets: list[tuple[int, ...]] = [(), ()]
    for i, spec in enumerate(kind.tensor_states):
        row = spec.shape is StateKind.ROW
        states[i] = torch.zeros(sum(ROWS) if row else tables.storage.numel(), device=tables.storage.device)
        offsets[i] = (0, ROWS[0]) if row else tuple(tables.offsets)
    return State(states[0], offsets[0], states[1], offsets[1], step=1)


def _hyper(kind: OptimKind) -> Hyper:
    return Hyper(kind, lr=0.1, eps=1e-3, weight_decay=0.0, weight_decay_mode=WeightDecayMode.NONE, beta1=0.8,
                 beta2=0.9)


def _device_form() -> str:
    return "cuda" if torch.cuda.is_available() else "meta"


FORMS = {"host": "cpu", "device": None}  # None: CUDA where there is a device, else meta


def _entry_points() -> dict[str, tuple[str, Callable[[str], Any]]]:
    """Each kernel entry point that calls fbgemm, by case: (the form it runs in, a call on that device)."""
    cases: dict[str, tuple[str, Callable[[str], Any]]] = {}
    for form in FORMS:
        for weighted in (False, True):
            w = "weighted" if weighted else "unweighted"
            cases[f"{form}-pool_sum-{w}"] = (form, functools.partial(_pool_sum, weighted=weighted))
            cases[f"{form}-dense_grad-{w}"] = (form, functools.partial(_dense_grad, weighted=weighted))
            for kind in OptimKind:
                if kind.fbgemm_cpu if form == "host" else kind.fbgemm_cuda:
                    cases[f"{form}-update_{kind.name}-{w}"] = (form, functools.partial(_update, weighted=weighted,
                                                                                        kind=kind))
    return cases


def _pool_sum(device: str, *, weighted: bool) -> None:
    fbgemm.pool_sum(_tables(device), _batch(device, weighted))


def _dense_grad(device: str, *, weighted: bool) -> None:
    fbgemm.dense_grad(torch.randn(3, sum(DIMS)).to(device), DIMS, ROWS, _batch(device, weighted))


def _update(device: str, *, weighted: bool, kind: OptimKind) -> None:
    tables = _tables(device)
    fbgemm.update(tables, _batch(device, weighted), torch.randn(3, sum(DIMS)).to(device), _state(kind, tables),
                  _hyper(kind))


def _unified_memory_query(device: str) -> None:
    """``in_unified_memory`` of a CUDA tensor (a fake one without a CUDA device: the query only reads its device)."""
    if device == "cuda":
        fbgemm.in_unified_memory(torch.zeros(4, device="cuda"))
        return
    with FakeTensorMode():
        fbgemm.in_unified_memory(torch.zeros(4, device="cuda"))


ENTRY_POINTS = {**_entry_points(), "device-in_unified_memory": ("device", _unified_memory_query)}


@pytest.mark.parametrize("case", sorted(ENTRY_POINTS))
def test_calls_bind_to_schemas(monkeypatch, case):
    form, run = ENTRY_POINTS[case]
    device = FORMS[form] or _device_form()
    with recording(monkeypatch) as rec:
        try:
            run(device)
        except AttributeError:
            if not rec.missing:
                raise
            _skip_unless_cuda_build(rec.missing)
    assert rec.calls, f"{case}: no fbgemm op called"
    listed = by_name()
    unlisted = sorted({c.op for c in rec.calls if c.op not in listed})
    assert not unlisted, f"{case}: called fbgemm ops tests/unit/fbgemm_ops.py does not list: {unlisted}"
    for call in rec.calls:
        op = listed[call.op]
        assert not op.probe, f"{call.op} is listed as looked for only, but was called"
        schema = getattr(torch.ops.fbgemm, call.op).default._schema
        problems = binding_problems(schema, call, op.positional)
        assert not problems, f"{case}: {call.op} ({_build()}): " + "; ".join(problems)


def kind_arguments(kind: OptimKind) -> set[str]:
    """The arguments of ``kind``'s backward-with-update op that carry its own values: its hyper-parameters but
    ``lr`` (a tensor every kind passes) and weight decay (never sent to fbgemm: its CPU kernels ignore it, and on
    CUDA the kernels run the torch-op math for it), its step count as ``iter``, and five tensors per state."""
    names = {h for h, _ in kind.hyper if h != "weight_decay"}
    if kind.counts_steps:
        names.add("iter")
    for i, _ in enumerate(kind.tensor_states, start=1):
        names |= {f"momentum{i}_{part}" for part in ("host", "dev", "uvm", "placements", "offsets")}
    return names


WRAPPERS = [(k, w) for k in OptimKind if k.fbgemm_cpu or k.fbgemm_cuda for w in (False, True)]


@pytest.mark.parametrize(("kind", "weighted"), WRAPPERS, ids=[backward_wrapper(k, w) for k, w in WRAPPERS])
def test_backward_op_takes_the_kinds_arguments(kind, weighted):
    name = backward_wrapper(kind, weighted)
    if not _registered(name):
        _skip_unless_cuda_build([name])
    wanted = kind_arguments(kind)
    takes = {a.name for a in getattr(torch.ops.fbgemm, name).default._schema.arguments}
    assert wanted <= takes, f"{name} ({_build()}) takes no {sorted(wanted - takes)}"
    for form, device in FORMS.items():
        device = device or _device_form()
        tables = _tables(device)
        args = fbgemm.table_args(tuple(tables.offsets), DIMS, ROWS, tables.storage.device)
        values = fbgemm.backward_values(tables.storage, args, _batch(device, weighted),
                                        torch.randn(3, sum(DIMS)).to(device), _state(kind, tables), _hyper(kind))
        assert wanted <= set(values), f"{form}: the kernels give {name} no {sorted(wanted - set(values))}"


def test_kind_arguments_follow_the_record():
    """The names come from the kinds' records: Adam's states, step and betas; nothing for SGD."""
    assert {"iter", "beta1", "beta2", "eps", "momentum2_dev", "momentum1_offsets"} <= kind_arguments(lookup("adam"))
    assert kind_arguments(lookup("sgd")) == set()


def test_binding_problems_are_found():
    """The binding check itself, on a schema of the installed fbgemm: a missing, an unknown, a mistyped and a
    misplaced argument are each reported."""
    schema = torch.ops.fbgemm.get_infos_metadata.default._schema
    unused = torch.empty(0)
    assert binding_problems(schema, Call("get_infos_metadata", (unused, 1, 2), {}), ("unused", "B", "T")) == []
    assert binding_problems(schema, Call("get_infos_metadata", (unused, 1), {}), ("unused", "B"))[0].startswith(
        "does not pass 'T'")
    assert "'B': float where" in binding_problems(schema, Call("get_infos_metadata", (unused, 1.0, 2), {}),
                                              ("unused", "B", "T"))[0]
    assert "which the schema does not take" in binding_problems(
        schema, Call("get_infos_metadata", (unused,), {"B": 1, "T": 2, "tables": 2}), ("unused",))[0]
    assert "stand for" in binding_problems(schema, Call("get_infos_metadata", (unused, 1, 2), {}),
                                           ("unused", "T", "B"))[0]
