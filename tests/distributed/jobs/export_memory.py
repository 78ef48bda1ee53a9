"""``save PATH MIB``: a checkpoint of 4 tables of MIB/4 MiB each (one process); ``export PATH DST BUFFER_MIB``:
export it to safetensors (a buffer of BUFFER_MIB, twice that of staging) and print the growth of this process's
peak resident memory, in bytes, as JSON."""

from __future__ import annotations

import json
import resource
import sys

import torch

import torchrec_dtensor_bridge as tdb


def _tables(mib: int) -> dict[str, torch.Tensor]:
    rows = (mib << 20) // 4 // (256 * 4)
    return {f"t{i}": torch.full((rows, 256), float(i)) + torch.arange(rows).unsqueeze(1) for i in range(4)}


def main() -> None:
    what, path = sys.argv[1], sys.argv[2]
    if what == "save":
        tdb.checkpoint.save(_tables(int(sys.argv[3])), path)
        return
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    buffer = int(sys.argv[4]) << 20
    done = tdb.checkpoint.export(path, sys.argv[3], progress=False, buffer_bytes=buffer, staging_bytes=2 * buffer)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"growth": after - before, "bytes": done.bytes}))


if __name__ == "__main__":
    main()
