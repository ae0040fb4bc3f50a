"""What a contributor adds from outside ``dropbp/``, with no change to the package: a drop shape
(:mod:`dropbp.policy.shapes`), registered in one call and trained exactly, and a feature
(:mod:`dropbp.features.base`), registered in one call and reached from ``apply``, the Trainer callback and the axolotl /
LLaMA-Factory config keys, its state round-tripping."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from conftest import assert_same_grads, batch, detach_outputs, loss_and_grads, tiny_model
from torch import nn

import dropbp
from dropbp.features.base import Feature, register_feature
from dropbp.policy.shapes import DropShape, get_shape, register_shape, shape_names


class EverySecond(DropShape):
    """Every second branch (the odd ones: each layer's MLP) dropped at twice the drop rate, the others always kept."""

    name = "every-second"

    def rates(self, flops: Sequence[float], drop_rate: float) -> list[float]:
        if 2 * drop_rate >= 1.0:
            raise ValueError(f"every-second cannot drop at {drop_rate}: the odd branches would need {2 * drop_rate}")
        return [2 * drop_rate if i % 2 else 0.0 for i in range(len(flops))]


def test_a_shape_defined_here_registers_in_one_call_and_trains_exactly():
    register_shape(EverySecond())
    assert "every-second" in shape_names() and isinstance(get_shape("every-second"), EverySecond)
    model = tiny_model("llama", layers=3)
    reference = copy.deepcopy(model)
    ctl = dropbp.apply(model, 0.3, seed=1, pattern="every-second")
    assert ctl.rates == [0.0, 0.6] * 3
    seen = set()
    for step in range(8):
        ids = batch(step)
        loss, grads = loss_and_grads(model, ids)
        dropped = ctl.last_dropped
        assert all(name.endswith(".mlp") for name in dropped)  # only the odd branches drop
        seen.add(dropped)
        handles = detach_outputs(reference, dropped)
        ref_loss, ref_grads = loss_and_grads(reference, ids)
        for handle in handles:
            handle.remove()
        assert torch.equal(loss, ref_loss)
        assert_same_grads(grads, ref_grads)
    assert len(seen) > 1 and any(seen)  # patterns differ from step to step, and some drop


def test_a_registered_shape_is_a_setting_and_its_own_refusals_reach_the_user():
    register_shape(EverySecond())
    ctl = dropbp.apply(tiny_model("llama", layers=2), 0.2)
    ctl.pattern = "every-second"
    assert ctl.pattern == "every-second" and ctl.rates == [0.0, 0.4] * 2
    with pytest.raises(ValueError, match="every-second cannot drop at 0.6"):
        ctl.drop_rate = 0.6  # the odd branches would need a rate above 1
    assert ctl.drop_rate == 0.2  # refused: nothing changed
    with pytest.raises(ValueError, match="every-second"):
        dropbp.apply(tiny_model("llama", layers=2), 0.2, pattern="every-third")  # the error lists the shapes


def test_a_second_shape_under_a_taken_name_is_refused():
    class Other(EverySecond):
        pass

    register_shape(EverySecond())
    with pytest.raises(ValueError, match="'every-second' is taken by EverySecond"):
        register_shape(Other())


@register_feature
class ForwardCounter(Feature):
    """Counts the model's training forwards (a toy feature: its setting, state, log and removal are its own)."""

    key = "forward_counter"

    def __init__(self, start: int = 0) -> None:
        super().__init__()
        if isinstance(start, bool) or not isinstance(start, int) or start < 0:
            raise ValueError(f"start must be an int >= 0, got {start!r}")
        self._start = start
        self.count = start

    def config(self) -> dict[str, Any]:
        return {"start": self._start}

    def attach(self, host) -> None:
        super().attach(host)
        self._part = host.model.register_forward_pre_hook(self._counted)

    def _counted(self, module: nn.Module, args: tuple) -> None:
        if module.training and torch.is_grad_enabled():
            self.count += 1

    def handles(self) -> list:
        return [] if self._part is None else [self._part]

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count}

    def check_state(self, state: Any) -> None:
        if not isinstance(state, dict) or sorted(state) != ["count"] or not isinstance(state["count"], int):
            raise ValueError(f"state['forward_counter'] must be {{'count': int}}, got {state!r:.60}")

    def load_state_dict(self, state: Any) -> None:
        self.count = state["count"]

    def logs(self) -> dict[str, float]:
        return {"forward_count": float(self.count)}


def _train(model: nn.Module, steps: int) -> None:
    for step in range(steps):
        ids = batch(step)
        model(input_ids=ids, labels=ids).loss.backward()


def test_a_feature_defined_here_is_reached_from_apply_and_its_state_round_trips():
    model = tiny_model("llama", layers=2)
    counter = ForwardCounter(start=2)
    assert ForwardCounter.from_config(counter.config()).config() == {"start": 2}  # its config is plain values
    ctl = dropbp.apply(model, 0.5, features=[counter])
    _train(model, 3)
    assert ctl.features["forward_counter"] is counter and counter.count == 5
    state = ctl.state_dict()
    assert state["forward_counter"] == {"count": 5}
    other = dropbp.apply(tiny_model("llama", layers=2), 0.5, features=[ForwardCounter()])
    other.load_state_dict(state)
    assert other.features["forward_counter"].count == 5 and other.step == ctl.step
    with pytest.raises(ValueError, match=r"state\['forward_counter'\] must be \{'count': int\}"):
        other.load_state_dict({**state, "forward_counter": {"count": "many"}})  # the feature checks its own state
    assert other.features["forward_counter"].count == 5  # refused: nothing changed
    ctl.remove()
    _train(model, 1)
    assert counter.count == 5 and not counter.attached  # removed with the controller


def test_a_feature_defined_here_is_reached_from_the_trainer_callback_and_the_config_keys(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("pydantic")
    from test_axolotl import _load_plugin, _stored_config
    from test_hf_integration import _trainer

    from dropbp.integrations.hf import DropBPCallback
    from dropbp.integrations.llamafactory import split_config

    callback = DropBPCallback(drop_rate=0.5, features=[ForwardCounter()])
    trainer = _trainer(tmp_path, callbacks=[callback], max_steps=4, logging_steps=2)
    trainer.train()
    assert callback.controller.features["forward_counter"].count == 4
    assert [h["dropbp/forward_count"] for h in trainer.state.log_history if "dropbp/forward_count" in h] == [2.0, 4.0]

    stored = _stored_config({"dropbp_drop_rate": 0.25, "dropbp_forward_counter": {"start": 7}})  # axolotl's keys
    (plugged,) = _load_plugin().add_callbacks_post_trainer(stored, _trainer(tmp_path / "axolotl", max_steps=1))
    assert plugged.controller.features["forward_counter"].config() == {"start": 7}
    with pytest.raises(ValueError, match=r"dropbp_forward_counter: start must be an int >= 0, got -1"):
        _stored_config({"dropbp_forward_counter": {"start": -1}})  # the feature's own check, named by its key

    rest, keys = split_config({"stage": "sft", "dropbp_forward_counter": True})  # a LLaMA-Factory YAML
    assert "dropbp_forward_counter" not in rest
    (made,) = keys.options().features
    assert isinstance(made, ForwardCounter) and made.count == 0
