"""The memory bound (dropbp.execution.bound): at most ``N - floor(drop_rate x N)`` kept branches store activations in
any step, gradients exactly the pattern's. References are clean copies of the model (no dropbp, no checkpointing)
with the pattern's branch outputs detached by plain hooks; the accounting is the test's own pack hook."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import assert_same_grads, batch, count_forwards, detach_outputs, loss_and_grads, tiny_model, with_lora

import dropbp


@pytest.mark.parametrize("hf_checkpointing", [False, True])
@pytest.mark.parametrize("method", ["full", "lora"])
@pytest.mark.parametrize("pattern", ["cut", "uniform"])
def test_gradients_are_the_patterns_with_the_bound_in_force(pattern, method, hf_checkpointing, monkeypatch):
    model = tiny_model("llama", layers=4)
    model = with_lora(model) if method == "lora" else model
    reference = copy.deepcopy(model)
    if hf_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # the uniform shape keeps more than the bound only while its rates rise: a warm-up
    ctl = dropbp.apply(model, 0.75, seed=0, pattern=pattern, memory_bound=True, warmup_steps=6 * (pattern == "uniform"))
    keep = ctl.schedule.max_kept_branches
    assert keep == 2  # 8 branches at 0.75
    counts = count_forwards(monkeypatch, {b.name: b.module for b in ctl.branches})
    bounded_steps = 0
    for step in range(10):
        counts.clear()
        loss, grads = loss_and_grads(model, batch(step))
        dropped = set(ctl.last_dropped)
        handles = detach_outputs(reference, ctl.last_dropped)
        ref_loss, ref_grads = loss_and_grads(reference, batch(step))
        for h in handles:
            h.remove()
        torch.testing.assert_close(loss, ref_loss, atol=1e-6, rtol=0)
        assert_same_grads(grads, ref_grads)
        kept = [b.name for b in ctl.branches if b.name not in dropped]
        assert all(counts[name] == 1 for name in dropped)  # a dropped branch is never recomputed
        if hf_checkpointing:
            assert all(counts[name] == 2 for name in kept)
        else:
            stored = [name for name in kept if counts[name] == 1]
            assert len(stored) <= keep
            assert all(counts[name] == 2 for name in kept if name not in stored)
            bounded_steps += len(kept) > keep
    assert hf_checkpointing or bounded_steps > 0


def _stored_branches(model, ctl, ids) -> tuple[set[str], int]:
    """The branches that saved a tensor for backward in one training forward, and the bytes saved in all
    (each storage once), by a pack hook of the test's own."""
    scope: list[str] = []
    saved: dict[int, tuple[int, str | None]] = {}
    handles = []
    def leave(module, args, output) -> None:
        scope.pop()

    for b in ctl.branches:
        handles.append(b.module.register_forward_pre_hook(lambda m, a, n=b.name: scope.append(n)))
        handles.append(b.module.register_forward_hook(leave, always_call=True))
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in parameters:
            saved.setdefault(storage.data_ptr(), (storage.nbytes(), scope[-1] if scope else None))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    for h in handles:
        h.remove()
    return {name for _, name in saved.values() if name is not None}, sum(n for n, _ in saved.values())


@pytest.mark.parametrize("rate", [0.5, 0.875])
def test_saved_activations_never_exceed_the_bound_over_200_steps(rate):
    model = tiny_model("llama", layers=6)
    uniform_model = copy.deepcopy(model)
    ctl = dropbp.apply(model, rate, seed=0, memory_bound=True)  # the cut, bounded
    uniform = dropbp.apply(uniform_model, rate, seed=0, pattern="uniform", memory_bound=False)
    keep = ctl.schedule.max_kept_branches
    assert keep == 12 - int(rate * 12)
    ids = batch(0, size=1, length=24)
    worst, worst_uniform, needed = 0, 0, 0
    for _ in range(200):
        stored, total = _stored_branches(model, ctl, ids)
        assert len(stored) <= keep, (ctl.step, sorted(stored))
        needed += len(ctl.branches) - len(ctl.last_dropped) > keep
        worst = max(worst, total)
        stored_uniform, total_uniform = _stored_branches(uniform_model, uniform, ids)
        assert len(stored_uniform) <= keep
        worst_uniform = max(worst_uniform, total_uniform)
    assert needed > 10  # the cut kept more than the bound in many steps: the bound did the work
    assert worst <= 1.05 * worst_uniform


def test_memory_bound_auto_follows_what_the_settings_buy():
    def bounded(**options) -> bool:
        return dropbp.apply(tiny_model("llama", layers=3), **options).memory_bound

    assert not bounded(drop_rate=0.5)
    assert bounded(drop_rate=0.75) and bounded(drop_rate=0.875)
    assert bounded(drop_rate=0.5, features=[dropbp.ChunkedLoss()])
    assert not bounded(drop_rate=0.875, memory_bound=False)
    assert bounded(drop_rate=0.5, memory_bound=True)
    with pytest.raises(TypeError, match="memory_bound must be True or False"):
        dropbp.apply(tiny_model("llama", layers=3), 0.5, memory_bound="yes")
    ctl = dropbp.apply(tiny_model("llama", layers=3), 0.5)
    assert ctl.schedule.max_kept_branches == 6
    ctl.memory_bound = True
    assert ctl.schedule.max_kept_branches == 3
    with pytest.raises(TypeError, match="memory_bound"):
        ctl.memory_bound = 1


def test_the_bound_leaves_nothing_behind_and_copies_clean():
    model = tiny_model("llama", layers=4)
    ctl = dropbp.apply(model, 0.875, seed=0)
    assert ctl.memory_bound
    pending = model(input_ids=batch(0), labels=batch(0)).loss  # forward over: no layer keeps a patch
    assert all("forward" not in vars(m) for m in model.modules() if m is not model)
    twin = copy.deepcopy(model)
    pending.backward()
    assert all("forward" not in vars(m) for m in twin.modules())
    ctl.remove()
    assert all("forward" not in vars(m) for m in model.modules())


@pytest.mark.parametrize("drop_rate", [0.5, 0.875])
def test_trainer_with_gradient_checkpointing_trains_as_without(tmp_path, drop_rate):
    """Checkpointing recomputes exactly: the same run's losses, step by step, with the Trainer's
    ``gradient_checkpointing=True`` and without (at 0.875 with the bound in force as well)."""
    from test_hf_integration import _trainer

    from dropbp.integrations.hf import attach

    losses = {}
    for checkpointing in (False, True):
        kw = dict(logging_steps=1, gradient_accumulation_steps=2, max_steps=8)
        kw["output_dir"] = str(tmp_path / str(checkpointing))
        if checkpointing:
            kw.update(gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False})
        trainer = _trainer(tmp_path, **kw)
        callback = attach(trainer, drop_rate=drop_rate, warmup=0)
        trainer.train()
        assert callback.controller.memory_bound == (drop_rate >= 0.75)
        losses[checkpointing] = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert len(losses[False]) == 8
    assert losses[True] == pytest.approx(losses[False], rel=1e-5, abs=0)


def test_inputs_of_checkpointed_layers_count_against_the_bound():
    from dropbp.execution.bound import INPUTS_PER_BRANCH, MemoryBound

    model = tiny_model("llama", layers=30)
    ctl = dropbp.apply(model, 0.875, memory_bound=False)
    bound = MemoryBound(model, [b.name for b in ctl.branches], [b.module for b in ctl.branches], ctl.backend)
    ctl.remove()
    assert INPUTS_PER_BRANCH == 8
    # every branch kept, bound 8: 28 layers checkpointed, so 4 branches store theirs and 28 inputs count as 4
    assert bound.select(frozenset(), 8) == tuple(range(28))
    # the top 7 layers kept (14 branches): 3 checkpointed leave 8 stored + 1 for inputs, too many; 4 leave 6 + 1
    assert bound.select(frozenset(range(46)), 8) == (23, 24, 25, 26)
    assert bound.select(frozenset(range(52)), 8) == ()  # within the bound: nothing checkpointed
