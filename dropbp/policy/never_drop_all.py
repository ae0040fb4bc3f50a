"""The one rule every drop pattern obeys: never drop every branch. Its one home: the rule, the rate checks
that apply it, and the guards that keep it.

A step in which every branch is dropped trains nothing that lives inside the branches (with LoRA,
nothing at all: ``loss.backward()`` raises). Per-branch rates ``r_i`` whose sum is at most ``N - 1``
allow a sampler that never drops all ``N`` (the systematic sampler drops ``floor(sum)`` or
``ceil(sum)`` branches): the rate checks here refuse larger sums,
:func:`fit_rates` lowers allocated rates into that bound, and :func:`keep_a_trainable_branch` is the
last guard, at every draw, for models whose trainable parameters sit in only some branches.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence

from dropbp.checks import check_fraction, check_sequence

__all__ = [
    "SUM_TOLERANCE",
    "check_cut_rates",
    "check_drop_rate",
    "check_rates",
    "fit_rates",
    "keep_a_trainable_branch",
    "max_total_rate",
]

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


def check_rates(rates: Sequence[float], num_branches: int) -> list[float]:
    """One rate per branch, each in ``[0, 1)``, summing to at most ``N - 1``.

    Args:
        rates: the per-branch drop probabilities, in branch order.
        num_branches: how many branches the model has.
    """
    rates = check_sequence("rates", rates)
    if len(rates) != num_branches:
        raise ValueError(f"rates must have one entry per branch: expected {num_branches}, got {len(rates)}")
    out = [check_fraction(f"rates[{i}]", r) for i, r in enumerate(rates)]
    limit = max_total_rate(num_branches)
    if sum(out) > limit + SUM_TOLERANCE:
        raise ValueError(
            f"rates sum to {sum(out):.4g} but with {num_branches} branches the sum must be at most "
            f"{limit}, or some steps would drop every branch (nothing left to train); lower the rates"
        )
    return out


def check_cut_rates(rates: Sequence[float], num_branches: int) -> list[float]:
    """Rates for the cut shape: one per branch in ``[0, 1]``, never rising with depth, the last 0.

    The cut sampler drops branch ``k`` when one uniform draw falls below ``rates[k]``; rates that rise
    with depth would drop a branch above a kept one (no longer a cut), and a last rate above 0 would
    drop every branch whenever the draw falls below it. A rate of 1 drops a branch in every step
    (a frozen bottom).

    Args:
        rates: the per-branch drop probabilities, in branch order (bottom first).
        num_branches: how many branches the model has.
    """
    rates = check_sequence("rates", rates)
    if len(rates) != num_branches:
        raise ValueError(f"rates must have one entry per branch: expected {num_branches}, got {len(rates)}")
    out = [check_fraction(f"rates[{i}]", r, high_inclusive=True) for i, r in enumerate(rates)]
    rising = next((i for i in range(1, len(out)) if out[i] > out[i - 1]), None)
    if rising is not None:
        raise ValueError(
            f"with pattern='cut' the rates must not rise with depth, but rates[{rising}]={out[rising]} > "
            f"rates[{rising - 1}]={out[rising - 1]}; pass rates that fall from the bottom branch to the top, "
            "or use pattern='uniform' for any rates"
        )
    if out[-1] != 0.0:
        raise ValueError(
            f"with pattern='cut' the last (top) branch's rate must be 0, got {out[-1]}: a cut keeps the top "
            "branch, or some steps would drop every branch"
        )
    return out


def check_drop_rate(drop_rate: object, num_branches: int) -> float:
    """A uniform drop rate for ``num_branches`` branches: in ``[0, 1)`` and within the rule.

    Args:
        drop_rate: every branch's drop probability.
        num_branches: how many branches the model has.
    """
    p = check_fraction("drop_rate", drop_rate)
    if p * num_branches > max_total_rate(num_branches) + SUM_TOLERANCE:
        largest = math.floor(max_total_rate(num_branches) / num_branches * 1000) / 1000
        raise ValueError(
            f"drop_rate={drop_rate} with {num_branches} branches would drop every branch in some steps, leaving "
            f"nothing to train; with {num_branches} branches drop_rate must be at most {largest}"
        )
    return p

