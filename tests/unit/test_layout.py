"""One-process tests of ShardLayout: builders, queries, validation and metadata round trips.

Expectations are computed here from first principles (prefix sums, painted
coverage arrays, hand-written offsets), never read back from the code under test.
"""

import itertools
import re
import string

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from torchrec_dtensor_bridge.convert.metadata import (
    layout_from_sharded_tensor_metadata,
    layout_from_storage_metadata,
    layout_to_sharded_tensor_metadata,
    layout_to_storage_metadata,
)
from torchrec_dtensor_bridge.layout import (
    LayoutKind,
    ShardLayout,
    ShardSpec,
    boxes_overlap,
    contiguous_strides,
)

HYPOTHESIS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _triples(lay):
    return [(s.rank, s.offsets, s.sizes) for s in lay.shards]


def _paint(shape, boxes):
    """Count how many of ``boxes`` cover each element of a table of ``shape``."""
    counter = np.zeros(shape, dtype=np.int64)
    for offsets, sizes in boxes:
        counter[tuple(slice(o, o + z) for o, z in zip(offsets, sizes))] += 1
    return counter


# ------------------------------------------------------------------ builders
def test_row_wise_even_matches_spec_example():
    lay = ShardLayout.row_wise((8, 16), 4, name="t0")
    assert _triples(lay) == [(r, (2 * r, 0), (2, 16)) for r in range(4)]
    assert lay.kind is LayoutKind.ROW_WISE
    assert lay.global_shape == (8, 16) and lay.ndim == 2 and lay.numel == 128


def test_row_wise_uneven_explicit_heights():
    lay = ShardLayout.row_wise((8, 16), [1, 3, 1, 3])
    assert [s.offsets for s in lay.shards] == [(0, 0), (1, 0), (4, 0), (5, 0)]
    assert [s.sizes for s in lay.shards] == [(1, 16), (3, 16), (1, 16), (3, 16)]
    assert lay.kind is LayoutKind.ROW_WISE


@pytest.mark.parametrize(
    "rows, world, heights",
    [
        (10, 4, [3, 3, 3, 1]),  # TorchRec: ceil(10/4)=3 rows each, the last one short
        (5, 4, [2, 2, 1, 0]),  # ceil(5/4)=2; the last rank gets an empty block
        (8, 4, [2, 2, 2, 2]),
        (1, 3, [1, 0, 0]),
        (7, 1, [7]),
    ],
)
def test_row_wise_torchrec_ceil_split(rows, world, heights):
    lay = ShardLayout.row_wise((rows, 6), world, name="emb")
    starts = [sum(heights[:i]) for i in range(world)]
    assert _triples(lay) == [(r, (starts[r], 0), (heights[r], 6)) for r in range(world)]
    # every rank of the split is listed, including one holding an empty block
    assert lay.ranks() == tuple(range(world))
    assert (_paint((rows, 6), [s.box for s in lay.shards]) == 1).all()


def test_row_wise_five_rows_on_four_ranks_empty_block():
    lay = ShardLayout.row_wise((5, 4), 4)
    last = lay.shards_on(3)
    assert last == (ShardSpec(3, (5, 0), (0, 4)),)
    assert last[0].numel == 0
    # an empty block is always kept by unique_shards
    assert len(lay.unique_shards()) == 4
    assert lay.kind is LayoutKind.ROW_WISE


def test_row_wise_on_explicit_ranks_and_1d_state():
    lay = ShardLayout.row_wise((10,), 3, ranks=[5, 2, 7], dtype=torch.float32, name="momentum1")
    assert _triples(lay) == [(5, (0,), (4,)), (2, (4,), (4,)), (7, (8,), (2,))]
    assert lay.ranks() == (2, 5, 7)
    assert lay.shards_on(2) == (ShardSpec(2, (4,), (4,)),)
    assert lay.shards_on(0) == ()
    assert lay.kind is LayoutKind.ROW_WISE and lay.dtype is torch.float32


def test_row_wise_one_row_table_is_held_by_one_rank():
    lay = ShardLayout.row_wise((1, 8), 4)
    assert [s.sizes for s in lay.shards] == [(1, 8), (0, 8), (0, 8), (0, 8)]
    assert lay.owner() == 0
    # one non-empty block: the whole table on one rank
    assert lay.kind is LayoutKind.TABLE_WISE


def test_table_row_wise_is_row_wise_on_a_subset_of_ranks():
    lay = ShardLayout.row_wise((6, 4), [2, 4], ranks=[4, 5])
    assert lay.ranks() == (4, 5)
    assert _triples(lay) == [(4, (0, 0), (2, 4)), (5, (2, 0), (4, 4))]
    assert lay.kind is LayoutKind.ROW_WISE


@pytest.mark.parametrize(
    "cols, widths",
    [(4, [4, 4, 4, 4]), ([3, 13], [3, 13]), (3, [6, 6, 4]), ([16], [16])],
)
def test_column_wise(cols, widths):
    lay = ShardLayout.column_wise((8, 16), cols, name="cw")
    starts = [sum(widths[:i]) for i in range(len(widths))]
    assert _triples(lay) == [(r, (0, starts[r]), (8, widths[r])) for r in range(len(widths))]
    expected_kind = LayoutKind.COLUMN_WISE if len(widths) > 1 else LayoutKind.TABLE_WISE
    assert lay.kind is expected_kind


def test_table_column_wise_on_ranks():
    lay = ShardLayout.column_wise((4, 10), [5, 5], ranks=[3, 3])
    assert lay.shards_on(3) == (ShardSpec(3, (0, 0), (4, 5)), ShardSpec(3, (0, 5), (4, 5)))
    assert lay.ranks() == (3,)
    assert lay.owner() is None  # two blocks, even if on one rank
    assert lay.kind is LayoutKind.COLUMN_WISE


def test_grid():
    lay = ShardLayout.grid((8, 16), [4, 4], [6, 10], ranks=[0, 1, 2, 3], name="g")
    assert _triples(lay) == [
        (0, (0, 0), (4, 6)),
        (1, (0, 6), (4, 10)),
        (2, (4, 0), (4, 6)),
        (3, (4, 6), (4, 10)),
    ]
    assert lay.kind is LayoutKind.GRID
    assert lay.shards_on(1) == (ShardSpec(1, (0, 6), (4, 10)),)


def test_grid_with_one_column_is_row_wise():
    lay = ShardLayout.grid((8, 16), [3, 5], [16], ranks=[1, 0])
    assert lay.kind is LayoutKind.ROW_WISE
    assert lay.ranks() == (0, 1)


def test_grid_wrong_number_of_ranks():
    with pytest.raises(ValueError, match=r"table 'g'.*2x2 blocks needs 4 ranks, got 3"):
        ShardLayout.grid((8, 16), [4, 4], [8, 8], ranks=[0, 1, 2], name="g")


def test_table_wise():
    lay = ShardLayout.table_wise((8, 16), 2, dtype=torch.float16, name="tw")
    assert _triples(lay) == [(2, (0, 0), (8, 16))]
    assert lay.kind is LayoutKind.TABLE_WISE
    assert lay.ranks() == (2,)
    assert lay.owner() == 2
    assert lay.shards_on(2) == lay.shards and lay.shards_on(0) == ()


def test_replicated():
    lay = ShardLayout.replicated((8, 16), [0, 1, 3])
    assert _triples(lay) == [(r, (0, 0), (8, 16)) for r in (0, 1, 3)]
    assert lay.kind is LayoutKind.REPLICATED
    assert lay.ranks() == (0, 1, 3)
    assert lay.unique_shards() == (ShardSpec(0, (0, 0), (8, 16)),)
    assert lay.owner() is None
    lay.validate()  # replicas are not an overlap


def test_replicated_on_one_rank_is_table_wise():
    assert ShardLayout.replicated((3, 3), [4]).kind is LayoutKind.TABLE_WISE


def test_unique_shards_keeps_first_replica_in_order():
    # hybrid: a row-wise cut replicated on two groups of ranks
    lay = ShardLayout.from_shards(
        (4, 2),
        [(0, (0, 0), (2, 2)), (1, (2, 0), (2, 2)), (2, (0, 0), (2, 2)), (3, (2, 0), (2, 2))],
    )
    assert lay.unique_shards() == (ShardSpec(0, (0, 0), (2, 2)), ShardSpec(1, (2, 0), (2, 2)))
    assert lay.kind is LayoutKind.ROW_WISE


def test_rank_none_and_with_name():
    lay = ShardLayout.from_shards((4,), [(None, (0,), (4,))], name="a")
    assert lay.ranks() == ()
    renamed = lay.with_name("b")
    assert renamed.name == "b" and renamed.shards == lay.shards


def test_shard_spec_helpers():
    s = ShardSpec(1, (2, 3), (4, 5), device="cuda:1")
    assert s.numel == 20
    assert s.box == ((2, 3), (4, 5))
    assert s.slices() == (slice(2, 6), slice(3, 8))
    assert s == ShardSpec(1, (2, 3), (4, 5))  # device is informative only


def test_boxes_overlap_and_strides():
    assert boxes_overlap((0, 0), (2, 2), (1, 1), (2, 2))
    assert not boxes_overlap((0, 0), (2, 2), (2, 0), (2, 2))  # touching is not overlapping
    assert not boxes_overlap((0, 0), (2, 2), (1, 1), (0, 2))  # an empty block shares nothing
    assert contiguous_strides((3, 4, 5)) == torch.empty(3, 4, 5).stride()
    assert contiguous_strides((0, 4)) == (4, 1)


def test_even_split_rejects_zero_parts():
    with pytest.raises(ValueError, match="positive, got 0"):
        ShardLayout.row_wise((4, 4), 0)


# ---------------------------------------------------------------- validation
def test_overlap_names_table_and_shards():
    with pytest.raises(
        ValueError,
        match=re.escape(
            "table 'emb' of shape [4, 4]: shard 0 (rank 0, offsets [0, 0], sizes [3, 4]) overlaps "
            "shard 1 (rank 1, offsets [2, 0], sizes [2, 4])"
        ),
    ):
        ShardLayout.from_shards((4, 4), [(0, (0, 0), (3, 4)), (1, (2, 0), (2, 4))], name="emb")


def test_overlap_found_regardless_of_order():
    # the overlapping pair is listed far apart and out of row order
    shards = [(1, (4, 0), (4, 4)), (2, (0, 4), (8, 4)), (0, (0, 0), (4, 4)), (3, (3, 2), (2, 2))]
    with pytest.raises(ValueError, match=r"table 'z'.*overlaps shard 3 \(rank 3, offsets \[3, 2\], sizes \[2, 2\]\)"):
        ShardLayout.from_shards((8, 8), shards, name="z")


def test_gap_names_covered_count():
    with pytest.raises(
        ValueError, match=re.escape("table 'emb' of shape [4, 4]: shards cover 12 of 16 elements")
    ):
        ShardLayout.from_shards((4, 4), [(0, (0, 0), (2, 4)), (1, (3, 0), (1, 4))], name="emb")


def test_gap_allowed_when_coverage_not_required():
    lay = ShardLayout.from_shards((4, 4), [(0, (0, 0), (2, 4))], validate=False)
    lay.validate(require_full_coverage=False)
    with pytest.raises(ValueError, match="cover 8 of 16"):
        lay.validate()


def test_row_heights_not_summing_to_table():
    with pytest.raises(ValueError, match="cover 16 of 20"):
        ShardLayout.row_wise((5, 4), [2, 2])
    with pytest.raises(ValueError, match=re.escape("out of bounds in dim 0 (3 + 3 > 5)")):
        ShardLayout.row_wise((5, 4), [3, 3])


def test_out_of_bounds_rows():
    with pytest.raises(
        ValueError,
        match=re.escape(
            "table 'emb' of shape [4, 4]: shard 1 (rank 1) at offsets [4, 0] with sizes [1, 4] "
            "is out of bounds in dim 0 (4 + 1 > 4)"
        ),
    ):
        ShardLayout.from_shards((4, 4), [(0, (0, 0), (4, 4)), (1, (4, 0), (1, 4))], name="emb")


def test_out_of_bounds_column_offset_equal_to_embedding_dim():
    # the widely copied upstream example: column offset == embedding dim
    shards = [(r, (2 * r, 16), (2, 16)) for r in range(4)]
    with pytest.raises(
        ValueError, match=re.escape("table 'ex' of shape [8, 16]: shard 0 (rank 0) at offsets [0, 16]")
    ) as info:
        ShardLayout.from_shards((8, 16), shards, name="ex")
    assert "dim 1 (16 + 16 > 16)" in str(info.value)


def test_negative_offset_and_rank():
    with pytest.raises(ValueError, match=r"table 'n'.*shard 0 \(rank 0\) has negative offset or size in dim 0"):
        ShardLayout.from_shards((4,), [(0, (-1,), (4,))], name="n")
    with pytest.raises(ValueError, match=r"table 'n'.*shard 0 has negative rank -2"):
        ShardLayout.from_shards((4,), [(-2, (0,), (4,))], name="n")


def test_wrong_ndim():
    with pytest.raises(
        ValueError,
        match=re.escape("table 'w' of shape [4, 4]: shard 1 has offsets [0] and sizes [4], expected 2 values each"),
    ):
        ShardLayout.from_shards((4, 4), [(0, (0, 0), (4, 2)), (1, (0,), (4,))], name="w")


def test_same_block_twice_on_one_rank():
    with pytest.raises(
        ValueError,
        match=re.escape("table 'd' of shape [4, 4]: shards 0 and 2 are the same block [0, 0]+[2, 4] twice on rank 0"),
    ):
        ShardLayout.from_shards(
            (4, 4), [(0, (0, 0), (2, 4)), (1, (2, 0), (2, 4)), (0, (0, 0), (2, 4))], name="d"
        )


def test_no_shards():
    with pytest.raises(ValueError, match="table 'e'.*no shards"):
        ShardLayout.from_shards((2, 2), [], name="e")
    ShardLayout.from_shards((0, 2), [], name="e")  # an empty table needs none


def test_negative_dimension():
    with pytest.raises(ValueError, match="table 'e'.*negative dimension"):
        ShardLayout.from_shards((-1, 2), [], name="e")


# ----------------------------------------------------- explicit round trips
def test_storage_metadata_round_trip_drops_replicas_and_empty_blocks():
    lay = ShardLayout.from_shards(
        (5, 4),
        [(0, (0, 0), (2, 4)), (1, (2, 0), (3, 4)), (2, (0, 0), (2, 4)), (3, (5, 0), (0, 4))],
        dtype=torch.bfloat16,
    )
    md = layout_to_storage_metadata(lay)
    assert md.size == torch.Size([5, 4]) and md.properties.dtype is torch.bfloat16
    assert [(tuple(c.offsets), tuple(c.sizes)) for c in md.chunks] == [((0, 0), (2, 4)), ((2, 0), (3, 4))]
    back = layout_from_storage_metadata(md, name="t")
    assert _triples(back) == [(None, (0, 0), (2, 4)), (None, (2, 0), (3, 4))]
    assert back.dtype is torch.bfloat16 and back.name == "t"


def test_storage_metadata_with_gap_is_rejected():
    lay = ShardLayout.from_shards((4, 4), [(0, (0, 0), (2, 4))], validate=False, name="g")
    with pytest.raises(ValueError, match="table 'g'.*cover 8 of 16"):
        layout_from_storage_metadata(layout_to_storage_metadata(lay), name="g")


def test_sharded_tensor_metadata_round_trip():
    lay = ShardLayout.row_wise((5, 4), 4, ranks=[3, 0, 2, 1], dtype=torch.float32, name="st")
    md = layout_to_sharded_tensor_metadata(lay)
    assert md.size == torch.Size([5, 4])
    assert [(m.placement.rank(), m.shard_offsets, m.shard_sizes) for m in md.shards_metadata] == [
        (3, [0, 0], [2, 4]),
        (0, [2, 0], [2, 4]),
        (2, [4, 0], [1, 4]),
        (1, [5, 0], [0, 4]),
    ]
    assert all(str(m.placement.device()) == "cpu" for m in md.shards_metadata)
    back = layout_from_sharded_tensor_metadata(md, name="st")
    assert back == lay
    assert _triples(back) == _triples(lay)


def test_sharded_tensor_metadata_refuses_replicas_and_missing_dtype():
    with pytest.raises(ValueError, match="table 'r'.*replicated"):
        layout_to_sharded_tensor_metadata(ShardLayout.replicated((2, 2), [0, 1], dtype=torch.float32, name="r"))
    with pytest.raises(ValueError, match="table 'r'.*no dtype"):
        layout_to_sharded_tensor_metadata(ShardLayout.row_wise((2, 2), 2, name="r"))


# ------------------------------------------------------------- hypothesis
@st.composite
def _cuts(draw, n, max_parts=4):
    """Sizes of 1..max_parts consecutive pieces of ``n`` (zero-size pieces allowed)."""
    parts = draw(st.integers(1, max_parts))
    points = sorted(draw(st.lists(st.integers(0, n), min_size=parts - 1, max_size=parts - 1)))
    bounds = [0, *points, n]
    return [b - a for a, b in zip(bounds, bounds[1:])]


@st.composite
def _grid_tables(draw, replicas=True):
    """A random valid grid: (shape, per-dim cut sizes, shards as (rank, offsets, sizes), world, name)."""
    ndim = draw(st.sampled_from([1, 2, 2, 3]))
    shape = tuple(draw(st.integers(1, 9 if ndim < 3 else 4)) for _ in range(ndim))
    cuts = [draw(_cuts(n)) for n in shape]
    world = draw(st.integers(1, 6))  # often more ranks than blocks: some ranks hold nothing
    per_dim = [list(zip(itertools.accumulate([0, *c[:-1]]), c)) for c in cuts]
    shards = []
    for combo in itertools.product(*per_dim):
        offsets = tuple(o for o, _ in combo)
        sizes = tuple(z for _, z in combo)
        copies = draw(st.integers(1, min(2, world))) if replicas else 1
        for rank in draw(st.lists(st.integers(0, world - 1), min_size=copies, max_size=copies, unique=True)):
            shards.append((rank, offsets, sizes))
    shards = draw(st.permutations(shards))
    name = draw(st.text(alphabet=string.ascii_lowercase + "._", min_size=1, max_size=8))
    return shape, cuts, shards, world, name


def _expected_kind(shape, cuts, shards):
    nonempty = [(o, z) for _, o, z in shards if all(z)]
    if len(set(nonempty)) == 1:
        return LayoutKind.REPLICATED if len(nonempty) > 1 else LayoutKind.TABLE_WISE
    cut_dims = {d for d, c in enumerate(cuts) if sum(1 for z in c if z) > 1}
    return {frozenset({0}): LayoutKind.ROW_WISE, frozenset({1}): LayoutKind.COLUMN_WISE}.get(
        frozenset(cut_dims), LayoutKind.GRID
    )


@HYPOTHESIS
@given(_grid_tables(), st.sampled_from([torch.float32, torch.float16, torch.int64]))
def test_random_valid_layouts(table, dtype):
    shape, cuts, shards, world, name = table
    lay = ShardLayout.from_shards(shape, shards, dtype=dtype, name=name)  # validates
    assert _triples(lay) == shards

    # every element covered exactly once by the distinct blocks ...
    assert (_paint(shape, [s.box for s in lay.unique_shards()]) == 1).all()
    # ... and each replica copy of a block covers it once more
    copies = _paint(shape, [(o, z) for _, o, z in shards])
    expected_copies = np.zeros(shape, dtype=np.int64)
    for _, o, z in shards:
        if all(z):
            expected_copies[tuple(slice(a, a + b) for a, b in zip(o, z))] = sum(
                1 for _, o2, z2 in shards if (o2, z2) == (o, z)
            )
    assert (copies == expected_copies).all()

    # rank queries
    assert lay.ranks() == tuple(sorted({r for r, _, _ in shards}))
    for r in range(world + 1):
        assert [(s.rank, s.offsets, s.sizes) for s in lay.shards_on(r)] == [t for t in shards if t[0] == r]
    distinct = {(o, z) for _, o, z in shards if all(z)}
    assert {s.box for s in lay.unique_shards() if s.numel} == distinct
    assert sum(1 for s in lay.unique_shards() if s.numel) == len(distinct)
    assert lay.kind is _expected_kind(shape, cuts, shards)

    # DCP storage metadata round trip: the same distinct non-empty boxes
    md = layout_to_storage_metadata(lay)
    assert tuple(md.size) == shape and md.properties.dtype is dtype
    assert sorted((tuple(c.offsets), tuple(c.sizes)) for c in md.chunks) == sorted(distinct)
    back = layout_from_storage_metadata(md, name=name)
    assert sorted(s.box for s in back.shards) == sorted(distinct)
    assert all(s.rank is None for s in back.shards)

    # ShardedTensor metadata round trip (a ShardedTensor holds no replicas)
    if len({(o, z) for _, o, z in shards if all(z)}) == sum(1 for _, _, z in shards if all(z)):
        st_md = layout_to_sharded_tensor_metadata(lay)
        assert [(m.placement.rank(), tuple(m.shard_offsets), tuple(m.shard_sizes)) for m in st_md.shards_metadata] == shards
        again = layout_from_sharded_tensor_metadata(st_md, name=name)
        assert again == lay and _triples(again) == shards and again.dtype is dtype
    else:
        with pytest.raises(ValueError, match="replicated"):
            layout_to_sharded_tensor_metadata(lay)


def _where(name, shape):
    return f"table {name!r} of shape {list(shape)}"


@HYPOTHESIS
@given(_grid_tables(replicas=False), st.data())
def test_random_invalid_layouts(table, data):
    shape, _, shards, _, name = table
    numel = int(np.prod(shape))
    kind = data.draw(st.sampled_from(["shift", "drop", "enlarge"]))
    bad = list(shards)
    also = ""
    if kind == "shift":
        # move a non-empty block back by one in a dim where it does not start at 0
        choices = [(i, d) for i, (_, o, z) in enumerate(shards) if all(z) for d in range(len(shape)) if o[d] > 0]
        assume(choices)
        i, d = data.draw(st.sampled_from(choices))
        r, o, z = shards[i]
        new_o = tuple(v - 1 if k == d else v for k, v in enumerate(o))
        bad[i] = (r, new_o, z)
        twins = [t for j, t in enumerate(shards) if j != i and (t[1], t[2]) == (new_o, z)]
        if twins and twins[0][0] == r:
            expect = "are the same block"
        elif twins:  # an identical box elsewhere reads as a replica: the gap is what is left
            expect = f"shards cover {numel - int(np.prod(z))} of {numel} elements"
        else:
            expect = f"shard {i} (rank {r}, offsets {list(new_o)}, sizes {list(z)})"
            also = "overlaps"
        event(f"shift: {expect.split()[0]}")
    elif kind == "drop":
        choices = [i for i, (_, _, z) in enumerate(shards) if all(z)]
        i = data.draw(st.sampled_from(choices))
        dropped = bad.pop(i)
        if bad:
            expect = f"shards cover {numel - int(np.prod(dropped[2]))} of {numel} elements"
        else:
            expect = "layout has no shards"
    else:
        i = data.draw(st.integers(0, len(shards) - 1))
        d = data.draw(st.integers(0, len(shape) - 1))
        extra = data.draw(st.integers(1, 3))
        r, o, z = shards[i]
        new_z = tuple(shape[d] - o[d] + extra if k == d else v for k, v in enumerate(z))
        bad[i] = (r, o, new_z)
        expect = (
            f"shard {i} (rank {r}) at offsets {list(o)} with sizes {list(new_z)} is out of bounds "
            f"in dim {d} ({o[d]} + {new_z[d]} > {shape[d]})"
        )
    with pytest.raises(ValueError) as info:
        ShardLayout.from_shards(shape, bad, name=name)
    msg = str(info.value)
    assert msg.startswith(_where(name, shape)), msg
    assert expect in msg and also in msg, (expect, also, msg)
    # the unperturbed layout is fine
    ShardLayout.from_shards(shape, shards, name=name)


def test_chunk_span_is_torch_chunk():
    from torchrec_dtensor_bridge.layout import chunk_sizes, chunk_span

    for extent in range(0, 13):
        for parts in range(1, 6):
            pieces = [len(p) for p in torch.arange(extent).chunk(parts)] if extent else []
            pieces += [0] * (parts - len(pieces))  # torch.chunk drops trailing empty pieces
            assert chunk_sizes(extent, parts) == pieces, (extent, parts)
            starts = [chunk_span(extent, parts, i)[0] for i in range(parts)]
            assert all(s + z <= extent for s, z in zip(starts, pieces))


def test_on_ranks_renumbers_the_groups_blocks():
    lay = ShardLayout.from_shards((10, 4), [(0, (0, 0), (5, 4)), (1, (5, 0), (5, 4)),
                                            (2, (0, 0), (5, 4)), (3, (5, 0), (5, 4))], name="t")
    part = lay.on_ranks([2, 3])
    assert [(s.rank, s.offsets) for s in part.shards] == [(0, (0, 0)), (1, (5, 0))]
    part.validate()
    assert lay.on_ranks([3, 2]).shards[0].rank == 1  # group-rank order, not sorted
    assert lay.on_ranks([0]).shards == (ShardSpec(0, (0, 0), (5, 4)),)


def test_digest_tells_layouts_apart():
    a = ShardLayout.row_wise((97, 4), [60, 37], dtype=torch.float32)
    b = ShardLayout.row_wise((97, 4), [70, 27], dtype=torch.float32)
    assert a.digest() == ShardLayout.row_wise((97, 4), [60, 37], dtype=torch.float32, name="other").digest()
    assert a.digest() != b.digest()
    assert a.digest() != ShardLayout.row_wise((97, 4), [60, 37], dtype=torch.float64).digest()
    assert a.digest() != ShardLayout.row_wise((97, 4), [60, 37], ranks=[1, 0], dtype=torch.float32).digest()
    assert 0 <= a.digest() < 2**62


def test_box_intersection_matches_a_mask_of_elements():
    from torchrec_dtensor_bridge.layout import box_intersection

    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        a_off, b_off = torch.randint(0, 5, (2,), generator=g).tolist(), torch.randint(0, 5, (2,), generator=g).tolist()
        a_sz, b_sz = torch.randint(0, 4, (2,), generator=g).tolist(), torch.randint(0, 4, (2,), generator=g).tolist()
        mask = torch.zeros(10, 10, dtype=torch.int64)
        mask[a_off[0] : a_off[0] + a_sz[0], a_off[1] : a_off[1] + a_sz[1]] += 1
        mask[b_off[0] : b_off[0] + b_sz[0], b_off[1] : b_off[1] + b_sz[1]] += 1
        both = (mask == 2).nonzero()
        got = box_intersection(a_off, a_sz, b_off, b_sz)
        if not len(both):
            assert got is None and not boxes_overlap(a_off, a_sz, b_off, b_sz)
            continue
        lo, hi = both.min(0).values.tolist(), (both.max(0).values + 1).tolist()
        assert got == (tuple(lo), tuple(h - low for low, h in zip(lo, hi)))
        assert boxes_overlap(a_off, a_sz, b_off, b_sz)
