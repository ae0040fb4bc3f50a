"""The drop policy: per-branch rates, seed, pattern bound and warm-up, turned into each step's pattern.

Everything that decides which branches drop lives here, behind setters that validate and take
effect from the next pattern drawn: the samplers are derived from the settings and rebuilt when one
changes, so no setting can leave a sampler built from stale ones. The pattern of a step is a pure
function of the settings and the step (:mod:`dropbp.sampler`), identical on every rank.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .allocation import cut_rates
from .checks import check_choice, check_cut_rates, check_drop_rate, check_int, check_rates, keep_a_trainable_branch
from .sampler import SAMPLERS, PatternSampler
from .schedule import BOUNDED_WARMUP_LEVELS, warmup_factor

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
    """

    def __init__(
        self,
        flops: Sequence[float],
        drop_rate: float,
        seed: int,
        max_patterns: int | None,
        warmup_steps: int,
        pattern: str = "cut",
    ) -> None:
        self._flops = list(flops)
        self._num_branches = check_int("number of branches", len(self._flops), 1)
        self._samplers: dict[float, PatternSampler] = {}  # by warm-up factor; derived, rebuilt on change
        self._pattern = check_choice("pattern", pattern, tuple(SAMPLERS))
        self.drop_rate = drop_rate
        self.seed = seed
        self.max_patterns = max_patterns
        self.warmup_steps = warmup_steps

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
        p = check_drop_rate(value, self._num_branches) if self._pattern == "uniform" else value
        rates = [p] * self._num_branches if self._pattern == "uniform" else cut_rates(self._flops, p)
        self.set_rates(rates)
        self._drop_rate = float(p)

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
        self._rates = check(rates, self._num_branches)
        self._samplers.clear()

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
        self._max_patterns = None if value is None else check_int("max_patterns", value, 1)
        self._samplers.clear()

    @property
    def warmup_steps(self) -> int:
        """Training forwards over which the rates rise linearly from 0 (:func:`dropbp.schedule.warmup_factor`)."""
        return self._warmup_steps

    @warmup_steps.setter
    def warmup_steps(self, value: int) -> None:
        self._warmup_steps = check_int("warmup_steps", value, 0)

    # -- patterns --------------------------------------------------------------------------------
    def draw(self, step: int, trainable: Callable[[], list[bool] | None] = lambda: None) -> frozenset[int]:
        """Indices of the branches dropped at ``step``.

        Args:
            step: the training forward, counted from 0.
            trainable: per branch, whether it holds a trainable parameter, or ``None`` when something
                outside the branches is trainable (see :func:`dropbp.checks.keep_a_trainable_branch`).
        """
        levels = None if self._max_patterns is None else BOUNDED_WARMUP_LEVELS
        sampler = self._sampler(warmup_factor(step, self._warmup_steps, levels))
        return keep_a_trainable_branch(sampler.pattern(step), self._rates, trainable)

    def _sampler(self, factor: float) -> PatternSampler:
        sampler = self._samplers.get(factor)
        if sampler is None:
            sampler = SAMPLERS[self._pattern]([r * factor for r in self._rates], self._seed, self._max_patterns)
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
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output; all or nothing (a bad value changes no setting)."""
        shape = state.get("pattern", "uniform")  # absent in states saved before the cut shape existed
        trial = DropPolicy(self._flops, state["drop_rate"], state["seed"], state["max_patterns"], 0, shape)
        trial.warmup_steps = state.get("warmup_steps", 0)  # absent in states saved before warm-up existed
        trial.set_rates(state["rates"])
        self.__dict__.update(trial.__dict__)
