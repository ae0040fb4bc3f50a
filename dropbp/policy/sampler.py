"""Which branches drop at a given step: a pure function of (seed, step, rates). The policy passes each forward's
pattern index (:mod:`dropbp.policy.windows`: the forward itself, unless the run's epochs end with short windows).

:class:`PatternSampler` (the uniform shape) drops branch ``i`` with probability exactly ``rates[i]`` and exactly
``floor(R)`` or ``ceil(R)`` branches each step (``R = sum(rates)``); with ``R <= N - 1`` (the rule that
:mod:`dropbp.checks` enforces) no step drops every branch. :class:`CutSampler` drops every branch below a random cut.
With ``max_patterns=K`` either cycles, in one fixed order, through a pool of ``K`` patterns (for compiled-graph
backends, where each distinct pattern is a distinct graph), each branch's frequency within ``1 / K`` of its rate:
at most ``K / gcd(K, a)`` distinct pattern sequences for ``a`` micro-batches per step. Randomness comes from
``random.Random`` seeded with a string (hashed with SHA-512), so every process computes the same pattern without
communicating. How patterns are drawn: docs/patterns.md ("How patterns are drawn"); the pool: docs/backends.md.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

__all__ = ["LARGEST_POOL", "CutSampler", "PatternSampler"]

#: The most patterns a pool holds (``max_patterns``): each is built and kept; a bound is for devices that compile a
#: graph per pattern (16 on Gaudi), and past a few thousand, drawing afresh (``max_patterns=None``) is what is meant.
LARGEST_POOL = 4096

# Swap attempts per pool cell: enough for the pool to look random (the chain mixes in O(cells) swaps).
_SWAPS_PER_CELL = 8


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
                # Rates are checked to sum to at most N - 1; only float rounding could reach N drops.
                break
        start = end
    return frozenset(dropped)


class PatternSampler:
    """Deterministic per-step drop patterns with exact per-branch marginals (the uniform shape).

    Args:
        rates: per-branch drop probabilities, in branch order (checked by :mod:`dropbp.checks`).
        seed: fixes every pattern.
        max_patterns: draw from a pool of this many patterns (``None``: unbounded).
    """

    _STREAM: tuple[str, ...] = ()  # names the shape's random stream (empty: the uniform shape's, as ever)

    def __init__(self, rates: Sequence[float], seed: int, max_patterns: int | None = None) -> None:
        self.rates = tuple(float(r) for r in rates)
        self.seed = seed
        self.max_patterns = max_patterns
        #: The random stream's name up to the per-draw key, written once (seeding reads it at every step).
        self._stream = ":".join(str(k) for k in (*self._STREAM, self.seed, self.rates))
        self._pool = self._build_pool() if max_patterns is not None else None

    def _rng(self, *key: object) -> random.Random:
        return random.Random(":".join((self._stream, *map(str, key))))

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

    def _draw(self, step: int) -> frozenset[int]:
        rng = self._rng("step", step)
        order = list(range(len(self.rates)))
        rng.shuffle(order)
        return _systematic(self.rates, order, rng.random())

    def pattern(self, step: int) -> frozenset[int]:
        """Indices of the branches dropped at ``step``."""
        if not any(self.rates):
            return frozenset()
        if self._pool is not None:
            return self._pool[step % len(self._pool)]
        return self._draw(step)

    def pool(self) -> tuple[frozenset[int], ...]:
        """The patterns cycled (``max_patterns``; the empty pattern where every rate is 0)."""
        if self._pool is None:
            raise ValueError("this sampler draws afresh each step: it has no pool")
        return self._pool if any(self.rates) else (frozenset(),)

    def distinct_patterns(self) -> int | None:
        """How many different patterns can occur (``None``: unbounded)."""
        return None if self._pool is None else len(set(self._pool))


class CutSampler(PatternSampler):
    """Depth-structured patterns: each step draws a cut and drops the branches below it.

    With rates that do not increase with depth, one uniform ``u`` per step and "drop branch ``k``
    when ``u < rates[k]``" drops exactly the branches below a cut, and branch ``k`` drops with
    probability exactly ``rates[k]``. A kept branch's gradient then misses no path: everything above
    it is kept too. At most ``N + 1`` distinct patterns exist (one per cut position); with
    ``max_patterns=K`` the pool is the stratified draws ``u_j = (j + v) / K``, so each branch's
    frequency over a cycle is within ``1 / K`` of its rate. A last rate of 0 keeps the top branch in
    every step, so no step drops every branch (:func:`dropbp.checks.check_cut_rates`, the rule of
    :mod:`dropbp.policy.never_drop_all`).
    """

    _STREAM = ("cut",)

    def _build_pool(self) -> tuple[frozenset[int], ...]:
        k = self.max_patterns
        v = self._rng("pool").random()
        return tuple(self._below((j + v) / k) for j in range(k))

    def _draw(self, step: int) -> frozenset[int]:
        return self._below(self._rng("step", step).random())

    def _below(self, u: float) -> frozenset[int]:
        return frozenset(i for i, r in enumerate(self.rates) if u < r)

