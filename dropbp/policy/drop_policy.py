"""The drop policy: per-branch rates and the settings of :class:`~dropbp.options.DropBPOptions` that decide them,
turned into each step's pattern.

The policy reads its settings from one options object; :meth:`DropPolicy.use` replaces it (made with
``dataclasses.replace``, so validated once, by the options) and re-derives the time schedule, the rates and the
samplers from it, all or nothing. The pattern of a step is a pure function of the settings and the step
(:mod:`dropbp.policy.sampler`), identical on every rank. The rule that no pattern drops every branch is
:mod:`dropbp.policy.never_drop_all`'s, applied to allocated rates (:meth:`DropPolicy.set_allocated_rates`) and to every
drawn pattern (:meth:`DropPolicy.draw`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from dropbp.checks import check_int, is_auto
from dropbp.policy.never_drop_all import fit_rates, keep_a_trainable_branch
from dropbp.policy.plugins import PatternDraw, policy_plugins
from dropbp.policy.sampler import PatternSampler
from dropbp.policy.schedule import BOUNDED_WARMUP_LEVELS, SCHEDULE_LEVELS, TimeSchedule, warmup_factor
from dropbp.policy.shapes import DropShape, get_shape
from dropbp.policy.windows import Windows

#: Pattern samplers kept at once (one per factor on the rates). A warm-up without a time schedule has a
#: factor per step; the oldest sampler goes first (samplers are pure functions: rebuilt alike when needed).
MAX_SAMPLERS = 32
#: Under a pattern bound, forwards per block that drops nothing or follows the pool while the rates move.
THINNING_BLOCK = 8
#: How far a peak's rounding may lift a rate past 1 before it counts as past 1.
_ROUNDING = 1e-9
#: ``memory_bound="auto"`` turns the bound on from this drop rate (or with a feature that buys memory).
AUTO_BOUND_RATE = 0.75

__all__ = ["AUTO_BOUND_RATE", "DropPolicy", "PolicySettings", "in_force"]


class PolicySettings(Protocol):
    """The settings the policy reads: these fields of :class:`dropbp.options.DropBPOptions` (a frozen dataclass,
    validated there; the policy never imports it, so it knows nothing of devices or execution). Of ``features`` it
    reads only their extension points (:mod:`dropbp.policy.plugins`)."""

    drop_rate: float | str
    seed: int
    max_patterns: int | None
    warmup_steps: int
    pattern: str
    total_steps: int | None
    memory_bound: bool | str
    features: Sequence[object]


_SETTINGS = tuple(PolicySettings.__annotations__)


def in_force(options: PolicySettings, flops: Sequence[float]) -> PolicySettings:
    """The settings in force for ``options`` as given, over branches of costs ``flops``: ``drop_rate="auto"`` is the
    rate the features' :class:`~dropbp.policy.plugins.RateChoice` chooses now, with no warm-up or rise;
    ``memory_bound="auto"`` is on from :data:`AUTO_BOUND_RATE` or with a feature that bounds memory."""
    settings: dict[str, Any] = {}
    if is_auto(options.drop_rate):
        chooser = policy_plugins(options.features).rate_choice
        if chooser is None:
            raise ValueError('drop_rate="auto" needs a feature that chooses the rate (dropbp.NoiseScale())')
        features = tuple(f for f in options.features if getattr(f, "rise", None) is None)
        rate = chooser.choose_rate(get_shape(options.pattern), flops)
        settings |= {"drop_rate": rate, "warmup_steps": 0, "total_steps": None, "features": features}
    if is_auto(options.memory_bound):
        rate, features = settings.get("drop_rate", options.drop_rate), settings.get("features", options.features)
        settings["memory_bound"] = policy_plugins(features).bounds_memory or rate >= AUTO_BOUND_RATE
    return _replace(options, **settings) if settings else options


def _time_schedule(options: PolicySettings) -> TimeSchedule | None:
    """The time schedule ``options`` describe (``None`` without a run length)."""
    if options.total_steps is None:
        return None
    levels = SCHEDULE_LEVELS if options.max_patterns is None else BOUNDED_WARMUP_LEVELS
    return TimeSchedule(options.total_steps, options.warmup_steps, levels, policy_plugins(options.features).rise)


class DropPolicy:
    """Which branches drop at each step, for branches of the given costs in forward order.

    Args:
        flops: each branch's cost, in branch order; their number is the number of branches.
        options: the settings as given (``drop_rate``, ``seed``, ``max_patterns`` (here ``None`` is unbounded),
            ``warmup_steps``, ``pattern``, ``total_steps``, ``memory_bound`` and the extension points of ``features``;
            ``"auto"``s resolved here, :func:`in_force`); its other fields are not the policy's. Patterns are
            drawn at each forward's pattern index (:mod:`dropbp.policy.windows`: the run's optimizer-step windows,
            :meth:`set_windows`), the rates' schedule at the forward itself. With
            ``total_steps`` the rates follow a :class:`~dropbp.policy.schedule.TimeSchedule` whose mean over the run
            is 1, so the run drops ``drop_rate`` on average, warm-up included.
    """

    def __init__(self, flops: Sequence[float], options: PolicySettings) -> None:
        if not (dataclasses.is_dataclass(options) and all(hasattr(options, name) for name in _SETTINGS)):
            raise TypeError(f"options must be a dropbp.options.DropBPOptions, got {type(options).__name__}")
        self._flops = list(flops)
        self._num_branches = check_int("number of branches", len(self._flops), 1)
        self._samplers: dict[float, PatternSampler] = {}  # by the step's factor; derived, rebuilt on change
        self._own_rates = True  # the rates are the shape's own for drop_rate (not given by set_rates)
        self._rates: list[float] = []
        self._time: TimeSchedule | None = None
        self._windows: Windows | None = None
        self._draw: PatternDraw | None = None
        self._options = options
        self.use(options)

    @property
    def num_branches(self) -> int:
        """How many branches the policy decides for."""
        return self._num_branches

    @property
    def options(self) -> PolicySettings:
        """The settings in force (``"auto"``s resolved)."""
        return self._options

    def use(self, options: PolicySettings, reset_rates: bool = False) -> None:
        """Decide from ``options`` (as given: their ``"auto"``s resolved here, :func:`in_force`) from the next
        pattern on; all or nothing (a ValueError changes nothing).

        ``reset_rates`` (a ``drop_rate`` or ``pattern`` set, even to its value) makes the rates the shape's own for
        the drop rate, as ``apply`` does; rates given by :meth:`set_rates` are otherwise kept, and checked at the new
        schedule's peak."""
        options = in_force(options, self._flops)
        own = self._own_rates or reset_rates
        draw = policy_plugins(options.features).pattern_draw
        if draw is not None:
            draw.check_draw(get_shape(options.pattern), options.max_patterns)
        time = _time_schedule(options)
        if options.max_patterns == 1 and (options.warmup_steps > 0 or (time is not None and time.peak != 1.0)):
            raise ValueError(
                "max_patterns=1 leaves no room for rates that move (a warm-up or a rising schedule): under a "
                "pattern bound they need the empty pattern beside the pool. Use max_patterns >= 2, or warmup_steps=0 "
                "and no rising schedule"
            )
        if own:
            rates = self._shape_rates(options, time)
        else:
            rates = self._rates
            self._check_peak(rates, options.pattern, time)
        self._options, self._time, self._rates, self._own_rates, self._draw = options, time, rates, own, draw
        self._samplers.clear()

    @property
    def windows(self) -> tuple[int, int] | None:
        """The run's optimizer-step windows, ``(training forwards per epoch, gradient accumulation steps)``, or None
        (:mod:`dropbp.policy.windows`)."""
        return None if self._windows is None else (self._windows.forwards_per_epoch, self._windows.accumulation)

    def set_windows(self, windows: Sequence[int] | None) -> None:
        """Draw at the pattern indices of these optimizer-step windows from the next pattern on (None: at each
        forward). The Trainer integration sets them from the run: epochs that end with a short window start each
        window's pool cycle (and a stratified group) at a multiple of the accumulation."""
        self._windows = Windows.of(windows)
        self._samplers.clear()

    def _shape_rates(self, options: PolicySettings, time: TimeSchedule | None) -> list[float]:
        """The pattern shape's own rates for the drop rate under ``time``: those of ``drop_rate`` times its peak,
        divided by the peak, so that they are the shape's at the peak and average ``drop_rate`` over the run."""
        p, peak = options.drop_rate, 1.0 if time is None else time.peak
        try:
            return [r / peak for r in get_shape(options.pattern).rates(self._flops, p * peak)]
        except ValueError as error:
            if peak == 1.0:
                raise
            detail = f"drop rate {p:g} x {peak:.3g} = {p * peak:.3g}: {error}"
            raise _peak_error(time, options.pattern, detail) from None

    def _check_peak(self, rates: Sequence[float], pattern: str, time: TimeSchedule | None) -> None:
        """Refuse a time schedule whose peak would lift some given rate past what the pattern shape allows.

        Keeping the run's mean at the drop rate while dropping less early means dropping more late:
        the rates at the peak are the rates times ``time.peak``.
        """
        if time is None or time.peak <= 1.0:
            return
        peak = [min(1.0, r * time.peak) if r * time.peak <= 1.0 + _ROUNDING else r * time.peak for r in rates]
        try:
            get_shape(pattern).check_rates(peak, self._num_branches)
        except ValueError as error:
            raise _peak_error(time, pattern, str(error)) from None

    def _peak_fits(self, options: PolicySettings) -> bool:
        """Whether the rates can take the peak of the time schedule of ``options``: :meth:`use`'s checks as a
        predicate (``tests/test_time_schedule.py`` holds the two equal)."""
        time = _time_schedule(options)
        if self._own_rates:
            peak = 1.0 if time is None else time.peak
            return get_shape(options.pattern).reaches(self._flops, options.drop_rate * peak)
        try:
            self._check_peak(self._rates, options.pattern, time)
        except ValueError:
            return False
        return True

    def longest_warmup(self, total_steps: int, up_to: int) -> int:
        """The longest warm-up, at most ``up_to`` forwards, whose time schedule over a run of ``total_steps``
        forwards these rates can take (a longer warm-up lifts the peak), else 0. Changes nothing."""
        options = self._options

        def fits(warmup: int) -> bool:
            return self._peak_fits(_replace(options, warmup_steps=warmup, total_steps=total_steps))

        if fits(up_to):
            return up_to
        longest, too_long = 0, up_to
        while too_long - longest > 1:
            middle = (longest + too_long) // 2
            longest, too_long = (middle, too_long) if fits(middle) else (longest, middle)
        return longest

    # -- what the settings decide ----------------------------------------------------------------
    @property
    def drop_rate(self) -> float:
        """The target drop rate."""
        return self._options.drop_rate

    @property
    def shape(self) -> DropShape:
        """The drop shape in force (:mod:`dropbp.policy.shapes`)."""
        return get_shape(self._options.pattern)

    def most_kept(self) -> int | None:
        """The most branches that store activations in a step under the memory bound (the shape's at the target drop
        rate), or None where the bound is off (``memory_bound``, resolved: a bool)."""
        if self._options.memory_bound is not True:
            return None
        return self.shape.most_kept(self._num_branches, self._options.drop_rate)

    @property
    def total_steps(self) -> int | None:
        """The run's length in training forwards (``None``: unknown, no time schedule)."""
        return self._options.total_steps

    @property
    def never_drops(self) -> bool:
        """Whether no step can drop a branch: every rate is 0 (a warm-up or time schedule only scales them)."""
        return not any(self._rates)

    @property
    def rates(self) -> list[float]:
        """Per-branch drop rates, in branch order (a copy)."""
        return list(self._rates)

    def set_rates(self, rates: Sequence[float]) -> None:
        """Set one rate per branch: for the uniform shape each in [0, 1), summing to at most N - 1; for
        the cut shape each in [0, 1], not rising with depth, the last 0 (:mod:`dropbp.checks`)."""
        pattern = self._options.pattern
        checked = get_shape(pattern).check_rates(rates, self._num_branches)
        self._check_peak(checked, pattern, self._time)
        self._rates = checked
        self._own_rates = False  # given rates are kept as they are when the time schedule changes
        self._samplers.clear()

    def set_allocated_rates(self, rates: Sequence[float], min_rate: float) -> None:
        """Set rates allocated for the time schedule's peak (calibration): lowered into the rule where they
        would drop every branch in some steps (:func:`dropbp.policy.never_drop_all.fit_rates`), then divided by the
        peak, so that the run's mean stays the drop rate."""
        peak = self.peak
        self.set_rates([r / peak for r in fit_rates(rates, self._flops, min_rate)])

    @property
    def peak(self) -> float:
        """The largest factor the time schedule puts on the rates (1 without one)."""
        return 1.0 if self._time is None else self._time.peak

    def factor(self, step: int) -> float:
        """The factor on every rate at training forward ``step``: the time schedule's, else the warm-up's."""
        if self._time is not None:
            return self._time.factor(step)
        levels = None if self._options.max_patterns is None else BOUNDED_WARMUP_LEVELS
        return warmup_factor(step, self._options.warmup_steps, levels)

    # -- patterns --------------------------------------------------------------------------------
    def draw(self, step: int, trainable: Callable[[], list[bool] | None] = lambda: None) -> frozenset[int]:
        """Indices of the branches dropped at ``step``.

        Args:
            step: the training forward, counted from 0.
            trainable: per branch, whether it holds a trainable parameter, or ``None`` when something
                outside the branches is trainable (see :func:`dropbp.policy.never_drop_all.keep_a_trainable_branch`).
        """
        index = self._index(step)
        if self._options.max_patterns is None or self._draw is not None:
            pattern = self._sampler(self.factor(step)).pattern(index)
        else:
            pattern = self._bounded(index)
        return keep_a_trainable_branch(pattern, self._rates, trainable)

    def _index(self, step: int) -> int:
        """The pattern index of forward ``step`` (:mod:`dropbp.policy.windows`)."""
        return step if self._windows is None else self._windows.index(step)

    def _block_factor(self, index: int) -> float:
        """Under a pattern bound, the factor on the rates of the thinning block that holds pattern ``index``: the
        factor at the block's first forward."""
        start = (index // THINNING_BLOCK) * THINNING_BLOCK
        return self.factor(start if self._windows is None else self._windows.forward(start))

    def drop_probabilities(
        self, step: int, trainable: Callable[[], list[bool] | None] = lambda: None
    ) -> tuple[float, ...]:
        """Per branch, how often it is dropped where ``step`` draws from (what ``unbiased=True`` weights a kept
        branch by: ``1 / (1 - p)``), the keep rule (``trainable``, as :meth:`draw`) included: drawn afresh, its rate
        times the factor (the samplers' marginals are exact), and 0 for the branch a cut's keep rule always keeps;
        from a pattern pool (``max_patterns``), its frequency over the pool's cycle, which is the rate only within
        ``1 / K``, times the share of blocks that follow the pool where the rates move. (Drawn afresh with the
        uniform shape, the keep rule's rare rescues are not counted.)"""
        bound = self._options.max_patterns
        if bound is None or self._draw is not None:
            factor = self.factor(step)
            rates = [min(1.0, r * factor) for r in self._rates]
            if self.shape.nested:
                rescued = keep_a_trainable_branch(frozenset(range(len(rates))), self._rates, trainable)
                rates = [0.0 if i not in rescued else r for i, r in enumerate(rates)]
            return tuple(rates)
        moving = self._rates_move()
        sampler = self._sampler(self.peak * bound / (bound - 1) if moving else self.peak)
        pool = [keep_a_trainable_branch(p, self._rates, trainable) for p in sampler.pool()]
        frequencies = [sum(i in p for p in pool) / len(pool) for i in range(len(self._rates))]
        if not moving:
            return tuple(frequencies)
        share = min(1.0, self._block_factor(self._index(step)) / self.peak)
        return tuple(share * (bound - 1) / bound * f for f in frequencies)

    def _bounded(self, index: int) -> frozenset[int]:
        """The pattern at pattern index ``index`` under a pattern bound ``K``: a pool of ``K`` patterns, cycled. When
        the rates move (a warm-up, a rising time schedule), one of the ``K`` slots is the empty pattern and the other
        ``K - 1`` are drawn at ``K / (K - 1)`` times the peak rates (capped at 1), and the forwards go in blocks of
        :data:`THINNING_BLOCK`: a block whose factor (at its first forward) is below the peak follows the pool in a
        share ``factor / peak`` of such blocks, spread evenly, and drops nothing in the others. Each branch drops at its
        rate times the factor (within the pool's ``1 / K``), a whole run never sees more than ``K`` patterns (each a
        compiled graph on a lazy device), and optimizer steps of 1, 2, 4 or 8 micro-batches see only the pool's own
        sequences of patterns, or none dropped."""
        bound = self._options.max_patterns
        if not self._rates_move():
            return self._sampler(self.peak).pattern(index)
        block = index // THINNING_BLOCK
        share = self._block_factor(index) / self.peak
        off = share < 1 - _ROUNDING and math.floor((block + 1) * share) == math.floor(block * share)
        slot = index % bound
        if share <= _ROUNDING or off or slot == 0:
            return frozenset()
        return self._sampler(self.peak * bound / (bound - 1)).pattern(slot - 1)

    def _rates_move(self) -> bool:
        """Whether the factor on the rates changes over the run: a warm-up, or a time schedule that rises."""
        return self._options.warmup_steps > 0 or self.peak != 1.0

    def _sampler(self, factor: float) -> PatternSampler:
        sampler = self._samplers.get(factor)
        if sampler is None:
            rates = [min(1.0, r * factor) for r in self._rates]  # a peak's rounding must not pass 1
            seed = self._options.seed
            if self._draw is not None:  # checked in use(): drawn afresh, no pool
                sampler = self._draw.sampler(self.shape, rates, seed, self._windows)
            else:
                sampler = self.shape.sampler(rates, seed, self._pool_size())
            if len(self._samplers) >= MAX_SAMPLERS:
                del self._samplers[next(iter(self._samplers))]
            self._samplers[factor] = sampler
        return sampler

    def _pool_size(self) -> int | None:
        """Patterns in a sampler's pool: ``max_patterns``, less the empty pattern's slot when the rates move."""
        bound = self._options.max_patterns
        return bound - 1 if bound is not None and self._rates_move() else bound

    # -- checkpoints -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The settings, as plain values."""
        options = self._options
        return {
            "rates": self.rates,
            "drop_rate": options.drop_rate,
            "seed": options.seed,
            "max_patterns": options.max_patterns,
            "warmup_steps": options.warmup_steps,
            "pattern": options.pattern,
            "total_steps": options.total_steps,
            "rates_follow_drop_rate": self._own_rates,
        } | ({} if self._windows is None else {"windows": list(self.windows)})

    def load_state_dict(self, state: dict[str, Any], options: PolicySettings) -> None:
        """Restore :meth:`state_dict` output: its rates under ``options`` (the state's settings as the controller
        resolved them on its device); all or nothing (a bad value changes no setting)."""
        trial = DropPolicy(self._flops, _replace(options, total_steps=None))
        trial.set_rates(state["rates"])
        trial.set_windows(state.get("windows"))
        trial.use(options)
        trial._own_rates = state["rates_follow_drop_rate"]  # the saved rates are kept as saved
        self.__dict__.update(trial.__dict__)


def _replace(options: PolicySettings, **change: Any) -> PolicySettings:
    """``options`` with ``change``, as the options' own class validates them."""
    return dataclasses.replace(options, **change)


def _peak_error(time: TimeSchedule, pattern: str, detail: str) -> ValueError:
    shorter = (
        "use a shorter rise or warm-up, or no rising schedule"
        if time.rises
        else "shorten the warm-up (apply's warmup_steps, attach's warmup=) or set it to 0"
    )
    return ValueError(
        f"the time schedule ({time.describe()}) keeps the run's mean drop rate by peaking at {time.peak:.3g}x the "
        f"rates, which the {pattern!r} shape cannot take ({detail}); lower drop_rate, or {shorter}"
    )
