"""One rank's batch of one table in canonical form: ids back to back, a length per bag, optional weights."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Bags"]


@dataclass(frozen=True)
class Bags:
    """One rank's batch in canonical form.

    Attributes:
        ids: 1-D int64 ids of every bag, back to back.
        lengths: number of ids in each bag (``int64``, one per bag).
        weights: per-sample weights aligned with ``ids``, or ``None``.
    """

    ids: torch.Tensor
    lengths: torch.Tensor
    weights: torch.Tensor | None

    @property
    def num_bags(self) -> int:
        return int(self.lengths.numel())

    def count_per_bag(self, mask: torch.Tensor) -> torch.Tensor:
        """For every bag, how many of its ids ``mask`` (one bool per id) selects: segment sums of a
        prefix sum (faster than ``bincount`` of the selected ids' bags)."""
        prefix = torch.zeros(mask.numel() + 1, dtype=torch.int64, device=mask.device)
        torch.cumsum(mask, 0, out=prefix[1:])
        bounds = torch.zeros(self.num_bags + 1, dtype=torch.int64, device=mask.device)
        torch.cumsum(self.lengths, 0, out=bounds[1:])
        return prefix[bounds[1:]] - prefix[bounds[:-1]]

    def bag_of_id(self) -> torch.Tensor:
        """For every id, the index of its bag."""
        return torch.repeat_interleave(
            torch.arange(self.num_bags, device=self.ids.device), self.lengths, output_size=self.ids.numel()
        )
