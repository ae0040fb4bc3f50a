"""Activation checkpointing with DropBP: a dropped branch's forward runs once per step (its output is
handed back to the recomputation), kept branches are recomputed as usual, gradients stay exactly those
of the detached reference, and nothing is held once the backward is over."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from conftest import assert_same_grads, batch, count_forwards, detach_outputs, loss_and_grads, tiny_model
from torch.utils.checkpoint import checkpoint

import dropbp


def _nothing_held(model: torch.nn.Module) -> bool:
    """No branch module carries the ``forward`` that hands a held output back (the model itself carries
    dropbp's interrupt guard for as long as dropbp is applied)."""
    return all("forward" not in vars(m) for m in model.modules() if m is not model)


def _check_steps(model, reference, ctl, counts, run, steps: int = 3) -> None:
    """Each step: dropped branches ran once, kept ones twice; gradients equal the reference's."""
    for step in range(steps):
        counts.clear()
        loss, grads = run(model, step)
        dropped = set(ctl.last_dropped)
        assert dropped and len(dropped) < len(ctl.branches)
        for b in ctl.branches:
            assert counts[b.name] == (1 if b.name in dropped else 2), (step, b.name, counts[b.name])
        handles = detach_outputs(reference, ctl.last_dropped)
        ref_loss, ref_grads = run(reference, step)
        for h in handles:
            h.remove()
        torch.testing.assert_close(loss, ref_loss, atol=1e-6, rtol=0)
        assert_same_grads(grads, ref_grads)
        assert _nothing_held(model)


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("arch", ["llama", "gpt2"])  # gpt2: dropout inside the branches
def test_hugging_face_checkpointing_runs_dropped_branches_once(arch, reentrant, monkeypatch):
    model = tiny_model(arch, layers=3)
    reference = copy.deepcopy(model)  # no checkpointing: the plain detached reference
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    ctl = dropbp.apply(model, 0.5, seed=1, pattern="uniform")
    modules = dict(model.named_modules())
    counts = count_forwards(monkeypatch, {b.name: modules[b.name] for b in ctl.branches})
    _check_steps(model, reference, ctl, counts, lambda m, step: loss_and_grads(m, batch(step)))


class Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.attn = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh())
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(width, 2 * width), torch.nn.Dropout(0.1), torch.nn.Linear(2 * width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x)
        return x + self.mlp(x)


class Net(torch.nn.Module):
    def __init__(self, reentrant: bool | None, width: int = 8, depth: int = 3) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(width) for _ in range(depth))
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x) if self.reentrant is None else checkpoint(block, x, use_reentrant=self.reentrant)
        return x


#: The branches of :class:`Net`, named for ``apply(branches=...)``.
NET_BRANCHES = [f"blocks.{i}.{kind}" for i in range(3) for kind in ("attn", "mlp")]


def net_and_reference(reentrant: bool) -> tuple[Net, Net]:
    """A :class:`Net` checkpointing its blocks, and an identical copy that does not (the reference)."""
    torch.manual_seed(0)
    model = Net(reentrant)
    reference = copy.deepcopy(model)
    reference.reentrant = None
    return model, reference


@pytest.mark.parametrize("reentrant", [False, True])
def test_torch_checkpoint_around_custom_blocks(reentrant, monkeypatch):
    model, reference = net_and_reference(reentrant)
    names = NET_BRANCHES
    ctl = dropbp.apply(model, 0.5, branches=names, seed=4, pattern="uniform")
    modules = dict(model.named_modules())
    counts = count_forwards(monkeypatch, {n: modules[n] for n in names})
    x = torch.randn(4, 8, requires_grad=True)

    def run(m, step):
        m.zero_grad(set_to_none=True)
        torch.manual_seed(step)  # the same dropout masks in both models
        loss = m(x).square().mean()
        loss.backward()
        return loss.detach(), {n: None if p.grad is None else p.grad.clone() for n, p in m.named_parameters()}

    _check_steps(model, reference, ctl, counts, run)


@pytest.mark.parametrize("checkpointing", [None, "non-reentrant", "reentrant"])
def test_only_outputs_a_recomputation_asks_for_are_held(checkpointing):
    """Without checkpointing nothing is held. Re-entrant checkpointing recomputes whole layers, so every
    dropped output is held; non-re-entrant checkpointing recomputes a layer only up to its last saved
    tensor, so only a dropped attention followed by a kept MLP is. All are gone after the backward."""
    model = tiny_model("llama", layers=4)
    if checkpointing:
        kwargs = {"use_reentrant": checkpointing == "reentrant"}
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    ctl = dropbp.apply(model, 0.5, seed=2, pattern="uniform")
    outputs: dict[str, weakref.ref] = {}

    def watch(name, out):
        outputs[name] = weakref.ref(out[0] if isinstance(out, tuple) else out)

    for b in ctl.branches:
        b.module.register_forward_hook(lambda m, a, out, n=b.name: watch(n, out))
    for step in range(3):
        ids = batch(step)
        loss = model(input_ids=ids, labels=ids).loss
        gc.collect()
        dropped = set(ctl.last_dropped)
        if checkpointing == "reentrant":
            want = dropped
        else:
            attn_then_kept_mlp = {f"model.layers.{i}.self_attn" for i in range(4)} - {
                f"model.layers.{i}.self_attn" for i in range(4) if f"model.layers.{i}.mlp" in dropped
            }
            want = dropped & attn_then_kept_mlp if checkpointing else set()
        assert {n for n, ref in outputs.items() if ref() is not None} == want, step
        loss.backward()
        del loss
        gc.collect()
        assert all(ref() is None for ref in outputs.values())
        assert _nothing_held(model)


def test_calibration_and_remove_leave_nothing_behind():
    model = tiny_model("llama", layers=2)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    ctl = dropbp.apply(model, 0.5, pattern="uniform")
    ids = batch()
    model(input_ids=ids, labels=ids)  # a forward whose backward never comes: its outputs are held
    assert not _nothing_held(model)
    ctl.calibrate(lambda: model(input_ids=ids, labels=ids).loss)  # forced patterns, released after
    assert _nothing_held(model)
    model(input_ids=ids, labels=ids)
    ctl.remove()
    assert _nothing_held(model)
