"""Kernel calls for many shards at once: one call per storage.

A TorchRec fused module keeps the tables of a rank that share a kernel configuration in ONE buffer, and the
shards :func:`...state_dict_to_dtensor` makes of them are views of it. The kernel ops (:mod:`.ops`) take
tables as element offsets into one flat storage, so the requests whose shards share a storage are looked
up, and updated, together. A request holds tensors, an optimizer's hyper-parameters (its kind a record of
:mod:`...optim_kinds`) and numbers: nothing of the caller's plans.

A request's ids must lie inside its shard's rows and its offsets run forward within its ids: the lookups
check their batches at their API edge (:class:`...lookup.arguments.ValueCheck`) and select each shard's
local ids from them, so these calls tell the ops that the ids are checked (``ids_checked``) and the ops do
not check them again (on CUDA, a device synchronisation per op and storage). A direct caller of
``torch.ops.tdb`` keeps the ops' own check.

1. :func:`accepts` - whether a shard can go through the ops at all (2-D, contiguous, fp32, fp16 or bf16; on
   CPU, or on CUDA with fbgemm's CUDA build and rows its kernels can read: aligned for their vector loads
   (:data:`.limits.VECTOR_BYTES`), at most :data:`.limits.MAX_D` columns). The ops pool half-precision rows into fp32; a request's output and
   dense gradient come back in its shard's dtype (as ``torch.embedding_bag``'s would).
2. :func:`pool` - :class:`Pooling` requests whose shard the ops accept, with int64 ids and offsets, and that
   sum are grouped by storage (and batch size, and whether they carry per-sample weights); each group is
   ONE ``tdb::pool_sum`` over a flat view of the storage spanning its shards (no copy), and each request's
   output is its columns of the result. MAX pooling, other dtypes and strided shards run
   ``torch.embedding_bag`` on the shard itself (fbgemm has no MAX; max keeps its arg-max rows for backward).
3. :func:`weight_grads` - the dense gradients of requests' shards, grouped by storage as for pooling: ONE
   ``tdb::pool_sum_backward`` per group (scattered by the arg-max rows for max; :func:`weight_grad` for one).
4. :func:`update` - :class:`Update` requests (each one a shard :func:`update_supported` accepts) are grouped
   by weight storage, state storage, hyper-parameters and step; each group is ONE ``tdb::sparse_update``.

On CUDA, a group whose batches together break a limit of fbgemm's kernels that each meets alone (ids or bag
boundaries past int32, :func:`.limits.batch_misfit`) makes one call per shard instead.

Example::

    >>> out, _ = kernels.pool([kernels.Pooling(shard, ids, offsets, None, False)])[0]
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

from ..optim_kinds import Hyper
from . import choose, fbgemm, limits, native
from .args import Batch, Tables
from .reference import add_bag_grads

__all__ = ["Pooling", "Update", "accepts", "pool", "update", "update_supported", "weight_grad", "weight_grads"]


_Member = TypeVar("_Member")


def accepts(shard: torch.Tensor) -> bool:
    """Whether ``shard`` can be looked up and updated through the ops (whatever runs underneath): on CUDA,
    only where fbgemm's CUDA kernels can take it whatever the batch (:func:`.limits.fits`: vector-aligned
    rows of 1 to :data:`.limits.MAX_D` columns); fp32, fp16 or bf16 (on CPU, what runs is
    :func:`.choose.for_weights`'s: bf16 only on ours)."""
    if shard.dim() != 2 or not shard.is_contiguous() or shard.dtype not in native.DTYPES:
        return False
    return shard.device.type == "cpu" or (shard.device.type == "cuda" and fbgemm.cuda_available()
                                          and limits.fits(shard, [0], [shard.shape[1]]))


def _int64(ids: torch.Tensor, offsets: torch.Tensor) -> bool:
    """The ops take int64 ids and offsets (fbgemm's kernels, one index dtype for both)."""
    return ids.dtype == torch.int64 and offsets.dtype == torch.int64


def _calls(members: list[_Member], ids: Callable[[_Member], int], bags: int, device: torch.device,
           ) -> list[list[_Member]]:
    """The kernel calls of one group: all its members in one, or, on CUDA where together their batches
    (``bags`` bags each, ``ids(member)`` ids) break a limit of fbgemm's kernels, one call per member."""
    if device.type != "cuda" or len(members) == 1 or limits.batch_misfit(
            len(members), bags, sum(ids(m) for m in members)) is None:
        return [members]
    return [[m] for m in members]


@dataclass(frozen=True)
class Pooling:
    """One shard's pooled lookup.

    Attributes:
        shard: the table's rows here, ``(rows, dim)``, read in place.
        ids: its local ids (int64).
        offsets: its ``bags + 1`` bag boundaries.
        weights: per-sample weights, one per id, or ``None``.
        max_mode: MAX pooling (else SUM).
        out_dtype: the output's dtype (``None``: the shard's); the ops pool in fp32.
    """

    shard: torch.Tensor
    ids: torch.Tensor
    offsets: torch.Tensor
    weights: torch.Tensor | None
    max_mode: bool
    out_dtype: torch.dtype | None = None


def _flat(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
    """A flat view of the storage ``tensors`` share, spanning them all, and each one's element offset in it."""
    lo = min(int(t.storage_offset()) for t in tensors)
    hi = max(int(t.storage_offset()) + t.numel() for t in tensors)
    return torch.as_strided(tensors[0], (hi - lo,), (1,), lo), [int(t.storage_offset()) - lo for t in tensors]


def _batch(parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]],
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Several tables' ``(ids, offsets, weights)`` as one batch in the ops' form (offsets table-major)."""
    if len(parts) == 1:
        return parts[0]
    ids = torch.cat([p[0] for p in parts])
    pieces, at = [parts[0][1].narrow(0, 0, 1)], 0
    for p in parts:
        pieces.append(p[1].narrow(0, 1, p[1].numel() - 1) + at)
        at += p[0].numel()
    psw = None if parts[0][2] is None else torch.cat([p[2] for p in parts if p[2] is not None])
    return ids, torch.cat(pieces), psw


def _home(t: torch.Tensor) -> tuple[int, str]:
    return t.untyped_storage().data_ptr(), str(t.device)


def pool(requests: list[Pooling]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Per request, its ``(bags, dim)`` output (a column view when it shared a kernel call) and, for max, the
    arg-max row of every (bag, column) (``None`` for a sum); no autograd graph."""
    out: list[tuple[torch.Tensor, torch.Tensor | None] | None] = [None] * len(requests)
    groups: dict[tuple, list[int]] = {}
    with torch.no_grad():
        for k, r in enumerate(requests):
            if r.max_mode or not accepts(r.shard) or not _int64(r.ids, r.offsets):
                res, _, _, argmax = torch.embedding_bag(r.shard, r.ids, r.offsets, False, 2 if r.max_mode else 0,
                                                        False, r.weights, True)
                out[k] = (res if r.out_dtype in (None, res.dtype) else res.to(r.out_dtype),
                          argmax if r.max_mode else None)
                continue
            key = (*_home(r.shard), r.offsets.numel(), r.weights is not None, r.out_dtype)
            groups.setdefault(key, []).append(k)
        for group in groups.values():
            first = requests[group[0]]
            for members in _calls(group, lambda k: requests[k].ids.numel(), first.offsets.numel() - 1,
                                  first.shard.device):
                _pool_call([requests[k] for k in members], members, out)
    return [o for o in out if o is not None]


def _pool_call(requests: list[Pooling], at_out: list[int],
               out: list[tuple[torch.Tensor, torch.Tensor | None] | None]) -> None:
    """ONE ``tdb::pool_sum`` for ``requests`` (shards of one storage); each one's output at its place in ``out``."""
    shards = [r.shard for r in requests]
    flat, at = _flat(shards)
    ids, offsets, psw = _batch([(r.ids, r.offsets, r.weights) for r in requests])
    res = torch.ops.tdb.pool_sum(flat, at, [s.shape[1] for s in shards], [s.shape[0] for s in shards], ids, offsets,
                                 None if psw is None else psw.to(torch.float32), ids_checked=True)
    want = requests[0].out_dtype or shards[0].dtype  # half-precision tables pool in fp32
    if res.dtype != want:
        res = res.to(want)
    c0 = 0
    for k, s in zip(at_out, shards):
        out[k] = (res if len(requests) == 1 else res.narrow(1, c0, s.shape[1]), None)
        c0 += s.shape[1]


def weight_grad(grad: torch.Tensor, r: Pooling, argmax: torch.Tensor | None = None) -> torch.Tensor:
    """The dense gradient of ``r.shard`` given its output gradient (for max: ``argmax`` from :func:`pool`,
    and ``grad`` already masked to the entries that count)."""
    return weight_grads([(grad, r, argmax)])[0]


def weight_grads(requests: list[tuple[torch.Tensor, Pooling, torch.Tensor | None]]) -> list[torch.Tensor]:
    """:func:`weight_grad` of each ``(grad, request, argmax)``; the sums whose shards share a storage (and batch
    size, and whether they carry per-sample weights) in ONE ``tdb::pool_sum_backward``, each shard's gradient a
    view of its result (the ops give every table's gradient back to back)."""
    out: list[torch.Tensor | None] = [None] * len(requests)
    groups: dict[tuple, list[int]] = {}
    for k, (grad, r, argmax) in enumerate(requests):
        if argmax is not None:
            out[k] = torch.zeros_like(r.shard).scatter_add_(0, argmax.clamp(min=0), grad.to(r.shard.dtype))
        elif not accepts(r.shard) or not _int64(r.ids, r.offsets):
            out[k] = add_bag_grads(torch.zeros_like(r.shard), grad, r.ids, r.offsets, r.weights)
        else:
            groups.setdefault((*_home(r.shard), r.offsets.numel(), r.weights is not None), []).append(k)
    for group in groups.values():
        first = requests[group[0]][1]
        for members in _calls(group, lambda k: requests[k][1].ids.numel(), first.offsets.numel() - 1,
                              first.shard.device):
            _grad_call([requests[k] for k in members], members, out)
    return [o for o in out if o is not None]


def _grad_call(requests: list[tuple[torch.Tensor, Pooling, torch.Tensor | None]], at_out: list[int],
               out: list[torch.Tensor | None]) -> None:
    """ONE ``tdb::pool_sum_backward`` for ``requests`` (shards of one storage); each one's gradient at its place
    in ``out``."""
    shards = [r.shard for _, r, _ in requests]
    grad = _columns([g.to(torch.float32) for g, _, _ in requests])
    grad = grad if grad.stride(-1) == 1 else grad.contiguous()
    ids, offsets, psw = _batch([(r.ids, r.offsets, r.weights) for _, r, _ in requests])
    flat = torch.ops.tdb.pool_sum_backward(grad, [s.shape[1] for s in shards], [s.shape[0] for s in shards], ids,
                                           offsets, None if psw is None else psw.to(torch.float32), ids_checked=True)
    if flat.dtype != shards[0].dtype:  # a weight's gradient has its dtype
        flat = flat.to(shards[0].dtype)
    at = 0
    for k, s in zip(at_out, shards):
        out[k] = flat.narrow(0, at, s.numel()).view(s.shape)
        at += s.numel()


@dataclass(frozen=True)
class Update:
    """One shard's fused update: its touched rows, and their state, in place from its output gradient.

    Attributes:
        shard: the table's rows here, ``(rows, dim)``, updated in place.
        ids: its local ids (int64), touching the rows to update.
        offsets: its ``bags + 1`` bag boundaries.
        weights: per-sample weights (fp32), one per id, or ``None``.
        grad: the bags' output gradient, ``(bags, dim)``.
        hyper: the optimizer's hyper-parameters.
        state: the kind's tensor states for this shard (:attr:`...optim_kinds.OptimKind.tensor_states`, in
            order): ``(rows,)`` for a per-row state, the shard's shape for an element-wise one.
        step: the table's step count, this step included.
    """

    shard: torch.Tensor
    ids: torch.Tensor
    offsets: torch.Tensor
    weights: torch.Tensor | None
    grad: torch.Tensor
    hyper: Hyper
    state: tuple[torch.Tensor, ...]
    step: int


_NO_IDS = torch.empty(0, dtype=torch.int64)


def update_supported(shard: torch.Tensor, hyper: Hyper, weights: torch.Tensor | None = None, *,
                     ids: torch.Tensor | None = None, offsets: torch.Tensor | None = None) -> bool:
    """Whether :func:`update` can update ``shard`` with ``hyper`` (and per-sample ``weights``): a shard the ops
    accept, fp32 weights, a kind a kernel the ranks settled on has (:func:`.choose.update_impl`), and a shard
    within that kernel's limits (ours: :func:`.native.fits`; fbgemm's on CUDA: :func:`.limits.misfit`); with
    the update's ``ids`` and ``offsets``, a batch within them too. ``False`` sends the shard to the
    optimizer's torch-op math, before anything runs."""
    if not accepts(shard) or (weights is not None and weights.dtype != torch.float32):
        return False
    if ids is not None and offsets is not None and not _int64(ids, offsets):
        return False
    which = choose.update_impl(shard.device, hyper.kind, hyper.weight_decay, shard.dtype,
                               stochastic=hyper.stochastic_rounding, nbytes=shard.numel() * shard.element_size())
    if which is choose.Impl.TORCH:
        return False
    n = 0 if ids is None else ids.numel()
    if shard.device.type == "cuda":
        return limits.batch_misfit(1, 0 if offsets is None else offsets.numel() - 1, n) is None
    if which is choose.Impl.NATIVE:
        width, rows = shard.shape[1], shard.shape[0]
        return native.fits(Tables(shard, [0], [width], [rows]), Batch(_NO_IDS if ids is None else ids, _NO_IDS))
    return True


def _columns(grads: list[torch.Tensor]) -> torch.Tensor:
    """The output gradients side by side: the base view itself when they are adjacent columns of one tensor
    (as the exchanges hand them), else a copy."""
    g0 = grads[0]
    adjacent = all(g.untyped_storage().data_ptr() == g0.untyped_storage().data_ptr() and g.stride() == g0.stride()
                   and g.shape[0] == g0.shape[0] for g in grads)
    at = g0.storage_offset()
    for g in grads:
        adjacent = adjacent and g.storage_offset() == at and g.stride(-1) == 1
        at += g.shape[1]
    if adjacent:
        width = sum(g.shape[1] for g in grads)
        return torch.as_strided(g0, (g0.shape[0], width), (g0.stride(0) if g0.shape[0] > 1 else width, 1),
                                g0.storage_offset()).to(torch.float32)
    return torch.cat([g.to(torch.float32) for g in grads], dim=1)


def update(updates: list[Update]) -> None:
    """Apply each update's optimizer to its shard in place, touched rows only; ONE ``tdb::sparse_update`` per
    group of shards sharing weight storage, state storage, hyper-parameters and step."""
    groups: dict[tuple, list[Update]] = {}
    for u in updates:
        key = (*_home(u.shard), u.hyper, u.step, u.offsets.numel(), u.weights is not None,
               *(_home(s) for s in u.state))
        groups.setdefault(key, []).append(u)
    for group in groups.values():
        u0 = group[0]
        for members in _calls(group, lambda u: u.ids.numel(), u0.offsets.numel() - 1, u0.shard.device):
            _update_call(members)


def _update_call(members: list[Update]) -> None:
    """ONE ``tdb::sparse_update`` for ``members`` (shards of one storage, their states of one storage each)."""
    shards = [u.shard.detach() for u in members]
    flat, at = _flat(shards)
    first = members[0]
    m1: torch.Tensor | None = None
    m2: torch.Tensor | None = None
    m1_at: list[int] = []
    m2_at: list[int] = []
    if len(first.state) > 0:
        m1, m1_at = _flat([u.state[0] for u in members])
    if len(first.state) > 1:
        m2, m2_at = _flat([u.state[1] for u in members])
    ids, offsets, psw = _batch([(u.ids, u.offsets, u.weights) for u in members])
    hyper = first.hyper
    torch.ops.tdb.sparse_update(
        flat, at, [s.shape[1] for s in shards], [s.shape[0] for s in shards], _columns([u.grad for u in members]),
        ids, offsets, psw, hyper.kind.name, m1, m1_at, m2, m2_at, hyper.lr, hyper.eps, hyper.weight_decay,
        hyper.weight_decay_mode.value, hyper.beta1, hyper.beta2, first.step, ids_checked=True,
        stochastic_rounding=hyper.stochastic_rounding,
    )
