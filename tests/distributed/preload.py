"""Imported once by the test ranks' fork server (:mod:`.harness`), before any rank is forked from it: torch,
with one OpenMP thread, and the libraries the ranks' test modules import (DTensor, DCP, TorchRec and its
fbgemm_gpu; about 1.5 s of imports per rank otherwise). None of them starts a thread when imported. Nothing
of this package is imported here: every rank imports it afresh."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402,F401
import torch.distributed  # noqa: E402,F401
import torch.distributed.checkpoint  # noqa: E402,F401
import torch.distributed.tensor  # noqa: E402,F401

try:  # the tests that need them say so when they are missing; the fork server must start regardless
    import fbgemm_gpu  # noqa: E402,F401
    import torchrec  # noqa: E402,F401
    import torchrec.distributed  # noqa: E402,F401
except Exception:  # noqa: BLE001
    pass
