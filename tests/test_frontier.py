"""Speedup at equal quality read off full backprop's frontier of complete runs (dropbp.tools.frontier)."""

from __future__ import annotations

import math

import pytest

from dropbp.tools.frontier import (
    AT_LEAST,
    AT_MOST,
    EXACT,
    Reading,
    best_batch_speedup,
    best_batch_time,
    equal_quality_speedup,
    frontier,
    frontier_time,
    over_seeds,
)

# Full backprop's complete runs: (training time, final loss) at three budgets.
BASELINE = [(100.0, 3.0), (200.0, 2.5), (400.0, 2.2)]


def test_frontier_is_the_lower_envelope_sorted_by_time() -> None:
    # a longer run that ends worse than a shorter one is not on the frontier
    assert frontier([(400.0, 2.6), (100.0, 3.0), (200.0, 2.5)]) == [(100.0, 3.0), (200.0, 2.5)]
    assert frontier(BASELINE) == BASELINE


def test_a_budget_point_reads_its_own_time() -> None:
    assert frontier_time(BASELINE, 2.5) == Reading(200.0, EXACT)


def test_between_budgets_the_frontier_is_linear_in_log_time() -> None:
    # halfway in loss between 3.0 @ 100 s and 2.5 @ 200 s: the geometric mean of the times
    reading = frontier_time(BASELINE, 2.75)
    assert reading.bound == EXACT
    assert reading.value == pytest.approx(math.sqrt(100.0 * 200.0))
    # a quarter of the way from 2.5 @ 200 s to 2.2 @ 400 s
    assert frontier_time(BASELINE, 2.425).value == pytest.approx(200.0 * 2.0**0.25)


def test_outside_the_budgets_the_reading_is_a_bound_not_an_extrapolation() -> None:
    assert frontier_time(BASELINE, 2.0) == Reading(400.0, AT_LEAST)  # better than full backprop's longest run
    assert frontier_time(BASELINE, 3.5) == Reading(100.0, AT_MOST)  # worse than its shortest
    assert frontier_time(BASELINE, 3.0) == Reading(100.0, AT_MOST)


def test_speedup_is_frontier_time_over_the_runs_time() -> None:
    # DropBP reached 2.5 (full backprop's 200 s) in 125 s: 1.6x sooner
    assert equal_quality_speedup(BASELINE, 125.0, 2.5) == Reading(pytest.approx(1.6), EXACT)
    assert equal_quality_speedup(BASELINE, 200.0, 2.1) == Reading(2.0, AT_LEAST)
    assert str(equal_quality_speedup(BASELINE, 200.0, 2.1)) == ">= 2.00x"
    assert str(equal_quality_speedup(BASELINE, 125.0, 2.5)) == "1.60x"


def test_bad_input_is_refused_with_the_reason() -> None:
    with pytest.raises(ValueError, match="2 or more budgets"):
        frontier([(100.0, 3.0)])
    with pytest.raises(ValueError, match="positive time and a finite loss"):
        frontier([(0.0, 3.0), (100.0, 2.0)])
    with pytest.raises(ValueError, match="positive time and a finite loss"):
        frontier([(50.0, math.nan), (100.0, 2.0)])
    with pytest.raises(ValueError, match="must be positive"):
        equal_quality_speedup(BASELINE, 0.0, 2.5)
    with pytest.raises(ValueError, match="at least one"):
        over_seeds([])


def test_over_seeds_gives_the_mean_and_a_student_t_interval() -> None:
    summary = over_seeds([Reading(1.2), Reading(1.4), Reading(1.6)])
    assert summary["mean"] == pytest.approx(1.4)
    # sd 0.2 over sqrt(3), times t(0.975, 2 dof) = 4.303
    half = 4.303 * 0.2 / math.sqrt(3)
    assert (summary["low"], summary["high"]) == (pytest.approx(1.4 - half), pytest.approx(1.4 + half))
    assert summary["bounded"] == 0 and summary["seeds"] == 3


def test_over_seeds_counts_bounds_and_one_seed_has_no_interval() -> None:
    summary = over_seeds([Reading(2.0, AT_LEAST), Reading(1.5)])
    assert summary["bounded"] == 1
    assert summary["per_seed"][0] == {"value": 2.0, "bound": AT_LEAST}
    single = over_seeds([Reading(1.1)])
    assert single["mean"] == 1.1 and math.isnan(single["low"]) and math.isnan(single["high"])


# Two batches' complete runs, budgets ending seconds apart: the cell's batch (FULL) and half of it (HALF). Half the
# batch is better at the short budget, the cell's batch at the long one.
FULL = [(100.0, 3.0), (200.0, 2.5), (400.0, 2.2)]
HALF = [(98.0, 2.9), (198.0, 2.6), (398.0, 2.3)]


def test_best_batch_is_the_least_time_over_each_batchs_own_frontier() -> None:
    # Written out by hand: the cell's batch reaches 2.55 between 100 s (3.0) and 200 s (2.5), the half batch between
    # 98 s (2.9) and 198 s (2.6); each in log-time.
    own = 100.0 * 2.0 ** ((3.0 - 2.55) / (3.0 - 2.5))
    half = 98.0 * (198.0 / 98.0) ** ((2.9 - 2.55) / (2.9 - 2.6))
    assert best_batch_time([FULL, HALF], 2.55) == Reading(pytest.approx(min(own, half)), EXACT)
    # One envelope of both batches' runs would join HALF's (198, 2.6) to FULL's (200, 2.5): nearly flat, 2.55 read
    # at ~199 s, far above what either batch needs on its own frontier.
    merged = frontier_time(FULL + HALF, 2.55).value
    assert merged > 198.0 and min(own, half) < 190.0
    assert best_batch_speedup([FULL, HALF], 50.0, 2.55) == Reading(pytest.approx(min(own, half) / 50.0), EXACT)


def test_best_batch_bounds_combine_as_bounds() -> None:
    # Above both batches' shortest runs: each reaches it in at most its shortest time; the least is at most 98 s.
    assert best_batch_time([FULL, HALF], 3.1) == Reading(98.0, AT_MOST)
    # Above HALF's shortest run only: HALF needs at most 98 s, FULL exactly 100 * 2^0.1: at most 98 s.
    assert best_batch_time([FULL, HALF], 2.95) == Reading(98.0, AT_MOST)
    # Past HALF's longest run (at least 398 s), exact on FULL at 400 s: HALF's could be less, so at most 400 s.
    assert best_batch_time([FULL, HALF], 2.2) == Reading(400.0, AT_MOST)
    # Past one batch's longest run (at least 600 s) and exact below that on the other: exact.
    assert best_batch_time([[(100.0, 3.0), (200.0, 2.0)], [(300.0, 2.9), (600.0, 2.5)]], 2.2) == Reading(
        pytest.approx(100.0 * 2.0**0.8), EXACT
    )
    # Past both: at least the shorter longest run.
    assert best_batch_time([FULL, HALF], 2.0) == Reading(398.0, AT_LEAST)
    assert best_batch_time([FULL], 2.75) == frontier_time(FULL, 2.75)
    with pytest.raises(ValueError, match="at least one batch"):
        best_batch_time([], 2.5)
    with pytest.raises(ValueError, match="positive"):
        best_batch_speedup([FULL], 0.0, 2.5)
