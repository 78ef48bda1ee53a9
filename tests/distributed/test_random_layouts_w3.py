"""Property-based round trips on 3 gloo ranks: random tables, cuts, rank assignments, dtypes."""

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from torchrec_dtensor_bridge.layout import ShardLayout

from .checks import check_layout
from .harness import make_pool_fixture

WORLD = 3
pool = make_pool_fixture(WORLD)


def _cuts(draw, extent: int) -> list[int]:
    inner = draw(st.sets(st.integers(1, max(extent - 1, 1)), max_size=min(4, extent - 1))) if extent > 1 else set()
    edges = [0, *sorted(inner), extent]
    return [b - a for a, b in zip(edges, edges[1:])]


@st.composite
def layouts(draw):
    rows = draw(st.integers(1, 40))
    shape = (rows,) if draw(st.booleans()) and rows > 1 else (rows, draw(st.integers(1, 12)))
    heights = _cuts(draw, rows)
    widths = _cuts(draw, shape[1]) if len(shape) == 2 else [None]
    blocks = [
        ((r0,) if w is None else (r0, c0), (h,) if w is None else (h, w))
        for r0, h in zip(_starts(heights), heights)
        for c0, w in zip(_starts([x or 0 for x in widths]), widths)
    ]
    ranks = draw(st.lists(st.integers(0, WORLD - 1), min_size=len(blocks), max_size=len(blocks)))
    order = draw(st.permutations(range(len(blocks))))
    dtype = draw(st.sampled_from([torch.float32, torch.float64, torch.int64]))
    shards = [(ranks[i], *blocks[i]) for i in order]
    return ShardLayout.from_shards(shape, shards, dtype=dtype, name="random")


def _starts(sizes):
    out, acc = [], 0
    for s in sizes:
        out.append(acc)
        acc += s
    return out


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(layout=layouts())
def test_random_layout_roundtrip(pool, layout):
    pictures = pool.run(check_layout, layout, layout.dtype)
    assert len(set(pictures)) == 1
