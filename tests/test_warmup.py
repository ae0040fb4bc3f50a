"""``warmup_steps``: every rate rises linearly from 0 over the first training forwards."""

from __future__ import annotations

import pytest
from conftest import batch, tiny_model

import dropbp
from dropbp.policy.sampler import PatternSampler


def test_warmup_scales_the_rates_exactly_then_hands_over():
    model = tiny_model("llama", layers=4)
    ctl = dropbp.apply(model, 0.5, seed=7, backend="cpu", warmup_steps=10, pattern="uniform")
    plain = PatternSampler([0.5] * 8, 7)
    for step in range(30):
        expected = PatternSampler([0.5 * step / 10] * 8, 7).pattern(step) if step < 10 else plain.pattern(step)
        assert ctl.dropped_at(step) == tuple(ctl.branches[i].name for i in sorted(expected))
    assert ctl.dropped_at(0) == ()
    for step in range(12):  # the training forwards draw those very patterns
        model(input_ids=batch(step), labels=batch(step)).loss.backward()
        assert ctl.last_dropped == ctl.dropped_at(step)


def test_bounded_patterns_warm_up_in_quarters():
    ctl = dropbp.apply(
        tiny_model("llama", layers=4), 0.5, seed=1, backend="cpu", warmup_steps=20, max_patterns=4, pattern="uniform"
    )
    seen = {ctl.dropped_at(s) for s in range(200)}
    assert len(seen) <= 4  # the bound holds over the warm-up too: 3 drawn and the empty pattern, one pool
    assert ctl.dropped_at(4) == ()  # factor floor(4 * 4 / 20) / 4 = 0
    after = [ctl.dropped_at(s) for s in range(24, 200)]  # past the warm-up: the pool, cycled
    assert set(after) == seen and after[:4] * 44 == after
    with pytest.raises(ValueError, match="max_patterns=1 leaves no room for rates that move"):
        dropbp.apply(tiny_model("llama", layers=2), 0.5, backend="cpu", warmup_steps=20, max_patterns=1)


def test_warmup_is_saved_and_a_state_without_it_is_refused():
    ctl = dropbp.apply(tiny_model("llama", layers=2), 0.5, backend="cpu", warmup_steps=12, pattern="uniform")
    state = ctl.state_dict()
    assert state["warmup_steps"] == 12
    other = dropbp.apply(tiny_model("llama", layers=2), 0.5, backend="cpu", pattern="uniform")
    other.load_state_dict(state)
    assert other.warmup_steps == 12 and [other.dropped_at(s) for s in range(20)] == [
        ctl.dropped_at(s) for s in range(20)
    ]
    del state["warmup_steps"]  # no release wrote such a state: refused, naming the key, nothing loaded
    with pytest.raises(ValueError, match=r"state is missing keys \['warmup_steps'\]"):
        other.load_state_dict(state)
    assert other.warmup_steps == 12
    with pytest.raises(ValueError, match=r"state version 0 is not this dropbp's \(2\): it was written by another"):
        other.load_state_dict({**ctl.state_dict(), "version": 0})


@pytest.mark.parametrize("bad", [-1, 2.5, True])
def test_bad_warmup_is_refused(bad):
    with pytest.raises((TypeError, ValueError), match="warmup_steps must be an int >= 0"):
        dropbp.apply(tiny_model("llama", layers=2), 0.5, backend="cpu", warmup_steps=bad, pattern="uniform")
