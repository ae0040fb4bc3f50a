"""Several training forwards before one backward (DPO, contrastive, multi-task losses), with activation
checkpointing: each forward's recomputation obeys the pattern that forward drew, so every gradient equals
the hand-detached reference's, whichever later forwards drew other patterns."""

from __future__ import annotations

import copy
import dataclasses

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


@dataclasses.dataclass
class _Output:
    hidden: torch.Tensor
    note: str = "not a tensor"


class _DataclassNet(torch.nn.Module):
    """:class:`Net` returning its output in a dataclass: the re-entrant regions are found through its fields."""

    def __init__(self, net: torch.nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> _Output:
        return _Output(self.net(x))


def test_reentrant_regions_are_found_through_a_dataclass_output():
    net, plain = net_and_reference(reentrant=True)
    model, reference = _DataclassNet(net), _DataclassNet(plain)
    branches = [f"net.{name}" for name in NET_BRANCHES]
    ctl = dropbp.apply(model, 0.5, branches=branches, seed=4, pattern="uniform")
    xs = [torch.randn(4, 8, requires_grad=True) for _ in range(6)]
    _check(model, reference, ctl, [xs[:2], xs[2:5], xs[5:]], loss=lambda m, x: m(x).hidden.square().mean())
