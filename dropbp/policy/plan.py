"""A run's drop patterns, known before it starts: how many distinct patterns and step sequences it uses.

On a lazy-graph device (Gaudi's lazy mode) every distinct training graph compiles once. With ``a`` micro-batches per
optimizer step, a micro-batch's forward+backward graph depends on its own pattern and on the patterns before it in
the step (they decide which gradients already exist to accumulate into), and the update graph on the step's whole
sequence of patterns. So a run compiles at most :attr:`PatternPlan.graphs` training graphs: one per distinct leading
part of a step's sequence, one per distinct sequence, and the first step's graphs once more (that step creates the
optimizer's state and the device's cached constants, so the second step's graphs differ from the first's even at one
pattern). Patterns are a pure function of the settings and the forward's index, so the plan is exact for a run whose
settings do not change (calibration changes the rates: plan after it).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

__all__ = ['DropTally', 'PatternPlan', 'plan_patterns']


@dataclass(frozen=True)
class PatternPlan:
    """What :func:`plan_patterns` found over a run."""

    #: Distinct drop patterns.
    patterns: int
    #: Distinct sequences of patterns in one optimizer step (one update graph each on a lazy device).
    sequences: int
    #: Distinct leading parts of those sequences (one forward+backward graph each on a lazy device).
    prefixes: int
    #: The first optimizer step from which no new sequence appears: no graph compiles from there on.
    settled_at: int
    #: Training forwards per optimizer step.
    micro_batches: int

    @property
    def graphs(self) -> int:
        """The most training graphs a lazy device compiles over the run (the first step's twice)."""
        return self.prefixes + self.sequences + self.micro_batches + 1


def plan_patterns(pattern_at: Callable[[int], Hashable], optimizer_steps: int, micro_batches: int) -> PatternPlan:
    """The plan of a run of ``optimizer_steps`` steps of ``micro_batches`` training forwards each, forward
    ``t`` dropping ``pattern_at(t)``."""
    patterns: set[Hashable] = set()
    sequences: set[tuple[Hashable, ...]] = set()
    prefixes: set[tuple[Hashable, ...]] = set()
    settled_at = 0
    for step in range(optimizer_steps):
        sequence = tuple(pattern_at(step * micro_batches + j) for j in range(micro_batches))
        if sequence not in sequences:
            sequences.add(sequence)
            settled_at = step + 1
        patterns.update(sequence)
        prefixes.update(sequence[: j + 1] for j in range(micro_batches))
    return PatternPlan(len(patterns), len(sequences), len(prefixes), settled_at, micro_batches)


class DropTally:
    """Running totals over training forwards: how many, branches dropped, branch FLOPs dropped.

    A step listener (:class:`dropbp.execution.hooks.StepListener`): the controller adds it to its step hooks.

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
