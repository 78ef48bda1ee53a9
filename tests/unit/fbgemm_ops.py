"""The fbgemm ops the package calls, named once: every ``torch.ops.fbgemm`` op ``kernels/fbgemm.py`` calls or looks
for, with how it calls each. ``test_fbgemm_schemas.py`` checks this list against that module's source (so that it
cannot go stale) and each op's schema in the installed fbgemm_gpu against what the calls pass;
``scripts/gpu_check.sh`` runs that test first on a GPU machine.
"""

from __future__ import annotations

from dataclasses import dataclass

from torchrec_dtensor_bridge.optim_kinds import OptimKind

__all__ = ["OPS", "FbgemmOp", "backward_wrapper", "by_name"]


@dataclass(frozen=True)
class FbgemmOp:
    """One fbgemm op the kernels use.

    Attributes:
        name: its name under ``torch.ops.fbgemm``.
        cuda_only: only fbgemm-gpu's CUDA build registers it (fbgemm-gpu-cpu does not): a check on the CPU build
            skips it, saying so; any other op missing there is a failure.
        positional: for an op the kernels call with positional arguments, the names of fbgemm's arguments
            (fbgemm-gpu 1.8.0's schema) those stand for, in order; empty for an op called by name.
        probe: the kernels only test whether it is registered (``hasattr``), never call it.
    """

    name: str
    cuda_only: bool = False
    positional: tuple[str, ...] = ()
    probe: bool = False


def backward_wrapper(kind: OptimKind, weighted: bool) -> str:
    """The name of fbgemm's backward-with-update op for ``kind`` (as its training module's autograd calls it)."""
    return f"split_embedding_backward_codegen_{kind.fbgemm}_{'weighted' if weighted else 'unweighted'}_pt2_wrapper"


def _ops() -> tuple[FbgemmOp, ...]:
    fixed = (
        FbgemmOp("split_embedding_codegen_forward_cpu", positional=(
            "weights", "weights_offsets", "D_offsets", "total_D", "hash_size_cumsum", "indices", "offsets",
            "pooling_mode", "indice_weights", "output_dtype")),
        FbgemmOp("split_embedding_backward_codegen_dense_cpu", positional=(
            "grad_output", "host_weights", "weights_offsets", "D_offsets", "max_D", "hash_size_cumsum",
            "total_hash_size_bits", "indices", "offsets", "pooling_mode", "indice_weights")),
        FbgemmOp("get_infos_metadata", positional=("unused", "B", "T")),
        FbgemmOp("is_uvm_tensor", positional=("t",)),
        FbgemmOp("split_embedding_codegen_lookup_sgd_function_pt2"),
        FbgemmOp("split_embedding_codegen_forward_unweighted_cuda", cuda_only=True, probe=True),
        FbgemmOp("split_embedding_backward_codegen_dense_unweighted_exact_cuda", cuda_only=True),
        FbgemmOp("split_embedding_backward_codegen_dense_weighted_exact_cuda", cuda_only=True),
    )
    wrappers = tuple(FbgemmOp(backward_wrapper(k, w), cuda_only=not k.fbgemm_cpu)
                     for k in OptimKind if k.fbgemm_cpu or k.fbgemm_cuda for w in (False, True))
    return fixed + wrappers


OPS: tuple[FbgemmOp, ...] = _ops()
"""Every fbgemm op the kernels use: four called by position, the others by name, one only looked for."""


def by_name() -> dict[str, FbgemmOp]:
    """:data:`OPS` by op name."""
    return {op.name: op for op in OPS}
