"""The policy's extension points: what an object given in ``features`` may change in how patterns are decided.

The core decides patterns from the drop shape (:mod:`dropbp.policy.shapes`), the warm-up and, for a run of known
length, a schedule that keeps the run's mean drop rate (:class:`dropbp.policy.schedule.TimeSchedule`). A feature may
plug into two points, read by :func:`policy_plugins` (the policy imports no feature: it reads these attributes):

- ``rise``: a :class:`Rise`, how the rates rise over the first part of a run of known length;
- ``pattern_draw``: a :class:`PatternDraw`, the sampler that replaces the shape's own (drawn afresh each step).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

from dropbp.policy.sampler import PatternSampler
from dropbp.policy.shapes import DropShape
from dropbp.policy.windows import Windows

__all__ = ["PatternDraw", "Rise", "policy_plugins"]


class Rise(Protocol):
    """How the rates rise from 0 over a run of known length (before the warm-up's factor and the mean's scaling)."""

    def level(self, step: int, total_steps: int) -> float:
        """The rise at training forward ``step`` of a run of ``total_steps`` forwards: from 0 to 1, never falling
        as the step grows (the time schedule finds where it changes by bisection)."""

    def describe(self) -> str:
        """The object as written (for messages)."""


class PatternDraw(Protocol):
    """Draws the patterns in place of the shape's sampler."""

    def check_draw(self, shape: DropShape, max_patterns: int | None) -> None:
        """Raise, saying what to change, where it cannot draw for ``shape`` under this pattern bound."""

    def sampler(
        self, shape: DropShape, rates: Sequence[float], seed: int, windows: Windows | None
    ) -> PatternSampler:
        """The sampler at these rates (a pure function of seed and pattern index)."""


def policy_plugins(features: Iterable[object]) -> tuple[Rise | None, PatternDraw | None]:
    """The rise and the pattern draw ``features`` give (``rise`` / ``pattern_draw`` attributes not None); two of one
    kind are refused."""
    rises = [r for f in features if (r := getattr(f, "rise", None)) is not None]
    draws = [d for f in features if (d := getattr(f, "pattern_draw", None)) is not None]
    for what, found in (("rise", rises), ("pattern draw", draws)):
        if len(found) > 1:
            raise ValueError(f"features give {len(found)} a {what} each ({found}): give one")
    return (rises[0] if rises else None), (draws[0] if draws else None)
