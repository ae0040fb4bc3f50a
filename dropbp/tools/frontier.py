"""Speedup at equal quality: how much sooner a run reaches a loss than full backprop can, from complete runs.

Full backprop is run to completion at several budgets (each its own warm-up and decay); the end of each run is a
point (training time, final loss), and their lower envelope is full backprop's **frontier**: the least time it needs
for a loss. A DropBP run that ended at loss ``l`` after time ``t`` has speedup ``frontier_time(l) / t``. Between two
budgets the frontier is linear in log-time; outside them the figure is a bound ("at least" past the longest budget's
loss, "at most" above the shortest's), never an extrapolation. Over seeds: the mean and a Student-t 95% interval.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "Reading",
    "frontier",
    "frontier_time",
    "best_batch_time",
    "equal_quality_speedup",
    "best_batch_speedup",
    "over_seeds",
    "exact_seeds",
]

EXACT, AT_LEAST, AT_MOST = "exact", "at least", "at most"

# Two-sided 95% Student-t quantiles by degrees of freedom (1..10); more seeds use the normal's 1.96 as a floor.
_T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228)


@dataclass(frozen=True)
class Reading:
    """A value read off a frontier, and whether it is exact or a bound (:data:`AT_LEAST` / :data:`AT_MOST`)."""

    value: float
    bound: str = EXACT

    def __str__(self) -> str:
        mark = {EXACT: "", AT_LEAST: ">= ", AT_MOST: "<= "}[self.bound]
        return f"{mark}{self.value:.2f}x"


def frontier(points: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """The lower envelope of complete runs' ``(time, final loss)``: sorted by time, each point kept only if it
    ends below every shorter budget (a longer run that ends worse buys nothing: the shorter one is taken)."""
    if len(points) < 2:
        raise ValueError(f"a frontier needs complete runs at 2 or more budgets, got {len(points)}")
    if any(t <= 0 or not math.isfinite(t) or not math.isfinite(loss) for t, loss in points):
        raise ValueError(f"every budget needs a positive time and a finite loss, got {list(points)}")
    kept: list[tuple[float, float]] = []
    for t, loss in sorted(points):
        if not kept or loss < kept[-1][1]:
            kept.append((t, loss))
    return kept


def frontier_time(points: Sequence[tuple[float, float]], loss: float) -> Reading:
    """The least time in which full backprop's complete runs ``points`` reach ``loss`` (see the module)."""
    front = frontier(points)
    if loss >= front[0][1]:
        return Reading(front[0][0], AT_MOST)
    if loss < front[-1][1]:
        return Reading(front[-1][0], AT_LEAST)
    for (t0, l0), (t1, l1) in zip(front, front[1:], strict=False):
        if loss == l1:
            return Reading(t1)
        if l1 < loss < l0:
            share = (l0 - loss) / (l0 - l1)
            return Reading(math.exp(math.log(t0) + share * (math.log(t1) - math.log(t0))))
    raise AssertionError("unreachable: the frontier's losses fall strictly")


def best_batch_time(batches: Sequence[Sequence[tuple[float, float]]], loss: float) -> Reading:
    """The least time in which full backprop reaches ``loss`` at its best batch: each batch's complete runs read off
    **their own** frontier, then the least of those times. (One envelope of every batch's runs would let a worse run
    of one batch, ending seconds before a better run of the other, flatten the frontier between them: it favours
    the run being compared.)

    Bounds combine as bounds: an "at most" from any batch (its shortest run already reaches ``loss``) makes the
    least time "at most" the smallest known upper bound; "at least" readings (``loss`` is past a batch's longest run)
    make it exact only when an exact reading is no longer than them, else "at most" that exact reading; all "at
    least", the least of them, "at least"."""
    if not batches:
        raise ValueError("best_batch_time needs the complete runs of at least one batch")
    readings = [frontier_time(points, loss) for points in batches]
    upper = [r.value for r in readings if r.bound != AT_LEAST]  # the least time is no more than these
    lower = [0.0 if r.bound == AT_MOST else r.value for r in readings]  # ... and no less than the least of these
    if not upper:
        return Reading(min(lower), AT_LEAST)
    least = min(upper)
    return Reading(least, EXACT if min(lower) == least else AT_MOST)


def best_batch_speedup(batches: Sequence[Sequence[tuple[float, float]]], time: float, loss: float) -> Reading:
    """:func:`best_batch_time` for ``loss`` over ``time``: how many times sooner than full backprop at its best
    batch the run reached its loss."""
    if time <= 0:
        raise ValueError(f"the run's time must be positive, got {time}")
    reached = best_batch_time(batches, loss)
    return Reading(reached.value / time, reached.bound)


def equal_quality_speedup(baseline: Sequence[tuple[float, float]], time: float, loss: float) -> Reading:
    """Full backprop's frontier time for ``loss`` over ``time``: how many times sooner the run reached its loss."""
    if time <= 0:
        raise ValueError(f"the run's time must be positive, got {time}")
    reached = frontier_time(baseline, loss)
    return Reading(reached.value / time, reached.bound)


def over_seeds(readings: Sequence[Reading]) -> dict:
    """Mean, Student-t 95% interval and per-seed values of one setting's speedups (one reading per seed).

    A bound enters the mean at its value; ``bounded`` counts such seeds, so a table can say the mean is itself
    a bound (all bounds the same way) or mixed."""
    if not readings:
        raise ValueError("over_seeds needs at least one reading")
    values = [r.value for r in readings]
    mean = statistics.fmean(values)
    half = math.nan
    if len(values) > 1:
        t = _T95[len(values) - 2] if len(values) - 1 <= len(_T95) else 1.96
        half = t * statistics.stdev(values) / math.sqrt(len(values))
    return {
        "mean": mean,
        "low": mean - half,
        "high": mean + half,
        "seeds": len(values),
        "per_seed": [{"value": r.value, "bound": r.bound} for r in readings],
        "bounded": sum(r.bound != EXACT for r in readings),
    }


def exact_seeds(summary: dict) -> dict | None:
    """:func:`over_seeds` of the seeds in ``summary`` (one of its results) whose readings are exact, or None where
    none is: a table can give the interval of the exact seeds and list the bounds apart, so that a bound never
    widens or moves an interval it is not part of."""
    exact = [Reading(s["value"]) for s in summary["per_seed"] if s["bound"] == EXACT]
    return over_seeds(exact) if exact else None
