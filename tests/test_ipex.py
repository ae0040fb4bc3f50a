"""The CPU backend with the real Intel Extension for PyTorch, not a stand-in.

IPEX 2.8.0, its last release, needs torch 2.8, older than dropbp's declared torch>=2.11, so these tests
run in an environment of their own, built by ``ci/ipex.sh`` (not part of CI); elsewhere they skip, with
the reason. IPEX is never imported here unless it matches torch: a mismatched IPEX ends the process.
"""

from __future__ import annotations

import importlib.metadata
import logging

import pytest
import torch
from conftest import assert_same_grads, batch, detach_outputs, tiny_model, with_lora

import dropbp
from dropbp import backends
from dropbp.tools.device_tools import tools_for


def _skip_reason() -> str | None:
    try:
        version = importlib.metadata.version("intel_extension_for_pytorch")
    except importlib.metadata.PackageNotFoundError:
        return "intel_extension_for_pytorch is not installed (ci/ipex.sh builds .venv-ipex with it)"
    if version.split(".")[:2] != torch.__version__.split("+")[0].split(".")[:2]:
        return f"intel_extension_for_pytorch {version} does not match torch {torch.__version__} (ci/ipex.sh)"
    return None


if (_reason := _skip_reason()) is not None:
    pytest.skip(_reason, allow_module_level=True)
ipex = pytest.importorskip("intel_extension_for_pytorch")
IPEXLinear = ipex.nn.utils._weight_prepack._IPEXLinear


@pytest.fixture(autouse=True)
def _cpu_backend_with_fresh_ipex(monkeypatch):
    monkeypatch.setenv("DROPBP_BACKEND", "cpu")
    backends.cpu.ipex.cache_clear()
    yield
    backends.cpu.ipex.cache_clear()


def _prepared(arch: str, method: str):
    """A tiny model and its AdamW through ``backend.prepare``, as examples/finetune.py does."""
    model = tiny_model(arch, layers=3)
    model = with_lora(model) if method == "lora" else model
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    return backends.get().prepare(model, optimizer)


def test_backend_applies_the_real_ipex_optimize(caplog):
    caplog.set_level(logging.INFO, logger="dropbp")
    backend = backends.get()
    assert backend.name == "cpu" and backends.cpu.ipex() is ipex
    model, optimizer = _prepared("llama", "full")
    layer = model.model.layers[0]
    # ipex.optimize(dtype=bf16) in training mode: linear layers prepacked in bf16, optimizer wrapped for
    # the fp32 master weights
    linears = [layer.self_attn.q_proj, layer.self_attn.o_proj, layer.mlp.gate_proj, layer.mlp.down_proj]
    assert all(type(m) is IPEXLinear and m.weight.dtype == torch.bfloat16 for m in linears)
    assert optimizer is not None and hasattr(optimizer, "params_attr")
    assert tools_for(backend).environment()["intel_extension_for_pytorch"] == ipex.__version__
    messages = [r.getMessage() for r in caplog.records if r.name == "dropbp"]
    assert messages == [f"cpu backend: using intel_extension_for_pytorch {ipex.__version__} (ipex.optimize)"]


@pytest.mark.parametrize("method", ["full", "lora"])
@pytest.mark.parametrize("arch", ["llama", "gpt2", "gpt_neox", "qwen2"])
def test_training_steps_under_ipex_equal_the_detached_reference(arch, method):
    """bf16 autocast forwards, backwards and IPEX's optimizer steps: dropbp's gradients and updated
    weights equal those of the same IPEX model with the dropped branch outputs detached by hand."""
    model, optimizer = _prepared(arch, method)
    reference, ref_optimizer = _prepared(arch, method)
    backend = backends.get()
    ctl = dropbp.apply(model, 0.5, seed=3, pattern="uniform", backend=backend)
    assert len(ctl.branches) == 6
    seen_drop = seen_keep = False
    for step in range(4):
        ids = batch(step)
        torch.manual_seed(123)
        with backend.autocast():
            loss = model(input_ids=ids, labels=ids).loss
        assert ctl.backward(loss)
        dropped = ctl.last_dropped
        seen_drop |= bool(dropped)
        seen_keep |= len(dropped) < len(ctl.branches)
        handles = detach_outputs(reference, dropped)
        torch.manual_seed(123)
        with backend.autocast():
            ref_loss = reference(input_ids=ids, labels=ids).loss
        ref_loss.backward()
        for handle in handles:
            handle.remove()
        assert torch.equal(loss, ref_loss)
        assert_same_grads(_grads(model), _grads(reference), atol=0)
        ctl.optimizer_step(optimizer)
        ref_optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        ref_optimizer.zero_grad(set_to_none=True)
        assert_same_grads(_weights(model), _weights(reference), atol=0)
    assert seen_drop and seen_keep


def _grads(model: torch.nn.Module) -> dict:
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def _weights(model: torch.nn.Module) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("training", [True, False], ids=["train-without-optimizer", "eval-with-optimizer"])
def test_ipex_cannot_take_the_pair_plain_pytorch_and_one_log_line(training, caplog):
    """ipex.optimize asserts train mode with an optimizer, or eval mode without one; ``dropbp check``
    prepares a training model alone. Any other pair stays on plain PyTorch and says why."""
    caplog.set_level(logging.INFO, logger="dropbp")
    model = tiny_model("llama").train(training)
    optimizer = None if training else torch.optim.SGD(model.parameters(), lr=0.1)
    assert backends.get().prepare(model, optimizer) == (model, optimizer)
    assert not any(isinstance(m, IPEXLinear) for m in model.modules())
    mode, given = ("training", "without") if training else ("eval", "with")
    assert [r.getMessage() for r in caplog.records if r.name == "dropbp"][-1] == (
        f"cpu backend: ipex.optimize takes a model in training mode with its optimizer, or one in eval mode "
        f"without; got one in {mode} mode {given} an optimizer, so it stays on plain PyTorch"
    )
