"""The forecast a run gets before it starts, from the measured map (dropbp.experimental.where_it_pays), and the
Trainer's log of it."""

from __future__ import annotations

import importlib.util
import json
import logging
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from dropbp.experimental.where_it_pays import MAP_FILE, forecast, measured_map

ROOT = Path(__file__).resolve().parent.parent

TABLE = {
    "conditions": "a test table",
    "cells": [
        {"steps": 100, "tokens": 1024, "rate": 0.5, "mean": 0.9, "low": 0.8, "high": 0.95},
        {"steps": 1000, "tokens": 1024, "rate": 0.5, "mean": 1.2, "low": 0.9, "high": 1.5},
        {"steps": 100, "tokens": 8192, "rate": 0.5, "mean": 1.4, "low": 1.2, "high": 1.6},
        {"steps": 100, "tokens": 1024, "rate": 0.75, "mean": 0.7, "low": 0.6, "high": 0.8},
    ],
}


def test_the_nearest_cell_in_log_steps_and_tokens_at_the_nearest_rate_decides():
    assert forecast(120, 900, 0.5, TABLE).steps == 100  # log(120/100) < log(1000/120)
    assert forecast(600, 1024, 0.5, TABLE).steps == 1000
    assert forecast(100, 16384, 0.55, TABLE).tokens == 8192
    assert forecast(100, 1024, 0.875, TABLE).drop_rate == 0.75  # the nearest measured rate
    unknown = forecast(90, None, 0.5, TABLE)  # the run length alone: the first of the nearest
    assert (unknown.steps, unknown.tokens) == (100, 1024) and "tokens per step unknown" in unknown.message


def test_the_verdict_follows_the_interval():
    below = forecast(100, 1024, 0.5, TABLE)
    assert below.pays is False and "NOT expected" in below.message
    level = forecast(1000, 1024, 0.5, TABLE)
    assert level.pays is None and "level" in level.message
    above = forecast(100, 8192, 0.5, TABLE)
    assert above.pays is True and "sooner" in above.message
    # the message names the measured cell, its figure, and the best measured regime (the knob that moves it)
    assert "0.90x [95%: 0.80, 0.95]" in below.message and "Best measured: 1.40x at 100 steps x 8192 tokens" in (
        below.message
    )
    assert "against full backprop at the same tokens per step" in below.message  # the figure names its baseline


def test_a_run_of_any_size_gets_the_nearest_regime():
    """Ints past a float's range (10**400 tokens a step or steps) are compared by their logs, never a ratio that
    overflows to 0 or inf."""
    huge = forecast(10, 10**400, 0.5, TABLE)
    assert huge.tokens == max(c["tokens"] for c in TABLE["cells"])
    assert forecast(10**400, 1024, 0.5, TABLE).steps == max(c["steps"] for c in TABLE["cells"])


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="optimizer_steps must be an int >= 1, got 0"):
        forecast(0, 1024, 0.5, TABLE)
    with pytest.raises(ValueError, match="tokens_per_step must be an int >= 1, got 0"):
        forecast(10, 0, 0.5, TABLE)
    with pytest.raises(ValueError, match="no cells"):
        forecast(10, 10, 0.5, {"conditions": "", "cells": []})


def test_the_shipped_map_is_the_one_the_record_makes():
    """dropbp/experimental/where_it_pays.json is written by ``benchmarks/where_it_pays.py --report`` from map.json."""
    spec = importlib.util.spec_from_file_location("where_it_pays", ROOT / "benchmarks" / "where_it_pays.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    record = json.loads((ROOT / "benchmarks" / "results" / "where_it_pays" / "map.json").read_text())
    assert measured_map() == json.loads(MAP_FILE.read_text()) == module.shipped_map(record)
    assert measured_map()["cells"], "the shipped map is empty"


def test_the_trainer_callback_logs_the_forecast_when_training_begins(caplog):
    from dropbp.integrations.hf import log_forecast

    args = SimpleNamespace(per_device_train_batch_size=2, gradient_accumulation_steps=4, world_size=1, max_length=128)
    with caplog.at_level(logging.INFO, logger="dropbp"):
        log_forecast(args, SimpleNamespace(max_steps=300), 0.5)
    want = forecast(300, 2 * 4 * 128, 0.5)
    ours = [r for r in caplog.records if r.name == "dropbp"]  # not another library's import-time log lines
    assert [r.getMessage() for r in ours] == [want.message]
    assert ours[0].levelno == (logging.INFO if want.pays else logging.WARNING)
