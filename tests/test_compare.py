"""The lockstep comparison engine behind ``dropbp demo`` and ``benchmarks/convergence.py``, and the
text corpora it trains on."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

from dropbp import backends
from dropbp.tools.arms import apply_arm
from dropbp.tools.compare import (
    Run,
    RunResult,
    compare,
    equal_quality,
    lockstep_timed,
    loss_at_time,
    summarise,
    time_to_target,
    timing_check,
    timing_verdict,
)
from dropbp.tools.textdata import CORPORA, TokenData, stdlib_docstrings


def _result(seconds: list[float], losses: list[float]) -> RunResult:
    r = RunResult(Run("r"))
    r.eval_seconds, r.val_loss, r.eval_steps = seconds, losses, list(range(len(losses)))
    return r


def test_time_to_target_and_loss_at_time_interpolate_between_evaluations():
    r = _result([0.0, 10.0, 20.0], [3.0, 2.0, 1.5])
    assert time_to_target(r, 2.5) == pytest.approx(5.0)
    assert time_to_target(r, 1.75) == pytest.approx(15.0)
    assert time_to_target(r, 1.0) is None
    assert loss_at_time(r, 15.0) == pytest.approx(1.75)
    assert loss_at_time(r, 25.0) is None  # the run stopped before


def _timed_run(run: Run, seconds: list[float], calibration: float = 0.0) -> RunResult:
    """A run evaluated every 5 steps, its calibration (if any) timed before step 5."""
    r = RunResult(run, step_seconds=seconds, calibration_seconds=calibration)
    r.eval_steps = list(range(0, len(seconds) + 1, 5))
    r.eval_seconds = [sum(seconds[:s]) + (calibration if s >= 5 else 0.0) for s in r.eval_steps]
    r.val_loss = [3.0 - 0.1 * i for i in range(len(r.eval_steps))]
    return r


@pytest.mark.parametrize("tail", [0.1, 2.0])  # the machine grew quiet, or busy, once the baseline stopped
def test_a_tail_trained_alone_is_timed_as_its_lockstep_steps(tail):
    base = _timed_run(Run("full backprop"), [1.0] * 10)
    run = Run("DropBP", 0.5, pattern="cut", schedule="warmup", drop_schedule="constant")
    longer = _timed_run(run, [0.9, 0.6, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.4, 0.6] + [tail] * 5, calibration=0.3)
    timed = lockstep_timed(longer, baseline_steps=10)
    assert timed.step_seconds == longer.step_seconds[:10] + [0.5] * 5  # the median of steps 8 and 9
    assert timed.eval_seconds == pytest.approx([0.0, 3.3, 5.8, 8.3])  # calibration kept, the tail at 0.5 a step
    assert timed.val_loss == longer.val_loss and timed.eval_steps == longer.eval_steps
    rows = summarise([base, longer], 10)
    assert rows[1]["train_s"] == pytest.approx(8.3) and rows[1]["tail_timed"] == 5
    # it trained for less time than the baseline's 10 s: read at its end, against full backprop's loss at 8.3 s
    assert rows[1]["val_loss_at_equal_time"] == 2.7
    assert rows[1]["baseline_val_loss_at_run_end"] == pytest.approx(2.9 - 0.1 * 3.3 / 5)
    assert rows[0]["tail_timed"] == 0


@pytest.mark.parametrize(
    "run",
    [
        Run("anneal", 0.5, schedule="anneal"),  # the rates fall over the tail: it costs more than before
        Run("rise over the whole run", 0.5, drop_schedule="linear", ramp=1.0),  # still rising in the window
    ],
)
def test_a_tail_whose_rates_still_move_is_left_as_measured(run):
    longer = _timed_run(run, [0.5] * 10 + [0.1] * 5)
    assert lockstep_timed(longer, baseline_steps=10) is longer
    rows = summarise([_timed_run(Run("full backprop"), [1.0] * 10), longer], 10)
    assert rows[1]["train_s"] == pytest.approx(5.5) and rows[1]["tail_timed"] == 0


def test_a_run_no_longer_than_the_baseline_is_left_as_measured():
    run = _timed_run(Run("DropBP", 0.5), [0.5, 0.1, 0.9])
    assert lockstep_timed(run, baseline_steps=3) is run


def _data(n: int = 48, seq: int = 12) -> TokenData:
    g = torch.Generator().manual_seed(0)
    return TokenData(torch.randint(3, 96, (n, seq), generator=g), torch.randint(3, 96, (8, seq), generator=g))


def test_lockstep_runs_share_the_start_and_the_batches():
    """Two identical baselines and a DropBP run at rate 0: identical curves (same weights, batches,
    learning rate); schedules and budgets are honoured; what was measured is handed on at each evaluation."""
    kept = []
    runs = [
        Run("full backprop"),
        Run("again"),
        Run("rate 0", 0.0),
        Run("warm-up", 0.5, schedule="warmup"),
        Run("anneal", 0.5, schedule="anneal", calibrate=True),
    ]
    results = compare(
        tiny_model("llama", layers=4),
        runs,
        _data(),
        steps=6,
        lr=1e-3,
        batch_size=4,
        backend=backends.get("cpu"),
        eval_every=3,
        dropbp_steps=9,
        on_evaluation=lambda so_far: kept.append([(r.run.name, r.eval_steps[-1]) for r in so_far]),
    )
    base, again, zero, warm, anneal = results
    assert base.val_loss == again.val_loss == zero.val_loss[: len(base.val_loss)]
    assert len(base.step_seconds) == 6 and len(warm.step_seconds) == 9
    assert warm.val_loss[1] != base.val_loss[1]  # warm-up has reached rate > 0 by step 3 of 6
    assert anneal.calibration_seconds > 0 and len(anneal.rates) == 8
    assert RunResult.from_dict(anneal.to_dict()) == anneal  # recorded runs can be re-summarised
    rows = summarise(results, 6)
    assert rows[0]["step_speedup"] == 1.0 and rows[0]["time_to_target_speedup"] == 1.0
    assert {"val_loss_at_equal_time", "val_loss_at_equal_steps"} <= set(rows[1])
    names = [r.name for r in runs]
    assert kept == [list(zip(names, [s, s, s, s, s], strict=True)) for s in (3, 6)] + [
        list(zip(names, [6, 6, 9, 9, 9], strict=True))
    ]


def test_each_step_records_the_mean_fraction_of_branch_flops_its_micro_batches_dropped():
    """Per optimizer step, the mean over its micro-batches of the dropped branches' share of branch FLOPs; the
    reference replays the same patterns on a second controller and reads which branches each forward dropped."""
    import copy

    from dropbp.tools.compare import run_options

    model, data = tiny_model("llama", layers=4), _data()
    run = Run("cut", 0.5, pattern="cut")
    full, dropped = compare(
        model,
        [Run("full backprop"), run],
        data,
        steps=3,
        lr=1e-3,
        batch_size=4,
        backend=backends.get("cpu"),
        eval_every=3,
        accumulation=2,
        seed=5,
    )
    assert full.dropped_fractions == [0.0, 0.0, 0.0]
    replay = copy.deepcopy(model).train()
    ctl = apply_arm(replay, 0.5, seed=5, seq_len=12, backend=backends.get("cpu"), **run_options(run, 3, 3, 2))
    flops = {b.name: b.flops for b in ctl.branches}
    per_forward = []
    for _ in range(6):
        replay(input_ids=data.train[:2])
        per_forward.append(sum(flops[name] for name in ctl.last_dropped) / sum(flops.values()))
    expected = [(per_forward[2 * i] + per_forward[2 * i + 1]) / 2 for i in range(3)]
    assert dropped.dropped_fractions == pytest.approx(expected)
    assert len(set(per_forward)) > 1  # the draws differ, so the test tells steps apart
    assert RunResult.from_dict(dropped.to_dict()).dropped_fractions == dropped.dropped_fractions


def test_equal_quality_reads_each_dropbp_run_off_full_backprops_complete_runs():
    """Full backprop at 5, 10 and 20 steps of 1 s (final losses 3.0, 2.5, 2.2); DropBP at 20 steps of 0.4 s ending
    at 2.5 reached in 8 s what full backprop needed 10 s for: 1.25x; one ending below every budget is a bound."""

    def ended(run: Run, steps: int, seconds: float, loss: float) -> RunResult:
        r = _timed_run(run, [seconds] * steps)
        r.val_loss = [*r.val_loss[:-1], loss]
        return r

    results = [
        ended(Run("full backprop"), 10, 1.0, 2.5),
        ended(Run("full, 5 steps"), 5, 1.0, 3.0),
        ended(Run("full, 20 steps"), 20, 1.0, 2.2),
        ended(Run("DropBP", 0.5), 20, 0.4, 2.5),
        ended(Run("DropBP, better", 0.5), 20, 0.5, 2.0),
    ]
    rows = equal_quality(results)
    assert [r["run"] for r in rows] == ["DropBP", "DropBP, better"]
    assert rows[0]["speedup"] == pytest.approx(1.25) and rows[0]["bound"] == "exact"
    assert rows[1]["speedup"] == pytest.approx(20 / 10) and rows[1]["bound"] == "at least"


def test_bad_schedule_is_named():
    with pytest.raises(ValueError, match="schedule must be 'warmup' or 'anneal', got 'cosine'"):
        compare(
            tiny_model("llama", layers=2),
            [Run("x", 0.5, schedule="cosine")],
            _data(),
            steps=2,
            lr=1e-3,
            batch_size=2,
            backend=backends.get("cpu"),
            eval_every=1,
        )


class _Bytes:
    """A stand-in tokenizer: one id per UTF-8 byte."""

    def __call__(self, text: str) -> dict[str, list[int]]:
        return {"input_ids": list(text.encode())}


def test_stdlib_docstrings_is_a_second_corpus_with_held_out_modules():
    data = stdlib_docstrings(_Bytes(), 64, max_val_windows=8, max_chars=200_000)
    assert data.train.shape[1] == 64 and len(data.train) > 1000 and data.val.shape == (8, 64)
    text = bytes(data.train[:200].flatten().tolist()).decode(errors="replace")
    assert "Return" in text or "return" in text  # docstring prose
    assert set(CORPORA) == {"pydoc", "stdlib-docstrings"}
    with pytest.raises(ValueError, match="longer than the text"):
        stdlib_docstrings(_Bytes(), 10**6, max_chars=1000)


class _FakeClock:
    """``time.perf_counter`` for compare.py alone: each timed step takes ``base`` seconds (the
    engine reads the clock at a step's start and end), except every ``every``-th step, which another
    process stretches ``factor`` times, as on a busy machine."""

    def __init__(self, base: float = 1.0, every: int = 0, factor: float = 10.0) -> None:
        self.t, self.calls, self.base, self.every, self.factor = 0.0, 0, base, every, factor

    def perf_counter(self) -> float:
        self.calls += 1
        if self.calls % 2 == 0:  # the end of a step
            step = self.calls // 2
            self.t += self.base * (self.factor if self.every and step % self.every == 0 else 1.0)
        return self.t


def _timed_compare(monkeypatch, clock: _FakeClock) -> list[RunResult]:
    from dropbp.tools import compare as engine

    monkeypatch.setattr(engine, "time", clock)
    runs = [
        Run("full backprop"),
        Run("DropBP 0.5", 0.5, pattern="uniform"),
        Run("DropBP 0.75", 0.75, pattern="uniform"),
    ]
    kwargs = dict(steps=12, lr=1e-3, batch_size=2, backend=backends.get("cpu"), eval_every=6)
    return compare(tiny_model("llama", layers=4), runs, _data(), **kwargs)


def test_a_quiet_clock_gives_exact_speedups_and_no_warning(monkeypatch):
    results = _timed_compare(monkeypatch, _FakeClock())
    check = timing_check(results)
    assert check == {"baseline_spread": 0.0, "reliable": True, "warning": None}
    assert [r["step_speedup"] for r in summarise(results, 12)] == [1.0, 1.0, 1.0]


def test_a_busy_clock_is_flagged_and_the_median_of_ratios_resists_it(monkeypatch):
    """Every 4th timed step is 10x slower (whichever run it falls on): the baseline's step times
    spread far beyond a quiet machine's, so the check says not to trust them; the speedups, medians
    of per-step ratios, stay at the true 1.0 instead of the 10x a stretched median could show."""
    results = _timed_compare(monkeypatch, _FakeClock(every=4))
    assert any(s == 10.0 for s in results[0].step_seconds[1:])  # the baseline was hit
    check = timing_check(results)
    assert not check["reliable"] and check["baseline_spread"] == pytest.approx(9.0)
    assert "UNRELIABLE TIMING" in check["warning"] and "not to be trusted" in check["warning"]
    assert [r["step_speedup"] for r in summarise(results, 12)] == [1.0, 1.0, 1.0]


def test_the_demo_table_carries_the_warning():
    from dropbp.tools.demo import table

    row = {
        "run": "full backprop",
        "step_s": 1.0,
        "step_speedup": 1.0,
        "val_loss_at_equal_steps": 2.0,
        "val_loss_at_equal_time": 2.0,
        "time_to_target_s": 10.0,
        "time_to_target_speedup": 1.0,
        "final_val_loss": 2.0,
        "steps": 6,
        "train_s": 6.0,
    }
    record = {"settings": {"steps": 6}, "summary": [row], "timing": {"warning": "UNRELIABLE TIMING: ..."}}
    assert table(record).endswith("UNRELIABLE TIMING: ...")
    record["timing"] = {"warning": None}
    assert "UNRELIABLE" not in table(record)


def test_bench_flags_a_busy_baseline_like_the_demo():
    from dropbp.tools.bench import markdown_table

    quiet, busy = timing_verdict([1.0, 1.02, 0.99, 1.01]), timing_verdict([1.0, 9.0, 1.1, 8.0, 1.0])
    assert quiet["reliable"] and quiet["warning"] is None
    assert not busy["reliable"] and busy["baseline_spread"] == pytest.approx(8.0 / 1.1)  # (9 - 1) / median
    base = {"step_s": 1.0, "tokens_per_s": 1.0, "peak_memory_bytes": None}
    point = {"preset": "tiny", "method": "full", "seq_len": 16, "batch_size": 1, "baseline": base, "rows": []}
    results = {"device": "cpu", "dtype": "float32", "torch": "x", "date": "d", "rounds": 5}
    assert "UNRELIABLE" not in markdown_table({**results, "points": [{**point, "timing": quiet}]})
    table = markdown_table({**results, "points": [{**point, "timing": busy}]})
    assert "- tiny/full seq 16 batch 1: UNRELIABLE TIMING" in table


def _row(run: str, final: float, train_s: float, at_time: float, base_at_end: float | None, ttt: float | None) -> dict:
    return {
        "run": run,
        "final_val_loss": final,
        "train_s": train_s,
        "steps": 10,
        "val_loss_at_equal_time": at_time,
        "baseline_val_loss_at_run_end": base_at_end,
        "time_to_target_speedup": ttt,
    }


def test_the_seeds_table_shows_each_seed_and_the_mean_and_keeps_not_reached_visible():
    from dropbp.tools.report import seeds_table

    seed0 = [_row("full", 2.0, 100.0, 2.0, 2.0, 1.0), _row("dropbp", 2.02, 80.0, 2.02, 2.01, None)]
    seed1 = [_row("full", 2.2, 100.0, 2.2, 2.2, 1.0), _row("dropbp", 2.2, 60.0, 2.1, None, 1.5)]
    lines = seeds_table([seed0, seed1], [0, 1])
    dropbp_row = lines[-1].split(" | ")
    assert dropbp_row[2] == "+20%/+40%; +30%"  # time saved
    assert dropbp_row[3] == "2.020/2.200"
    assert dropbp_row[4] == "+1.00%/+0.00%; +0.50%"  # gap at equal steps
    # equal time: seed 0 ended first (against full backprop at that moment), seed 1 ran longer (at full's end)
    assert dropbp_row[5] == "+0.010/-0.100; -0.045"
    assert dropbp_row[6] == "-/1.50x; not reached |"
    with pytest.raises(ValueError, match="seed 1 has runs"):
        seeds_table([seed0, seed1[:1]], [0, 1])


def _with_losses(result: RunResult, losses: list[float]) -> RunResult:
    result.val_loss = losses
    return result


def test_the_learning_rates_table_takes_each_runs_own_best_rate_in_its_comparisons_time():
    """DropBP is best at the rate where full backprop is worse, and that comparison ran on a machine twice as
    slow: each run is read at its own best rate, in units of its own comparison's baseline time."""
    from dropbp.tools.report import learning_rates_table

    def comparison(step: float, base: list[float], dropbp: list[float]) -> list[RunResult]:
        return [
            _with_losses(_timed_run(Run("full backprop"), [step] * 10), base),
            _with_losses(_timed_run(Run("DropBP", 0.5), [step / 2] * 15), dropbp),
        ]

    lines = learning_rates_table(
        [
            (1e-3, comparison(1.0, [3.0, 2.5, 2.0], [3.0, 2.6, 2.2, 2.1])),
            (2e-3, comparison(2.0, [3.0, 2.6, 2.2], [3.0, 2.4, 1.95, 1.9])),
        ]
    )
    assert lines[2] == "| full backprop | 2.000 | 2.200 | 0.001 |"
    assert lines[3] == "| DropBP | 2.100 | 1.900 | 0.002 |"
    assert "full backprop at its own (0.001, final loss 2.000)" in lines[5]
    # 0.75 of its comparison's baseline time; against full backprop at 0.75 of its own (2.25); 2.0 reached at
    # 0.25 + 0.25 * 0.4 / 0.45 of the time full backprop took
    assert lines[-1] == "| DropBP | 0.002 | 0.75 | 1.900 | -5.00% | -0.350 | 2.12x |"
    assert lines[-2] == "| full backprop | 0.001 | 1.00 | 2.000 | +0.00% | +0.000 | 1.00x |"
    with pytest.raises(ValueError, match="lr 0.002 has runs"):
        learning_rates_table([(1e-3, comparison(1.0, [3, 2, 1], [3, 2, 1, 1])), (2e-3, [_timed_run(Run("x"), [1.0])])])
