"""``dropbp.experimental.DroppedGradFill`` (0.3's ``dropped_grads``): what the optimizer sees for a dropped branch
(no fill, as the paper: "skip"; "zero"; "reuse")."""

from __future__ import annotations

import pytest
import torch
from conftest import batch, tiny_model

import dropbp
from dropbp.experimental import DroppedGradFill


def _grads(ctl: dropbp.DropBPController) -> dict[str, list[torch.Tensor | None]]:
    return {b.name: [None if p.grad is None else p.grad.clone() for p in b.module.parameters()] for b in ctl.branches}


def _train(mode: str, optimizer: str = "sgd", steps: int = 8):
    """Train a tiny llama (4 branches at rate 0.5) and record, per step, what each branch's
    parameters held as gradient right after the optimizer step, and how far they moved."""
    model = tiny_model("llama", layers=2)
    fill = [] if mode == "skip" else [DroppedGradFill(mode)]  # "skip": 0.3's name for no fill, the core's
    ctl = dropbp.apply(model, 0.5, seed=3, backend="cpu", features=fill)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=1.0) if optimizer == "sgd" else torch.optim.AdamW(params, lr=1e-2)
    history = []
    for step in range(steps):
        model(input_ids=batch(step), labels=batch(step)).loss.backward()
        computed = _grads(ctl)
        before = {b.name: [p.detach().clone() for p in b.module.parameters()] for b in ctl.branches}
        opt.step()
        seen = _grads(ctl)
        moved = {  # (before, after) per parameter
            b.name: [(q, p.detach().clone()) for p, q in zip(b.module.parameters(), before[b.name], strict=True)]
            for b in ctl.branches
        }
        history.append((set(ctl.last_dropped), computed, seen, moved))
        opt.zero_grad(set_to_none=True)
    return ctl, history


def test_skip_leaves_dropped_branches_without_gradient_or_update():
    _, history = _train("skip")
    for dropped, _, seen, moved in history:
        for name in dropped:
            assert all(g is None for g in seen[name])
            assert all(torch.equal(a, b) for a, b in moved[name])


def test_reuse_gives_the_last_computed_gradient_and_sgd_applies_it():
    _, history = _train("reuse")
    last: dict[str, list[torch.Tensor]] = {}
    reused = 0
    for dropped, computed, seen, moved in history:
        for name, grads in seen.items():
            if name in dropped:
                assert all(g is None for g in computed[name])  # the backward really was dropped
                if name not in last:
                    assert all(g is None for g in grads)  # never kept yet: nothing to reuse, skipped
                    continue
                reused += 1
                for g, ref, (before, after) in zip(grads, last[name], moved[name], strict=True):
                    assert torch.equal(g, ref)
                    assert torch.equal(after, before - ref)  # SGD, lr 1: the update is the reused gradient
            else:
                for g, ref in zip(grads, computed[name], strict=True):
                    assert torch.equal(g, ref)  # kept branches: untouched
                last[name] = grads
    assert reused >= 4


def test_zero_lets_adam_momentum_move_dropped_branches():
    _, history = _train("zero", optimizer="adamw")
    kept_before: set[str] = set()
    moved_while_dropped = 0
    for dropped, _, seen, moved in history:
        for name in dropped:
            assert all(torch.equal(g, torch.zeros_like(g)) for g in seen[name])
            if name in kept_before:
                moved_while_dropped += all(not torch.equal(a, b) for a, b in moved[name])
        kept_before |= set(seen) - dropped
    assert moved_while_dropped >= 2


def test_only_parameters_of_the_stepping_optimizer_are_filled_and_remove_stops_filling():
    model = tiny_model("llama", layers=2)
    ctl = dropbp.apply(model, 0.5, seed=3, backend="cpu", features=[DroppedGradFill("zero")])
    first = ctl.branches[0].module
    others = [p for p in model.parameters() if all(p is not q for q in first.parameters())]
    opt = torch.optim.SGD(others, lr=0.1)
    for step in range(6):
        model(input_ids=batch(step), labels=batch(step)).loss.backward()
        dropped = set(ctl.last_dropped)
        opt.step()
        if ctl.branches[0].name in dropped:
            assert all(p.grad is None for p in first.parameters())  # not this optimizer's
        opt.zero_grad(set_to_none=True)
        for p in first.parameters():
            p.grad = None
    ctl.remove()
    model(input_ids=batch(9), labels=batch(9)).loss.backward()
    opt.step()  # no hook left: nothing filled, nothing raised
    assert ctl.options.features[0].mode == "zero"


def test_bad_mode_is_rejected_with_the_choices():
    with pytest.raises(ValueError, match=r"mode must be one of \('zero', 'reuse'\), got 'stale'"):
        DroppedGradFill("stale")


def test_a_fill_removed_by_replace_options_stops_filling():
    model = tiny_model("llama", layers=2)
    fill = DroppedGradFill("zero")
    ctl = dropbp.apply(model, 0.5, seed=3, backend="cpu", features=[fill])
    ctl.replace_options(features=[])
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    for step in range(4):
        model(input_ids=batch(step), labels=batch(step)).loss.backward()
        opt.step()
        for b in ctl.branches:
            if b.name in ctl.last_dropped:
                assert all(p.grad is None for p in b.module.parameters())  # no fill: skipped, as the paper
        opt.zero_grad(set_to_none=True)
    assert not fill.attached


def test_two_optimizers_stepping_in_turn_both_fill_their_parameters():
    model = tiny_model("llama", layers=2)
    ctl = dropbp.apply(model, 0.5, seed=3, backend="cpu", features=[DroppedGradFill("zero")])
    params = [p for p in model.parameters() if p.requires_grad]
    first, second = torch.optim.SGD(params[::2], lr=0.1), torch.optim.SGD(params[1::2], lr=0.1)
    for step in range(4):
        model(input_ids=batch(step), labels=batch(step)).loss.backward()
        first.step()
        second.step()
        for b in ctl.branches:
            if b.name in ctl.last_dropped:
                assert all(p.grad is not None and not p.grad.any() for p in b.module.parameters())
        first.zero_grad(set_to_none=True)
        second.zero_grad(set_to_none=True)
