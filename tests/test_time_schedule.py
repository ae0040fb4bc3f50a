"""A drop rate that moves with training time (``apply(total_steps=)``: the warm-up given back later; the experimental
rise, ``dropbp.experimental.RisingSchedule``, written here as the results tables' ``drop_schedule`` / ``ramp`` arms)
and the convergence engine's regime (accumulated micro-batches, per-run learning-rate schedules)."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import batch, tiny_model, with_lora

import dropbp
from dropbp.experimental import RisingSchedule
from dropbp.experimental.schedules import RISES
from dropbp.policy.schedule import TimeSchedule
from dropbp.tools.arms import apply_arm
from dropbp.tools.compare import Run, compare, lr_factor
from dropbp.tools.textdata import TokenData

SHAPES_AND_RAMPS = [("constant", 0.5), ("linear", 0.4), ("cosine", 0.4), ("step", 0.2)]


@pytest.mark.parametrize("pattern", ["cut", "uniform"])
@pytest.mark.parametrize(("schedule", "ramp"), SHAPES_AND_RAMPS)
@pytest.mark.parametrize("warmup", [0, 30])
def test_the_mean_rate_over_the_run_is_the_drop_rate(pattern, schedule, ramp, warmup):
    total = 300
    ctl = apply_arm(
        tiny_model("llama", layers=6),
        0.5,
        backend="cpu",
        pattern=pattern,
        total_steps=total,
        drop_schedule=schedule,
        ramp=ramp,
        warmup_steps=warmup,
    )
    rates = [ctl.schedule.drop_rate_at(s) for s in range(total)]
    assert sum(rates) / total == pytest.approx(0.5, abs=1e-9)
    if schedule != "constant" or warmup:
        assert rates[0] == 0.0 and max(rates) > 0.5  # less early, more late: the same compute
    assert ctl.schedule.drop_rate_at(10 * total) == rates[-1]  # past the run, the last rate holds


def test_a_rising_schedule_drops_less_early_than_late_and_cuts_from_the_bottom():
    ctl = apply_arm(
        tiny_model("llama", layers=6), 0.5, seed=3, backend="cpu", total_steps=400, drop_schedule="linear", ramp=0.5
    )
    early = sum(len(ctl.dropped_at(s)) for s in range(100))
    late = sum(len(ctl.dropped_at(s)) for s in range(300, 400))
    assert early < late
    names = [b.name for b in ctl.branches]
    for s in range(400):  # every pattern is still a cut: the dropped branches are a bottom prefix
        dropped = ctl.dropped_at(s)
        assert list(dropped) == names[: len(dropped)]


def test_without_total_steps_nothing_changes():
    model = tiny_model("llama", layers=4)
    plain = dropbp.apply(model, 0.5, seed=5, backend="cpu", warmup_steps=10)
    before = [plain.dropped_at(s) for s in range(50)]
    plain.remove()
    again = apply_arm(model, 0.5, seed=5, backend="cpu", warmup_steps=10, drop_schedule="linear")
    assert [again.dropped_at(s) for s in range(50)] == before  # a schedule needs the run's length
    assert again.total_steps is None


def test_a_state_resumes_in_the_middle_of_a_schedule():
    kw = dict(seed=11, backend="cpu", total_steps=40, drop_schedule="cosine", ramp=0.5, warmup_steps=6)
    model = tiny_model("llama", layers=4)
    whole = apply_arm(model, 0.5, **kw)
    uninterrupted = []
    for step in range(40):
        model(input_ids=batch(step), labels=batch(step)).loss.backward()
        uninterrupted.append(whole.last_dropped)
    whole.remove()

    first = apply_arm(model, 0.5, **kw)
    for step in range(17):
        model(input_ids=batch(step), labels=batch(step)).loss.backward()
    state = first.state_dict()
    first.remove()
    assert state["total_steps"] == 40

    rise = [RisingSchedule("cosine", ramp=0.5)]  # the rise is a feature: given again, as features are
    resumed = dropbp.apply(model, 0.5, seed=0, backend="cpu", features=rise)  # other settings: the state's win
    resumed.load_state_dict(state)
    assert (resumed.total_steps, resumed.step) == (40, 17)
    assert resumed.rates == whole.rates
    for step in range(17, 40):
        model(input_ids=batch(step), labels=batch(step)).loss.backward()
        assert resumed.last_dropped == uninterrupted[step]


def test_hand_loop_with_accumulation_draws_a_pattern_per_micro_batch():
    model = with_lora(tiny_model("llama", layers=4))
    ctl = apply_arm(
        model, 0.5, seed=2, backend="cpu", total_steps=32, drop_schedule="linear", ramp=0.25
    )
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    seen = []
    for step in range(4):
        for micro in range(8):
            ids = batch(8 * step + micro)
            (model(input_ids=ids, labels=ids).loss / 8).backward()
            seen.append(ctl.last_dropped)
            assert ctl.step == 8 * step + micro + 1
        optimizer.step()
        optimizer.zero_grad()
    assert seen == [ctl.dropped_at(s) for s in range(32)]
    assert len(set(seen[8:16])) > 1  # micro-batches of one optimizer step differ


def test_settings_are_checked_and_an_impossible_peak_is_refused():
    model = tiny_model("llama", layers=4)
    with pytest.raises(ValueError, match=r"kind must be one of \('linear', 'cosine', 'step'\)"):
        RisingSchedule("exponential")
    with pytest.raises(ValueError, match=r"ramp must be a fraction of the run in \(0, 1\], got 0"):
        RisingSchedule("linear", ramp=0.0)
    with pytest.raises(ValueError, match="total_steps must be"):
        dropbp.apply(model, 0.5, backend="cpu", total_steps=0)
    with pytest.raises(ValueError, match=r"\(RisingSchedule.*peaking at 2x the rates, which the .cut. shape cannot"):
        dropbp.apply(model, 0.5, backend="cpu", total_steps=100, features=[RisingSchedule("step", ramp=0.5)])
    ctl = dropbp.apply(model, 0.5, backend="cpu", total_steps=100)
    before = ctl.state_dict()
    with pytest.raises(ValueError, match="peaking at 2x"):
        ctl.replace_options(features=[RisingSchedule("step")])  # ramp 0.5 by default: a refused change changes nothing
    assert ctl.state_dict() == before and ctl.features == {}
    ctl.replace_options(features=[RisingSchedule("step", ramp=0.2)])
    assert ctl.features["rising_schedule"].config() == {"kind": "step", "ramp": 0.2}
    ctl.replace_options(features=[])
    assert ctl.state_dict() == before


def test_a_warm_up_too_high_to_keep_the_mean_is_refused_with_advice_that_fits():
    """With no rising shape, only the warm-up lifts the peak: the advice names it, not the shape."""
    with pytest.raises(ValueError) as refused:
        dropbp.apply(tiny_model("llama", layers=4), 0.875, backend="cpu", total_steps=100, warmup_steps=20)
    message = str(refused.value)
    assert "(warmup_steps=20, total_steps=100)" in message
    advice = "lower drop_rate, or shorten the warm-up (apply's warmup_steps, attach's warmup=) or set it to 0"
    assert message.endswith(advice)
    dropbp.apply(tiny_model("llama", layers=4), 0.875, backend="cpu", total_steps=100)  # no warm-up: no peak


def test_bounded_pattern_pools_move_in_quarters():
    ctl = apply_arm(
        tiny_model("llama", layers=4), 0.5, backend="cpu", max_patterns=4, total_steps=200, drop_schedule="linear"
    )
    assert len({ctl.schedule.drop_rate_at(s) for s in range(200)}) <= 5  # 0, 1/4, 1/2, 3/4 and 1 of the peak


def test_time_schedule_quantises_then_keeps_the_mean():
    for rise in (None, *(RisingSchedule(kind, ramp=0.3) for kind in RISES)):
        time = TimeSchedule(1000, 50, 20, rise)
        assert time.mean() == pytest.approx(1.0, abs=1e-12)
        assert len({time.factor(s) for s in range(1000)}) <= 21


def test_lr_factor_is_warmup_then_cosine_over_the_runs_own_steps():
    assert [lr_factor(s, 100, "constant") for s in (0, 50, 99)] == [1.0, 1.0, 1.0]
    assert lr_factor(0, 100, "cosine") == 0.0  # as transformers.get_cosine_schedule_with_warmup
    assert lr_factor(5, 100, "cosine") == pytest.approx(0.5)
    assert lr_factor(10, 100, "cosine") == pytest.approx(1.0)
    assert lr_factor(55, 100, "cosine") == pytest.approx(0.5)
    assert lr_factor(100, 100, "cosine") == pytest.approx(0.0, abs=1e-12)
    # the transformers schedule, step for step
    transformers = pytest.importorskip("transformers")
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = transformers.get_cosine_schedule_with_warmup(opt, 12, 120)
    for step in range(120):
        assert opt.param_groups[0]["lr"] == pytest.approx(lr_factor(step, 120, "cosine"), abs=1e-12)
        opt.step()
        sched.step()


def test_engine_gives_each_run_its_own_schedules_and_a_pattern_per_micro_batch(monkeypatch):
    data = TokenData(torch.randint(3, 64, (40, 12)), torch.randint(3, 64, (4, 12)))
    lrs: dict[int, list[float]] = {}
    original = torch.optim.AdamW.step

    def recording(self, *a, **k):
        lrs.setdefault(id(self), []).append(self.param_groups[0]["lr"])
        return original(self, *a, **k)

    monkeypatch.setattr(torch.optim.AdamW, "step", recording)
    controllers = []

    def applying(*a, **k):
        controllers.append(apply_arm(*a, **k))
        return controllers[-1]

    monkeypatch.setattr("dropbp.tools.compare.apply", applying)
    runs = [
        Run("full backprop"),
        Run("cut, own length", 0.5, pattern="cut", drop_schedule="linear", ramp=0.5),
        Run("old regime", 0.5, pattern="cut", accumulation=1, lr_schedule="constant", steps=6),
    ]
    results = compare(
        tiny_model("llama", layers=4),
        runs,
        data,
        steps=6,
        dropbp_steps=9,
        lr=1e-2,
        batch_size=4,
        backend=dropbp.backends.get("cpu"),
        eval_every=3,
        accumulation=4,
        lr_schedule="cosine",
        weight_decay=0.01,
    )
    assert [len(r.step_seconds) for r in results] == [6, 9, 6]
    base, own, old = lrs.values()  # optimizers in run order
    assert base == pytest.approx([1e-2 * lr_factor(s, 6, "cosine") for s in range(6)])
    assert own == pytest.approx([1e-2 * lr_factor(s, 9, "cosine") for s in range(9)])
    assert old == [1e-2] * 6
    assert math.isclose(max(own), 1e-2)
    own_ctl, old_ctl = controllers
    assert (own_ctl.step, own_ctl.total_steps) == (9 * 4, 9 * 4)  # a pattern per micro-batch, over its own run
    assert (old_ctl.step, old_ctl.total_steps) == (6, None)


def _longest_by_trial(ctl, total: int, up_to: int) -> int:
    """The reference: try every warm-up from ``up_to`` down on the controller itself, the first one it takes
    (0 when it takes none: the schedule's own rise then asks too high a peak)."""
    state = ctl.state_dict()
    try:
        for warmup in range(up_to, -1, -1):
            try:
                ctl.replace_options(warmup_steps=warmup, total_steps=total)
                return warmup
            except ValueError:
                continue
        return 0
    finally:
        ctl.load_state_dict(state)


@pytest.mark.parametrize("pattern", ["cut", "uniform"])
@pytest.mark.parametrize("schedule", ["constant", "linear"])
@pytest.mark.parametrize("rate", [0.5, 0.75, 0.8, 0.85, 0.875])
def test_the_longest_warmup_is_the_longest_the_settings_take(pattern, schedule, rate):
    """``ctl.longest_warmup`` (a pure function) equals a search that tries each warm-up on the controller, with
    the shape's own rates and with given ones, and it changes nothing."""
    ctl = apply_arm(tiny_model("llama", layers=4), rate, pattern=pattern, drop_schedule=schedule)
    for given in (False, True):
        if given:
            ctl.set_rates([r * 0.9 for r in ctl.rates])
        before = ctl.state_dict()
        for total, up_to in ((50, 10), (200, 40), (1000, 200)):
            assert ctl.schedule.longest_warmup(total, up_to) == _longest_by_trial(ctl, total, up_to)
        assert ctl.state_dict() == before


def test_settings_change_together_all_or_nothing():
    ctl = dropbp.apply(tiny_model("llama", layers=4), 0.5)
    before = ctl.state_dict()
    with pytest.raises(ValueError, match="keeps the run's mean drop rate by peaking"):
        ctl.replace_options(drop_rate=0.875, warmup_steps=100, total_steps=200)
    assert ctl.state_dict() == before
    with pytest.raises(ValueError, match="branches cannot change after apply"):
        ctl.replace_options(branches=["model.layers.0.mlp"])
    ctl.replace_options(seed=3, warmup_steps=20, total_steps=200)
    assert (ctl.seed, ctl.warmup_steps, ctl.total_steps, ctl.options.seed) == (3, 20, 200, 3)


@pytest.mark.parametrize("setting", ["drop_rate", "pattern"])
def test_setting_the_drop_rate_or_pattern_to_its_value_resets_given_rates(setting):
    ctl = dropbp.apply(tiny_model("llama", layers=2), 0.5, pattern="uniform")
    ctl.set_rates([0.1, 0.2, 0.3, 0.4])
    setattr(ctl, setting, getattr(ctl, setting))
    assert ctl.rates == [0.5] * 4


@pytest.mark.parametrize("pattern", ["cut", "uniform"])
@pytest.mark.parametrize("rate", [0.25, 0.5, 0.75, 0.875])
@pytest.mark.parametrize("drop_schedule", ["constant", "linear", "cosine", "step"])
@pytest.mark.parametrize("max_patterns", [4, 16])
def test_a_pattern_bound_holds_over_the_whole_run(pattern, rate, drop_schedule, max_patterns):
    """Every shape under a bound (a lazy device's graphs), warm-up and time schedule included: at most
    ``max_patterns`` distinct patterns over the run, and the run's mean drop rate kept."""
    import math

    from dropbp.integrations.hf import fit_auto_warmup

    steps = 400
    model = tiny_model("llama", layers=6)
    ctl = dropbp.apply(model, rate, seed=0, backend="cpu", max_patterns=max_patterns, pattern=pattern)
    rise = [] if drop_schedule == "constant" else [RisingSchedule(drop_schedule)]
    try:
        ctl.replace_options(features=rise, total_steps=steps)
    except ValueError as refused:  # a rising schedule's peak past what the shape takes: refused, said elsewhere
        assert "peaking at" in str(refused)
        pytest.skip(f"{drop_schedule} at {rate} peaks past what {pattern} patterns take")
    fit_auto_warmup(ctl, steps)
    patterns = [ctl.dropped_at(s) for s in range(steps)]
    assert len(set(patterns)) <= max_patterns
    # each branch's share of drops follows its scheduled rate, within the pool's 1/K per branch
    scheduled = sum(ctl.schedule.drop_rate_at(s) for s in range(steps)) / steps
    dropped = sum(len(p) for p in patterns) / (steps * len(ctl.branches))
    assert math.isclose(dropped, scheduled, abs_tol=1 / (max_patterns - 1) + 0.02)


@pytest.mark.parametrize("kind", [None, *RISES])
@pytest.mark.parametrize(
    ("total", "warmup", "levels"), [(1, 0, 20), (7, 3, 4), (300, 60, 20), (1000, 0, 20), (997, 131, 4)]
)
def test_the_schedule_equals_its_step_by_step_definition(kind, total, warmup, levels):
    """Issue 71, class F: the schedule is worked out from the runs of steps at one level (found by bisection), so its
    memory and time do not grow with the run; it equals the definition written out step by step here."""
    rise = None if kind is None else RisingSchedule(kind, ramp=0.3)
    try:
        time = TimeSchedule(total, warmup, levels, rise)
    except ValueError:
        return  # drops nothing over the run (a step rise on one forward): refused, as the definition's mean is 0
    warmed = [min(1.0, s / warmup) if warmup else 1.0 for s in range(total)]
    raw = [(1.0 if rise is None else rise.level(s, total)) * w for s, w in enumerate(warmed)]
    quantised = [math.floor(levels * x + 0.5) / levels for x in raw]
    mean = sum(quantised) / total
    want = [q / mean for q in quantised]
    assert [time.factor(s) for s in range(total)] == pytest.approx(want, rel=1e-12)
    assert time.peak == pytest.approx(max(want), rel=1e-12) and time.mean() == pytest.approx(1.0, rel=1e-12)
    assert time.factor(10 * total) == time.factor(total - 1) and len(set(want)) <= levels + 1


def test_a_run_of_a_billion_forwards_costs_what_a_short_one_does():
    """Issue 71, class F: total_steps=10**9 (and 2 * 10**5) plan at once, holding a few runs of steps, not a factor per
    forward (a list of 10**9 floats hung); max_patterns past what a pool may hold is refused naming the bound."""
    model = tiny_model("llama", layers=4)
    ctl = dropbp.apply(model, 0.5, warmup_steps=10**8, total_steps=10**9, features=[RisingSchedule("cosine")])
    rates = [ctl.schedule.drop_rate_at(s) for s in (0, 10**8, 5 * 10**8, 10**9 - 1)]
    assert rates[0] == 0.0 and rates[1] < rates[2] <= rates[3]
    with pytest.raises(ValueError, match=r"max_patterns=100000 is more than the 4096 patterns a pool may hold"):
        dropbp.apply(tiny_model("llama", layers=4), 0.5, max_patterns=10**5)
