"""Counting the places a test's code reads tensor values back to the host (``tolist``, ``item``, ``int``,
``bool``, ...): on an accelerator each is a synchronisation."""

from __future__ import annotations

import pytest
import torch

READS = ("tolist", "item", "__int__", "__bool__", "__index__", "__float__")


def count_host_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """From now until ``monkeypatch`` is undone, every value read of a tensor appends its kind to the list
    returned."""
    reads: list[str] = []
    for name in READS:
        def counted(self, *args, _orig=getattr(torch.Tensor, name), _name=name, **kwargs):  # type: ignore[no-untyped-def]
            reads.append(_name)
            return _orig(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, counted)
    return reads
