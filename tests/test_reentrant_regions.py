"""Re-entrant checkpointed regions dropbp cannot attribute to a training forward (issue 41, items 7-8).

A user's own ``torch.utils.checkpoint(..., use_reentrant=True)`` around the whole model runs its forward without a
graph (no pattern is drawn): its recomputation must not apply an earlier step's pattern, so it gets full backprop,
with a warning. Regions behind a wrapper's plain-object output are found (the output's attributes are searched), so
several forwards before one backward each recompute with their own pattern. References are clean copies without
dropbp or checkpointing, with the patterns' branch outputs detached by plain hooks."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import assert_same_grads, batch, summed_loss_and_grads, tiny_model
from torch import nn
from torch.utils.checkpoint import checkpoint

import dropbp


def _checkpointed_loss(model, ids: torch.Tensor) -> torch.Tensor:
    """The whole model inside one re-entrant checkpoint (its input must need a gradient: the embeddings')."""
    embeds = model.get_input_embeddings()(ids)
    return checkpoint(lambda e: model(inputs_embeds=e, labels=ids).loss, embeds, use_reentrant=True)


def test_a_reentrant_checkpoint_around_the_model_gets_full_backprop_with_a_warning():
    model = tiny_model("llama", layers=4)
    reference = copy.deepcopy(model)
    ctl = dropbp.apply(model, 0.5, seed=0, warmup_steps=0)
    with pytest.warns(UserWarning, match="re-entrant checkpointed region .* get full backprop"):
        for step in range(4):
            ids = batch(step)
            model(input_ids=ids, labels=ids).loss.backward()  # a plain step: a pattern in force
            assert ctl.last_dropped
            before = ctl.step
            _, grads, _ = summed_loss_and_grads(model, [ids], loss=_checkpointed_loss)
            _, ref_grads, _ = summed_loss_and_grads(reference, [ids], loss=_checkpointed_loss)
            assert_same_grads(grads, ref_grads)
            assert ctl.step == before  # no pattern drawn for a forward without a graph


class _Output:
    """A wrapper's own output type: a plain object, neither a tuple, a mapping nor a dataclass."""

    def __init__(self, loss: torch.Tensor) -> None:
        self.loss = loss


class _Wrapper(nn.Module):
    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, input_ids: torch.Tensor) -> _Output:
        return _Output(self.lm(input_ids=input_ids, labels=input_ids).loss)


def _wrapper_loss(model, ids):
    return model(ids).loss


def test_regions_behind_a_plain_object_output_keep_each_forwards_pattern():
    lm = tiny_model("llama", layers=4)
    reference = _Wrapper(copy.deepcopy(lm))
    lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    lm.enable_input_require_grads()
    model = _Wrapper(lm)
    ctl = dropbp.apply(model, 0.5, seed=0, warmup_steps=0)
    inputs = [batch(i) for i in range(3)]
    for _ in range(3):
        _, grads, patterns = summed_loss_and_grads(model, inputs, ctl=ctl, loss=_wrapper_loss)
        assert len(set(patterns)) > 1  # forwards with different patterns, one backward
        _, ref_grads, _ = summed_loss_and_grads(reference, inputs, patterns=patterns, loss=_wrapper_loss)
        assert_same_grads(grads, ref_grads)
