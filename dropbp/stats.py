"""What was dropped over the training forwards since the last read: for logs and trainer callbacks."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["DropTally"]


@dataclass
class DropTally:
    """Running totals over training forwards: how many, branches dropped, branch FLOPs dropped."""

    forwards: int = 0
    branches: int = 0
    flops: float = 0.0

    def record(self, dropped: frozenset[int], flops: Sequence[float]) -> None:
        """Count one training forward that dropped ``dropped`` (indices into ``flops``)."""
        self.forwards += 1
        self.branches += len(dropped)
        self.flops += sum(flops[i] for i in dropped)

    def summary(self, total_flops: float) -> dict[str, float]:
        """Forwards, mean branches dropped per forward, mean fraction of branch FLOPs dropped."""
        n = self.forwards
        return {
            "forwards": float(n),
            "dropped_branches": self.branches / n if n else 0.0,
            "dropped_flops_fraction": self.flops / (n * total_flops) if n else 0.0,
        }
