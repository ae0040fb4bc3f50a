"""What was dropped over the training forwards since the last read: for logs and trainer callbacks."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["DropTally"]


class DropTally:
    """Running totals over training forwards: how many, branches dropped, branch FLOPs dropped.

    A step listener (:class:`dropbp.hooks.StepListener`): the controller adds it to its step hooks.

    Args:
        flops: the branches' costs, in branch order.
    """

    def __init__(self, flops: Sequence[float]) -> None:
        self._flops = list(flops)
        self.reset()

    def reset(self) -> None:
        """Start the totals again from nothing."""
        self.forwards = 0
        self.branches = 0
        self.flops = 0.0

    def on_training_forward(self, pattern: frozenset[int]) -> None:
        """Count one training forward that dropped ``pattern`` (branch indices)."""
        self.forwards += 1
        self.branches += len(pattern)
        self.flops += sum(self._flops[i] for i in pattern)

    def on_remove(self) -> None:
        """Nothing to undo: the totals stay readable."""

    def summary(self) -> dict[str, float]:
        """Forwards, mean branches dropped per forward, mean fraction of branch FLOPs dropped."""
        n = self.forwards
        return {
            "forwards": float(n),
            "dropped_branches": self.branches / n if n else 0.0,
            "dropped_flops_fraction": self.flops / (n * sum(self._flops)) if n else 0.0,
        }
