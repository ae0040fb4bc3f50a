"""Scripts written for the research code run unchanged: DropBP layers + DropBPHandler."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from dropbp import allocate_rates
from dropbp.handler import DropBPHandler
from dropbp.layer import DropBP


class Block(nn.Module):
    """A transformer-shaped block edited the research-code way."""

    def __init__(self, h: int = 8) -> None:
        super().__init__()
        self.attn = nn.Linear(h, h)
        self.mlp = nn.Sequential(nn.Linear(h, 4 * h), nn.GELU(), nn.Linear(4 * h, h))
        self.dropbp_attn = DropBP(flops=h * h)
        self.dropbp_mlp = DropBP(flops=8 * h * h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.dropbp_attn(self.attn(x)) + x
        return self.dropbp_mlp(self.mlp(x)) + x


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(Block(), Block(), Block()).train()


def test_layer_semantics():
    layer = DropBP(flops=10, p=1)
    x = torch.ones(2, requires_grad=True)
    assert not layer(x).requires_grad and layer.is_detach and layer.count == 1
    layer.p = 0
    assert layer(x).requires_grad and not layer.is_detach
    layer.p = 1
    layer.eval()
    assert layer(x) is x


def test_handler_rates_and_errors():
    model = _model()
    handler = DropBPHandler(model, 0.5)
    assert handler.num_layers == 6 and handler.drop_rates == [0.5] * 6
    handler.set_initial_drop_rate()
    assert [m.p for m in model.modules() if isinstance(m, DropBP)] == [0.5] * 6
    handler.set_initial_drop_rate(0.2)
    assert {m.p for m in model.modules() if isinstance(m, DropBP)} == {0.2}
    with pytest.raises(ValueError, match=r"number of drop rates \(2\) does not match.*\(6\)"):
        handler.set_diverse_drop_rate([0.1, 0.2])
    assert handler.extract_flops() == [64, 512] * 3


def test_set_dropped_layers_reaches_the_target():
    random.seed(0)
    model = _model()
    handler = DropBPHandler(model, 0.5)
    for _ in range(50):
        handler.set_dropped_layers()
        ps = [m.p for m in model.modules() if isinstance(m, DropBP)]
        assert set(ps) <= {0, 1} and sum(ps) >= 3


def test_sensitivity_based_drop_bp_and_training_loop(capsys, caplog):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(16, 8), torch.randn(16, 8)
    handler = DropBPHandler(model, 0.5)
    handler.set_initial_drop_rate()

    def backprop():
        out = model(x)
        loss = (out - y).square().mean()
        opt.zero_grad()
        loss.backward()

    with caplog.at_level("INFO", logger="dropbp"):
        sens, rates = handler.sensitivity_based_drop_bp(backprop, 0.5)
    assert len(sens) == 6 and all(s >= 0 for s in sens) and max(s > 0 for s in sens)
    assert rates == allocate_rates(sens, handler.extract_flops(), 0.5)
    assert "sensitivity" in caplog.text and capsys.readouterr().out == ""  # logged, not printed
    # the old training loop, verbatim in shape
    for _ in range(5):
        handler.set_dropped_layers()
        loss = (model(x) - y).square().mean()
        if not handler.detact_non_grad():
            loss.backward()
        opt.step()
        opt.zero_grad()
    assert sum(handler.extract_count()) > 0


def test_detact_non_grad_reports_all_dropped():
    model = _model()
    handler = DropBPHandler(model, 0.5)
    handler.set_diverse_drop_rate([1] * 6)
    loss = model(torch.randn(2, 8)).sum()
    assert handler.detact_non_grad() and not loss.requires_grad
