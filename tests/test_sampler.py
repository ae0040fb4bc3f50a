"""Sampler properties, checked statistically with fixed seeds."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest

from dropbp.policy.never_drop_all import check_rates
from dropbp.policy.sampler import PatternSampler

STEPS = 20000


def _rates(n: int, seed: int) -> list[float]:
    rng = random.Random(seed)
    rates = [rng.choice([0.0, 0.1, 0.3, 0.5, 0.7, 0.9]) for _ in range(n)]
    while sum(rates) > n - 1:
        rates[rates.index(max(rates))] = 0.5
    return rates


@pytest.mark.parametrize("n, seed", [(8, 0), (24, 1), (3, 2)])
def test_marginals_count_and_never_all(n, seed):
    rates = _rates(n, seed)
    sampler = PatternSampler(rates, seed=seed)
    total = sum(rates)
    hits = Counter()
    for step in range(STEPS):
        pattern = sampler.pattern(step)
        assert len(pattern) in {math.floor(total), math.ceil(total)}
        assert len(pattern) < n
        hits.update(pattern)
    for i, r in enumerate(rates):
        sigma = math.sqrt(r * (1 - r) / STEPS)
        assert abs(hits[i] / STEPS - r) <= 5 * sigma + 1e-12, (i, r, hits[i] / STEPS)


def test_at_the_limit_every_step_keeps_exactly_one_branch():
    n = 5
    sampler = PatternSampler([(n - 1) / n] * n, seed=3)
    assert all(len(sampler.pattern(s)) == n - 1 for s in range(2000))


def test_pattern_is_a_pure_function_of_seed_and_step():
    rates = _rates(16, 4)
    a, b = PatternSampler(rates, seed=11), PatternSampler(rates, seed=11)
    steps = [5, 0, 999, 5, 42]
    assert [a.pattern(s) for s in steps] == [b.pattern(s) for s in steps]
    assert a.pattern(5) == a.pattern(5)
    other = PatternSampler(rates, seed=12)
    assert [a.pattern(s) for s in range(50)] != [other.pattern(s) for s in range(50)]


@pytest.mark.parametrize("k", [1, 4, 8, 37])
def test_max_patterns_bounds_distinct_patterns_and_frequencies(k):
    rates = _rates(12, 5)
    sampler = PatternSampler(rates, seed=0, max_patterns=k)
    cycles = 40
    patterns = [sampler.pattern(s) for s in range(k * cycles)]
    assert len(set(patterns)) <= k
    assert sampler.distinct_patterns() == len(set(patterns))
    hits = Counter(i for p in patterns for i in p)
    for i, r in enumerate(rates):
        assert abs(hits[i] / len(patterns) - r) <= 1 / k + 1e-12, (i, r)
    assert all(len(p) < len(rates) for p in patterns)


def test_zero_rates_never_drop():
    sampler = PatternSampler([0.0] * 6, seed=0)
    assert all(sampler.pattern(s) == frozenset() for s in range(100))


@pytest.mark.parametrize(
    "rates, error, match",
    [
        ([0.5], ValueError, "one entry per branch: expected 2"),
        ([0.5, 1.0], ValueError, r"rates\[1\] must be in \[0, 1\)"),
        ([0.5, -0.1], ValueError, r"rates\[1\]"),
        ([0.5, float("nan")], ValueError, r"rates\[1\]"),
        ([0.5, "a"], TypeError, r"rates\[1\] must be a number"),
        ([0.9, 0.9], ValueError, "must be at most 1"),
        (0.5, TypeError, "sequence"),
    ],
)
def test_bad_rates_are_named(rates, error, match):
    with pytest.raises(error, match=match):
        check_rates(rates, 2)


def test_pattern_pool_is_diverse():
    """The pool uses its bound: not just the two alternating patterns of one systematic layout."""
    for rates in ([0.5] * 16, [0.875] * 16, [0.3, 0.7] * 8):
        assert PatternSampler(rates, seed=0, max_patterns=16).distinct_patterns() >= 12


# -- the cut shape ---------------------------------------------------------------------------------
from dropbp.policy.allocation import cut_rates  # noqa: E402
from dropbp.policy.never_drop_all import check_cut_rates  # noqa: E402
from dropbp.policy.sampler import CutSampler  # noqa: E402

CUT_FLOPS = [1.0, 2.0] * 8


@pytest.mark.parametrize(("p", "max_rate"), [(0.25, None), (0.5, None), (0.5, 1.0), (0.875, 1.0)])
def test_cut_rates_reach_the_flop_weighted_drop_rate_and_fall_with_depth(p, max_rate):
    rates = cut_rates(CUT_FLOPS, p, max_rate=max_rate)
    assert sum(r * f for r, f in zip(rates, CUT_FLOPS, strict=True)) / sum(CUT_FLOPS) == pytest.approx(p, abs=1e-9)
    assert check_cut_rates(rates, len(rates)) == rates  # falling, in [0, 1], top 0
    cap = (1 + p) / 2 if max_rate is None else max_rate  # the default cap keeps the bottom training
    assert max(rates) <= cap and (max_rate is not None or max(rates) == pytest.approx(cap))


def test_a_cut_that_cannot_reach_the_rate_says_so_and_what_to_do():
    # 16 branches, the top one 1/12 of the FLOPs: capped at 0.9375, cuts reach at most 0.859
    with pytest.raises(ValueError, match=r"drop_rate=0.875 cannot be reached.*at most 0.8594.*pattern='uniform'"):
        cut_rates(CUT_FLOPS, 0.875)


@pytest.mark.parametrize("max_patterns", [None, 8])
def test_cut_patterns_are_cuts_with_exact_marginals_and_never_drop_everything(max_patterns):
    rates = cut_rates(CUT_FLOPS, 0.5)
    sampler = CutSampler(rates, seed=3, max_patterns=max_patterns)
    steps = 4000
    counts = [0] * len(rates)
    for step in range(steps):
        pattern = sampler.pattern(step)
        assert pattern == frozenset(range(len(pattern)))  # every branch below a depth, none above
        assert len(pattern) < len(rates)
        for i in pattern:
            counts[i] += 1
    tolerance = 4 * (0.25 / steps) ** 0.5 if max_patterns is None else 1 / max_patterns + 1e-9
    assert all(abs(c / steps - r) <= tolerance for c, r in zip(counts, rates, strict=True))
    if max_patterns is not None:
        assert sampler.distinct_patterns() <= max_patterns


def test_cut_patterns_are_a_function_of_seed_and_step():
    rates = cut_rates(CUT_FLOPS, 0.5)
    a, b = CutSampler(rates, seed=5), CutSampler(rates, seed=5)
    assert [a.pattern(s) for s in range(50)] == [b.pattern(s) for s in reversed(range(50))][::-1]
    assert [a.pattern(s) for s in range(50)] != [CutSampler(rates, seed=6).pattern(s) for s in range(50)]


@pytest.mark.parametrize(
    "rates, match",
    [
        ([0.5, 0.6, 0.0], r"must not rise with depth.*rates\[1\]"),
        ([0.9, 0.5, 0.1], "last \\(top\\) branch's rate must be 0"),
        ([1.5, 0.5, 0.0], r"rates\[0\] must be in \[0, 1\]"),
    ],
)
def test_bad_cut_rates_are_named(rates, match):
    with pytest.raises(ValueError, match=match):
        check_cut_rates(rates, 3)


def test_apply_with_the_cut_shape_resumes_the_same_patterns():
    from conftest import tiny_model

    import dropbp

    ctl = dropbp.apply(tiny_model("llama", layers=4), 0.5, seed=2, pattern="cut", warmup_steps=4)
    state = ctl.state_dict()
    assert state["pattern"] == "cut" and ctl.rates == cut_rates([b.flops for b in ctl.branches], 0.5)
    resumed = dropbp.apply(tiny_model("llama", layers=4), 0.25, seed=0)
    resumed.load_state_dict(state)
    assert resumed.pattern == "cut" and [resumed.dropped_at(s) for s in range(30)] == [
        ctl.dropped_at(s) for s in range(30)
    ]
    with pytest.raises(ValueError, match="must not rise with depth"):
        ctl.set_rates([0.1] + [0.5] * 6 + [0.0])
