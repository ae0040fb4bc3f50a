"""Sensitivity-based allocation of per-branch drop rates (DropBP's greedy, mission.md section 5).

The research code runs this greedy in a C++ extension that keeps rates and priorities in float32
and its FLOP total in float64. Its decisions (which branch is raised next, when a branch stops being
eligible) depend on those roundings, so this pure-Python version emulates them step for step and
makes the same decisions for the same inputs, with no compiled extension to build.
"""

from __future__ import annotations

import heapq
import math
import struct
from collections.abc import Sequence

__all__ = ["allocate_rates"]


def _f32(x: float) -> float:
    """Round a Python float to the nearest float32, as a C++ float assignment does."""
    return struct.unpack("f", struct.pack("f", x))[0]


def _check_numbers(name: str, values: Sequence[float], *, positive: bool) -> list[float]:
    if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
        raise TypeError(f"{name} must be a sequence of numbers, got {type(values).__name__}")
    out = []
    for i, v in enumerate(values):
        try:
            f = float(v)
        except (TypeError, ValueError):
            raise TypeError(f"{name}[{i}] must be a number, got {v!r}") from None
        if not math.isfinite(f) or f < 0 or (positive and f == 0):
            bound = "> 0" if positive else ">= 0"
            raise ValueError(f"{name}[{i}] must be a finite number {bound}, got {v!r}")
        out.append(f)
    return out


def _check_rate(name: str, value: float, low: float, high: float, *, high_inclusive: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    v = float(value)
    inside = low <= v <= high if high_inclusive else low <= v < high
    if not inside:
        close = "]" if high_inclusive else ")"
        raise ValueError(f"{name} must be in [{low}, {high}{close}, got {value!r}")
    return v


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
    drop_rate = _check_rate("drop_rate", drop_rate, 0.0, 1.0, high_inclusive=False)
    min_rate = _check_rate("min_rate", min_rate, 0.0, 1.0, high_inclusive=False)
    max_rate = _check_rate("max_rate", max_rate, min_rate, 1.0, high_inclusive=False)
    step = _check_rate("step", step, 0.0, 1.0, high_inclusive=True)
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
