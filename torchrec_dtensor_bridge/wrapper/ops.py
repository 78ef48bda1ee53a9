"""The handlers of :class:`LocalShardsWrapper`'s ops named one by one: copies, views, fills, comparisons.

The element-wise families are in ``elementwise.py``, reductions and the gather in ``reductions.py``.

Registered once, at import, in the table of ``op_table`` (see there).
"""

from __future__ import annotations


import torch

from .elementwise import empty_of
from .elementwise import like as _like
from .elementwise import check_operand, operand_part
from .local_shards_wrapper import LocalShardsWrapper
from .op_table import implements

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


@implements(aten._to_copy.default)
def _to_copy(func, args, kwargs):
    w = args[0]
    if not w.local_shards():
        return empty_of(w, kwargs.get("dtype"), kwargs.get("device"))
    return _like(w, [func(s, *args[1:], **kwargs) for s in w.local_shards()])


@implements(aten.detach.default, aten.alias.default)
def _unary_alias(func, args, kwargs):
    w = args[0]
    return _like(w, [func(s) for s in w.local_shards()])


@implements(aten.clone.default)
def _clone(func, args, kwargs):
    fmt = kwargs.get("memory_format")
    if fmt not in (None, torch.preserve_format, torch.contiguous_format):
        raise NotImplementedError(f"LocalShardsWrapper.clone does not support memory_format={fmt}")
    return _like(args[0], [s.clone() for s in args[0].local_shards()])


@implements(aten.new_empty.default, aten.new_zeros.default, aten.new_ones.default, aten.new_full.default)
def _new(func, args, kwargs):
    """A new tensor of the wrapper's own shape is one of its blocks (the same layout, filled as asked); of no
    elements, a wrapper holding nothing (DTensor's local tensor on a rank outside the mesh); of any other
    size, a plain tensor of that size, dtype and device, as ``Tensor.new_*`` gives (DTensor asks for its
    own even split's local size: its result is then a DTensor of that split, its values as asked)."""
    w, size = args[0], torch.Size(args[1])
    if size == w.shape:
        return _like(w, [func(s, s.shape, *args[2:], **kwargs) for s in w.local_shards()])
    if size.numel() == 0:
        return empty_of(w, kwargs.get("dtype"), None)
    return func(torch.empty(0, dtype=w.dtype, device=w.device), size, *args[2:], **kwargs)


@implements(aten.view.default, aten._unsafe_view.default, aten.reshape.default)
def _view(func, args, kwargs):
    w, size = args[0], torch.Size(args[1])
    if size in (w.shape, w.global_shape):
        # DTensor views a local tensor as itself (from_local) or as the global shape;
        # per shard both mean "the same shard": the new wrapper holds the same shard
        # tensors, so it aliases their storage exactly as a view would.
        return w._like(list(w.local_shards()))
    if len(w.local_shards()) == 1 and size.numel() == w.numel() and w.local_offsets()[0] == torch.Size(
        [0] * w.dim()
    ) and size == w.local_shards()[0].shape:
        return _like(w, [w.local_shards()[0].view(size)])
    raise NotImplementedError(
        f"LocalShardsWrapper cannot view shape {list(w.shape)} (global {list(w.global_shape)}) as {list(size)}"
    )


@implements(aten.copy_.default)
def _copy(func, args, kwargs):
    w, src = args[0], args[1]
    check_operand(w, src, func)
    parts = [operand_part(w, src, i, func) for i in range(len(w.local_shards()))]
    for dst, part in zip(w.local_shards(), parts):
        dst.copy_(part, **kwargs)
    return w


@implements(aten.equal.default)
def _equal(func, args, kwargs):
    a, b = args
    if not isinstance(a, LocalShardsWrapper) or not isinstance(b, LocalShardsWrapper):
        return False
    return (
        a.local_offsets() == b.local_offsets()
        and a.local_sizes() == b.local_sizes()
        and all(torch.equal(x, y) for x, y in zip(a.local_shards(), b.local_shards()))
    )


@implements(aten.is_same_size.default)
def _is_same_size(func, args, kwargs):
    return args[0].shape == args[1].shape


@implements(aten.fill_.Scalar, aten.fill_.Tensor)
def _fill(func, args, kwargs):
    for s in args[0].local_shards():
        func(s, args[1])
    return args[0]


@implements(aten.zero_.default)
def _zero(func, args, kwargs):
    for s in args[0].local_shards():
        s.zero_()
    return args[0]


@implements(c10d.wait_tensor.default)
def _wait(func, args, kwargs):
    w = args[0]
    for s in w.local_shards():
        func(s)
    return w
