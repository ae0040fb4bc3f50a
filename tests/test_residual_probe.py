"""Branches that add the residual themselves are refused (issue 41, item 3): BLOOM's attention and MLP and MPT's MLP
take the residual as an argument and return it plus their output. Dropped, such a branch cuts the residual stream
and the layers below it get no gradient, so the first training forward refuses it, naming it; the supported
architectures pass the same probe, which then leaves the model."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from conftest import assert_same_grads, batch, detach_outputs, loss_and_grads, tiny_model, with_lora

import dropbp

OWN_RESIDUAL = {
    "bloom": (dict(hidden_size=32, n_head=4), "BloomAttention|BloomMLP"),
    "mpt": (dict(d_model=32, n_heads=4), "MptMLP"),
}


@pytest.mark.parametrize("pattern", ["cut", "uniform"])
@pytest.mark.parametrize("arch", sorted(OWN_RESIDUAL))
def test_a_branch_that_takes_the_residual_is_refused_at_apply(arch, pattern):
    """BLOOM's and MPT's branches take the residual as an argument (``forward(hidden_states, residual)``): refused
    before any step, whatever the pattern shape. Reliability round 5 (G): the probe alone saw only calls with a graph,
    so an MPT MLP dropped at step 0 under uniform patterns was never probed and trained with the residual stream cut."""
    config, kind = OWN_RESIDUAL[arch]
    model = tiny_model(arch, layers=3, **config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "not among the tested architectures"
        with pytest.raises(ValueError, match=rf"branch '.+' \(({kind})\) adds the residual itself.*branches=\[") as e:
            dropbp.apply(model, 0.5, seed=0, warmup_steps=0, pattern=pattern)
    assert "x = x + f(x)" in str(e.value)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())  # nothing left attached


def test_a_branch_that_takes_the_residual_is_refused_whatever_the_settings():
    """Class G, drawn beyond the listed case: any drop rate, seed, pattern shape, warm-up and pattern bound - the
    refusal comes at ``apply``, before any step could drop such a branch, and leaves nothing attached."""
    hypothesis = pytest.importorskip("hypothesis")
    from hypothesis import given, settings
    from hypothesis import strategies as st

    @settings(max_examples=12, deadline=None, derandomize=True)
    @given(
        arch=st.sampled_from(sorted(OWN_RESIDUAL)),
        rate=st.sampled_from([0.1, 0.5, 0.75]),
        seed=st.integers(0, 50),
        pattern=st.sampled_from(["cut", "uniform"]),
        warmup=st.sampled_from([0, 4]),
        bound=st.sampled_from([None, 2, 16]),
    )
    def check(arch, rate, seed, pattern, warmup, bound):
        config, kind = OWN_RESIDUAL[arch]
        model = tiny_model(arch, layers=2, **config)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with pytest.raises(ValueError, match=rf"\(({kind})\) adds the residual itself"):
                dropbp.apply(model, rate, seed=seed, pattern=pattern, warmup_steps=warmup, max_patterns=bound)
        assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())

    assert hypothesis is not None
    check()


class _AddsItsInput(torch.nn.Module):
    """A branch that adds its input without naming it ``residual``: only its graph shows it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.lin(x)


def test_a_branch_that_adds_its_input_is_refused_at_its_first_call_with_a_graph():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), _AddsItsInput(), _AddsItsInput()).train()
    dropbp.apply(model, 0.0, branches=["1", "2"])
    for _ in range(2):  # refused again, not only once
        with pytest.raises(ValueError, match=r"branch '1' \(_AddsItsInput\) adds the residual itself"):
            model(torch.randn(2, 8))
    assert torch.is_grad_enabled()


def _own_reference_grads(model, names, ids):
    """Full backprop with the named modules' outputs detached: what a branch outside the residual add gives."""
    handles = detach_outputs(model, names)
    try:
        return loss_and_grads(model, ids)
    finally:
        for h in handles:
            h.remove()


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gpt_neox", "phi3", "qwen3_moe"])
@pytest.mark.parametrize("method", ["full", "lora"])
def test_supported_architectures_pass_the_probe_and_it_leaves(arch, method):
    extra = {}
    if arch == "qwen3_moe":
        extra = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
        extra.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    model = tiny_model(arch, layers=3, **extra)
    model = with_lora(model) if method == "lora" else model
    reference = copy.deepcopy(model)
    ctl = dropbp.apply(model, 0.5, seed=0, warmup_steps=0)
    probes = sum(len(b.module._forward_hooks) for b in ctl.branches)
    for step in range(12):  # every branch kept at least once (the bottom one at rate 0.75)
        loss, grads = loss_and_grads(model, batch(step))
        ref_loss, ref_grads = _own_reference_grads(reference, ctl.last_dropped, batch(step))
        assert_same_grads(grads, ref_grads)
    # once every branch was seen kept, the probe's hooks are gone
    assert sum(len(b.module._forward_hooks) for b in ctl.branches) == probes - len(ctl.branches)
