"""The fused-optimizer kernels on CUDA, every kind, weighted or not, in every table dtype, against the unsharded
reference; skipped where there is no CUDA device. The third step of ``scripts/gpu_check.sh``, after the install
and the schema check: small and quick, so that a fault of the kernels' calls shows before the longer tests run.

For each of the 4 kinds (sgd, rowwise_adagrad, adagrad, adam), without and with per-sample weights, for fp32,
fp16 and bf16 tables: a 32 x 16 table in two row blocks (two storages: two fbgemm calls per step) takes two
lookups with the kind's :class:`~torchrec_dtensor_bridge.FusedOptimizer` on CUDA. Every expectation comes from
the unsharded reference on CPU (``F.embedding_bag`` on the whole fp32 table, autograd, the textbook update of
``tests/distributed/sparse_reference.py``), none from the package:

* each step's output, within the dtype's resolution;
* the optimizer state after the steps (fp32 whatever the table's dtype): within fp32's rounding for fp32 tables;
  for half-precision tables within the dtype's resolution, as a gradient in the table's dtype (what torch's
  autograd gives a half table) may be squared there (the per-row gradients themselves are exact: the table, the
  per-sample weights and the output gradient are multiples of powers of two);
* the table after the steps, within a few units in the last place of the dtype (half-precision rows are
  written back rounded, stochastically by default: at most one unit per step);
* with fbgemm-gpu's CUDA build installed, its lookup function and its backward-with-update op for the kind and
  weighting are what ran (the profiler names them): the check is of fbgemm's kernels, not of a fallback.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torchrec_dtensor_bridge as tdb
from torchrec_dtensor_bridge.kernels import fbgemm
from torchrec_dtensor_bridge.layout import ShardLayout

from ..distributed.sparse_reference import SparseReference
from .tables import batch, dtensors, exact_table, scale

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

CUDA = torch.device("cuda", 0)
SHAPE = (32, 16)
LAYOUT = ShardLayout.row_wise(SHAPE, [12, 20], ranks=[0, 0])
KINDS = ["sgd", "rowwise_adagrad", "adagrad", "adam"]
HYPER = {"lr": 0.1, "eps": 1e-3, "beta1": 0.8, "beta2": 0.9}
STEPS = 2
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
TOL = {  # two units in the last place below 1 (fp16 2**-11, bf16 2**-8), and fp32's sums and square roots
    torch.float32: {"rtol": 1e-5, "atol": 1e-5},
    torch.float16: {"rtol": 1e-3, "atol": 1e-3},
    torch.bfloat16: {"rtol": 8e-3, "atol": 8e-3},
}
STATE_TOL = {torch.float32: {"rtol": 1e-5, "atol": 1e-6}, torch.float16: TOL[torch.float16],
             torch.bfloat16: TOL[torch.bfloat16]}


def per_sample_weights(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``n`` weights in 0.25 .. 1 (exact in every dtype)."""
    return ((torch.arange(n) % 4 + 1) / 4).to(device, dtype)


def train(kind: str, weighted: bool, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """:data:`STEPS` fused-optimizer lookups of the table on ``device`` and of the unsharded reference on CPU,
    checking each step's output; the table and the state after them, ours (``"table"``, the state's keys) and the
    reference's (the same keys prefixed ``"want."``), on CPU in fp32."""
    full = exact_table(SHAPE, 3).to(dtype)
    (weight,) = dtensors([LAYOUT.with_name("t")], [full], device, shared=False)
    weight.requires_grad_()
    opt = tdb.FusedOptimizer({"t": weight}, kind, **HYPER)
    ref = SparseReference(full.float(), kind, **HYPER)
    for step in range(STEPS):
        ids, offsets = batch(SHAPE[0], 40 + step, device)
        psw = per_sample_weights(ids.numel(), dtype, device) if weighted else None
        out = tdb.sharded_embedding_bag(ids, weight, offsets, mode="sum", per_sample_weights=psw, optimizer=opt)
        assert out.dtype == dtype and out.device == device
        g = scale(out)
        (out * g).sum().backward()
        assert weight.grad is None, "a fused optimizer leaves no gradient"
        table = ref.w.clone().requires_grad_()
        ref_psw = None if psw is None else psw.float().cpu()
        want = F.embedding_bag(ids.cpu(), table, offsets.cpu(), mode="sum", per_sample_weights=ref_psw)
        torch.testing.assert_close(out.float().cpu(), want.detach(), **TOL[dtype],
                                   msg=lambda m, step=step: f"output of step {step}: {m}")
        (grad,) = torch.autograd.grad((want * g.float().cpu()).sum(), table)
        ref.apply(grad, ids.cpu().unique())
    got = {"table": tdb.full_tensor(weight.detach()).float().cpu()}
    for key, value in opt.state_dict().items():
        got[key] = (tdb.full_tensor(value) if isinstance(value, torch.distributed.tensor.DTensor) else value).cpu()
    got["want.table"] = ref.w
    got |= {f"want.{k}": v for k, v in ref.state("t").items()}
    return got


def fbgemm_ran(kind: str, weighted: bool, events: set[str]) -> list[str]:
    """fbgemm's ops for ``kind``'s fused lookup that ``events`` (profiler event names) lack."""
    which = "weighted" if weighted else "unweighted"
    wanted = ["fbgemm::split_embedding_codegen_lookup_sgd_function_pt2",
              f"fbgemm::split_embedding_backward_codegen_{kind}_{which}_pt2_wrapper"]
    return [w for w in wanted if w not in events]


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("kind", KINDS)
def test_fused_kernels_equal_the_reference(groups, kind, weighted, dtype):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        got = train(kind, weighted, dtype, CUDA)
        torch.cuda.synchronize()
    torch.testing.assert_close(got["table"], got["want.table"], **TOL[dtype])
    states = sorted(k for k in got if k != "table" and not k.startswith("want."))
    assert states == sorted(k.removeprefix("want.") for k in got if k.startswith("want.") and k != "want.table")
    for key in states:
        torch.testing.assert_close(got[key].to(got[f"want.{key}"].dtype), got[f"want.{key}"], **STATE_TOL[dtype],
                                   msg=lambda m, key=key: f"{key}: {m}")
    if fbgemm.cuda_available():
        lacking = fbgemm_ran(kind, weighted, {e.name for e in prof.events()})
        assert not lacking, f"fbgemm-gpu's CUDA build is installed, but {lacking} did not run"
