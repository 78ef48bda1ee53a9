"""One-process tests of LocalShardsWrapper: shape, accessors, validation, op table,
pickling, the DCP hooks and a single-process DCP save/load.

Every expectation is computed here on plain tensors (slices of a full table,
the same op applied to plain shards), never read back from the wrapper.
"""

import copy
import io
import re

import pytest
import torch

from tests.layout import committed
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import WriteItemType

from torchrec_dtensor_bridge.layout import ShardLayout
from torchrec_dtensor_bridge.wrapper import LocalShardsWrapper

NO_DIST_WARNING = "ignore:torch.distributed is disabled:UserWarning"


def _table(shape, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


def _box(offsets, sizes):
    return tuple(slice(o, o + s) for o, s in zip(offsets, sizes))


# Named cases: (global_shape, [(offsets, sizes)], expected packed shape, stacked dim).
CASES = {
    # two row shards on one rank (rows 0-1 and 5-7): stacked on dim 0
    "rows": ((8, 4), [((0, 0), (2, 4)), ((5, 0), (3, 4))], (5, 4), 0),
    # two column shards of unequal width: stacked on dim 1
    "cols": ((8, 16), [((0, 0), (8, 3)), ((0, 3), (8, 5))], (8, 8), 1),
    # two column shards of EQUAL width: still dim 1 (not (16, 4))
    "cols_equal": ((8, 16), [((0, 4), (8, 4)), ((0, 12), (8, 4))], (8, 8), 1),
    # equal row shards: (4, 16) by rows
    "rows_equal": ((8, 16), [((2, 0), (2, 16)), ((6, 0), (2, 16))], (4, 16), 0),
    "one": ((8, 4), [((6, 0), (2, 4))], (2, 4), 0),
    "three_rows_1d": ((10,), [((0,), (3,)), ((3,), (3,)), ((9,), (1,))], (7,), 0),
}
OP_CASES = ["rows", "cols", "cols_equal", "one", "three_rows_1d"]


def _make(case, seed=0, dtype=torch.float32):
    """A wrapper for ``case`` over clones of a full random table, and that table."""
    gshape, boxes, _, _ = CASES[case]
    full = _table(gshape, seed, dtype)
    shards = [full[_box(o, s)].clone() for o, s in boxes]
    return LocalShardsWrapper(shards, [o for o, _ in boxes], gshape), full


def _expected_split(case, packed):
    """``packed`` cut into the case's shards by hand, along its stacked dim."""
    _, boxes, _, dim = CASES[case]
    out, start = [], 0
    for _, sizes in boxes:
        out.append(packed.narrow(dim, start, sizes[dim]))
        start += sizes[dim]
    return out


def _assert_same_layout(a, b):
    assert isinstance(a, LocalShardsWrapper) and isinstance(b, LocalShardsWrapper)
    assert a.local_offsets() == b.local_offsets()
    assert a.local_sizes() == b.local_sizes()
    assert a.global_shape == b.global_shape and a.shape == b.shape


def _assert_shards_equal(w, expected):
    got = w.local_shards()
    assert len(got) == len(expected)
    for i, (x, y) in enumerate(zip(got, expected)):
        assert x.dtype == y.dtype, (i, x.dtype, y.dtype)
        assert torch.equal(x, y), (i, x, y)


# --------------------------------------------------------------------- shape
@pytest.mark.parametrize("case", list(CASES))
def test_packed_shape(case):
    gshape, boxes, shape, dim = CASES[case]
    w, _ = _make(case)
    assert w.shape == torch.Size(shape)
    assert w.stack_dim == dim
    assert w.stride() == torch.empty(shape).stride()
    assert w.global_shape == torch.Size(gshape)
    assert w.dtype == torch.float32 and w.device.type == "cpu"


def test_column_shards_of_equal_width_stack_on_dim_1():
    w = LocalShardsWrapper([torch.zeros(8, 4), torch.ones(8, 4)], [(0, 0), (0, 4)], (8, 8))
    assert w.shape == (8, 8)  # the buggy upstream rule would give (16, 4) or hide the cut dim
    assert w.pack()[:, 4:].eq(1).all() and w.pack()[:, :4].eq(0).all()


def test_several_row_shards_stack_on_dim_0():
    # the shipped torch/torchrec wrappers concatenate along dim 1: (2, 8) here
    w = LocalShardsWrapper([torch.zeros(1, 4), torch.ones(1, 4)], [(0, 0), (1, 0)], (2, 4))
    assert w.shape == (2, 4)


@pytest.mark.parametrize("gshape, shape", [((8, 4), (0, 0)), ((10,), (0,)), (None, (0, 0))])
def test_no_shards(gshape, shape):
    w = LocalShardsWrapper([], [], gshape, dtype=torch.float16)
    assert w.shape == torch.Size(shape)
    assert w.is_empty_shard()
    assert w.local_shards() == []
    # one all-zero size at one all-zero offset, as TorchRec's: the two lists pair up
    assert w.local_sizes() == [torch.Size([0] * len(shape))]
    assert w.local_offsets() == [torch.Size([0] * len(shape))]
    assert w.local_chunks == []
    assert w.dtype == torch.float16
    if gshape is not None:
        assert w.global_shape == torch.Size(gshape)
        assert w.storage_metadata().size == torch.Size(gshape)
    assert w.storage_metadata().chunks == []


# ----------------------------------------------------------------- accessors
@pytest.mark.parametrize("case", list(CASES))
def test_accessors(case):
    gshape, boxes, _, _ = CASES[case]
    shards = [torch.full(s, float(i)) for i, (_, s) in enumerate(boxes)]
    w = LocalShardsWrapper(shards, [o for o, _ in boxes], gshape)
    got = w.local_shards()
    assert len(got) == len(shards)
    assert all(a is b and a.data_ptr() == b.data_ptr() for a, b in zip(got, shards))
    offsets = w.local_offsets()
    assert isinstance(offsets, list) and all(type(o) is torch.Size for o in offsets)
    assert offsets == [torch.Size(o) for o, _ in boxes]
    sizes = w.local_sizes()
    assert isinstance(sizes, list) and all(type(s) is torch.Size for s in sizes)
    assert sizes == [torch.Size(s) for _, s in boxes]
    assert w.local_chunks == [
        ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s in boxes
    ]
    md = w.storage_metadata()
    assert md.size == torch.Size(gshape)
    assert md.properties.dtype == torch.float32
    assert md.chunks == w.local_chunks
    assert not w.is_empty_shard()


def test_local_offsets_is_a_copy():
    w, _ = _make("rows")
    w.local_offsets().clear()
    assert len(w.local_offsets()) == 2


def test_global_shape_defaults_to_packed_shape():
    w = LocalShardsWrapper([torch.ones(2, 3)], [(4, 0)])
    assert w.global_shape == torch.Size([2, 3])
    assert w.storage_metadata().size == torch.Size([2, 3])


def test_layout_sets_global_shape():
    lay = ShardLayout.row_wise((8, 4), [2, 3, 3], dtype=torch.float32, name="t")
    w = LocalShardsWrapper([torch.ones(3, 4)], [(2, 0)], layout=lay)
    assert w.global_shape == torch.Size([8, 4]) and w.layout_of_table is lay


# ---------------------------------------------------------------- validation
def _raises(match, *args, **kwargs):
    with pytest.raises(ValueError, match=re.escape(match)):
        LocalShardsWrapper(*args, **kwargs)


def test_mismatched_counts():
    _raises("got 2 local_shards but 1 local_offsets", [torch.ones(1, 2), torch.ones(1, 2)], [(0, 0)])
    _raises("got 0 local_shards but 1 local_offsets", [], [(0, 0)])


def test_mixed_dtype():
    _raises(
        "shard 1 has dtype torch.float64, but shard 0 has dtype torch.float32",
        [torch.ones(1, 2), torch.ones(1, 2, dtype=torch.float64)],
        [(0, 0), (1, 0)],
    )


def test_mixed_device():
    _raises(
        "shard 2 has device meta, but shard 0 has device cpu",
        [torch.ones(1, 2), torch.ones(1, 2), torch.empty(1, 2, device="meta")],
        [(0, 0), (1, 0), (2, 0)],
    )


def test_mixed_ndim():
    _raises("shard 1 has ndim 1, but shard 0 has ndim 2", [torch.ones(1, 2), torch.ones(2)], [(0, 0), (1,)])


def test_offsets_of_wrong_length():
    _raises("shard 0 has 2 dims but offsets [0] have 1 values", [torch.ones(1, 2)], [(0,)])


def test_global_shape_of_wrong_length():
    _raises("shard 0 has 2 dims but global_shape [4] has 1", [torch.ones(1, 2)], [(0, 0)], (4,))


def test_negative_offsets():
    _raises("shard 1 has negative offsets [2, -1]", [torch.ones(1, 2), torch.ones(1, 2)], [(0, 0), (2, -1)])


def test_offsets_out_of_global_shape_rows():
    _raises(
        "shard 1 at offsets [7, 0] with sizes [2, 4] exceeds global_shape [8, 4] in dim 0 (7 + 2 > 8)",
        [torch.ones(2, 4), torch.ones(2, 4)],
        [(0, 0), (7, 0)],
        (8, 4),
    )


def test_column_offset_equal_to_embedding_dim_is_rejected():
    # the widely copied upstream example: a 2x16 shard at column offset 16 of an 8x16 table
    _raises(
        "shard 0 at offsets [0, 16] with sizes [2, 16] exceeds global_shape [8, 16] in dim 1 (16 + 16 > 16)",
        [torch.ones(2, 16)],
        [(0, 16)],
        (8, 16),
    )


def test_overlapping_shards():
    _raises(
        "shards 0 (offsets [0, 0], sizes [3, 4]) and 2 (offsets [2, 0], sizes [2, 4]) overlap",
        [torch.ones(3, 4), torch.ones(1, 4), torch.ones(2, 4)],
        [(0, 0), (6, 0), (2, 0)],
        (8, 4),
    )


def test_touching_and_empty_shards_do_not_overlap():
    w = LocalShardsWrapper(
        [torch.ones(2, 4), torch.ones(0, 4), torch.ones(2, 4)], [(0, 0), (1, 0), (2, 0)], (4, 4)
    )
    assert w.shape == (4, 4)


def test_non_tensor_shard_is_a_type_error():
    with pytest.raises(TypeError, match="list of Tensors"):
        LocalShardsWrapper([[1.0, 2.0]], [(0,)])


# ------------------------------------------------------------------------ ops
@pytest.mark.parametrize("case", OP_CASES)
def test_to_dtype(case):
    w, _ = _make(case)
    plain = [s.clone() for s in w.local_shards()]
    out = w.to(torch.float64)
    _assert_same_layout(out, w)
    assert out.dtype == torch.float64
    _assert_shards_equal(out, [s.to(torch.float64) for s in plain])
    _assert_shards_equal(w, plain)  # source untouched


def test_to_dtype_of_empty_wrapper():
    out = LocalShardsWrapper([], [], (4, 4)).to(torch.float64)
    assert isinstance(out, LocalShardsWrapper) and out.dtype == torch.float64
    assert out.is_empty_shard() and out.global_shape == (4, 4)


def test_a_cast_records_the_dtype_in_the_layout_on_ranks_with_and_without_shards():
    """Every rank's layout of the cast table must agree (its digest includes the dtype): the rank holding
    nothing records the new dtype as the rank holding the table does."""
    lay = ShardLayout.table_wise((4, 4), 1, dtype=torch.float32)
    holder = LocalShardsWrapper([torch.ones(4, 4)], [(0, 0)], (4, 4), layout=lay).to(torch.float16)
    nothing = LocalShardsWrapper([], [], (4, 4), layout=lay).to(torch.float16)
    assert holder.layout_of_table.dtype == nothing.layout_of_table.dtype == torch.float16
    assert holder.layout_of_table.digest() == nothing.layout_of_table.digest()


@pytest.mark.parametrize("case", OP_CASES)
def test_clone(case):
    w, _ = _make(case)
    out = w.clone()
    _assert_same_layout(out, w)
    _assert_shards_equal(out, [s.clone() for s in w.local_shards()])
    assert all(a.data_ptr() != b.data_ptr() for a, b in zip(out.local_shards(), w.local_shards()))
    out.local_shards()[0].fill_(123.0)
    assert not w.local_shards()[0].eq(123.0).any()


@pytest.mark.parametrize("case", OP_CASES)
def test_detach_shares_storage(case):
    w, _ = _make(case)
    out = w.detach()
    _assert_same_layout(out, w)
    assert [s.data_ptr() for s in out.local_shards()] == [s.data_ptr() for s in w.local_shards()]
    out.local_shards()[-1].fill_(7.0)
    assert w.local_shards()[-1].eq(7.0).all()


@pytest.mark.parametrize("case", OP_CASES)
def test_view_as_own_and_global_shape(case):
    w, _ = _make(case)
    for shape in (w.shape, w.global_shape):
        out = w.view(shape)
        _assert_same_layout(out, w)
        assert [s.data_ptr() for s in out.local_shards()] == [s.data_ptr() for s in w.local_shards()]


@pytest.mark.parametrize("case", OP_CASES)
def test_copy_from_same_layout_wrapper(case):
    dst, _ = _make(case, seed=1)
    src, full = _make(case, seed=2)
    ptrs = [s.data_ptr() for s in dst.local_shards()]
    ret = dst.copy_(src)
    assert ret is dst
    assert [s.data_ptr() for s in dst.local_shards()] == ptrs  # in place
    _, boxes, _, _ = CASES[case]
    _assert_shards_equal(dst, [full[_box(o, s)] for o, s in boxes])


@pytest.mark.parametrize("case", OP_CASES)
def test_copy_from_packed_plain_tensor(case):
    dst, _ = _make(case, seed=1)
    packed = _table(tuple(CASES[case][2]), seed=3)
    dst.copy_(packed)
    _assert_shards_equal(dst, _expected_split(case, packed))


def test_copy_from_plain_tensor_of_wrong_shape():
    dst, _ = _make("rows")
    message = ("an operand of shape [4, 5] matches neither the table nor this rank's blocks "
               "(offsets [[0, 0], [5, 0]] sizes [[2, 4], [3, 4]]")
    with pytest.raises(ValueError, match=re.escape(message)):
        dst.copy_(torch.zeros(4, 5))


def _other_layout():
    """Same packed shape as CASES["rows"] ((5, 4)) but different offsets / sizes."""
    moved = LocalShardsWrapper([torch.ones(2, 4), torch.ones(3, 4)], [(0, 0), (4, 0)], (8, 4))
    resized = LocalShardsWrapper([torch.ones(3, 4), torch.ones(2, 4)], [(0, 0), (5, 0)], (8, 4))
    return [moved, resized]


@pytest.mark.parametrize("which", [0, 1])
@pytest.mark.parametrize("op", ["copy_", "add_", "mul_"])
def test_layout_mismatch_is_a_value_error(op, which):
    w, _ = _make("rows")
    before = [s.clone() for s in w.local_shards()]
    other = _other_layout()[which]
    with pytest.raises(ValueError, match=r"wrappers differ in layout: offsets \[\[0, 0\], \[5, 0\]\]"):
        getattr(w, op)(other)
    _assert_shards_equal(w, before)


@pytest.mark.parametrize("case", OP_CASES)
def test_equal(case):
    w, _ = _make(case)
    assert torch.equal(w, w.clone())
    changed = w.clone()
    changed.local_shards()[-1].view(-1)[-1] += 1
    assert not torch.equal(w, changed)


def test_equal_needs_same_offsets():
    a = LocalShardsWrapper([torch.ones(2, 4), torch.ones(3, 4)], [(0, 0), (5, 0)], (8, 4))
    b = LocalShardsWrapper([torch.ones(2, 4), torch.ones(3, 4)], [(0, 0), (4, 0)], (8, 4))
    assert not torch.equal(a, b)


@pytest.mark.parametrize("case", OP_CASES)
@pytest.mark.parametrize("fn", ["zeros_like", "empty_like", "ones_like"])
def test_like_ops(case, fn):
    w, _ = _make(case)
    out = getattr(torch, fn)(w)
    _assert_same_layout(out, w)
    assert out.dtype == w.dtype
    assert all(a.data_ptr() != b.data_ptr() for a, b in zip(out.local_shards(), w.local_shards()))
    if fn != "empty_like":
        value = 0.0 if fn == "zeros_like" else 1.0
        _assert_shards_equal(out, [torch.full_like(s, value) for s in w.local_shards()])
    out64 = getattr(torch, fn)(w, dtype=torch.float64)
    assert out64.dtype == torch.float64 and all(s.dtype == torch.float64 for s in out64.local_shards())


@pytest.mark.parametrize("case", OP_CASES)
def test_new_empty_and_new_zeros(case):
    w, _ = _make(case)
    out = w.new_empty(w.shape)
    _assert_same_layout(out, w)
    assert out.dtype == w.dtype
    out64 = w.new_empty(w.shape, dtype=torch.float64)
    assert all(s.dtype == torch.float64 for s in out64.local_shards())
    zeros = w.new_zeros(w.shape)
    _assert_shards_equal(zeros, [torch.zeros_like(s) for s in w.local_shards()])
    empty = w.new_empty((0,))
    assert isinstance(empty, LocalShardsWrapper) and empty.is_empty_shard()
    assert empty.global_shape == w.global_shape


def test_new_tensors_of_another_size_are_plain_tensors():
    """As ``Tensor.new_*``: the size asked, the wrapper's dtype and device (what DTensor asks for its own even
    split's local tensor)."""
    w, _ = _make("rows")
    for out, value in ((w.new_empty((3, 3)), None), (w.new_zeros((3, 3)), 0.0), (w.new_ones((3, 3)), 1.0),
                       (w.new_full((3, 3), 2.5), 2.5)):
        assert type(out) is torch.Tensor and out.shape == (3, 3) and out.dtype == w.dtype, out
        if value is not None:
            assert torch.equal(out, torch.full((3, 3), value))
    full = w.new_full(w.shape, -1.5)  # the wrapper's own shape: its blocks
    _assert_same_layout(full, w)
    _assert_shards_equal(full, [torch.full(s.shape, -1.5) for s in w.local_shards()])


@pytest.mark.parametrize("case", OP_CASES)
def test_fill_and_zero(case):
    w, _ = _make(case)
    ptrs = [s.data_ptr() for s in w.local_shards()]
    assert w.fill_(3.5) is w
    _assert_shards_equal(w, [torch.full(s.shape, 3.5) for s in w.local_shards()])
    w.fill_(torch.tensor(-2.0))
    _assert_shards_equal(w, [torch.full(s.shape, -2.0) for s in w.local_shards()])
    assert w.zero_() is w
    _assert_shards_equal(w, [torch.zeros(s.shape) for s in w.local_shards()])
    assert [s.data_ptr() for s in w.local_shards()] == ptrs


@pytest.mark.parametrize("case", OP_CASES)
@pytest.mark.parametrize("op", ["add_", "mul_", "div_", "sub_"])
def test_inplace_binary_with_scalar(case, op):
    w, _ = _make(case)
    plain = [s.clone() for s in w.local_shards()]
    ptrs = [s.data_ptr() for s in w.local_shards()]
    assert getattr(w, op)(1.75) is w
    _assert_shards_equal(w, [getattr(p, op)(1.75) for p in plain])
    assert [s.data_ptr() for s in w.local_shards()] == ptrs


@pytest.mark.parametrize("case", OP_CASES)
@pytest.mark.parametrize("op", ["add_", "mul_", "div_", "sub_"])
def test_inplace_binary_with_wrapper(case, op):
    w, _ = _make(case, seed=4)
    other, _ = _make(case, seed=5)
    plain = [s.clone() for s in w.local_shards()]
    getattr(w, op)(other)
    _assert_shards_equal(w, [getattr(p, op)(o) for p, o in zip(plain, other.local_shards())])


@pytest.mark.parametrize("case", ["rows", "cols_equal"])
def test_inplace_binary_with_packed_tensor_and_alpha(case):
    w, _ = _make(case, seed=6)
    packed = _table(tuple(CASES[case][2]), seed=7)
    plain = [s.clone() for s in w.local_shards()]
    w.add_(packed, alpha=-0.5)
    _assert_shards_equal(w, [p.add_(q, alpha=-0.5) for p, q in zip(plain, _expected_split(case, packed))])


def test_inplace_with_zero_dim_tensor():
    w, _ = _make("rows")
    plain = [s.clone() for s in w.local_shards()]
    w.mul_(torch.tensor(3.0))
    _assert_shards_equal(w, [p * 3.0 for p in plain])


def test_is_same_size():
    a, _ = _make("rows")
    b, _ = _make("rows", seed=1)
    assert torch.ops.aten.is_same_size.default(a, b)


def test_wait_tensor_returns_the_wrapper():
    w, _ = _make("rows")
    assert torch.ops._c10d_functional.wait_tensor(w) is w


@pytest.mark.parametrize(
    "call, name",
    [
        (lambda w: torch.cumsum(w, 0), "aten.cumsum"),
        (lambda w: w @ torch.ones(4, 4), "aten.mm"),
        (lambda w: torch.sort(w, 0), "aten.sort"),
        (lambda w: w[0], "aten.select"),
    ],
)
def test_unsupported_op_names_the_op(call, name):
    w, _ = _make("rows")
    with pytest.raises(NotImplementedError, match=re.escape(f"LocalShardsWrapper does not support {name}")):
        call(w)


# ------------------------------------------------------- pickling and copies
def _with_layout():
    lay = ShardLayout.row_wise((8, 4), [2, 3, 3], ranks=[0, 1, 0], dtype=torch.float32, name="t")
    lay.kind  # cached state must pickle too
    lay.unique_shards()
    full = _table((8, 4), seed=8)
    return LocalShardsWrapper([full[0:2].clone(), full[5:8].clone()], [(0, 0), (5, 0)], layout=lay), full


@pytest.mark.parametrize("weights_only", [False, True])
@pytest.mark.parametrize("case", ["rows", "cols_equal", "three_rows_1d", "with_layout", "empty"])
def test_torch_save_load(case, weights_only):
    if case == "with_layout":
        w, _ = _with_layout()
    elif case == "empty":
        w = LocalShardsWrapper([], [], (6, 2), dtype=torch.float64)
    else:
        w, _ = _make(case)
    buf = io.BytesIO()
    torch.save({"w": w}, buf)
    buf.seek(0)
    out = torch.load(buf, weights_only=weights_only)["w"]
    _assert_same_layout(out, w)
    assert out.dtype == w.dtype
    _assert_shards_equal(out, [s.clone() for s in w.local_shards()])
    assert out.layout_of_table == w.layout_of_table


@pytest.mark.parametrize("case", ["rows", "cols", "one", "with_layout"])
def test_deepcopy(case):
    w, _ = _with_layout() if case == "with_layout" else _make(case)
    out = copy.deepcopy(w)
    _assert_same_layout(out, w)
    _assert_shards_equal(out, [s.clone() for s in w.local_shards()])
    assert all(a.data_ptr() != b.data_ptr() for a, b in zip(out.local_shards(), w.local_shards()))
    out.zero_()
    assert all(s.ne(0).any() for s in w.local_shards())
    assert out.layout_of_table == w.layout_of_table


def test_deepcopy_of_empty_wrapper():
    w = LocalShardsWrapper([], [], (6, 2), dtype=torch.float64)
    out = copy.deepcopy(w)
    assert out.is_empty_shard() and out.global_shape == (6, 2) and out.dtype == torch.float64


# ---------------------------------------------------------------- DCP hooks
def _with_empty_middle():
    full = _table((8, 4), seed=9)
    shards = [full[0:2].clone(), torch.empty(0, 4), full[5:8].clone()]
    return LocalShardsWrapper(shards, [(0, 0), (2, 0), (5, 0)], (8, 4)), full


def test_create_write_items():
    w, _ = _with_empty_middle()
    items = w.__create_write_items__("t", w)
    assert len(items) == 2  # none for the empty shard
    expected = [((0, 0), (2, 4)), ((5, 0), (3, 4))]
    for item, (o, s) in zip(items, expected):
        assert item.type == WriteItemType.SHARD
        assert item.index.fqn == "t" and item.index.offset == torch.Size(o)
        assert item.tensor_data.chunk == ChunkStorageMetadata(torch.Size(o), torch.Size(s))
        assert item.tensor_data.size == torch.Size([8, 4])  # the global shape, not (5, 4)
        assert item.tensor_data.properties.dtype == torch.float32
    # each index resolves to the shard it describes
    assert [w.__get_tensor_shard__(i.index).data_ptr() for i in items] == [
        w.local_shards()[0].data_ptr(),
        w.local_shards()[2].data_ptr(),
    ]


def test_create_write_items_of_empty_wrapper():
    w = LocalShardsWrapper([], [], (8, 4))
    assert w.__create_write_items__("t", w) == []
    assert w.__create_chunk_list__() == []


def test_create_chunk_list():
    w, _ = _with_empty_middle()
    assert w.__create_chunk_list__() == [
        ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([2, 4])),
        ChunkStorageMetadata(torch.Size([5, 0]), torch.Size([3, 4])),
    ]


def test_get_tensor_shard():
    w, _ = _with_empty_middle()
    a, _, b = w.local_shards()
    assert w.__get_tensor_shard__(MetadataIndex("t", (0, 0), 0)) is a
    assert w.__get_tensor_shard__(MetadataIndex("t", (5, 0), 2)).data_ptr() == b.data_ptr()
    # a wrong (or global) index hint falls back to matching offsets
    for hint in (0, 1, 7, None):
        assert w.__get_tensor_shard__(MetadataIndex("t", (5, 0), hint)) is b
    assert w.__get_tensor_shard__(MetadataIndex("t", [0, 0], 2)) is a


def test_get_tensor_shard_unknown_offset():
    w, _ = _with_empty_middle()
    with pytest.raises(ValueError, match=re.escape("'t': no local shard at offsets [3, 0]")):
        w.__get_tensor_shard__(MetadataIndex("t", (3, 0), 0))


def test_get_tensor_shard_prefers_non_empty_shard_at_same_offsets():
    # rank holding an empty block at row 2 and the real block that starts at row 2;
    # DCP's load hint counts only non-empty chunks, so hint 1 means the real block
    w = LocalShardsWrapper([torch.ones(2, 4), torch.empty(0, 4), torch.ones(3, 4)], [(0, 0), (2, 0), (2, 0)], (5, 4))
    real = w.local_shards()[2]
    for hint in (0, 1, 2, None):
        assert w.__get_tensor_shard__(MetadataIndex("t", (2, 0), hint)) is real


# ------------------------------------------------------ single-process DCP
def _full_cover_cases():
    """Wrappers whose shards cover their whole table (one process holds it all)."""
    return {
        "rows": ((8, 4), [((0, 0), (2, 4)), ((2, 0), (1, 4)), ((3, 0), (5, 4))]),
        "cols": ((8, 16), [((0, 0), (8, 8)), ((0, 8), (8, 8))]),
        "one": ((8, 4), [((0, 0), (8, 4))]),
        "rows_1d": ((9,), [((0,), (4,)), ((4,), (5,))]),
        "empty_at_same_offset": ((5, 4), [((0, 0), (2, 4)), ((2, 0), (0, 4)), ((2, 0), (3, 4))]),
    }


def _wrapper_over(full, gshape, boxes):
    return LocalShardsWrapper([full[_box(o, s)].clone() for o, s in boxes], [o for o, _ in boxes], gshape)


@pytest.mark.filterwarnings(NO_DIST_WARNING)
@pytest.mark.parametrize("case", list(_full_cover_cases()))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dcp_save_load_in_place(tmp_path, case, dtype):
    gshape, boxes = _full_cover_cases()[case]
    full = _table(gshape, seed=10, dtype=dtype)
    w = _wrapper_over(full, gshape, boxes)
    dcp.save({"w": w}, checkpoint_id=str(tmp_path), no_dist=True)
    ptrs = [s.data_ptr() for s in w.local_shards()]
    w.zero_()
    dcp.load({"w": w}, checkpoint_id=str(tmp_path), no_dist=True)
    assert [s.data_ptr() for s in w.local_shards()] == ptrs  # loaded in place
    _assert_shards_equal(w, [full[_box(o, s)] for o, s in boxes])

    md = dcp.FileSystemReader(str(tmp_path)).read_metadata().state_dict_metadata["w"]
    assert md.size == torch.Size(gshape) and md.properties.dtype == dtype
    assert sorted((tuple(c.offsets), tuple(c.sizes)) for c in md.chunks) == sorted(
        (o, s) for o, s in boxes if all(s)
    )


@pytest.mark.filterwarnings(NO_DIST_WARNING)
def test_dcp_load_into_a_different_layout(tmp_path):
    """Saved as three row shards, loaded into two column shards of the same table."""
    full = _table((8, 16), seed=11)
    src = _wrapper_over(full, (8, 16), [((0, 0), (3, 16)), ((3, 0), (4, 16)), ((7, 0), (1, 16))])
    dcp.save({"w": src}, checkpoint_id=str(tmp_path), no_dist=True)
    dst_boxes = [((0, 0), (8, 5)), ((0, 5), (8, 11))]
    dst = LocalShardsWrapper([torch.zeros(s) for _, s in dst_boxes], [o for o, _ in dst_boxes], (8, 16))
    dcp.load({"w": dst}, checkpoint_id=str(tmp_path), no_dist=True)
    _assert_shards_equal(dst, [full[_box(o, s)] for o, s in dst_boxes])


@pytest.mark.filterwarnings(NO_DIST_WARNING)
def test_a_wrapper_holding_part_of_a_table_loads_through_tdb_checkpoint(tmp_path):
    """Plain ``dcp.load`` compares a bare wrapper's own (packed) size with the table's and refuses one that
    holds part of the table (rows 0-2 and 5-7 of 8: [6, 16] against [8, 16]); ``tdb.checkpoint.load`` loads
    it by its blocks."""
    import torchrec_dtensor_bridge as tdb

    full = _table((8, 16), seed=12)
    tdb.checkpoint.save({"w": _wrapper_over(full, (8, 16), [((0, 0), (8, 16))])}, tmp_path / "c")
    boxes = [((0, 0), (3, 16)), ((5, 0), (3, 16))]
    dst = LocalShardsWrapper([torch.zeros(s) for _, s in boxes], [o for o, _ in boxes], (8, 16))
    with pytest.raises(CheckpointException) as refused:  # DCP wraps its ValueError
        dcp.load({"w": dst}, checkpoint_id=str(committed(tmp_path / "c")), no_dist=True)
    causes = [refused.value, *getattr(refused.value, "failures", {}).values()]
    assert any("Size mismatch" in str(c) for c in causes), causes
    tdb.checkpoint.load({"w": dst}, tmp_path / "c")
    _assert_shards_equal(dst, [full[_box(o, s)] for o, s in boxes])


# ------------------------------------------------------- flatten / unflatten (torch.compile)
@pytest.mark.parametrize("case", OP_CASES)
def test_flatten_unflatten_round_trip_keeps_offsets_and_layout(case):
    gshape, boxes, _, _ = CASES[case]
    full = _table(gshape)
    layout = ShardLayout.from_shards(gshape, [(0, o, s) for o, s in boxes], dtype=torch.float32,
                                     validate=False)
    w = LocalShardsWrapper([full[_box(o, s)].clone() for o, s in boxes], [o for o, _ in boxes], gshape,
                           layout=layout)
    names, meta = w.__tensor_flatten__()
    back = LocalShardsWrapper.__tensor_unflatten__({n: getattr(w, n) for n in names}, meta, w.shape, w.stride())
    assert [tuple(o) for o in back.local_offsets()] == [tuple(o) for o, _ in boxes]
    assert back.layout_of_table == layout and back.global_shape == torch.Size(gshape)
    assert back.shape == w.shape and back.stride() == w.stride()
    _assert_shards_equal(back, [full[_box(o, s)] for o, s in boxes])


# ------------------------------------------------------- the element-wise families and reductions
@pytest.mark.parametrize("case", OP_CASES)
def test_pointwise_functional_inplace_and_out(case):
    w, full = _make(case, seed=8)
    v, _ = _make(case, seed=9)
    _, boxes, _, _ = CASES[case]
    plain = [full[_box(o, s)] for o, s in boxes]
    other = [s.clone() for s in v.local_shards()]
    _assert_shards_equal(torch.sin(w), [torch.sin(p) for p in plain])
    _assert_shards_equal(torch.addcmul(w, v, v, value=0.5), [torch.addcmul(p, q, q, value=0.5)
                                                          for p, q in zip(plain, other)])
    _assert_shards_equal(w > v, [p > q for p, q in zip(plain, other)])
    out = torch.zeros_like(w)
    ptrs = [s.data_ptr() for s in out.local_shards()]
    assert torch.mul(w, v, out=out) is out
    assert [s.data_ptr() for s in out.local_shards()] == ptrs
    _assert_shards_equal(out, [p * q for p, q in zip(plain, other)])
    _assert_shards_equal(torch.full_like(w, 2.5), [torch.full_like(p, 2.5) for p in plain])


@pytest.mark.parametrize("case", OP_CASES)
def test_foreach_ops_run_once_over_every_shard(case):
    a, fa = _make(case, seed=10)
    b, fb = _make(case, seed=11)
    _, boxes, _, _ = CASES[case]
    pa = [fa[_box(o, s)].clone() for o, s in boxes]
    pb = [fb[_box(o, s)].clone() for o, s in boxes]
    plain_extra = torch.ones(3)
    torch._foreach_mul_([a, plain_extra], 3.0)
    torch._foreach_lerp_([a], [b], 0.25)
    _assert_shards_equal(a, [torch.lerp(p * 3.0, q, 0.25) for p, q in zip(pa, pb)])
    assert torch.equal(plain_extra, torch.full((3,), 3.0))
    sq = torch._foreach_sqrt([b.abs()])
    _assert_shards_equal(sq[0], [q.abs().sqrt() for q in pb])
    norms = torch._foreach_norm([b, plain_extra], 2)
    torch.testing.assert_close(norms[0], torch.linalg.vector_norm(torch.cat([q.reshape(-1) for q in pb])))
    torch.testing.assert_close(norms[1], torch.linalg.vector_norm(plain_extra))


@pytest.mark.parametrize("case", OP_CASES)
def test_local_reductions(case):
    w, full = _make(case, seed=12)
    _, boxes, _, _ = CASES[case]
    flat = torch.cat([full[_box(o, s)].reshape(-1) for o, s in boxes])
    torch.testing.assert_close(w.sum(), flat.sum())
    torch.testing.assert_close(w.amax(), flat.amax())
    torch.testing.assert_close(w.norm(), flat.norm())
    torch.testing.assert_close(w.mean(), flat.mean())


def test_random_init_gives_each_shard_its_own_stream_and_repeats_with_the_seed():
    w, _ = _make("rows")
    torch.manual_seed(3)
    w.uniform_(-1, 1)
    first = [s.clone() for s in w.local_shards()]
    assert not torch.equal(first[0][:2], first[1][:2])
    torch.manual_seed(3)
    w.uniform_(-1, 1)
    _assert_shards_equal(w, first)
    assert all(((s >= -1) & (s <= 1)).all() for s in first)


def test_empty_wrapper_sizes_and_offsets_pair_up():
    w = LocalShardsWrapper([], [], (8, 4))
    assert len(w.local_sizes()) == len(w.local_offsets())
    assert w.local_chunks == [] and w.__create_chunk_list__() == []
