"""How fast this machine gives a process memory it touches for the first time, by how much the process holds.

Allocates ``--chunks`` zero-filled tensors of ``--gib`` GiB one after the other, holding each, and prints
the rate of each fill (the fill is the first touch of the chunk's pages). On a machine whose memory is
backed lazily (a virtual machine), memory the guest has not used recently is faulted in far more slowly
than memory it has: the figures of every benchmark that allocates a lot depend on it, and on what the
process (and the machine) held before.

    python scripts/bench_first_touch.py --gib 2 --chunks 6
"""

from __future__ import annotations

import argparse
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=2.0)
    parser.add_argument("--chunks", type=int, default=6)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    held = []
    n = int(args.gib * (1 << 30)) // 4
    for _ in range(args.chunks):
        t0 = time.perf_counter()
        chunk = torch.zeros(n)
        dt = time.perf_counter() - t0
        print(f"holding {len(held) * args.gib:5.1f} GiB: {args.gib} GiB zero-filled in {dt:6.2f} s "
              f"({args.gib / dt:5.2f} GiB/s)", flush=True)
        held.append(chunk)


if __name__ == "__main__":
    main()
