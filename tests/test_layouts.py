"""Post-norm decoders and mixture-of-experts layers: what a dropped branch is.

A branch is everything between the residual read and the residual add. In post-norm decoders
(gemma2, olmo2) the norm applied to a branch's output before the add belongs to it, so the
hand-written reference here detaches what is really added to the residual: the post-norm's output.
Mixture-of-experts MLPs (mixtral, qwen3_moe) are branches like any MLP; their cost counts only the
experts a token runs through.
"""

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
from dropbp.execution.discovery import branch_flops

_SHAPE = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
LAYOUTS = {
    "gemma2": _SHAPE,
    "olmo2": _SHAPE,
    "mixtral": dict(_SHAPE, num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": dict(_SHAPE, moe_intermediate_size=48, num_experts=4, num_experts_per_tok=2),
}
# What the residual add receives from each branch of a post-norm decoder, by the branch's child
# name (hand-written); elsewhere it is the branch's own output.
RESIDUAL_INPUT = {
    "gemma2": {"self_attn": "post_attention_layernorm", "mlp": "post_feedforward_layernorm"},
    "olmo2": {"self_attn": "post_attention_layernorm", "mlp": "post_feedforward_layernorm"},
}


def _model(arch: str, method: str = "full"):
    model = tiny_model(arch, layers=3, **LAYOUTS[arch])
    return with_lora(model) if method == "lora" else model


def _added(arch: str, branch: str) -> str:
    layer, child = branch.rsplit(".", 1)
    return f"{layer}.{RESIDUAL_INPUT[arch][child]}" if arch in RESIDUAL_INPUT else branch


@pytest.mark.parametrize("pattern", ["cut", "uniform"])
@pytest.mark.parametrize("method", ["full", "lora"])
@pytest.mark.parametrize("arch", sorted(LAYOUTS))
def test_gradients_equal_reference_detaching_what_the_residual_receives(arch, method, pattern):
    model = _model(arch, method)
    reference = copy.deepcopy(model)
    ctl = dropbp.apply(model, 0.5, seed=3, pattern=pattern)
    seen = set()
    for step in range(4):
        ids = batch(step)
        loss, grads = loss_and_grads(model, ids)
        dropped = ctl.last_dropped
        seen.add(bool(dropped))
        handles = detach_outputs(reference, tuple(_added(arch, n) for n in dropped))
        ref_loss, ref_grads = loss_and_grads(reference, ids)
        for h in handles:
            h.remove()
        assert torch.equal(loss, ref_loss)
        assert_same_grads(grads, ref_grads)
        for name in dropped:  # the post-norm of a dropped branch gets nothing (full: its weight)
            post = _added(arch, name)
            assert all(grads[n] is None for n in grads if n.removeprefix("base_model.model.").startswith(post + "."))
    assert True in seen


@pytest.mark.parametrize("arch", ["gemma2", "olmo2"])
def test_post_norm_is_part_of_the_branch(arch):
    ctl = dropbp.apply(_model(arch), 0.5, pattern="uniform")
    modules = dict(ctl.model.named_modules())
    for b in ctl.branches:
        assert b.tail == (modules[_added(arch, b.name)],)
        assert b.parts == (modules[b.name], modules[_added(arch, b.name)])


@pytest.mark.parametrize("arch", ["gemma2", "olmo2"])
def test_importance_weights_apply_at_the_residual_add(arch):
    """ImportanceWeights: the weight covers the branch up to the residual add, so the post-norm's own weight gets the
    weighted gradient too; everything else gets the detached reference's."""
    model = _model(arch)
    reference = copy.deepcopy(model)
    weights = [dropbp.experimental.ImportanceWeights()]
    ctl = dropbp.apply(model, 0.5, seed=4, features=weights, pattern="uniform")
    ctl.set_rates([0.2, 0.6, 0.5, 0.4, 0.3, 0.7])
    rates = {b.name: b.rate for b in ctl.branches}
    for step in range(3):
        ids = batch(step)
        loss, grads = loss_and_grads(model, ids)
        dropped = ctl.last_dropped
        handles = detach_outputs(reference, tuple(_added(arch, n) for n in dropped))
        ref_loss, ref_grads = loss_and_grads(reference, ids)
        for h in handles:
            h.remove()
        for name in set(rates) - set(dropped):
            weight_branch_grads(ref_grads, name, 1 / (1 - rates[name]), (_added(arch, name),))
        assert torch.equal(loss, ref_loss)
        assert_same_grads(grads, ref_grads, atol=1e-5)


def test_zero_fill_covers_the_post_norm():
    """DroppedGradFill("zero"): the optimizer sees a zero gradient for every parameter of a dropped
    branch, its post-norm included (not a real gradient, not None)."""
    model = _model("gemma2")
    ctl = dropbp.apply(model, 0.5, seed=3, features=[dropbp.experimental.DroppedGradFill("zero")], pattern="uniform")
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    loss_and_grads(model, batch())
    opt.step()
    params = dict(model.named_parameters())
    for name in ctl.last_dropped:
        post = _added("gemma2", name)
        for pname in [n for n in params if n.startswith(post + ".") or n.startswith(name + ".")]:
            assert params[pname].grad is not None and not params[pname].grad.any(), pname


def test_calibration_measures_post_norm_branches():
    """Dropping a branch with a post-norm removes its norm's gradient too, so calibration (the
    gradient change from dropping one branch) measures each branch at the residual add: one-pass
    equals the research code's N + 1 passes."""
    model = _model("olmo2")
    ctl = dropbp.apply(model, 0.5, pattern="uniform")
    ids = batch()
    fast = ctl.calibrate(lambda: model(input_ids=ids, labels=ids).loss)
    with dropbp.experimental.exact_recompute():
        slow = ctl.calibrate(lambda: model(input_ids=ids, labels=ids).loss)
    torch.testing.assert_close(torch.tensor(fast), torch.tensor(slow), rtol=1e-4, atol=1e-12)


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_moe_cost_counts_only_the_experts_a_token_runs_through(arch):
    model = _model(arch)
    ctl = dropbp.apply(model, 0.5, pattern="uniform")
    mlp = ctl.branches[1]
    experts = dict(mlp.module.named_modules())["experts"]
    expert_weights = sum(p.numel() for p in experts.parameters())
    router = sum(  # a linear in transformers 4, its own module in 5
        m.in_features * m.out_features
        for n, m in mlp.module.named_modules()
        if isinstance(m, torch.nn.Linear) and "experts" not in n.split(".")
    )
    assert mlp.flops == pytest.approx(2.0 * (expert_weights * 2 / 4 + router))  # top-2 of 4 experts
    assert branch_flops(mlp.module, "mlp", 12, None) == pytest.approx(2.0 * (expert_weights + router))
