"""Argument checks: a wrong type is always a ``TypeError`` and a wrong value always a ``ValueError``.

Every public entry point (the options of ``apply`` and ``attach``, :mod:`dropbp.options`; the
controller's setters; ``allocate_rates``; the CLI) validates its values with these, each message
naming the argument, what it got and what it accepts. The checks of drop rates, which apply the never-drop-everything
rule, live with the rule (:mod:`dropbp.policy.never_drop_all`). :class:`Once` says a warning at most once per object.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

__all__ = [
    "AUTO",
    "check_bool",
    "check_choice",
    "check_fraction",
    "check_int",
    "check_number",
    "check_sequence",
    "is_auto",
]

#: An option's value that the library decides (``drop_rate="auto"``: the rate chosen each optimizer step from the
#: measured gradient noise scale; ``memory_bound="auto"``, ``warmup="auto"``, ...).
AUTO = "auto"


def is_auto(value: object) -> bool:
    """Whether an option that takes ``"auto"`` was given it (each option resolves its own ``"auto"`` in one place)."""
    return isinstance(value, str) and value == AUTO


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


class Once:
    """A warning said at most once per object that holds it (``Once(message)()``: said now, or nothing)."""

    def __init__(self, message: str, category: type[Warning] = UserWarning) -> None:
        self.message, self.category = message, category
        self.said = False

    def __call__(self) -> None:
        if not self.said:
            self.said = True
            warnings.warn(self.message, self.category, stacklevel=3)
