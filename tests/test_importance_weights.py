"""Importance weights (``dropbp.experimental.ImportanceWeights``, 0.3's ``unbiased=True``) make the cut's gradient
exactly unbiased for every branch's parameters.

Two checks against a hand-written reference on a plain copy (outputs detached, then each kept branch's parameter
gradients multiplied by ``1 / (1 - r)`` for its rate ``r`` in force at that forward, the warm-up or time schedule
worked out by hand): every drawn step equals the reference for its pattern; and the reference's expectation over
every cut, each weighted by its probability under the rates in force, equals full backprop's gradient exactly.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from conftest import batch, detach_outputs, loss_and_grads, tiny_model, weight_branch_grads

import dropbp
from dropbp.experimental import ImportanceWeights, RisingSchedule
from dropbp.policy.schedule import SCHEDULE_LEVELS


def _warmup(step: int) -> float:  # warmup_steps=4: 0, 1/4, 2/4, 3/4, then 1
    return min(1.0, step / 4)


def _linear_schedule(step: int, total: int = 8, ramp: float = 0.5) -> float:
    """A linear rise over the first half of 8 forwards, quantised to the schedule's levels, mean 1."""
    quantised = [
        math.floor(SCHEDULE_LEVELS * min(1.0, s / (ramp * total)) + 0.5) / SCHEDULE_LEVELS for s in range(total)
    ]
    return quantised[min(step, total - 1)] / (sum(quantised) / total)


SCHEDULES = {  # the options (features made afresh: one object per controller), and the factor worked out by hand
    "warm-up": (lambda: {"warmup_steps": 4, "features": []}, _warmup),
    "time schedule": (lambda: {"features": [RisingSchedule("linear", ramp=0.5)], "total_steps": 8}, _linear_schedule),
}


def _weighted_reference(reference, ids, names, rates, dropped) -> dict:
    """The hand-written estimator for one pattern: detached outputs, kept branches' gradients weighted."""
    handles = detach_outputs(reference, tuple(dropped))
    _, grads = loss_and_grads(reference, ids)
    for h in handles:
        h.remove()
    for name, rate in zip(names, rates, strict=True):
        if name not in dropped and rate > 0:
            weight_branch_grads(grads, name, 1 / (1 - rate))
    return grads


def _cuts(names: list[str], rates: list[float]) -> list[tuple[float, tuple[str, ...]]]:
    """Every cut (the branches below depth k dropped) with its probability: a uniform u drops branch i when
    u < rates[i], rates not rising with depth, so the cut at k has probability rates[k-1] - rates[k]."""
    edges = [1.0, *rates, 0.0]
    return [(edges[k] - edges[k + 1], tuple(names[:k])) for k in range(len(names) + 1) if edges[k] > edges[k + 1]]


def _expectation(cuts, estimator, params: list[str]) -> dict:
    """Each parameter's gradient averaged over the cuts by their probabilities (no gradient counts as zero)."""
    total = dict.fromkeys(params, 0.0)
    for p, dropped in cuts:
        grads = estimator(dropped)
        for n in params:
            if grads[n] is not None:
                total[n] = total[n] + p * grads[n]
    return total


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_each_step_and_the_expectation_over_cuts_are_exact(schedule):
    options, factor = SCHEDULES[schedule]
    model = tiny_model("llama", layers=3)
    reference = copy.deepcopy(model)
    options = options()
    ctl = dropbp.apply(model, 0.3, seed=2, **{**options, "features": [*options["features"], ImportanceWeights()]})
    names, base = [b.name for b in ctl.branches], ctl.rates
    ids = batch(7)
    _, full = loss_and_grads(reference, ids)
    branch_params = [n for n in full if any(n.startswith(f"{b}.") for b in names)]
    for step in range(8):
        _, grads = loss_and_grads(model, ids)
        rates = [min(1.0, r * factor(step)) for r in base]
        dropped = ctl.last_dropped
        assert dropped == tuple(names[: len(dropped)])  # a cut
        want = _weighted_reference(reference, ids, names, rates, dropped)
        for name in full:
            if want[name] is None:
                assert grads[name] is None, name
            else:
                torch.testing.assert_close(grads[name], want[name], atol=1e-5, rtol=0, msg=name)
        cuts = _cuts(names, rates)
        if len(cuts) < 2:
            continue  # nothing drops at this step
        expected = _expectation(
            cuts, lambda d, r=rates: _weighted_reference(reference, ids, names, r, d), branch_params
        )
        plain = [0.0] * len(names)
        unweighted = _expectation(
            cuts, lambda d, r=plain: _weighted_reference(reference, ids, names, r, d), branch_params
        )
        for n in branch_params:
            torch.testing.assert_close(expected[n], full[n], atol=1e-5, rtol=1e-5, msg=n)
        bottom = [n for n in branch_params if n.startswith(f"{names[0]}.")]
        # without the weights the bottom branch's expected gradient is (1 - its rate) of full backprop's
        for n in bottom:
            torch.testing.assert_close(unweighted[n], (1 - rates[0]) * full[n], atol=1e-5, rtol=1e-5, msg=n)
        assert rates[0] > 0


def test_a_kept_branch_passes_full_backprops_gradient_down_the_residual_stream():
    """The weight stays on the branch's own parameters: below every kept branch nothing compounds (the
    embeddings of a step that dropped nothing get exactly full backprop's gradient, weights or not)."""
    model = tiny_model("llama", layers=3)
    reference = copy.deepcopy(model)
    ctl = dropbp.apply(model, 0.3, seed=0, features=[ImportanceWeights()])
    ids = batch(3)
    _, full = loss_and_grads(reference, ids)
    for _ in range(40):
        _, grads = loss_and_grads(model, ids)
        if not ctl.last_dropped:
            break
    assert ctl.last_dropped == ()
    want = dict(full)
    for b in ctl.branches:
        weight_branch_grads(want, b.name, 1 / (1 - b.rate))
    for name in full:
        torch.testing.assert_close(grads[name], want[name], atol=1e-5, rtol=0, msg=name)


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointing_recomputes_with_the_weights_of_the_forward_it_recomputes(reentrant):
    """Under activation checkpointing, several forwards (during the warm-up, each at its own rate) before one
    backward get exactly the weighted gradients they get without checkpointing."""
    plain = tiny_model("llama", layers=3)
    checkpointed = copy.deepcopy(plain)
    checkpointed.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    for model in (plain, checkpointed):
        dropbp.apply(model, 0.3, seed=5, features=[ImportanceWeights()], warmup_steps=4)
    results = []
    for model in (plain, checkpointed):
        model.train()
        model.zero_grad(set_to_none=True)
        loss = sum(model(input_ids=batch(i), labels=batch(i)).loss for i in range(4))
        loss.backward()
        results.append({n: p.grad for n, p in model.named_parameters()})
    assert results[0].keys() == results[1].keys()
    for name, grad in results[0].items():
        if grad is None:
            assert results[1][name] is None, name
        else:
            torch.testing.assert_close(results[1][name], grad, atol=1e-5, rtol=0, msg=name)
