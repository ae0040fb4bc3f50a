"""The policy's extension points: what an object given in ``features`` may change in how patterns are decided.

The core decides patterns from the drop shape (:mod:`dropbp.policy.shapes`), the warm-up and, for a run of known
length, a schedule that keeps the run's mean drop rate (:class:`dropbp.policy.schedule.TimeSchedule`). A feature may
plug into these points, read by :func:`policy_plugins` (the policy imports no feature: it reads these attributes):

- ``rise``: a :class:`Rise`, how the rates rise over the first part of a run of known length;
- ``pattern_draw``: a :class:`PatternDraw`, the sampler that replaces the shape's own (drawn afresh each step);
- ``chooses_rate``: the feature is a :class:`RateChoice`, which chooses ``drop_rate="auto"``'s rate;
- ``bounds_memory``: ``memory_bound="auto"`` turns the bound on with the feature (what it buys is memory).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple, Protocol

from dropbp.policy.sampler import PatternSampler
from dropbp.policy.shapes import DropShape
from dropbp.policy.windows import Windows

__all__ = ["PatternDraw", "Plugins", "RateChoice", "Rise", "policy_plugins"]


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


class RateChoice(Protocol):
    """Chooses the rate that ``drop_rate="auto"`` stands for."""

    def choose_rate(self, shape: DropShape, flops: Sequence[float]) -> float:
        """The rate now, among those ``shape`` reaches over branches of these costs."""


class Plugins(NamedTuple):
    """What the features of one set of options plug into the policy."""

    rise: Rise | None
    pattern_draw: PatternDraw | None
    rate_choice: RateChoice | None
    bounds_memory: bool


def policy_plugins(features: Iterable[object]) -> Plugins:
    """What ``features`` plug in (``rise`` / ``pattern_draw`` attributes not None, ``chooses_rate`` /
    ``bounds_memory`` true); two of one kind are refused."""
    features = list(features)
    rises = [r for f in features if (r := getattr(f, "rise", None)) is not None]
    draws = [d for f in features if (d := getattr(f, "pattern_draw", None)) is not None]
    choices = [f for f in features if getattr(f, "chooses_rate", False)]
    for what, found in (("rise", rises), ("pattern draw", draws), ("rate choice", choices)):
        if len(found) > 1:
            raise ValueError(f"features give {len(found)} a {what} each ({found}): give one")
    bounds = any(getattr(f, "bounds_memory", False) for f in features)
    return Plugins(rises[0] if rises else None, draws[0] if draws else None, choices[0] if choices else None, bounds)
