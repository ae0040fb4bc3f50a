"""Deep copies and pickles of a model under DropBP are clean: the model as it was before ``apply``
(no dropbp hook, no patched ``forward``), trainable exactly like an untouched one, and ``apply`` and
``remove`` work on them independently of the original, which keeps its controller."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from conftest import assert_same_grads, batch, loss_and_grads, tiny_model, with_lora
from test_checkpointing import Net

import dropbp
from dropbp.tools.arms import apply_arm


def _copy(model, how: str):
    if how == "deepcopy":
        return copy.deepcopy(model)
    if how == "pickle":
        return pickle.loads(pickle.dumps(model))
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def _extras(model) -> dict:
    """Per module: its hook ids and the instance attributes a copy could carry dropbp in."""
    return {
        name: (
            [list(getattr(m, d)) for d in ("_forward_pre_hooks", "_forward_hooks", "_forward_hooks_always_called")],
            {k for k in ("forward", "__getstate__") if k in vars(m)},
        )
        for name, m in model.named_modules()
    }


CASES = [
    (kind, how)
    for kind in ("full", "lora", "chunked_loss", "gpt2", "checkpointing_mid_step")
    for how in ("deepcopy", "pickle", "torch.save")
    if not (kind == "checkpointing_mid_step" and how != "deepcopy")  # HF's own checkpointing hook cannot pickle
]


@pytest.mark.parametrize(("kind", "how"), CASES)
def test_copy_is_clean_and_independent(kind, how):
    model = tiny_model("gpt2" if kind == "gpt2" else "llama", layers=3)
    model = with_lora(model) if kind == "lora" else model
    if kind == "checkpointing_mid_step":  # held outputs patch the dropped branches' forward until backward
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    untouched = copy.deepcopy(model)
    ctl = apply_arm(model, 0.5, seed=3, pattern="uniform", chunked_loss=kind == "chunked_loss")
    loss_and_grads(model, batch(0))
    pending = model(input_ids=batch(1), labels=batch(1)).loss  # a forward whose backward has not come yet
    if kind == "checkpointing_mid_step":
        assert any("forward" in vars(m) for m in model.modules() if m is not model)  # the model's: the guard
    twin = _copy(model, how)
    pending.backward()

    assert _extras(twin) == _extras(untouched)
    ids = batch(2)
    loss, grads = loss_and_grads(twin, ids)
    want_loss, want = loss_and_grads(untouched, ids)
    assert torch.equal(loss, want_loss)
    assert_same_grads(grads, want, atol=0)  # no pattern of the original's reaches the copy

    twin_ctl = dropbp.apply(twin, 0.5, seed=3, pattern="uniform")  # no second set of hooks: the first
    loss_and_grads(twin, ids)
    assert twin_ctl.step == 1 and ctl.step == 2
    loss_and_grads(model, ids)
    assert ctl.step == 3 and twin_ctl.step == 1
    twin_ctl.remove()
    assert _extras(twin) == _extras(untouched)
    ctl.remove()
    assert _extras(model) == _extras(untouched)


@pytest.mark.parametrize("how", ["pickle", "torch.save"])
def test_pickle_between_forward_and_backward_under_checkpointing(how):
    """Outputs held for the recomputation patch the branches' forward: a pickle leaves them out."""
    torch.manual_seed(0)
    model = Net(reentrant=False)
    untouched = copy.deepcopy(model)
    names = [f"blocks.{i}.{kind}" for i in range(3) for kind in ("attn", "mlp")]
    ctl = dropbp.apply(model, 0.5, branches=names, seed=1, pattern="uniform")
    x = torch.randn(4, 8)
    while not any("forward" in vars(m) for m in model.modules() if m is not model):  # a step that holds an output
        loss = model(x).sum()
    twin = _copy(model, how)
    loss.backward()
    assert _extras(twin) == _extras(untouched)
    torch.testing.assert_close(twin.eval()(x), untouched.eval()(x), atol=0, rtol=0)  # eval: no dropout
    ctl.remove()
