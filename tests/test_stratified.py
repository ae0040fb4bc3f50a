"""Stratified cuts (``dropbp.experimental.StratifiedCuts(N)``, 0.3's ``stratify=N``): each group of N forwards draws
one cut depth in each of N equal slices."""

from __future__ import annotations

import math

import pytest
from conftest import batch, tiny_model

import dropbp
from dropbp.experimental import StratifiedCuts
from dropbp.experimental.stratified import StratifiedCutSampler, stratified_depth
from dropbp.policy.sampler import CutSampler
from dropbp.policy.windows import Windows


@pytest.mark.parametrize("group", [2, 3, 8])
def test_a_group_takes_one_depth_in_each_slice(group):
    for start in range(0, 40 * group, group):
        depths = [stratified_depth(7, group, start + j) for j in range(group)]
        assert sorted(math.floor(u * group) for u in depths) == list(range(group))
        assert all(0.0 <= u < 1.0 for u in depths)
    # the slices come in a different order from group to group, and the offsets differ
    firsts = {math.floor(stratified_depth(7, group, start) * group) for start in range(0, 40 * group, group)}
    assert len(firsts) == group


def test_every_branch_drops_in_floor_or_ceil_of_its_share_of_each_group():
    """Exact per group: a branch at rate r drops in floor(N r) or ceil(N r) of the N forwards (so at rate at most
    1 - 1/N it is kept in at least one), and it never drops more often than that."""
    rates = [0.75, 0.75, 0.6, 0.45, 0.3, 0.1, 0.0]
    group = 4
    sampler = StratifiedCutSampler(rates, seed=3, group=group)
    for start in range(0, 200, group):
        patterns = [sampler.pattern(step) for step in range(start, start + group)]
        for i, r in enumerate(rates):
            drops = sum(i in p for p in patterns)
            assert math.floor(group * r) <= drops <= math.ceil(group * r), (start, i, drops)
            if r <= 1 - 1 / group:
                assert drops < group
        assert all(p == frozenset(range(len(p))) for p in patterns)  # cuts: the branches below a depth


def test_independent_draws_can_drop_a_branch_in_every_forward_of_a_step():
    """The control: without stratification the bottom branch (rate 0.75) is dropped in all 4 micro-batches of some
    steps, and never trains there."""
    sampler = CutSampler([0.75, 0.5, 0.0], seed=3)
    groups = [[sampler.pattern(step) for step in range(s, s + 4)] for s in range(0, 400, 4)]
    assert any(all(0 in p for p in g) for g in groups)


def test_apply_stratifies_and_the_setting_is_saved():
    model = tiny_model("llama", layers=3).train()
    ctl = dropbp.apply(model, 0.5, seed=1, features=[StratifiedCuts(4)])
    assert ctl.state_dict()["stratified_cuts"] == {"group": 4}
    rates, names = ctl.rates, [b.name for b in ctl.branches]
    for _ in range(3):
        counts = dict.fromkeys(names, 0)
        for _ in range(4):
            model(input_ids=batch(0))
            for name in ctl.last_dropped:
                counts[name] += 1
        for name, r in zip(names, rates, strict=True):
            assert math.floor(4 * r) <= counts[name] <= math.ceil(4 * r)
    plain = dropbp.apply(tiny_model("llama", layers=3), 0.5, seed=1)
    with pytest.raises(ValueError, match=r"state was saved with StratifiedCuts \(\{'group': 4\}\), .* pass it in"):
        plain.load_state_dict(ctl.state_dict())  # the patterns would differ: not loaded without the feature
    other = dropbp.apply(tiny_model("llama", layers=3), 0.5, seed=1, features=[StratifiedCuts(2)])
    with pytest.raises(ValueError, match=r"saved with StratifiedCuts settings \{'group': 4\}, this one has"):
        other.load_state_dict(ctl.state_dict())
    again = dropbp.apply(tiny_model("llama", layers=3), 0.5, seed=1, features=[StratifiedCuts(4)])
    again.load_state_dict(ctl.state_dict())
    assert [again.dropped_at(s) for s in range(40)] == [ctl.dropped_at(s) for s in range(40)]


@pytest.mark.parametrize(
    ("group", "options", "message"),
    [
        (0, {}, "group must be an int >= 2"),
        (4, {"pattern": "uniform"}, "needs pattern='cut'"),
        (4, {"max_patterns": 16}, "max_patterns=16: given"),
    ],
)
def test_bad_stratification_is_refused_with_the_reason(group, options, message):
    with pytest.raises(ValueError, match=message):
        dropbp.apply(tiny_model("llama", layers=3), 0.5, features=[StratifiedCuts(group)], **options)


def test_windows_map_forwards_to_indices_that_start_every_optimizer_step():
    """Epochs of 15 forwards at accumulation 4 (optimizer steps of 4, 4, 4 and 3): each epoch's forwards take the
    indices of 16 - the 16th, which the short window leaves out, is never drawn - so every optimizer step starts
    at a multiple of 4; a stratified group that a short window ends has as many slices as forwards."""
    w = Windows(forwards_per_epoch=15, accumulation=4)
    assert [w.index(s) for s in (0, 11, 12, 14, 15, 18, 29, 30)] == [0, 11, 12, 14, 16, 19, 30, 32]
    assert [w.forward(i) for i in (0, 14, 15, 16, 31, 32)] == [0, 14, 15, 15, 30, 30]
    assert [w.group_size(i, 4) for i in (0, 3, 12, 14, 16, 28, 30)] == [4, 4, 3, 3, 4, 3, 3]
    assert w.group_size(12, 2) == 2 and w.group_size(14, 2) == 1 and w.group_size(12, 3) == 3  # 3 crosses windows
    assert [Windows(16, 4).index(s) for s in range(40)] == list(range(40))  # whole windows: the forward itself


@pytest.mark.parametrize("size", [1, 2, 3])
def test_a_short_group_takes_one_depth_in_each_of_its_own_slices(size):
    for start in range(0, 160, 4):
        depths = [stratified_depth(7, 4, start + j, size) for j in range(size)]
        assert sorted(math.floor(u * size) for u in depths) == list(range(size))
    assert stratified_depth(7, 4, 9, 4) == stratified_depth(7, 4, 9)  # a whole group: as before windows existed
    with pytest.raises(ValueError, match="not among the first 2 of its group of 4"):
        stratified_depth(7, 4, 10, 2)


def test_windows_are_set_by_the_run_and_saved_with_the_state():
    model = tiny_model("llama", layers=3).train()
    ctl = dropbp.apply(model, 0.5, seed=1, features=[StratifiedCuts(4)])
    ctl.windows = [15, 4]
    assert ctl.windows == (15, 4) and ctl.state_dict()["windows"] == [15, 4]
    again = dropbp.apply(tiny_model("llama", layers=3), 0.5, seed=1, features=[StratifiedCuts(4)])
    assert "windows" not in again.state_dict()  # none set: the state has no key (states saved before windows load)
    again.load_state_dict(ctl.state_dict())
    assert again.windows == (15, 4)
    assert [again.dropped_at(s) for s in range(40)] == [ctl.dropped_at(s) for s in range(40)]
    plain = dropbp.apply(tiny_model("llama", layers=3), 0.5, seed=1, features=[StratifiedCuts(4)])
    plain.load_state_dict({k: v for k, v in ctl.state_dict().items() if k != "windows"})
    assert plain.windows is None
    ctl.windows = None
    assert "windows" not in ctl.state_dict()


@pytest.mark.parametrize(
    ("windows", "error", "message"),
    [
        ((0, 4), ValueError, r"windows\[0\] must be"),
        ((15, 4, 1), TypeError, r"windows must be \(training forwards per epoch, gradient accumulation steps\)"),
        (15, TypeError, "windows must be"),
        ((15, 2.5), TypeError, r"windows\[1\] must be"),
    ],
)
def test_bad_windows_are_refused_naming_them(windows, error, message):
    ctl = dropbp.apply(tiny_model("llama", layers=3), 0.5)
    with pytest.raises(error, match=message):
        ctl.windows = windows
    assert ctl.windows is None
    with pytest.raises((TypeError, ValueError), match=r"windows"):
        ctl.load_state_dict(ctl.state_dict() | {"windows": windows})
