"""``ctl.schedule``: what the controller's policy will do over a run, read without running it, and what it dropped.

The drop rate expected at a step and over a span of steps, the longest warm-up a run can take, the distinct patterns
and (lazy-graph devices) training graphs of a run, the most branches a step stores: pure functions of the settings,
for the Trainer integration, the tools and users planning a run (nothing here changes the controller); and the tally
of what the training forwards so far dropped.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

from dropbp.checks import check_int
from dropbp.options import DropBPOptions
from dropbp.policy.drop_policy import DropPolicy
from dropbp.policy.plan import DropTally, PatternPlan, plan_patterns

__all__ = ["RunSchedule"]


class RunSchedule:
    """A view of one controller's policy (``ctl.schedule``): what it will drop, read-only, and what it dropped (the
    tally, which :meth:`drop_stats` resets)."""

    def __init__(
        self,
        policy: DropPolicy,
        flops: Sequence[float],
        tally: DropTally,
        pattern: Callable[[int], frozenset[int]],
    ) -> None:
        self._policy = policy
        self._tally = tally
        self._flops = list(flops)
        self._pattern = pattern

    @property
    def options(self) -> DropBPOptions:
        """The options in force: as given, resolved on the backend (``max_patterns``, ``memory_bound``, an ``"auto"``
        drop rate)."""
        return self._policy.options

    @property
    def max_kept_branches(self) -> int:
        """The most branches that store activations in one step: with the memory bound, the drop shape's
        ``most_kept`` at ``drop_rate``; without it, every branch (a step may drop none)."""
        return self._policy.most_kept() or len(self._flops)

    def drop_rate_at(self, step: int) -> float:
        """The expected FLOP-weighted drop rate at training forward ``step``: the rates under the warm-up and time
        schedule of that step. Over a run of ``total_steps`` forwards its mean is ``drop_rate``."""
        return self._rate_under(self._policy.factor(check_int("step", step, 0)))

    def mean_drop_rate(self, start: int, stop: int) -> float:
        """The mean of :meth:`drop_rate_at` over the training forwards ``start`` to ``stop - 1``."""
        check_int("start", start, 0)
        if check_int("stop", stop, 0) <= start:
            raise ValueError(f"stop must be above start, got start={start}, stop={stop}")
        factors = Counter(self._policy.factor(step) for step in range(start, stop))
        return sum(n * self._rate_under(factor) for factor, n in factors.items()) / (stop - start)

    def longest_warmup(self, total_steps: int, up_to: int) -> int:
        """The longest warm-up, at most ``up_to`` training forwards, whose time schedule over a run of ``total_steps``
        forwards the rates can take while keeping the run's mean (a longer warm-up asks a higher peak later); 0 where
        none can."""
        check_int("total_steps", total_steps, 1)
        return self._policy.longest_warmup(total_steps, check_int("up_to", up_to, 0))

    def patterns(self, optimizer_steps: int | None = None, micro_batches: int = 1) -> PatternPlan:
        """The distinct patterns, step sequences and (on a lazy-graph device) training graphs of a run of
        ``optimizer_steps`` steps of ``micro_batches`` training forwards each, from forward 0
        (:mod:`dropbp.policy.plan`); ``optimizer_steps`` defaults to the run's length when ``total_steps`` is set."""
        check_int("micro_batches", micro_batches, 1)
        if optimizer_steps is None:
            total = self._policy.total_steps
            if total is None:
                raise ValueError(
                    "schedule.patterns needs optimizer_steps: this controller has no total_steps (the run's length "
                    "in training forwards), so it cannot tell how long the run is"
                )
            optimizer_steps = -(-total // micro_batches)
        check_int("optimizer_steps", optimizer_steps, 1)
        return plan_patterns(self._pattern, optimizer_steps, micro_batches)

    def drop_stats(self, reset: bool = True) -> dict[str, float]:
        """What was dropped over the training forwards since the last reset: their number, the mean number of branches
        dropped per forward, and the mean fraction of branch FLOPs dropped."""
        stats = self._tally.summary()
        if reset:
            self._tally.reset()
        return stats

    def _rate_under(self, factor: float) -> float:
        rates = self._policy.rates
        dropped = sum(f * min(1.0, r * factor) for f, r in zip(self._flops, rates, strict=True))
        return dropped / sum(self._flops)
