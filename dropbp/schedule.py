"""Drop-rate schedules: pure functions of the step that scale every branch's rate.

A schedule multiplies the rates by a factor in ``[0, 1]`` that depends only on the step, so the
pattern of a step stays a pure function of (seed, step, rates) and a resumed run repeats an
uninterrupted one. The controller uses :func:`warmup_factor` (``apply(..., warmup_steps=N)``,
``attach(trainer, warmup=0.2)``); :func:`anneal_factor` is the measured alternative the convergence
benchmark compares against (applied there with ``ctl.set_rates`` each step).

Warm-up exists because the first steps of a fine-tune are where it learns most: running them with
(nearly) full backprop closed about a fifth of DropBP's gap at equal time in the recorded runs.
"""

from __future__ import annotations

import math

__all__ = ["BOUNDED_WARMUP_LEVELS", "anneal_factor", "warmup_factor"]

#: Warm-up levels where the number of distinct patterns is bounded (each level is a new pool).
BOUNDED_WARMUP_LEVELS = 4


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


def anneal_factor(step: int, total_steps: int, fraction: float) -> float:
    """The factor on every rate at ``step`` when the rates fall linearly to 0 over the last ``fraction``.

    Args:
        step: the optimizer step, counted from 0.
        total_steps: the run's length in steps.
        fraction: the share of the run, at its end, over which the rates fall.
    """
    return min(1.0, (total_steps - step) / (fraction * total_steps))
