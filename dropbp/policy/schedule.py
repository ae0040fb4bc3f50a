"""Drop-rate schedules: pure functions of the step that scale every branch's rate.

A schedule multiplies the rates by a factor in ``[0, 1]`` that depends only on the step, so the pattern of a step
stays a pure function of (seed, step, rates) and a resumed run repeats an uninterrupted one. The controller uses
:func:`warmup_factor` (``apply(..., warmup_steps=N)``, ``attach(trainer, warmup=0.2)``) and, when it knows the run's
length (``apply(..., total_steps=T)``, ``attach`` always), a :class:`TimeSchedule`, which gives back later in the run
what the warm-up left undropped, so that the mean rate over the run is the drop rate (the annealed alternative the
convergence benchmark compares against is :func:`dropbp.tools.compare.anneal_factor`).
Why, and what was measured: docs/regime.md ("A drop rate that moves with training time"), docs/history.md.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dropbp.policy.plugins import Rise

__all__ = ["BOUNDED_WARMUP_LEVELS", "SCHEDULE_LEVELS", "TimeSchedule", "warmup_factor"]

#: Warm-up levels where the number of distinct patterns is bounded (each level is a new pool).
BOUNDED_WARMUP_LEVELS = 4
#: Levels of a time schedule's factor where patterns are unbounded: steps of 5%, so that at most 21
#: pattern samplers are ever built.
SCHEDULE_LEVELS = 20


def warmup_factor(step: int, warmup_steps: int, levels: int | None = None) -> float:
    """The factor on every rate at ``step``: rising linearly from 0 to 1 over ``warmup_steps``.

    Args:
        step: the training forward, counted from 0.
        warmup_steps: how many forwards the warm-up lasts (0: none, the factor is always 1).
        levels: quantise the factor to multiples of ``1 / levels`` (bounded pattern pools warm up in
            quarters, so warm-up adds at most three pools); ``None``: one level per step.
    """
    if step >= warmup_steps:
        return 1.0
    levels = warmup_steps if levels is None else levels
    return math.floor(levels * step / warmup_steps) / levels


class TimeSchedule:
    """The factor on every rate at each training forward of a run of known length, whose mean is 1.

    The warm-up's factor (times a rise where one is given: :class:`dropbp.policy.plugins.Rise`), quantised to
    ``levels`` (each level is one pattern sampler, or one pattern pool on compiled devices), then scaled so that
    its mean over the ``total_steps`` forwards is exactly 1: the run saves the compute its drop rate
    asks for, less early and more late. Forwards past ``total_steps`` keep the last factor.

    Args:
        total_steps: the run's length in training forwards (micro-batches: optimizer steps times
            gradient accumulation), counted like ``warmup_steps``.
        warmup_steps: the warm-up's length in forwards (0: none).
        levels: the quantisation (:data:`SCHEDULE_LEVELS`, or :data:`BOUNDED_WARMUP_LEVELS` for bounded
            pattern pools).
        rise: how the rates rise over the run (None: they do not; only the warm-up lifts them).
    """

    def __init__(self, total_steps: int, warmup_steps: int, levels: int, rise: Rise | None = None) -> None:
        self._settings = (total_steps, warmup_steps)
        self._rise, self._levels = rise, levels
        # The level is non-decreasing in the step (the warm-up's and the rise's are): it stays on each of at most
        # levels + 1 runs of steps, each run's end found by bisection, so neither memory nor time grows with the run.
        #: (first step, level) of each run, and the sum of the level over the run's steps.
        self._runs: list[tuple[int, int]] = []
        summed, step = 0, 0
        while step < total_steps:
            level, low, high = self._level(step), step, total_steps  # the run's last step: low
            while high - low > 1:
                middle = (low + high) // 2
                low, high = (middle, high) if self._level(middle) == level else (low, middle)
            self._runs.append((step, level))
            summed, step = summed + level * (low - step + 1), low + 1
        if summed == 0:
            raise ValueError(
                f"the drop schedule drops nothing over the whole run of {total_steps} training forwards "
                f"({self.describe()}): lengthen the run or shorten the rise or the warm-up"
            )
        self._per_level = total_steps / summed  # a level's factor, over levels: the mean factor over the run is 1
        #: The largest factor: the rates at their peak are the rates times this.
        self.peak = self._runs[-1][1] * self._per_level

    def _level(self, step: int) -> int:
        """The raw factor at ``step`` (the rise times the warm-up) as the nearest of ``levels`` equal steps of 1."""
        total, warmup = self._settings
        raw = (1.0 if self._rise is None else self._rise.level(step, total)) * warmup_factor(step, warmup)
        return math.floor(self._levels * raw + 0.5)

    @property
    def rises(self) -> bool:
        """Whether the rates rise (else only a warm-up lifts the peak)."""
        return self._rise is not None

    def describe(self) -> str:
        """The settings, for messages."""
        total, warmup = self._settings
        rise = "" if self._rise is None else f"{self._rise.describe()}, "
        return f"{rise}warmup_steps={warmup}, total_steps={total}"

    def factor(self, step: int) -> float:
        """The factor on every rate at training forward ``step`` (counted from 0); past the run, the last one."""
        return self._level(min(step, self._settings[0] - 1)) * self._per_level

    def mean(self) -> float:
        """The factor's mean over the run (1, up to rounding)."""
        total, ends = self._settings[0], [start for start, _ in self._runs[1:]] + [self._settings[0]]
        return sum((end - start) * level for (start, level), end in zip(self._runs, ends, strict=True)) * (
            self._per_level / total
        )
