"""Rising drop-rate schedules (0.3's ``drop_schedule`` and ``ramp``): the rates rise from 0 over the first part of a
run of known length, then hold at the peak that keeps the run's mean drop rate. Measured and not better
(benchmarks/results/convergence_time-schedules_lora_pydoc_accumulate.md).

:class:`RisingSchedule` is a feature that plugs into the policy's time schedule (its ``rise``,
:class:`dropbp.policy.plugins.Rise`); without a run length (``total_steps``) it changes nothing. With the cut shape a
rising schedule is a randomised progressive freezing from the bottom. A peak the shape cannot take is refused.
"""

from __future__ import annotations

import math
from typing import Any

from dropbp.checks import check_choice, check_fraction
from dropbp.features.base import Feature, register_feature

__all__ = ["DEFAULT_RAMP", "RISES", "RisingSchedule"]

#: How the rates rise over the first ``ramp`` of the run: ``"linear"``, ``"cosine"`` (a half cosine, slow at both
#: ends) or ``"step"`` (0, then the peak at once).
RISES = ("linear", "cosine", "step")
#: The share of the run over which the rates rise when none is given.
DEFAULT_RAMP = 0.5


def _check_ramp(value: object) -> float:
    ramp = check_fraction("ramp", value, 0.0, 1.0, high_inclusive=True, what="a fraction of the run")
    if ramp == 0.0:
        raise ValueError("ramp must be a fraction of the run in (0, 1], got 0")
    return ramp


@register_feature
class RisingSchedule(Feature):
    """The rates rise from 0 over the first ``ramp`` of the run (``"linear"``, ``"cosine"`` or ``"step"``), then hold
    at the peak that keeps the run's mean drop rate (with ``total_steps``, or under the Trainer integration).

    Args:
        kind: one of :data:`RISES`.
        ramp: the share of the run, in (0, 1], over which the rates rise.
    """

    key = "rising_schedule"
    needed_to_resume = True
    replaces = {
        "drop_schedule": "features=[dropbp.experimental.RisingSchedule('linear', ramp=0.5)] (was "
        "drop_schedule='linear', ramp=0.5; 'cosine' and 'step' alike; 'constant' is the core's: leave it out)",
        "ramp": "features=[dropbp.experimental.RisingSchedule(kind, ramp=...)]",
    }

    def __init__(self, kind: str = "linear", ramp: float = DEFAULT_RAMP) -> None:
        super().__init__()
        self.kind = check_choice("kind", kind, RISES)
        self.ramp = _check_ramp(ramp)

    @property
    def rise(self) -> RisingSchedule:
        """The policy's extension point (:class:`dropbp.policy.plugins.Rise`): this object."""
        return self

    def level(self, step: int, total_steps: int) -> float:
        position = step / (self.ramp * total_steps)
        if position >= 1.0:
            return 1.0
        if self.kind == "linear":
            return position
        if self.kind == "cosine":
            return (1.0 - math.cos(math.pi * position)) / 2.0
        return 0.0  # "step": nothing until the ramp ends

    def describe(self) -> str:
        return repr(self)

    @classmethod
    def migrate_state(cls, state: dict[str, Any], attached: Feature | None) -> dict[str, Any]:
        """0.3's ``drop_schedule`` and ``ramp`` taken out; one other than ``"constant"`` needs this feature attached
        with the same settings."""
        if "drop_schedule" not in state and "ramp" not in state:
            return state
        rest = {k: v for k, v in state.items() if k not in ("drop_schedule", "ramp")}
        kind, ramp = state.get("drop_schedule", "constant"), state.get("ramp", DEFAULT_RAMP)
        if kind == "constant":
            return rest
        wanted = cls(kind, ramp)
        if not isinstance(attached, cls) or attached.config() != wanted.config():
            raise ValueError(
                f"state was saved by dropbp 0.3 with drop_schedule={kind!r}, ramp={ramp}: pass "
                f"features=[dropbp.experimental.{wanted!r}] to resume it"
            )
        return rest

    @classmethod
    def from_flat(cls, settings: dict[str, Any]) -> RisingSchedule | None:
        kind, ramp = settings.pop("drop_schedule", "constant"), settings.pop("ramp", DEFAULT_RAMP)
        if kind == "constant":
            _check_ramp(ramp)  # given with no rise, still checked
            return None
        return cls(kind, ramp)

    def config(self) -> dict[str, Any]:
        return {"kind": self.kind, "ramp": self.ramp}

    def __repr__(self) -> str:
        return f"RisingSchedule({self.kind!r}, ramp={self.ramp:g})"
