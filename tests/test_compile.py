"""torch.compile with ``dropbp.execution.compile_guards.compile_branches``: over 50 training steps the number of
compiled graphs stays within two per branch type (kept: grad on, dropped: no_grad), counted with Dynamo's own
counters, and the gradients equal eager gradients for the same pattern."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import assert_same_grads, batch, detach_outputs, loss_and_grads, tiny_model
from torch._dynamo.utils import counters, get_compilation_metrics

import dropbp
from dropbp.execution.compile_guards import compile_branches

STEPS = 50


@pytest.fixture
def fresh_dynamo():
    """A reset Dynamo with room for the recompilations transformers itself causes: from transformers 5.24 one
    deprecation wrapper's code object wraps both the causal-LM and the base model's forward, so Dynamo compiles
    it once per caller and grad mode and, past its default limit of 8, runs that frame eagerly - which would
    hide the compiled behaviour these tests check (seen in CI on 2026-11-24)."""
    torch._dynamo.reset()
    counters.clear()
    with torch._dynamo.config.patch(recompile_limit=64):
        yield
    torch._dynamo.reset()


def test_compiled_branches_stay_within_their_recompile_bound(fresh_dynamo):
    model = tiny_model("llama", layers=3, use_cache=False)
    eager = copy.deepcopy(model)
    ctl = dropbp.apply(model, 0.5, seed=0)
    compile_branches(ctl)  # inductor, the default
    bound = 2 * len({type(b.module) for b in ctl.branches})  # attention and MLP: 4
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    graphs, patterns = [], set()
    for step in range(STEPS):
        ids = batch(step)
        _, grads = loss_and_grads(model, ids)
        patterns.add(ctl.last_dropped)
        graphs.append(counters["stats"]["unique_graphs"])
        if step < 4 or step % 10 == 0:  # both variants of every branch appear in the first steps
            eager.load_state_dict(model.state_dict())
            handles = detach_outputs(eager, ctl.last_dropped)
            _, eager_grads = loss_and_grads(eager, ids)
            for h in handles:
                h.remove()
            assert_same_grads(grads, eager_grads, atol=1e-5)
        optimizer.step()
    recompiles = [m.recompile_reason for m in get_compilation_metrics() if m.recompile_reason]
    print(f"\n{len(patterns)} patterns in {STEPS} steps: {graphs[-1]} graphs, {len(recompiles)} recompiles")
    assert len(patterns) > bound  # many patterns, few graphs
    assert graphs[-1] <= bound and graphs[-1] == graphs[4]
    assert len(recompiles) <= bound // 2 and all("grad_mode" in r for r in recompiles)


def _compile_warnings(record) -> list:
    return [w for w in record if issubclass(w.category, RuntimeWarning) and "compile_branches" in str(w.message)]


@pytest.mark.parametrize("how", ["torch.compile(model)", "model.compile()", "layers"])
def test_compiling_around_the_branches_says_once_to_compile_the_branches(fresh_dynamo, how):
    """Whole-model or whole-layer compilation gives a norm in front of a dropped branch a zero gradient, not
    none (unlike eager): the first compiled training forward warns, once, naming compile_branches."""
    model = tiny_model("llama", layers=2, use_cache=False)
    ctl = dropbp.apply(model, 0.5, seed=0, pattern="uniform")
    ctl.set_rates([0.0, 0.5, 0.0, 0.0])  # layer 0's MLP drops in some steps
    if how == "torch.compile(model)":
        compiled = torch.compile(model, backend="aot_eager")
    elif how == "model.compile()":
        model.compile(backend="aot_eager")
        compiled = model
    else:
        for layer in model.model.layers:
            layer.compile(backend="aot_eager")
        compiled = model
    ids = batch()
    with pytest.warns() as record:
        model.eval()
        with torch.no_grad():
            compiled(input_ids=ids)  # an evaluation: nothing to warn about
        assert _compile_warnings(record) == []
        model.train()
        norms = []
        for step in range(4):
            model.zero_grad(set_to_none=True)
            compiled(input_ids=batch(step), labels=batch(step)).loss.backward()
            if "model.layers.0.mlp" in ctl.last_dropped:
                norms.append(model.model.layers[0].post_attention_layernorm.weight.grad)
    assert len(_compile_warnings(record)) == 1
    assert norms and all(g is not None and not g.any() for g in norms)  # what the warning is about


def test_compiled_branches_or_eager_forwards_do_not_warn(fresh_dynamo, recwarn):
    model = tiny_model("llama", layers=2, use_cache=False)
    ctl = dropbp.apply(model, 0.5, seed=0, pattern="uniform")
    ctl.set_rates([0.0, 0.5, 0.0, 0.0])
    for step in range(2):
        loss_and_grads(model, batch(step))  # eager
    compile_branches(ctl, backend="aot_eager")
    for step in range(4):
        _, grads = loss_and_grads(model, batch(step))
        if "model.layers.0.mlp" in ctl.last_dropped:
            assert grads["model.layers.0.post_attention_layernorm.weight"] is None  # exact, as eager
    assert _compile_warnings(recwarn) == []
