"""``PATH DST BUFFER_MIB``: export the checkpoint PATH (the :func:`tables` of ``test_checkpoint_export_w2``, saved
by the test) to safetensors (a buffer of BUFFER_MIB, twice that of staging) and print the growth of this process's
peak resident memory, in bytes, as JSON."""

from __future__ import annotations

import json
import resource
import sys

import torch

import torchrec_dtensor_bridge as tdb


def tables(mib: int) -> dict[str, torch.Tensor]:
    """4 tables of ``mib / 4`` MiB each, 256 columns; table ``i``'s row ``r`` holds ``i + r``."""
    rows = (mib << 20) // 4 // (256 * 4)
    return {f"t{i}": torch.full((rows, 256), float(i)) + torch.arange(rows).unsqueeze(1) for i in range(4)}


def main() -> None:
    path, dst = sys.argv[1], sys.argv[2]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    buffer = int(sys.argv[3]) << 20
    done = tdb.checkpoint.export(path, dst, progress=False, buffer_bytes=buffer, staging_bytes=2 * buffer)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"growth": after - before, "bytes": done.bytes}))


if __name__ == "__main__":
    main()
