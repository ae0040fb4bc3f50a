"""Which branches drop at a given step: a pure function of (seed, step, rates).

Systematic sampling over the branches in a random order: with cumulative rates laid end to end on
``[0, R)`` (``R = sum(rates)``), the points ``u, u + 1, u + 2, ...`` (``u`` uniform in ``[0, 1)``)
each fall in one branch's interval, and that branch drops. Since every rate is below 1, branch ``i``
drops with probability exactly ``rates[i]``, and exactly ``floor(R)`` or ``ceil(R)`` branches drop
each step, which keeps the step time and peak memory steady. With ``R <= N - 1`` no step drops
every branch.

With ``max_patterns=K`` the sampler draws from a pool of ``K`` patterns instead, built with one order
and the stratified offsets ``(k + v) / K``: across the pool branch ``i`` drops in
``floor(K * r_i)`` or ``ceil(K * r_i)`` patterns and each pattern drops ``floor(R)`` or ``ceil(R)``
branches. That layout alone repeats few patterns (at uniform rates, every other branch of the one
order), so random swaps that keep every row and column count (pattern a drops i but not j, pattern
b drops j but not i: exchange) then mix the pool. Cycling through the pool (shuffled every ``K``
steps) keeps each branch's frequency within ``1 / K`` of its rate. Compiled-graph backends need this
bound: each distinct pattern is a distinct graph.

Randomness comes from ``random.Random`` seeded with a string, which Python hashes with SHA-512, so
every process (every rank of a distributed job) computes the same pattern without communicating.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

__all__ = ["PatternSampler", "check_rates", "max_total_rate"]


# Swap attempts per pool cell: enough for the pool to look random (the chain mixes in O(cells) swaps).
_SWAPS_PER_CELL = 8


def max_total_rate(num_branches: int) -> int:
    """The largest sum of rates that never drops every branch: at least one branch is kept."""
    return num_branches - 1


def _systematic(rates: Sequence[float], order: Sequence[int], u: float) -> frozenset[int]:
    """Branches hit by the points ``u + j`` (``j = 0, 1, ...``) when laid out in ``order``."""
    dropped = []
    point = u
    start = 0.0
    for i in order:
        end = start + rates[i]
        if start <= point < end:
            dropped.append(i)
            point += 1.0
            if len(dropped) == len(order) - 1:
                # Only float rounding of a sum of rates equal to N - 1 could reach N drops.
                break
        start = end
    return frozenset(dropped)


class PatternSampler:
    """Deterministic per-step drop patterns with exact per-branch marginals."""

    def __init__(self, rates: Sequence[float], seed: int, max_patterns: int | None = None) -> None:
        self.rates = tuple(float(r) for r in rates)
        self.seed = seed
        self.max_patterns = max_patterns
        self._pool = self._build_pool() if max_patterns is not None else None

    def _rng(self, *key: object) -> random.Random:
        return random.Random(":".join(str(k) for k in (self.seed, self.rates, *key)))

    def _build_pool(self) -> tuple[frozenset[int], ...]:
        k = self.max_patterns
        rng = self._rng("pool")
        order = list(range(len(self.rates)))
        rng.shuffle(order)
        v = rng.random()
        pool = [set(_systematic(self.rates, order, (j + v) / k)) for j in range(k)]
        n = len(self.rates)
        for _ in range(_SWAPS_PER_CELL * k * n):
            a, b = rng.randrange(k), rng.randrange(k)
            i, j = rng.randrange(n), rng.randrange(n)
            if i in pool[a] and j not in pool[a] and j in pool[b] and i not in pool[b]:
                pool[a] ^= {i, j}
                pool[b] ^= {i, j}
        return tuple(frozenset(p) for p in pool)

    def pattern(self, step: int) -> frozenset[int]:
        """Indices of the branches dropped at ``step``."""
        if not any(self.rates):
            return frozenset()
        if self._pool is not None:
            k = len(self._pool)
            cycle, position = divmod(step, k)
            slots = list(range(k))
            self._rng("cycle", cycle).shuffle(slots)
            return self._pool[slots[position]]
        rng = self._rng("step", step)
        order = list(range(len(self.rates)))
        rng.shuffle(order)
        return _systematic(self.rates, order, rng.random())

    def distinct_patterns(self) -> int | None:
        """How many different patterns can occur (``None``: unbounded)."""
        return None if self._pool is None else len(set(self._pool))


def check_rates(rates: Sequence[float], num_branches: int) -> list[float]:
    """Validate per-branch rates: one per branch, each in [0, 1), and never all branches dropped."""
    if isinstance(rates, (str, bytes)) or not hasattr(rates, "__len__"):
        raise TypeError(f"rates must be a sequence of numbers, got {type(rates).__name__}")
    if len(rates) != num_branches:
        raise ValueError(f"rates must have one entry per branch: expected {num_branches}, got {len(rates)}")
    out = []
    for i, r in enumerate(rates):
        if isinstance(r, (bool, str, bytes)):
            raise TypeError(f"rates[{i}] must be a number, got {r!r}")
        try:
            f = float(r)
        except (TypeError, ValueError):
            raise TypeError(f"rates[{i}] must be a number, got {r!r}") from None
        if not (0.0 <= f < 1.0):  # also rejects NaN
            raise ValueError(f"rates[{i}] must be in [0, 1), got {r!r}")
        out.append(f)
    limit = max_total_rate(num_branches)
    if sum(out) > limit + 1e-9:  # tolerance for float sums; _systematic still never drops all
        raise ValueError(
            f"rates sum to {sum(out):.4g} but with {num_branches} branches the sum must be at most "
            f"{limit}, or some steps would drop every branch (nothing left to train); lower the rates"
        )
    return out
