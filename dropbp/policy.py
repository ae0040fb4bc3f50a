"""The drop policy: per-branch rates, seed, pattern bound, warm-up and time schedule, turned into each step's pattern.

Everything that decides which branches drop lives here, behind setters that validate and take
effect from the next pattern drawn: the samplers are derived from the settings and rebuilt when one
changes, so no setting can leave a sampler built from stale ones. The pattern of a step is a pure
function of the settings and the step (:mod:`dropbp.sampler`), identical on every rank. The rule
that no pattern drops every branch is :mod:`dropbp.keep`'s, applied here: to allocated rates
(:meth:`DropPolicy.set_allocated_rates`) and to every drawn pattern (:meth:`DropPolicy.draw`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .allocation import cut_rates
from .checks import (
    check_choice,
    check_cut_rates,
    check_drop_rate,
    check_fraction,
    check_int,
    check_ramp,
    check_rates,
)
from .keep import fit_rates, keep_a_trainable_branch
from .sampler import SAMPLERS, PatternSampler
from .schedule import BOUNDED_WARMUP_LEVELS, DROP_SCHEDULES, SCHEDULE_LEVELS, TimeSchedule, warmup_factor

#: The ramp of a rising drop schedule when none is given: the share of the run over which it rises.
DEFAULT_RAMP = 0.5
#: Pattern samplers kept at once (one per factor on the rates). A warm-up without a time schedule has a
#: factor per step; the oldest sampler goes first (samplers are pure functions: rebuilt alike when needed).
MAX_SAMPLERS = 32

__all__ = ["DropPolicy"]


class DropPolicy:
    """Which branches drop at each step, for branches of the given costs in forward order.

    Args:
        flops: each branch's cost, in branch order; their number is the number of branches.
        drop_rate: the target drop rate, which sets the initial rates (and calibration's target).
        seed: fixes the patterns.
        max_patterns: bound on distinct patterns (``None``: unbounded).
        warmup_steps: training forwards over which every rate rises linearly from 0.
        pattern: the shape of the patterns: ``"cut"`` (each step drops every branch below a random
            depth; :func:`dropbp.allocation.cut_rates` gives the rates) or ``"uniform"`` (the paper:
            every branch drops at ``drop_rate``, independently of depth).
        total_steps: the run's length in training forwards; ``None``: unknown (the rates stay as set,
            after the warm-up). Known, the rates follow a :class:`~dropbp.schedule.TimeSchedule` whose
            mean over the run is 1, so the run drops ``drop_rate`` on average, warm-up included.
        drop_schedule: how the rates move over a run of known length (:data:`dropbp.schedule.DROP_SCHEDULES`).
        ramp: the share of the run over which a rising schedule rises, in (0, 1].
    """

    def __init__(
        self,
        flops: Sequence[float],
        drop_rate: float,
        seed: int,
        max_patterns: int | None,
        warmup_steps: int,
        pattern: str = "cut",
        total_steps: int | None = None,
        drop_schedule: str = "constant",
        ramp: float = DEFAULT_RAMP,
    ) -> None:
        self._flops = list(flops)
        self._num_branches = check_int("number of branches", len(self._flops), 1)
        self._samplers: dict[float, PatternSampler] = {}  # by the step's factor; derived, rebuilt on change
        self._time: TimeSchedule | None = None  # derived from the schedule's settings, rebuilt on change
        self._pattern = check_choice("pattern", pattern, tuple(SAMPLERS))
        self._max_patterns: int | None = None
        self._warmup_steps = 0
        self._total_steps: int | None = None
        self._drop_schedule = check_choice("drop_schedule", drop_schedule, DROP_SCHEDULES)
        self._ramp = check_ramp("ramp", ramp)
        self.drop_rate = drop_rate
        self.seed = seed
        self.max_patterns = max_patterns
        self.warmup_steps = warmup_steps
        self.total_steps = total_steps

    @property
    def num_branches(self) -> int:
        """How many branches the policy decides for."""
        return self._num_branches

    # -- settings: each validates, and patterns follow from the next step on ---------------------
    @property
    def drop_rate(self) -> float:
        """The target drop rate; setting it sets every branch's rate to it (as ``apply`` does)."""
        return self._drop_rate

    @drop_rate.setter
    def drop_rate(self, value: float) -> None:
        p = check_fraction("drop_rate", value)  # a number (not a bool or a string) in [0, 1)
        if self._pattern == "uniform":
            p = check_drop_rate(p, self._num_branches)
        self._rates = self._shape_rates(p, self._time)
        self._own_rates = True
        self._samplers.clear()
        self._drop_rate = float(p)

    def _shape_rates(self, p: float, time: TimeSchedule | None) -> list[float]:
        """The pattern shape's own rates for drop rate ``p`` under ``time``: those of ``p`` times its peak,
        divided by the peak, so that they are the shape's at the peak and average ``p`` over the run."""
        peak = 1.0 if time is None else time.peak
        try:
            if self._pattern == "uniform":
                return [check_drop_rate(p * peak, self._num_branches) / peak] * self._num_branches
            return [r / peak for r in cut_rates(self._flops, p * peak)]
        except ValueError as error:
            if peak == 1.0:
                raise
            raise self._peak_error(time, f"drop rate {p:g} x {peak:.3g} = {p * peak:.3g}: {error}") from None

    @property
    def pattern(self) -> str:
        """``"cut"`` or ``"uniform"``; setting it resets the rates to that shape's for :attr:`drop_rate`."""
        return self._pattern

    @pattern.setter
    def pattern(self, value: str) -> None:
        shape = check_choice("pattern", value, tuple(SAMPLERS))
        previous = self._pattern
        self._pattern = shape
        try:
            self.drop_rate = self._drop_rate
        except ValueError:
            self._pattern = previous
            raise

    @property
    def rates(self) -> list[float]:
        """Per-branch drop rates, in branch order (a copy)."""
        return list(self._rates)

    def set_rates(self, rates: Sequence[float]) -> None:
        """Set one rate per branch: for the uniform shape each in [0, 1), summing to at most N - 1; for
        the cut shape each in [0, 1], not rising with depth, the last 0 (:mod:`dropbp.checks`)."""
        check = check_rates if self._pattern == "uniform" else check_cut_rates
        checked = check(rates, self._num_branches)
        self._check_peak(checked, self._time)
        self._rates = checked
        self._own_rates = False  # given rates are kept as they are when the time schedule changes
        self._samplers.clear()

    def set_allocated_rates(self, rates: Sequence[float], min_rate: float) -> None:
        """Set rates allocated for the time schedule's peak (calibration): lowered into the rule where they
        would drop every branch in some steps (:func:`dropbp.keep.fit_rates`), then divided by the peak, so
        that the run's mean stays the drop rate."""
        peak = self.peak
        self.set_rates([r / peak for r in fit_rates(rates, self._flops, min_rate)])

    @property
    def seed(self) -> int:
        """The seed of every pattern."""
        return self._seed

    @seed.setter
    def seed(self, value: int) -> None:
        self._seed = check_int("seed", value, 0)
        self._samplers.clear()

    @property
    def max_patterns(self) -> int | None:
        """Bound on distinct patterns (compiled-graph devices); ``None``: unbounded."""
        return self._max_patterns

    @max_patterns.setter
    def max_patterns(self, value: int | None) -> None:
        bound = None if value is None else check_int("max_patterns", value, 1)
        self._retime(max_patterns=bound)

    @property
    def warmup_steps(self) -> int:
        """Training forwards over which the rates rise linearly from 0 (:func:`dropbp.schedule.warmup_factor`)."""
        return self._warmup_steps

    @warmup_steps.setter
    def warmup_steps(self, value: int) -> None:
        self._retime(warmup_steps=check_int("warmup_steps", value, 0))

    @property
    def total_steps(self) -> int | None:
        """The run's length in training forwards (``None``: unknown, no time schedule)."""
        return self._total_steps

    @total_steps.setter
    def total_steps(self, value: int | None) -> None:
        self._retime(total_steps=None if value is None else check_int("total_steps", value, 1))

    @property
    def drop_schedule(self) -> str:
        """How the rates move over a run of known length (:data:`dropbp.schedule.DROP_SCHEDULES`)."""
        return self._drop_schedule

    @drop_schedule.setter
    def drop_schedule(self, value: str) -> None:
        self._retime(drop_schedule=check_choice("drop_schedule", value, DROP_SCHEDULES))

    @property
    def ramp(self) -> float:
        """The share of the run over which a rising drop schedule rises."""
        return self._ramp

    @ramp.setter
    def ramp(self, value: float) -> None:
        self._retime(ramp=check_ramp("ramp", value))

    @property
    def peak(self) -> float:
        """The largest factor the time schedule puts on the rates (1 without one)."""
        return 1.0 if self._time is None else self._time.peak

    def factor(self, step: int) -> float:
        """The factor on every rate at training forward ``step``: the time schedule's, else the warm-up's."""
        if self._time is not None:
            return self._time.factor(step)
        levels = None if self._max_patterns is None else BOUNDED_WARMUP_LEVELS
        return warmup_factor(step, self._warmup_steps, levels)

    def _retime(self, **change: Any) -> None:
        """Apply a change to the schedule's settings if the rates stay valid at its peak; else change nothing."""
        settings = {
            "max_patterns": self._max_patterns,
            "warmup_steps": self._warmup_steps,
            "total_steps": self._total_steps,
            "drop_schedule": self._drop_schedule,
            "ramp": self._ramp,
            **change,
        }
        time = None
        if settings["total_steps"] is not None:
            levels = SCHEDULE_LEVELS if settings["max_patterns"] is None else BOUNDED_WARMUP_LEVELS
            time = TimeSchedule(
                settings["total_steps"], settings["drop_schedule"], settings["ramp"], settings["warmup_steps"], levels
            )
        rates = self._shape_rates(self._drop_rate, time) if self._own_rates else self._rates
        self._check_peak(rates, time)
        for name, value in settings.items():
            setattr(self, f"_{name}", value)
        self._time = time
        self._rates = rates
        self._samplers.clear()

    def _check_peak(self, rates: Sequence[float], time: TimeSchedule | None) -> None:
        """Refuse a time schedule whose peak would lift some rate past what the pattern shape allows.

        Keeping the run's mean at the drop rate while dropping less early means dropping more late:
        the rates at the peak are the rates times ``time.peak``.
        """
        if time is None or time.peak <= 1.0:
            return
        peak = [min(1.0, r * time.peak) if r * time.peak <= 1.0 + 1e-9 else r * time.peak for r in rates]
        check = check_rates if self._pattern == "uniform" else check_cut_rates
        try:
            check(peak, self._num_branches)
        except ValueError as error:
            raise self._peak_error(time, str(error)) from None

    def _peak_error(self, time: TimeSchedule, detail: str) -> ValueError:
        shorter = (
            "use a shorter ramp or warm-up, or drop_schedule='constant'"
            if time.rises
            else "shorten the warm-up (apply's warmup_steps, attach's warmup=) or set it to 0"
        )
        return ValueError(
            f"the time schedule ({time.describe()}) keeps the run's mean drop rate by peaking at {time.peak:.3g}x the "
            f"rates, which the {self._pattern!r} shape cannot take ({detail}); lower drop_rate, or {shorter}"
        )

    # -- patterns --------------------------------------------------------------------------------
    def draw(self, step: int, trainable: Callable[[], list[bool] | None] = lambda: None) -> frozenset[int]:
        """Indices of the branches dropped at ``step``.

        Args:
            step: the training forward, counted from 0.
            trainable: per branch, whether it holds a trainable parameter, or ``None`` when something
                outside the branches is trainable (see :func:`dropbp.keep.keep_a_trainable_branch`).
        """
        sampler = self._sampler(self.factor(step))
        return keep_a_trainable_branch(sampler.pattern(step), self._rates, trainable)

    def _sampler(self, factor: float) -> PatternSampler:
        sampler = self._samplers.get(factor)
        if sampler is None:
            rates = [min(1.0, r * factor) for r in self._rates]  # a peak's rounding must not pass 1
            sampler = SAMPLERS[self._pattern](rates, self._seed, self._max_patterns)
            if len(self._samplers) >= MAX_SAMPLERS:
                del self._samplers[next(iter(self._samplers))]
            self._samplers[factor] = sampler
        return sampler

    # -- checkpoints -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The settings, as plain values."""
        return {
            "rates": self.rates,
            "drop_rate": self._drop_rate,
            "seed": self._seed,
            "max_patterns": self._max_patterns,
            "warmup_steps": self._warmup_steps,
            "pattern": self._pattern,
            "total_steps": self._total_steps,
            "drop_schedule": self._drop_schedule,
            "ramp": self._ramp,
            "rates_follow_drop_rate": self._own_rates,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output; all or nothing (a bad value changes no setting)."""
        shape = state.get("pattern", "uniform")  # absent in states saved before the cut shape existed
        trial = DropPolicy(self._flops, state["drop_rate"], state["seed"], state["max_patterns"], 0, shape)
        trial.warmup_steps = state.get("warmup_steps", 0)  # absent in states saved before warm-up existed
        # absent in states saved before time schedules existed: none
        trial.drop_schedule = state.get("drop_schedule", "constant")
        trial.ramp = state.get("ramp", DEFAULT_RAMP)
        trial.set_rates(state["rates"])
        trial.total_steps = state.get("total_steps")
        trial._own_rates = bool(state.get("rates_follow_drop_rate", False))  # the saved rates are kept as saved
        self.__dict__.update(trial.__dict__)
