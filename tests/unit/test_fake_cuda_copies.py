"""A table listed twice in one fused update on CUDA: the arguments fbgemm's CUDA backward receives, against fbgemm's
own module with a ``feature_table_map`` that maps two features onto one table (fake ``cuda:0`` tensors, in one
subprocess: the machinery of ``test_fake_cuda.py``).

fbgemm's CUDA backward groups the ids by ``hash_size_cumsum[t] + id`` and updates each group once: a table that
got one ``hash_size_cumsum`` entry per listing would be two groups updating the same rows at once. fbgemm's
``SplitTableBatchedEmbeddingBagsCodegen`` gives the features of one table that table's offset
(``hash_size_cumsum = [cumsum[t] for t in feature_table_map] + [total]``, its total and ``total_hash_size_bits``
counting each table's rows once); its buffers, built here on the CPU (the same code whatever its device), are the
expectation. Ours: ``torch.ops.tdb.sparse_update`` (and ``pool_sum``) over the same tables with the shared one
listed at one element offset each time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from torchrec_dtensor_bridge.kernels import fbgemm

from .test_fake_cuda import BAGS, DEV, GAP, KINDS, Recorder, _place, given, one_call

pytestmark = pytest.mark.skipif(not fbgemm.available(), reason="needs fbgemm_gpu")

SHAPES = [(20, 8), (12, 4)]  # the physical tables (rows, dims)
MAPS = {"two_features_one_table": [0, 0], "shared_apart": [0, 1, 0], "shared_together": [1, 0, 0, 1]}
_OPTIM = {"sgd": "EXACT_SGD", "rowwise_adagrad": "EXACT_ROWWISE_ADAGRAD", "adagrad": "EXACT_ADAGRAD", "adam": "ADAM"}


def module_buffers(shapes: list[tuple[int, int]], fmap: list[int], kind: str) -> dict[str, Any]:
    """fbgemm's own module for ``shapes`` with ``feature_table_map=fmap`` (built on the CPU, outside the fake
    mode): the buffers its backward hands on, as values."""
    from torch.utils._python_dispatch import _disable_current_modes

    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice, SplitTableBatchedEmbeddingBagsCodegen)

    # its CPU mode has no Adam: Adagrad's module lays out the same per-element first state
    kind = "adagrad" if kind == "adam" else kind
    with _disable_current_modes(), torch.no_grad():
        m = SplitTableBatchedEmbeddingBagsCodegen(
            [(r, d, EmbeddingLocation.HOST, ComputeDevice.CPU) for r, d in shapes], feature_table_map=fmap,
            optimizer=getattr(EmbOptimType, _OPTIM[kind]))
        out = {name: getattr(m, name).tolist() for name in ("hash_size_cumsum", "D_offsets", "weights_offsets")}
        if kind != "sgd":
            out["momentum1_offsets"] = m.momentum1_offsets.tolist()
        out["total_hash_size_bits"], out["max_D"] = m.total_hash_size_bits, m.max_D
    return out


def _pattern(values: list[int]) -> list[int]:
    """Which entries are equal: each value replaced by the index of its first appearance's distinct value."""
    seen: dict[int, int] = {}
    return [seen.setdefault(v, len(seen)) for v in values]


def _check(rec: Recorder, fmap: list[int], kind: str) -> None:
    used = sorted(set(fmap))  # fbgemm's module: its tables in our storage's order, each with a feature
    theirs = module_buffers([SHAPES[p] for p in used], [used.index(p) for p in fmap], kind)
    size, at = _place(SHAPES, GAP)
    storage = torch.empty(size, device=DEV)
    offsets_, dims, rows = [at[p] for p in fmap], [SHAPES[p][1] for p in fmap], [SHAPES[p][0] for p in fmap]
    per_row = kind == "rowwise_adagrad"
    state_size, state_at = _place([(r, 1 if per_row else d) for r, d in SHAPES], GAP)
    states = [(torch.empty(state_size, device=DEV), [state_at[p] for p in fmap])
              for _ in range({"sgd": 0, "adam": 2}.get(kind, 1))]
    m1, m2 = (states + [(None, []), (None, [])])[:2]  # type: ignore[list-item]
    ids = torch.empty(3 * BAGS * len(fmap), dtype=torch.int64, device=DEV)
    offsets = torch.empty(BAGS * len(fmap) + 1, dtype=torch.int64, device=DEV)
    grad = torch.empty(BAGS, sum(dims), device=DEV)

    def update() -> None:
        torch.ops.tdb.sparse_update(storage, offsets_, dims, rows, grad, ids, offsets, None, kind, m1[0], m1[1],
                                    m2[0], m2[1], 0.1, 1e-8, 0.0, 0, 0.9, 0.999, 1)

    a = one_call(rec, update, backward=True).args
    problems = []
    for name in ("hash_size_cumsum", "D_offsets"):
        if rec.value(a[name]) != theirs[name]:
            problems.append(f"{name}: {rec.value(a[name])} (ours) != {theirs[name]} (fbgemm's module)")
    for name in ("total_hash_size_bits", "max_D"):
        if a[name] != theirs[name]:
            problems.append(f"{name}: {a[name]} (ours) != {theirs[name]} (fbgemm's module)")
    # ours at the caller's offsets (with gaps), fbgemm's module's packed: the same tables share one offset
    for name, ours_at in (("weights_offsets", offsets_), ("momentum1_offsets", m1[1])):
        if name not in theirs:
            continue
        got = rec.value(a[name])
        if got != list(ours_at) or _pattern(got) != _pattern(theirs[name]):
            problems.append(f"{name}: {got} (ours, given {list(ours_at)}) shares unlike {theirs[name]}")
    given(a["indices"], ids)
    given(a["offsets"], offsets)
    lookup = one_call(rec, lambda: torch.ops.tdb.pool_sum(storage, offsets_, dims, rows, ids, offsets, None)).args
    if rec.value(lookup["hash_size_cumsum"]) != theirs["hash_size_cumsum"]:
        problems.append(f"lookup hash_size_cumsum: {rec.value(lookup['hash_size_cumsum'])} != {theirs['hash_size_cumsum']}")
    assert not problems, "\n".join(problems)


def checks() -> dict[str, Callable[[Recorder], None]]:
    return {f"{name}-{kind}": (lambda rec, f=fmap, k=kind: _check(rec, f, k))
            for name, fmap in MAPS.items() for kind in KINDS}


@pytest.fixture(scope="module")
def results(fake_cuda_results: dict[str, dict[str, str | None]]) -> dict[str, str | None]:
    return fake_cuda_results[__name__]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", sorted(MAPS))
def test_copies_share_one_hash_size_cumsum_offset(results, name, kind):
    """The backward's (and the lookup function's) table arguments equal fbgemm's module's for the same
    ``feature_table_map``."""
    assert results[f"{name}-{kind}"] is None, results[f"{name}-{kind}"]

