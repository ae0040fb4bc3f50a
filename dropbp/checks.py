"""Argument checks: a wrong type is always a ``TypeError`` and a wrong value always a ``ValueError``.

Every public entry point (the options of ``apply`` and ``attach``, :mod:`dropbp.options`; the
controller's setters; ``allocate_rates``; the CLI) validates its values with these, each message
naming the argument, what it got and what it accepts. The rate checks apply the never-drop-everything
rule of :mod:`dropbp.keep` (rates summing to at most ``N - 1``); the rule itself lives there.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from .keep import SUM_TOLERANCE, max_total_rate

__all__ = [
    "RATE_CHECKS",
    "check_bool",
    "check_choice",
    "check_cut_rates",
    "check_drop_rate",
    "check_fraction",
    "check_int",
    "check_number",
    "check_rates",
    "check_ramp",
    "check_sequence",
]


def check_int(name: str, value: object, minimum: int) -> int:
    """``value`` as an int ``>= minimum`` (bools refused).

    Args:
        name: the argument's name, for the message.
        value: what the caller passed.
        minimum: the smallest accepted value.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int >= {minimum}, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value}")
    return value


def _as_float(name: str, value: object, accepts: str) -> float:
    """``float(value)``, refusing bools, strings and ``None`` with a TypeError that says what ``name`` accepts."""
    if isinstance(value, (bool, str, bytes)) or value is None:
        raise TypeError(f"{name} must be {accepts}, got {value!r}")
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be {accepts}, got {type(value).__name__}") from None


def check_number(name: str, value: object) -> float:
    """``value`` as a finite float (bools and strings refused).

    Args:
        name: the argument's name, for the message.
        value: what the caller passed.
    """
    number = _as_float(name, value, "a number")
    if not math.isfinite(number):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return number


def check_fraction(
    name: str, value: object, low: float = 0.0, high: float = 1.0, *, high_inclusive: bool = False, what: str = ""
) -> float:
    """``value`` as a float in ``[low, high)`` (or ``[low, high]``): drop rates, fractions of a run.

    Args:
        name: the argument's name, for the message.
        value: what the caller passed.
        low: the smallest accepted value.
        high: the upper bound.
        high_inclusive: whether ``high`` itself is accepted.
        what: what the value stands for, for the message (e.g. "a fraction of the training steps").
    """
    interval = f"[{low:g}, {high:g}{']' if high_inclusive else ')'}"
    number = _as_float(name, value, f"{what or 'a number'} in {interval}")
    inside = low <= number <= high if high_inclusive else low <= number < high  # NaN is never inside
    if not inside:
        raise ValueError(f"{name} must be {what + ' ' if what else ''}in {interval}, got {value!r}")
    return number


def check_bool(name: str, value: object) -> bool:
    """``value`` if it is ``True`` or ``False``.

    Args:
        name: the argument's name, for the message.
        value: what the caller passed.
    """
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {type(value).__name__}")
    return value


def check_choice(name: str, value: object, choices: Sequence[str]) -> str:
    """``value`` if it is one of ``choices``.

    Args:
        name: the argument's name, for the message.
        value: what the caller passed.
        choices: the accepted values.
    """
    if value not in choices:
        raise ValueError(f"{name} must be one of {tuple(choices)}, got {value!r}")
    return value  # type: ignore[return-value]


def check_sequence(name: str, values: object) -> list:
    """``values`` as a list, if it is a sequence (a list, a tuple, a tensor) and not a string.

    Args:
        name: the argument's name, for the message.
        values: what the caller passed.
    """
    if isinstance(values, (str, bytes)) or not hasattr(values, "__len__") or not hasattr(values, "__iter__"):
        raise TypeError(f"{name} must be a sequence of numbers, got {type(values).__name__}")
    return list(values)


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


def check_ramp(name: str, value: object) -> float:
    """The share of a run over which a rising drop schedule rises: a float in ``(0, 1]``.

    Args:
        name: the argument's name, for the message.
        value: what the caller passed.
    """
    ramp = check_fraction(name, value, 0.0, 1.0, high_inclusive=True, what="a fraction of the run")
    if ramp == 0.0:
        raise ValueError(f"{name} must be a fraction of the run in (0, 1], got 0")
    return ramp


#: Per pattern shape, the check of its per-branch rates.
RATE_CHECKS = {"uniform": check_rates, "cut": check_cut_rates}
