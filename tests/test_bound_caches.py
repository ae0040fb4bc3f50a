"""The memory bound meets key/value caches (issue 41, items 1-2): GPT-2 passes its cache to each block positionally
and keeps ``use_cache=True`` in training; a training forward may continue a cached prefix (``cache=``, PEFT prefix
tuning). Gradients must be the pattern's exactly. References are clean copies (no dropbp) with the pattern's branch
outputs detached by plain hooks."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import TINY_CONFIGS, assert_same_grads, batch, count_forwards, detach_outputs, tiny_model

import dropbp

PREFIX = 4


def _grads(model) -> dict:
    return {n: (None if p.grad is None else p.grad.clone()) for n, p in model.named_parameters()}


def _prefixed_loss(model, ids: torch.Tensor) -> torch.Tensor:
    """A training forward that continues a prefix held in a cache built without a graph."""
    with torch.no_grad():
        prefix = model(input_ids=ids[:, :PREFIX], use_cache=True)
    cache = getattr(prefix, "cache", None) or prefix.past_key_values
    return model(input_ids=ids[:, PREFIX:], cache=cache, labels=ids[:, PREFIX:]).loss


def _plain_loss(model, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def _step(model, ids, loss_of) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(123)
    loss = loss_of(model, ids)
    loss.backward()
    return loss.detach(), _grads(model)


@pytest.mark.parametrize(
    ("model_type", "loss_of"),
    [("gpt2", _plain_loss), ("gpt2", _prefixed_loss), ("llama", _prefixed_loss)],
    ids=["gpt2-use-cache", "gpt2-prefix", "llama-prefix"],
)
def test_the_bound_with_a_cache_keeps_the_patterns_gradients(model_type, loss_of, monkeypatch):
    model = tiny_model(model_type, layers=4)
    assert model.config.use_cache  # GPT-2's default, kept in training
    reference = copy.deepcopy(model)
    ctl = dropbp.apply(model, 0.75, seed=0, memory_bound=True, warmup_steps=6)
    counts = count_forwards(monkeypatch, {b.name: b.module for b in ctl.branches})
    recomputed = 0
    calls = 2 if loss_of is _prefixed_loss else 1  # the prefix's no-grad forward runs every branch once more
    with pytest.warns(UserWarning, match="continues a cached prefix") if loss_of is _prefixed_loss else _nothing():
        for step in range(8):
            counts.clear()
            loss, grads = _step(model, batch(step, length=12), loss_of)
            handles = detach_outputs(reference, ctl.last_dropped)
            ref_loss, ref_grads = _step(reference, batch(step, length=12), loss_of)
            for h in handles:
                h.remove()
            torch.testing.assert_close(loss, ref_loss, atol=1e-6, rtol=0)
            assert_same_grads(grads, ref_grads)
            recomputed += sum(counts[b.name] > calls for b in ctl.branches)
    # without a prefix the bound checkpoints kept layers; with one it must not (the cache would grow twice)
    assert (recomputed > 0) == (loss_of is _plain_loss)


def _bounded_steps_are_exact(model, reference, ctl, steps: int) -> None:
    """``steps`` training steps early in a long warm-up (more kept than the bound lets store), each exact against
    ``reference`` with the step's pattern detached."""
    for step in range(steps):
        loss, grads = _step(model, batch(step), _plain_loss)
        assert len(ctl.branches) - len(ctl.last_dropped) > ctl.schedule.max_kept_branches
        handles = detach_outputs(reference, ctl.last_dropped)
        ref_loss, ref_grads = _step(reference, batch(step), _plain_loss)
        for h in handles:
            h.remove()
        torch.testing.assert_close(loss, ref_loss, atol=1e-6, rtol=0)
        assert_same_grads(grads, ref_grads)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_peft_prefix_tuning_under_the_bound_keeps_the_prefix_and_the_gradients():
    peft = pytest.importorskip("peft")
    model = tiny_model("llama", layers=4)
    config = peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3)
    model = peft.get_peft_model(model, config).train()
    reference = copy.deepcopy(model)
    # rates warm up from 0: every branch kept, more than the bound's 2, in the first steps
    ctl = dropbp.apply(model, 0.75, seed=0, memory_bound=True, warmup_steps=100)
    with pytest.warns(UserWarning, match="continues a cached prefix"):
        _bounded_steps_are_exact(model, reference, ctl, 3)


@pytest.mark.parametrize("model_type", sorted(TINY_CONFIGS))
def test_every_architecture_with_its_cache_on_keeps_the_patterns_gradients_under_the_bound(model_type):
    """Each tested architecture's own layer signature (keyword or positional cache, position ids, parallel residual)
    with ``use_cache=True`` in training, the bound checkpointing some of its layers."""
    model = tiny_model(model_type, layers=4, use_cache=True)
    reference = copy.deepcopy(model)
    ctl = dropbp.apply(model, 0.75, seed=0, memory_bound=True, warmup_steps=100)
    _bounded_steps_are_exact(model, reference, ctl, 4)
