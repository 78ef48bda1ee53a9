"""A process in which the package's extension cannot be imported, as in a pure-Python install (run by
``test_kernels_cli.py`` as ``python -m tests.unit.without_extension``): the ``kernels`` report, then two training
steps of a one-rank lookup with a fused optimizer and an incremental checkpoint save, every warning the package
logs kept. Prints one line, ``WITHOUT-EXTENSION:`` and a JSON object: the CLI's exit status, the report, the
warnings and the namespaces of the kernel ops the profiler saw."""

from __future__ import annotations

import sys

MARK = "WITHOUT-EXTENSION:"


def main() -> None:
    sys.modules["torchrec_dtensor_bridge._C"] = None  # type: ignore[assignment] - its import now fails
    import json
    import logging
    import tempfile
    from pathlib import Path

    warnings: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            warnings.append(record.getMessage())

    logging.getLogger("torchrec_dtensor_bridge").addHandler(Keep(logging.WARNING))

    import torch
    import torch.distributed as dist

    import torchrec_dtensor_bridge as tdb
    from torchrec_dtensor_bridge import cli
    from torchrec_dtensor_bridge.kernels import report

    from ..gpu.tables import dtensors

    code = cli.main(["kernels"])
    found = report.report()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    w = torch.randn(40, 16, generator=torch.Generator().manual_seed(0))
    (weight,) = dtensors([tdb.ShardLayout.row_wise((40, 16), [15, 25], ranks=[0, 0]).with_name("t")], [w],
                         torch.device("cpu"), shared=True)
    weight.requires_grad_()
    opt = tdb.FusedOptimizer([weight], "rowwise_adagrad", lr=0.1)
    ids, offsets = torch.tensor([1, 5, 5, 39, 0]), torch.tensor([0, 2, 5])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            tdb.sharded_embedding_bag(ids, weight, offsets, mode="sum", optimizer=opt).sum().backward()
        with tempfile.TemporaryDirectory() as d:
            tdb.checkpoint.save({"t": w}, Path(d) / "base")
            tdb.checkpoint.save({"t": w + 1}, Path(d) / "next", base=Path(d) / "base")
    spaces = sorted({e.name.split("::")[0] for e in prof.events()} & {"tdb", "tdb_native", "fbgemm"})
    dist.destroy_process_group()
    print(MARK + json.dumps({"code": code, "report": found, "warnings": warnings, "ops": spaces}))


if __name__ == "__main__":
    main()
