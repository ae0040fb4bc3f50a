"""allocate_rates against an independent implementation of mission.md section 5 (numpy float32,
linear scan instead of a heap), known answers, and input validation."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from dropbp import allocate_rates


def spec_allocation(sens, flops, p, min_rate=0.0, max_rate=0.9, step=0.1):
    """The reference's greedy written from the spec: float32 rates and priorities, float64 total."""
    s32 = np.asarray(sens, dtype=np.float32)
    f32 = np.asarray(flops, dtype=np.float32)
    rates = np.full(len(sens), min_rate, dtype=np.float32)
    count = [0] * len(sens)
    prio = {i: np.float32(-(float(s32[i]) * (step + min_rate))) for i in range(len(sens))}
    total = float(sum(float(f) for f in f32)) * (1 - min_rate)
    target = int((1 - p) * sum(flops))
    while total > target:
        if not prio:
            return None  # unreachable
        # largest priority (smallest S * r'), ties: the later branch
        i = max(prio, key=lambda j: (prio[j], j))
        rates[i] = np.float32(float(rates[i]) + step)
        count[i] += 1
        total -= float(f32[i]) * step
        if float(rates[i]) < max_rate:
            prio[i] = np.float32(float(prio[i]) - step * float(s32[i]))
        else:
            del prio[i]
    return [min_rate + c * step for c in count]


def _case(rng: random.Random):
    n = rng.randint(1, 40)
    style = rng.choice(["continuous", "ties", "zeros", "tiny"])
    if style == "continuous":
        sens = [rng.lognormvariate(0, 2) for _ in range(n)]
    elif style == "ties":
        sens = [float(rng.randint(0, 3)) for _ in range(n)]
    elif style == "zeros":
        sens = [0.0] * n
    else:
        sens = [rng.random() * 1e-6 for _ in range(n)]
    if rng.random() < 0.5:
        flops = [rng.choice([3.0e6, 1.2e7]) if i % 2 else 3.0e6 + rng.random() for i in range(n)]
    else:
        flops = [rng.uniform(1, 1e9) for _ in range(n)]
    min_rate = rng.choice([0.0, 0.0, 0.1, 0.2])
    p = rng.uniform(0, 0.95)
    return sens, flops, p, min_rate


def test_agrees_with_independent_spec_on_random_cases():
    rng = random.Random(2024)
    checked = unreachable = 0
    for _ in range(400):
        sens, flops, p, min_rate = _case(rng)
        want = spec_allocation(sens, flops, p, min_rate)
        if want is None:
            with pytest.raises(ValueError, match="cannot be reached"):
                allocate_rates(sens, flops, p, min_rate=min_rate)
            unreachable += 1
            continue
        got = allocate_rates(sens, flops, p, min_rate=min_rate)
        assert got == pytest.approx(want, abs=1e-9), (sens, flops, p, min_rate)
        checked += 1
    assert checked >= 200 and unreachable > 0


def test_known_answer_and_tie_goes_to_later_branch():
    # Costs S * r' in increasing order; the last increment is a tie at 1.2 between branches 2 and 3.
    assert allocate_rates([1, 2, 3, 4], [1, 1, 1, 1], 0.5) == [0.9, 0.5, 0.3, 0.3]
    assert allocate_rates([5, 5], [10, 10], 0.05) == [0.0, 0.1]


def test_rates_meet_the_flop_budget_and_bounds():
    rng = random.Random(7)
    for _ in range(50):
        n = rng.randint(2, 30)
        sens = [rng.random() for _ in range(n)]
        flops = [rng.uniform(1e5, 1e7) for _ in range(n)]
        p = rng.uniform(0, 0.85)
        rates = allocate_rates(sens, flops, p)
        kept = sum((1 - r) * f for r, f in zip(rates, flops, strict=True))
        assert kept <= int((1 - p) * sum(flops)) + 1e-3 * sum(flops)
        assert all(0 <= r <= 0.9 + 1e-12 for r in rates)


def test_zero_rate_gives_min_rate():
    assert allocate_rates([1.0, 2.0], [1e6, 1e6], 0.0) == [0.0, 0.0]
    assert allocate_rates([1.0, 2.0], [1e6, 1e6], 0.1, min_rate=0.1) == [0.1, 0.1]


@pytest.mark.parametrize(
    "args, kwargs, error, match",
    [
        (([1.0], [1.0, 2.0], 0.5), {}, ValueError, "one entry per branch"),
        (([], [], 0.5), {}, ValueError, "empty"),
        (([1.0], [1.0], 1.0), {}, ValueError, r"drop_rate must be in \[0, 1\)"),
        (([1.0], [1.0], -0.1), {}, ValueError, "drop_rate"),
        (([1.0], [1.0], math.nan), {}, ValueError, "drop_rate"),
        (([1.0], [1.0], "0.5"), {}, TypeError, "drop_rate must be a number"),
        (([-1.0], [1.0], 0.5), {}, ValueError, r"sensitivities\[0\]"),
        (([math.nan], [1.0], 0.5), {}, ValueError, r"sensitivities\[0\]"),
        (([1.0], [0.0], 0.5), {}, ValueError, r"flops\[0\] must be a finite number > 0"),
        (([1.0], ["x"], 0.5), {}, TypeError, r"flops\[0\] must be a number"),
        (("ab", [1.0], 0.5), {}, TypeError, "sensitivities must be a sequence"),
        (([1.0], [1.0], 0.5), {"min_rate": 0.95}, ValueError, "max_rate"),
        (([1.0], [1.0], 0.5), {"step": 0}, ValueError, "step"),
        (([1.0, 1.0], [1.0, 1.0], 0.92), {}, ValueError, "cannot be reached with max_rate=0.9"),
    ],
)
def test_bad_input_is_named(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        allocate_rates(*args, **kwargs)
