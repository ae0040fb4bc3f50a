"""torch.compile with ``dropbp.compile.compile_branches``: over 50 training steps the number of compiled
graphs stays within two per branch type (kept: grad on, dropped: no_grad), counted with Dynamo's own
counters, and the gradients equal eager gradients for the same pattern."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import assert_same_grads, batch, detach_outputs, loss_and_grads, tiny_model
from torch._dynamo.utils import counters, get_compilation_metrics

import dropbp
from dropbp.compile import compile_branches

STEPS = 50


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
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
