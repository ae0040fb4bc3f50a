"""Saved-activation accounting (dropbp.tools.memory): exact bytes, split by branch, for fixed patterns."""

from __future__ import annotations

import pytest
import torch
from conftest import batch, tiny_model, with_lora
from torch import nn

import dropbp
from dropbp.tools.memory import branch_bytes, saved_bytes

# attention of layer 0, MLP of layers 1 and 2: one attention branch stays kept in every layer but 0
PATTERN = (0, 3, 5)


def _ctl(arch: str, method: str):
    model = tiny_model(arch, layers=3)
    if method == "lora":
        model = with_lora(model)
    return model, dropbp.apply(model, 0.0, pattern="uniform")


@pytest.mark.parametrize("method", ["full", "lora"])
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_dropped_pattern_saves_full_minus_its_branches(arch, method):
    model, ctl = _ctl(arch, method)
    ids = batch()
    full = saved_bytes(ctl, ids)
    freed = branch_bytes(ctl, ids)
    got = saved_bytes(ctl, ids, PATTERN)
    assert got.total == full.total - sum(freed[i] for i in PATTERN)
    assert got.saved_by_dropping == sum(freed[i] for i in PATTERN)
    assert got.full_total == full.total
    # kept branches keep exactly what they kept under full backprop; dropped ones keep nothing
    for i, b in enumerate(got.branches):
        assert b == (0 if i in PATTERN else full.branches[i])
    assert got.dropped_packs == 0
    assert got.dropped == tuple(ctl.branches[i].name for i in PATTERN)
    # dropping a branch frees at least its own saved tensors (and those of its pre-norm)
    assert all(f >= b > 0 for f, b in zip(freed, full.branches, strict=True))
    assert full.rest > 0 and got.rest == got.total - got.kept


def test_by_name_equals_by_index():
    model, ctl = _ctl("llama", "full")
    ids = batch()
    names = [ctl.branches[i].name for i in PATTERN]
    assert saved_bytes(ctl, ids, names) == saved_bytes(model, ids, PATTERN)


class _TwoBranches(nn.Module):
    """x0 = x * s; h1 = x0 + A(x0); h2 = h1 + B(h1): every saved tensor is known by hand."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(width))
        self.a = nn.Linear(width, width, bias=False)
        self.b = nn.Linear(width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x0 = x * self.scale  # saves x (the parameter is left out of the count)
        h1 = x0 + self.a(x0)  # the linear saves x0
        return h1 + self.b(h1)  # the linear saves h1


def test_bytes_match_a_hand_count():
    model = _TwoBranches(8).train()
    ctl = dropbp.apply(model, 0.0, branches=["a", "b"], pattern="uniform")
    x = torch.randn(2, 8)
    one = 2 * 8 * 4  # one float32 activation
    closure = lambda: model(x).sum()  # noqa: E731
    full = saved_bytes(ctl, closure)
    assert (full.total, full.branches, full.rest) == (3 * one, (one, one), one)
    drop_b = saved_bytes(ctl, closure, ["b"])
    assert (drop_b.total, drop_b.branches, drop_b.saved_by_dropping) == (2 * one, (one, 0), one)
    drop_a = saved_bytes(ctl, closure, [0])
    assert (drop_a.total, drop_a.branches) == (2 * one, (0, one))  # x (the mul's) and h1 (B's input)
    assert branch_bytes(ctl, closure) == [one, one]


def test_takes_no_step_and_leaves_grads_alone():
    model, ctl = _ctl("llama", "full")
    saved_bytes(ctl, batch(), PATTERN)
    assert ctl.step == 0 and ctl.last_dropped == ()
    assert all(p.grad is None for p in model.parameters())


def test_bad_input_is_refused_clearly():
    model = tiny_model("llama", layers=2)
    with pytest.raises(ValueError, match="dropbp.apply"):
        saved_bytes(model, batch())
    ctl = dropbp.apply(model, 0.0, pattern="uniform")
    with pytest.raises(ValueError, match="not a branch"):
        saved_bytes(ctl, batch(), ["model.layers.0"])
    with pytest.raises(ValueError, match="index"):
        saved_bytes(ctl, batch(), [99])
    with pytest.raises(TypeError, match="collection"):
        saved_bytes(ctl, batch(), "model.layers.0.mlp")
    model.eval()
    with pytest.raises(RuntimeError, match="model.train"):
        saved_bytes(ctl, batch())
