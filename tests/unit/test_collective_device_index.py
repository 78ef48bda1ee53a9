"""The lookups' collectives on the tables' GPU, not on ``torch.cuda.current_device()`` (without a GPU: fake CUDA
tensors on ``cuda:1`` and a fake process group of two ranks, in one subprocess).

A process that never called ``torch.cuda.set_device`` has ``current_device() == 0``: a group of a CUDA mesh names
``cuda:0``, and a collective buffer made there runs NCCL on the wrong GPU (or fails) while the tables live on
``cuda:1``. Here the tables are DTensors of a ``cuda`` mesh whose local tensors are fake ``cuda:1`` tensors, and a
lookup with a bad argument (checked before any value is read) goes to its agreement step: the collective audit of
``tests/distributed/test_collective_devices_w2.py`` (its dispatch mode) records the devices of that collective's
tensors and must find ``cuda:1`` alone. The agreement is the one collective of the lookups whose tensors are not
made from the batch's or the tables' own (ids, outputs, gradients: all on the tables' device).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from torchrec_dtensor_bridge.groups import CommGroup
from torchrec_dtensor_bridge.lookup.functional import on_device

ROOT = Path(__file__).resolve().parents[2]
MARK = "DEVICE-INDEX-RESULTS:"


class _Stop(Exception):
    """Raised by the audit after the first collective: fake tensors carry no values to agree on."""


def main() -> None:
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torch.utils._python_dispatch import _disable_current_modes

    import torchrec_dtensor_bridge as tdb
    from torchrec_dtensor_bridge.convert import dtensor_from_local_shards
    from torchrec_dtensor_bridge.layout import ShardLayout

    from ..distributed.test_collective_devices_w2 import COLLECTIVES, CollectiveDevices

    fake = FakeTensorMode(allow_non_fake_inputs=True)

    class FirstCollective(CollectiveDevices):
        """The audit, stopping after the first collective, above a fake mode: a tensor made on a CUDA device, and
        every op on one, is fake (this torch has no CUDA); an op on real tensors alone runs as it is (the mesh's
        rank tensor is real, its values read)."""

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            kwargs = kwargs or {}
            device = kwargs.get("device")
            on_cuda = device is not None and torch.device(device).type == "cuda"
            flat = [x for a in [*args, *kwargs.values()] for x in (a if isinstance(a, (list, tuple)) else [a])]
            if func.namespace not in COLLECTIVES and not on_cuda and not any(isinstance(x, FakeTensor) for x in flat):
                with _disable_current_modes():
                    return func(*args, **kwargs)
            out = super().__torch_dispatch__(func, types, args, kwargs)
            if self.calls:
                raise _Stop
            return out

    torch.cuda.current_device = lambda: 0  # a process that never called torch.cuda.set_device
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    mesh = DeviceMesh("cuda", [0, 1])
    results: dict[str, object] = {}
    with fake:
        local = torch.empty(4, 4, device="cuda:1")
        ids = torch.zeros(3, dtype=torch.int64, device="cuda:1")
        offsets = torch.zeros(1, dtype=torch.int64, device="cuda:1")
    layout = ShardLayout.row_wise((8, 4), [4, 4], ranks=[0, 1]).with_name("t")
    weight = dtensor_from_local_shards(layout, [local], device_mesh=mesh)  # (the mesh's own tensor is real)
    assert weight.device == torch.device("cuda", 1) and Shard(0) in weight.placements
    for name in ("sharded_embedding_bags", "sharded_embedding_bag"):
        audit = FirstCollective("cuda:1")
        try:
            with fake, torch.no_grad(), audit:
                if name == "sharded_embedding_bags":
                    tdb.sharded_embedding_bags([ids], [weight], [offsets], mode="no such mode")
                else:
                    tdb.sharded_embedding_bag(ids, weight, offsets, mode="no such mode")
            results[name] = "no collective"
        except _Stop:
            results[name] = audit.calls
        except Exception as e:  # noqa: BLE001 - reported to the test process
            results[name] = f"{type(e).__name__}: {e}"
    print(MARK + json.dumps(results))


@pytest.fixture(scope="module")
def results() -> dict[str, object]:
    proc = subprocess.run([sys.executable, "-m", "tests.unit.test_collective_device_index"], cwd=ROOT,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"}, capture_output=True, text=True, timeout=180)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(MARK)]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1][len(MARK):])


@pytest.mark.parametrize("name", ["sharded_embedding_bags", "sharded_embedding_bag"])
def test_agreement_on_the_tables_gpu(results, name):
    got = results[name]
    assert isinstance(got, list) and got, got
    (op, devices), = got
    assert op == "allgather_" and set(devices) == {"cuda:1"}, got


def test_on_device_takes_the_tables_index():
    group = CommGroup(None, (0, 1), torch.device("cuda", 0))
    assert on_device(group, [torch.device("cuda", 1)]).device == torch.device("cuda", 1)
    assert on_device(group, [torch.device("cpu"), torch.device("cuda", 2)]).device == torch.device("cuda", 2)
    assert on_device(group, [torch.device("cpu")]) is group  # no table of the group's device type
    assert on_device(group, [torch.device("cuda", 0)]) is group


if __name__ == "__main__":
    main()
