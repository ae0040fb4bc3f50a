"""Sensitivity-based allocation of per-branch drop rates (the DropBP reference code's greedy).

The research code runs this greedy in a C++ extension that keeps rates and priorities in float32
and its FLOP total in float64. Its decisions (which branch is raised next, when a branch stops being
eligible) depend on those roundings, so this pure-Python version emulates them step for step and
makes the same decisions for the same inputs, with no compiled extension to build.
"""

from __future__ import annotations

import heapq
import struct
from collections.abc import Sequence

from dropbp.checks import check_fraction, check_number, check_sequence

__all__ = ["allocate_rates", "cut_cap", "cut_rates", "cut_reaches"]


def _f32(x: float) -> float:
    """Round a Python float to the nearest float32, as a C++ float assignment does."""
    return struct.unpack("f", struct.pack("f", x))[0]


def _check_numbers(name: str, values: Sequence[float], *, positive: bool) -> list[float]:
    out = [check_number(f"{name}[{i}]", v) for i, v in enumerate(check_sequence(name, values))]
    for i, f in enumerate(out):
        if f < 0 or (positive and f == 0):
            raise ValueError(f"{name}[{i}] must be a finite number {'> 0' if positive else '>= 0'}, got {values[i]!r}")
    return out


def allocate_rates(
    sensitivities: Sequence[float],
    flops: Sequence[float],
    drop_rate: float,
    *,
    min_rate: float = 0.0,
    max_rate: float = 0.9,
    step: float = 0.1,
) -> list[float]:
    """Per-branch drop rates whose FLOP-weighted mean reaches ``drop_rate``, sparing sensitive branches.

    Every branch starts at ``min_rate``. While the kept backward FLOPs exceed
    ``int((1 - drop_rate) * sum(flops))``, the branch whose next rate ``r + step`` has the smallest
    ``sensitivity * (r + step)`` (ties: the later branch) is raised by ``step``; a branch stays
    eligible while its rate is below ``max_rate``. This is the reference's greedy exactly, including
    its float32 arithmetic, so the same inputs give the same rates.

    Returns the rates as ``min_rate + k * step`` (``k`` increments per branch), in branch order.
    Raises ValueError if ``max_rate`` makes ``drop_rate`` unreachable.
    """
    sens = _check_numbers("sensitivities", sensitivities, positive=False)
    fl = _check_numbers("flops", flops, positive=True)
    if not sens:
        raise ValueError("sensitivities is empty: there must be at least one branch")
    if len(sens) != len(fl):
        raise ValueError(f"sensitivities and flops must have one entry per branch, got {len(sens)} and {len(fl)}")
    drop_rate = check_fraction("drop_rate", drop_rate)
    min_rate = check_fraction("min_rate", min_rate)
    max_rate = check_fraction("max_rate", max_rate, min_rate)
    step = check_fraction("step", step, high_inclusive=True)
    if step == 0:
        raise ValueError("step must be in (0, 1], got 0")

    # float32 copies, as the reference converts its inputs with torch.tensor(..., dtype=float32).
    sens32 = [_f32(s) for s in sens]
    fl32 = [_f32(f) for f in fl]
    rates32 = [_f32(min_rate)] * len(sens)
    increments = [0] * len(sens)
    target = int((1 - drop_rate) * sum(fl))  # computed in Python floats, as the reference does
    total = 0.0
    for f in fl32:
        total += f
    total *= 1 - min_rate

    # std::priority_queue<pair<float, int64>> pops the largest (priority, index): the smallest
    # S * r' and, on ties, the later branch. heapq is a min-heap, so both are negated.
    heap = [(-_f32(-(s * (step + min_rate))), -i) for i, s in enumerate(sens32)]
    heapq.heapify(heap)
    while total > target:
        if not heap:
            raise ValueError(
                f"drop_rate={drop_rate} cannot be reached with max_rate={max_rate}: every branch is "
                f"at max_rate; raise max_rate or lower drop_rate"
            )
        neg_priority, neg_i = heapq.heappop(heap)
        i = -neg_i
        rates32[i] = _f32(rates32[i] + step)
        increments[i] += 1
        total -= fl32[i] * step
        if rates32[i] < max_rate:
            priority = _f32(-neg_priority - step * sens32[i])
            heapq.heappush(heap, (-priority, neg_i))
    return [round(min_rate + k * step, 12) for k in increments]


def cut_cap(drop_rate: float) -> float:
    """The cut shape's default cap on every rate, ``(1 + drop_rate) / 2``.

    Uncapped, the bottom branches drop in nearly every step and barely train; halfway between the
    target rate and 1 they still train in a quarter of the steps at 0.5 (capped against uncapped:
    docs/patterns.md).
    """
    return (1.0 + drop_rate) / 2.0


def _cut_reachable(flops: Sequence[float], max_rate: float) -> float:
    """The highest mean rate cuts capped at ``max_rate`` approach: every branch but the top one (always kept)
    at the cap."""
    return max_rate * (sum(flops) - flops[-1]) / sum(flops)


def cut_reaches(flops: Sequence[float], drop_rate: float) -> bool:
    """Whether :func:`cut_rates` can give ``drop_rate`` (in [0, 1)) under its default cap, without raising."""
    return drop_rate == 0.0 or drop_rate < _cut_reachable(flops, cut_cap(drop_rate))


def cut_rates(flops: Sequence[float], drop_rate: float, *, max_rate: float | None = None) -> list[float]:
    """Rates for the cut shape whose FLOP-weighted mean is ``drop_rate``: falling with depth, the top 0.

    The cut falls at a random point ``x`` of the model's depth measured in FLOPs (``x`` in [0, 1),
    bottom first), with ``P(x <= m) = m ** a``; a branch whose FLOP midpoint is ``m`` drops when the
    cut lies above it, with probability ``1 - m ** a`` (capped at ``max_rate``). ``a`` is solved so
    that the FLOP-weighted mean rate is ``drop_rate`` exactly: ``a = 1`` (a cut uniform over depth)
    gives about 0.5; larger ``a`` pushes the cut up. The top branch is always kept (rate 0).

    Args:
        flops: each branch's cost, in branch order (bottom first).
        drop_rate: the FLOP-weighted mean drop rate wanted, in [0, 1).
        max_rate: cap on every rate (below 1 keeps the bottom branches training sometimes); ``None``:
            :func:`cut_cap` of ``drop_rate``, the measured best; 1.0 for uncapped cuts.

    Raises:
        ValueError: when ``drop_rate`` cannot be reached under ``max_rate`` with the top branch kept.
    """
    fl = _check_numbers("flops", flops, positive=True)
    if not fl:
        raise ValueError("flops is empty: there must be at least one branch")
    drop_rate = check_fraction("drop_rate", drop_rate)
    max_rate = cut_cap(drop_rate) if max_rate is None else check_fraction("max_rate", max_rate, high_inclusive=True)
    total = sum(fl)
    below = [sum(fl[:k]) for k in range(len(fl))]
    mids = [(b + f / 2) / total for b, f in zip(below, fl, strict=True)]

    def profile(a: float) -> list[float]:
        return [min(max_rate, 1.0 - m**a) for m in mids[:-1]] + [0.0]

    def mean(a: float) -> float:
        return sum(r * f for r, f in zip(profile(a), fl, strict=True)) / total

    reachable = _cut_reachable(fl, max_rate)
    if drop_rate == 0.0:
        return [0.0] * len(fl)
    if drop_rate >= reachable:
        raise ValueError(
            f"drop_rate={drop_rate} cannot be reached by cuts capped at {max_rate:g} over these {len(fl)} branches: "
            f"the top branch is always kept, which leaves at most {reachable:.4f}; lower drop_rate, raise max_rate, "
            "or use pattern='uniform' (the paper's patterns), which reaches higher rates on few branches"
        )
    low, high = 0.0, 1.0
    while mean(high) < drop_rate:
        low, high = high, high * 2
    for _ in range(200):  # bisection to float precision: mean() rises with a
        a = (low + high) / 2
        low, high = (a, high) if mean(a) < drop_rate else (low, a)
    return profile(high)
