"""Several training forwards before one backward (DPO, contrastive, multi-task losses), with activation
checkpointing: each forward's recomputation obeys the pattern that forward drew, so every gradient equals
the hand-detached reference's, whichever later forwards drew other patterns."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import assert_same_grads, batch, summed_loss_and_grads, tiny_model, with_lora
from test_checkpointing import NET_BRANCHES, net_and_reference

import dropbp


def _check(model, reference, ctl, inputs_per_step, loss=None) -> None:
    """Every step's summed loss and gradients equal the reference's for the patterns the forwards drew;
    some step's forwards drew different patterns (else the test would prove nothing)."""
    kwargs = {} if loss is None else {"loss": loss}
    differing = False
    for inputs in inputs_per_step:
        first = ctl.step
        got_loss, grads, patterns = summed_loss_and_grads(model, inputs, ctl=ctl, **kwargs)
        assert patterns == [ctl.dropped_at(first + i) for i in range(len(inputs))]
        differing |= len(set(patterns)) > 1
        want_loss, want, _ = summed_loss_and_grads(reference, inputs, patterns=patterns, **kwargs)
        torch.testing.assert_close(got_loss, want_loss, atol=1e-6, rtol=0)
        assert_same_grads(grads, want)
    assert differing


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("pattern", ["cut", "uniform"])
@pytest.mark.parametrize("method", ["full", "lora"])
@pytest.mark.parametrize("arch", ["llama", "gpt2"])  # gpt2: dropout inside the branches
def test_hugging_face_checkpointing_several_forwards(arch, method, pattern, reentrant):
    model = tiny_model(arch, layers=3)
    model = with_lora(model) if method == "lora" else model
    reference = copy.deepcopy(model)  # no checkpointing, no DropBP: outputs detached by hand
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    if reentrant and method == "lora":
        model.enable_input_require_grads()  # reentrant checkpointing needs an input with grad
    ctl = dropbp.apply(model, 0.5, seed=3, pattern=pattern)
    steps = [[batch(0), batch(1)], [batch(2), batch(3), batch(4)], [batch(5)], [batch(6), batch(7)]]
    _check(model, reference, ctl, steps)


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("pattern", ["cut", "uniform"])
def test_torch_checkpoint_several_forwards(pattern, reentrant):
    model, reference = net_and_reference(reentrant)
    ctl = dropbp.apply(model, 0.5, branches=NET_BRANCHES, seed=4, pattern=pattern)
    xs = [torch.randn(4, 8, requires_grad=True) for _ in range(6)]
    steps = [xs[:2], xs[2:5], xs[5:]]
    _check(model, reference, ctl, steps, loss=lambda m, x: m(x).square().mean())
