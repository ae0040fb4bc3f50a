"""What the measured map says about a run before it starts: the speedup at equal quality of its nearest regime.
Experimental: superseded by the run's own noise scale (:class:`dropbp.NoiseScale`, whose forecast reads the user's
model and data); the Trainer callback logs it only where the noise scale is not measured.

The map (``benchmarks/where_it_pays.py``, docs/where-it-pays.md) measured DropBP's shipped default against full
backprop over run length and tokens per optimizer step; its figures ship as ``where_it_pays.json`` beside this
file, written by that script's report. :func:`forecast` finds the measured cell nearest to a run (log-distance in
steps and tokens, at the nearest measured drop rate) and says what it found; the Trainer callback logs it when
training begins. A forecast, not a measurement: the map's model, data and hardware are not the user's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from dropbp.checks import check_fraction, check_int
from dropbp.files import read_json

__all__ = ["Forecast", "forecast", "measured_map"]

MAP_FILE = Path(__file__).with_name("where_it_pays.json")


@dataclass(frozen=True)
class Forecast:
    """The measured cell nearest to a run and what it says."""

    steps: int  # the cell's run length (full backprop's optimizer steps)
    tokens: int  # the cell's tokens per optimizer step
    drop_rate: float
    mean: float  # speedup at equal quality, DropBP at equal time, mean over seeds
    low: float  # its 95% interval
    high: float
    pays: bool | None  # True: the interval is above 1; False: below 1; None: level (1 inside it)
    message: str


@cache
def measured_map(path: Path = MAP_FILE) -> dict:
    """The shipped map: ``{"conditions": str, "cells": [{"steps", "tokens", "rate", "mean", "low", "high"}, ...]}``."""
    return read_json(path, "reinstall dropbp: this file ships with it")


def forecast(
    optimizer_steps: int, tokens_per_step: int | None, drop_rate: float, table: dict | None = None
) -> Forecast:
    """The forecast for a run of ``optimizer_steps`` steps of ``tokens_per_step`` tokens (None: not known, the
    run length alone decides) at ``drop_rate``, from ``table`` (default: :func:`measured_map`)."""
    check_int("optimizer_steps", optimizer_steps, 1)
    if tokens_per_step is not None:
        check_int("tokens_per_step", tokens_per_step, 1)
    drop_rate = check_fraction("drop_rate", drop_rate)
    table = measured_map() if table is None else table
    cells = table["cells"]
    if not cells:
        raise ValueError("the measured map has no cells")
    rate = min({c["rate"] for c in cells}, key=lambda r: abs(r - drop_rate))

    def distance(c: dict) -> float:
        # logs of each side, not of their ratio: a ratio of ints past a float's range is 0.0 or inf
        tokens = 0.0 if tokens_per_step is None else (math.log(c["tokens"]) - math.log(tokens_per_step)) ** 2
        return (math.log(c["steps"]) - math.log(optimizer_steps)) ** 2 + tokens

    cell = min((c for c in cells if c["rate"] == rate), key=distance)
    pays = True if cell["low"] > 1.0 else False if cell["high"] < 1.0 else None
    best = max(cells, key=lambda c: c["mean"])
    tokens_text = "tokens per step unknown" if tokens_per_step is None else f"{tokens_per_step} tokens per step"
    verdict = {
        True: "DropBP is expected to reach full backprop's quality sooner",
        False: "DropBP is NOT expected to reach full backprop's quality sooner (it trades quality for time)",
        None: "DropBP is expected to be level with full backprop at equal time (no quality sooner)",
    }[pays]
    message = (
        f"dropbp: your run ({optimizer_steps} optimizer steps, {tokens_text}, drop rate {drop_rate:g}) is nearest "
        f"the measured regime of {cell['steps']} steps x {cell['tokens']} tokens at {rate:g}: speedup at equal "
        f"quality against full backprop at the same tokens per step {cell['mean']:.2f}x [95%: {cell['low']:.2f}, "
        f"{cell['high']:.2f}] (against full backprop at its best batch it is lower: docs/results.md). {verdict}. "
        "Best measured: "
        f"{best['mean']:.2f}x at {best['steps']} steps x {best['tokens']} tokens, rate {best['rate']:g}. "
        f"Measured on {table['conditions']} (docs/where-it-pays.md)."
    )
    return Forecast(cell["steps"], cell["tokens"], rate, cell["mean"], cell["low"], cell["high"], pays, message)
