"""The one rule every drop pattern obeys: never drop every branch. Owned by :mod:`dropbp.policy`.

A step in which every branch is dropped trains nothing that lives inside the branches (with LoRA,
nothing at all: ``loss.backward()`` raises). Per-branch rates ``r_i`` whose sum is at most ``N - 1``
allow a sampler that never drops all ``N`` (the systematic sampler drops ``floor(sum)`` or
``ceil(sum)`` branches): the rate checks of :mod:`dropbp.checks` refuse larger sums,
:func:`fit_rates` lowers allocated rates into that bound, and :func:`keep_a_trainable_branch` is the
last guard, at every draw, for models whose trainable parameters sit in only some branches.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

__all__ = ["SUM_TOLERANCE", "fit_rates", "keep_a_trainable_branch", "max_total_rate"]

log = logging.getLogger("dropbp")

#: Float sums of rates that equal N - 1 may round a hair above it.
SUM_TOLERANCE = 1e-9


def max_total_rate(num_branches: int) -> int:
    """The largest sum of per-branch rates that can leave one branch kept in every step."""
    return num_branches - 1


def fit_rates(rates: Sequence[float], flops: Sequence[float], min_rate: float, step: float = 0.1) -> list[float]:
    """``rates`` lowered into the rule: the highest rate drops by ``step`` until the sum is ``<= N - 1``.

    A FLOP-weighted allocation over few branches can put cheap branches at 0.9 and exceed the bound;
    the warning says which overall (FLOP-weighted) drop rate is left.

    Args:
        rates: allocated rates, in branch order.
        flops: each branch's cost, to report the drop rate that is left.
        min_rate: no rate is lowered below this.
        step: the allocation's increment.
    """
    limit = max_total_rate(len(rates))
    fitted = list(rates)
    if sum(fitted) <= limit + SUM_TOLERANCE:
        return fitted
    wanted = sum(r * f for r, f in zip(fitted, flops, strict=True)) / sum(flops)
    while sum(fitted) > limit + SUM_TOLERANCE:
        i = max(range(len(fitted)), key=lambda j: (fitted[j], j))
        fitted[i] = max(min_rate, round(fitted[i] - step, 12))
    achieved = sum(r * f for r, f in zip(fitted, flops, strict=True)) / sum(flops)
    log.warning(
        "dropbp: with %d branches the allocated rates would drop every branch in some steps; the highest "
        "were lowered, giving a FLOP-weighted drop rate of %.3f instead of %.3f",
        len(fitted),
        achieved,
        wanted,
    )
    return fitted


def keep_a_trainable_branch(
    pattern: frozenset[int], rates: Sequence[float], trainable: Callable[[], list[bool] | None]
) -> frozenset[int]:
    """``pattern``, less one branch if it drops every branch that holds trainable parameters.

    Rates within the rule keep one branch per step, but with LoRA on attention only (say) the kept
    one may hold nothing trainable, and then the loss has no gradient. In such a step the trainable
    branch with the lowest rate (then the first) is kept: rare, and still a pure function of
    (seed, step).

    Args:
        pattern: the drawn pattern (indices of dropped branches).
        rates: the current per-branch rates, for the choice of the branch to keep.
        trainable: called only when something is dropped; per branch, whether it holds a trainable
            parameter, or ``None`` when a parameter outside the branches (embeddings, a head) is
            trainable, so every pattern leaves something to train.
    """
    if not pattern:
        return pattern
    mask = trainable()
    if mask is None or any(t for i, t in enumerate(mask) if i not in pattern):
        return pattern
    dropped = [i for i in pattern if mask[i]]
    if not dropped:
        return pattern
    return pattern - {min(dropped, key=lambda i: (rates[i], i))}
