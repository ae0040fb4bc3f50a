"""Settings mean one thing everywhere (reliability round 5, class A, drawn): whatever sequence of ``apply``, setters
and states saved on another device a controller goes through, on the CPU or the lazy-graph backend, its settings are
the last ones given, and each is resolved on its device as ``apply`` resolves it - ``max_patterns=None`` is the
device's bound (16 on the lazy one, none on the CPU), ``memory_bound="auto"`` is on from drop rate 0.75 - at every
point, not only at ``apply``. A setting the device or the model cannot take is refused, naming it, changing nothing."""

from __future__ import annotations

import pytest
from conftest import tiny_model

import dropbp

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule  # noqa: E402

BOUND = {"cpu": None, "lazy": 16}  # each backend's own pattern bound (its default_max_patterns)
RATES = [0.25, 0.5, 0.75, 0.875]
SETTERS = {
    "drop_rate": st.sampled_from(RATES),
    "max_patterns": st.sampled_from([None, 4, 8]),
    "memory_bound": st.sampled_from(["auto", True, False]),
    "pattern": st.sampled_from(["cut", "uniform"]),
    "seed": st.integers(0, 3),
}
STATE_SETTINGS = ("drop_rate", "max_patterns", "pattern", "seed")  # memory_bound is not a state's


class Settings(RuleBasedStateMachine):
    @initialize(
        backend=st.sampled_from(["cpu", "lazy"]),
        drop_rate=st.sampled_from([0.25, 0.5, 0.75]),
        memory_bound=SETTERS["memory_bound"],
        max_patterns=SETTERS["max_patterns"],
    )
    def build(self, backend: str, drop_rate: float, memory_bound, max_patterns) -> None:
        self.backend = backend
        self.given = {"drop_rate": drop_rate, "memory_bound": memory_bound, "max_patterns": max_patterns,
                      "pattern": "cut", "seed": 0}  # fmt: skip
        self.ctl = dropbp.apply(tiny_model("llama", layers=3), backend=backend, **self.given)

    @rule(data=st.data(), name=st.sampled_from(sorted(SETTERS)))
    def set_one(self, data, name: str) -> None:
        value = data.draw(SETTERS[name])
        before = self.ctl.state_dict()
        if name == "drop_rate" and value == 0.875 and self.given["pattern"] == "uniform":
            with pytest.raises(ValueError, match="drop_rate"):  # 6 branches: uniform patterns take 5/6 at most
                setattr(self.ctl, name, value)
            assert self.ctl.state_dict() == before
            return
        if name == "pattern" and value == "uniform" and self.given["drop_rate"] == 0.875:
            with pytest.raises(ValueError, match="drop_rate"):
                setattr(self.ctl, name, value)
            assert self.ctl.state_dict() == before
            return
        setattr(self.ctl, name, value)
        self.given[name] = value

    @rule(
        backend=st.sampled_from(["cpu", "lazy"]),
        drop_rate=st.sampled_from([0.25, 0.5, 0.75]),
        max_patterns=SETTERS["max_patterns"],
        pattern=SETTERS["pattern"],
        seed=SETTERS["seed"],
    )
    def load_a_state_saved_elsewhere(self, backend: str, drop_rate: float, max_patterns, pattern: str, seed) -> None:
        """A state another controller saved, on either device: its settings become this one's, resolved here."""
        saver = dropbp.apply(
            tiny_model("llama", layers=3), drop_rate, backend=backend, max_patterns=max_patterns, pattern=pattern,
            seed=seed,
        )  # fmt: skip
        state = saver.state_dict()
        saver.remove()
        self.ctl.load_state_dict(state)
        self.given.update({name: state[name] for name in STATE_SETTINGS})

    @invariant()
    def settings_are_the_last_given_resolved_here(self) -> None:
        ctl, given = self.ctl, self.given
        for name, value in given.items():
            assert getattr(ctl.options, name) == value, name
        assert ctl.drop_rate == given["drop_rate"] and ctl.pattern == given["pattern"] and ctl.seed == given["seed"]
        bound = BOUND[self.backend] if given["max_patterns"] is None else given["max_patterns"]
        assert ctl.max_patterns == bound
        on = given["drop_rate"] >= 0.75 if given["memory_bound"] == "auto" else given["memory_bound"]
        assert ctl.memory_bound is on
        if bound is not None:  # a pool: a run never sees more patterns than the bound
            assert len({ctl.dropped_at(s) for s in range(64)}) <= bound

    @rule()
    def save_and_load_back(self) -> None:
        """A state holds the settings as resolved (the device's bound as a number): loaded back, nothing changes."""
        state = self.ctl.state_dict()
        self.ctl.load_state_dict(state)
        assert self.ctl.state_dict() == state
        self.given.update({name: state[name] for name in STATE_SETTINGS})


Settings.TestCase.settings = settings(max_examples=25, stateful_step_count=8, deadline=None, derandomize=True)
test_settings = Settings.TestCase
