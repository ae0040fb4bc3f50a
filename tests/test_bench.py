"""``dropbp bench``: what each round's pattern dropped, and the speedup at the pattern's expected fraction."""

from __future__ import annotations

import statistics

import pytest
from conftest import tiny_model

import dropbp
from dropbp import backends
from dropbp.execution.discovery import flops_at_length
from dropbp.tools.bench import Point, at_expected_fraction, measure_model


def test_on_a_line_the_correction_lands_on_the_line_at_the_expected_fraction():
    dropped = [0.0, 0.3, 0.85, 0.6, 0.1]
    step_s = [3.0 - 1.8 * d for d in dropped]  # exactly linear: the rounds' mean is off only by what they drew
    assert at_expected_fraction(step_s, dropped, 0.5) == pytest.approx(3.0 - 1.8 * 0.5, abs=1e-12)
    assert statistics.mean(step_s) != pytest.approx(3.0 - 1.8 * 0.5)


def test_rounds_that_drew_one_fraction_keep_their_mean():
    assert at_expected_fraction([2.0, 2.2, 2.4], [0.5, 0.5, 0.5], 0.3) == pytest.approx(2.2)


def test_each_round_records_the_fraction_its_pattern_dropped():
    """The bench reads the step's pattern from the controller it timed; the reference draws the same seed's
    step-0 pattern without running anything (``dropped_at``) and weighs it by the branches' FLOPs."""
    model = tiny_model("llama", layers=4)
    point = Point("tiny-llama", "full", 16, 1)
    summary = measure_model(model, point, [0.5], backends.get("cpu"), rounds=4, warmup=1, patterns=("cut",))
    (row,) = summary["rows"]
    want = []
    for rnd in range(1, 5):  # the timed rounds, each seeded with its round number
        with flops_at_length(16):
            ctl = dropbp.apply(model, 0.5, seed=rnd, pattern="cut")
        flops = {b.name: b.flops for b in ctl.branches}
        want.append(sum(flops[n] for n in ctl.dropped_at(0)) / sum(flops.values()))
        ctl.remove()
    assert row["round_dropped_fraction"] == pytest.approx(want, abs=1e-12)
    assert row["dropped_fraction"] == pytest.approx(statistics.mean(want))
    assert row["expected_dropped_fraction"] == pytest.approx(0.5, abs=1e-9)
    base = statistics.mean(summary["baseline"]["round_step_s"])
    at = at_expected_fraction(row["round_step_s"], want, 0.5)
    assert row["speedup_at_expected"] == pytest.approx(base / at)
