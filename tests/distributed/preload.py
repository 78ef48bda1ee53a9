"""Imported once by the test ranks' fork server (:mod:`.harness`): torch, with one OpenMP thread, before any
rank is forked from it. Nothing of this package is imported here: every rank imports it afresh."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402,F401
import torch.distributed  # noqa: E402,F401
