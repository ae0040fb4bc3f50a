"""A dropped step's gradients are exactly those of the unmodified model with the dropped branch
outputs detached, for real Hugging Face architectures, full fine-tuning and LoRA."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import (
    assert_same_grads,
    batch,
    detach_outputs,
    loss_and_grads,
    tiny_model,
    weight_branch_grads,
    with_lora,
)

import dropbp

ARCHS = ["llama", "gpt2", "gpt_neox", "qwen2"]
METHODS = ["full", "lora"]


def _model(arch: str, method: str):
    model = tiny_model(arch, layers=3)
    return with_lora(model) if method == "lora" else model


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("arch", ARCHS)
def test_gradients_equal_detached_reference(arch, method):
    model = _model(arch, method)
    reference = copy.deepcopy(model)
    ctl = dropbp.apply(model, 0.5, seed=3, pattern="uniform")
    seen_drop = seen_keep = False
    for step in range(4):
        ids = batch(step)
        loss, grads = loss_and_grads(model, ids)
        dropped = ctl.last_dropped
        assert dropped == ctl.dropped_at(step)
        seen_drop |= bool(dropped)
        seen_keep |= len(dropped) < len(ctl.branches)
        handles = detach_outputs(reference, dropped)
        ref_loss, ref_grads = loss_and_grads(reference, ids)
        for h in handles:
            h.remove()
        assert torch.equal(loss, ref_loss)
        assert_same_grads(grads, ref_grads)
    assert seen_drop and seen_keep


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("arch", ARCHS)
def test_drop_rate_zero_changes_nothing(arch, method):
    model = _model(arch, method)
    reference = copy.deepcopy(model)
    ctl = dropbp.apply(model, 0.0, pattern="uniform")
    ids = batch()
    loss, grads = loss_and_grads(model, ids)
    ref_loss, ref_grads = loss_and_grads(reference, ids)
    assert ctl.last_dropped == ()
    assert torch.equal(loss, ref_loss)
    assert_same_grads(grads, ref_grads, atol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_eval_mode_drops_nothing(arch):
    model = tiny_model(arch)
    reference = copy.deepcopy(model).eval()
    ctl = dropbp.apply(model, 0.6, pattern="uniform")
    model.eval()
    ids = batch()
    loss, grads = loss_and_grads(model, ids)
    ref_loss, ref_grads = loss_and_grads(reference, ids)
    assert ctl.step == 0 and ctl.last_dropped == ()
    assert torch.equal(loss, ref_loss)
    assert_same_grads(grads, ref_grads, atol=0)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("arch", ARCHS)
def test_remove_restores_model_exactly(arch, method):
    model = _model(arch, method)
    reference = copy.deepcopy(model)
    hooks_before = {n: (dict(m._forward_pre_hooks), dict(m._forward_hooks)) for n, m in model.named_modules()}
    ctl = dropbp.apply(model, 0.5, pattern="uniform")
    loss_and_grads(model, batch())
    ctl.remove()
    hooks_after = {n: (dict(m._forward_pre_hooks), dict(m._forward_hooks)) for n, m in model.named_modules()}
    assert hooks_after == hooks_before
    ids = batch(1)
    loss, grads = loss_and_grads(model, ids)
    ref_loss, ref_grads = loss_and_grads(reference, ids)
    assert torch.equal(loss, ref_loss)
    assert_same_grads(grads, ref_grads, atol=0)
    dropbp.apply(model, 0.5, pattern="uniform").remove()  # attachable again after removal


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("arch", ARCHS)
def test_gradient_checkpointing_sees_same_pattern(arch, method, reentrant):
    plain = _model(arch, method)
    checkpointed = copy.deepcopy(plain)
    checkpointed.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    if reentrant and method == "lora":
        checkpointed.enable_input_require_grads()  # reentrant checkpointing needs an input with grad
    ctl_plain = dropbp.apply(plain, 0.5, seed=5, pattern="uniform")
    ctl_ckpt = dropbp.apply(checkpointed, 0.5, seed=5, pattern="uniform")
    for step in range(3):
        ids = batch(step)
        loss, grads = loss_and_grads(plain, ids)
        ck_loss, ck_grads = loss_and_grads(checkpointed, ids)
        assert ctl_plain.last_dropped == ctl_ckpt.last_dropped
        torch.testing.assert_close(ck_loss, loss, atol=1e-6, rtol=0)
        assert_same_grads(ck_grads, grads)


def test_dropped_branch_builds_no_graph():
    model = tiny_model("llama")
    ctl = dropbp.apply(model, 0.5, seed=1, pattern="uniform")
    modules = dict(model.named_modules())
    inside: list[str] = []
    saved: dict[str, int] = {b.name: 0 for b in ctl.branches}
    outputs: dict[str, bool] = {}
    for b in ctl.branches:
        m = modules[b.name]
        m.register_forward_pre_hook(lambda mod, args, n=b.name: inside.append(n))

        def after(mod, args, out, n=b.name):
            inside.pop()
            outputs[n] = (out[0] if isinstance(out, tuple) else out).requires_grad

        m.register_forward_hook(after)

    def pack(t):
        if inside:
            saved[inside[-1]] += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=batch(), labels=batch()).loss.backward()
    dropped = set(ctl.last_dropped)
    assert dropped and len(dropped) < len(ctl.branches)
    for name in saved:
        if name in dropped:
            assert saved[name] == 0 and outputs[name] is False, name
        else:
            assert saved[name] > 0 and outputs[name] is True, name


def test_custom_model_with_explicit_branches():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = torch.nn.Linear(8, 8)
            self.ff = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))

        def forward(self, x):
            x = x + self.attn(x)
            return x + self.ff(x)

    model = torch.nn.Sequential(Block(), Block(), Block())
    reference = copy.deepcopy(model)
    names = ["2.ff", "0.attn", "0.ff", "1.attn", "1.ff", "2.attn"]
    ctl = dropbp.apply(model, 0.5, branches=names, seed=2, pattern="uniform")
    assert [b.name for b in ctl.branches] == ["0.attn", "0.ff", "1.attn", "1.ff", "2.attn", "2.ff"]
    assert [b.kind for b in ctl.branches] == ["attn", "mlp"] * 3
    assert ctl.branches[1].flops == 2.0 * (8 * 16 + 16 * 8)
    x = torch.randn(4, 8)
    for _ in range(3):
        model.zero_grad()
        model(x).square().mean().backward()
        got = {n: p.grad for n, p in model.named_parameters()}
        handles = detach_outputs(reference, ctl.last_dropped)
        reference.zero_grad(set_to_none=True)
        reference(x).square().mean().backward()
        for h in handles:
            h.remove()
        assert_same_grads(got, {n: p.grad for n, p in reference.named_parameters()})


@pytest.mark.parametrize("method", METHODS)
def test_importance_weights_equal_scaled_reference(method):
    """ImportanceWeights (0.3's unbiased=True): a kept branch's own parameters get its detached-reference gradient
    times 1 / (1 - rate); every other parameter, the residual stream included, gets the detached reference's
    unscaled."""
    model = _model("llama", method)
    reference = copy.deepcopy(model)
    weights = dropbp.experimental.ImportanceWeights()
    ctl = dropbp.apply(model, 0.5, seed=3, features=[weights], pattern="uniform")
    ctl.set_rates([0.2, 0.6, 0.5, 0.4, 0.3, 0.7])
    rates = {b.name: b.rate for b in ctl.branches}
    for step in range(3):
        ids = batch(step)
        loss, grads = loss_and_grads(model, ids)
        dropped = ctl.last_dropped
        handles = detach_outputs(reference, dropped)
        ref_loss, ref_grads = loss_and_grads(reference, ids)
        for h in handles:
            h.remove()
        for name in set(rates) - set(dropped):
            weight_branch_grads(ref_grads, name, 1 / (1 - rates[name]))
        assert torch.equal(loss, ref_loss)
        assert_same_grads(grads, ref_grads, atol=1e-5)
    assert ctl.features["importance_weights"] is weights
    ctl.replace_options(features=[])  # and calibration always measures plain gradients
    assert not weights.attached
    plain = dropbp.apply(copy.deepcopy(reference), 0.5, pattern="uniform")
    ids = batch(9)
    torch.manual_seed(0)
    a = ctl.calibrate(lambda: model(input_ids=ids, labels=ids).loss)
    torch.manual_seed(0)
    b = plain.calibrate(lambda: plain.model(input_ids=ids, labels=ids).loss)
    assert a == pytest.approx(b, rel=1e-4)
