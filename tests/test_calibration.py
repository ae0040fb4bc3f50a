"""calibrate(): one-pass sensitivities equal the brute-force definition; rates follow allocation;
the model is left as it was; ranks agree."""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import tempfile

import pytest
import torch
from conftest import batch, detach_outputs, ranks_done, run_ranks, tiny_model, with_lora

import dropbp

CASES = [(arch, method) for arch in ("llama", "gpt2") for method in ("full", "lora")]


def _setup(arch: str, method: str, layers: int = 3):
    model = tiny_model(arch, layers=layers)
    if method == "lora":
        model = with_lora(model)
    ctl = dropbp.apply(model, 0.5, pattern="uniform")
    ids = batch(7)
    return model, ctl, (lambda: model(input_ids=ids, labels=ids).loss)


@pytest.mark.parametrize("gradnorm", [True, False])
@pytest.mark.parametrize("arch, method", CASES)
def test_one_pass_agrees_with_brute_force(arch, method, gradnorm):
    model, ctl, closure = _setup(arch, method)  # gpt2 has dropout: both methods see the same masks
    torch.manual_seed(0)
    fast = ctl.calibrate(closure, gradnorm=gradnorm)
    torch.manual_seed(0)
    with dropbp.experimental.exact_recompute():
        brute = ctl.calibrate(closure, gradnorm=gradnorm)
    assert len(fast) == len(ctl.branches) and all(s > 0 for s in brute)
    assert fast == pytest.approx(brute, rel=1e-4)
    flops = [b.flops for b in ctl.branches]
    assert ctl.rates == dropbp.allocate_rates(brute, flops, 0.5)


def test_brute_force_matches_the_definition_written_by_hand():
    """S_i from an unmodified copy with branch i's output detached by a plain hook."""
    model, ctl, closure = _setup("llama", "full", layers=2)
    reference = copy.deepcopy(model)
    ids = batch(7)

    def grads(handles=()):
        loss = reference(input_ids=ids, labels=ids).loss
        out = torch.autograd.grad(loss, list(reference.parameters()), allow_unused=True)
        for h in handles:
            h.remove()
        return out

    full = grads()
    want = []
    for b in ctl.branches:
        dropped = grads(detach_outputs(reference, (b.name,)))
        s = 0.0
        for g, d in zip(full, dropped, strict=True):
            if g is not None:
                s += (g.norm() - (d.norm() if d is not None else 0.0)).item() ** 2
        want.append(s)
    with dropbp.experimental.exact_recompute():
        assert ctl.calibrate(closure) == pytest.approx(want, rel=1e-5)
    assert ctl.calibrate(closure) == pytest.approx(want, rel=1e-4)


def test_model_is_left_as_it_was():
    model, ctl, closure = _setup("llama", "full")
    ids = batch(1)
    model(input_ids=ids, labels=ids).loss.backward()  # a training step, with its pattern and .grad
    before_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    no_grad_before = {n for n, p in model.named_parameters() if p.grad is None}
    model.model.layers[1].eval()  # a mixed train/eval state must come back too
    modes = {n: m.training for n, m in model.named_modules()}
    step, last = ctl.step, ctl.last_dropped
    for exact in (False, True):
        with dropbp.experimental.exact_recompute() if exact else contextlib.nullcontext():
            ctl.calibrate(closure)
        assert {n: m.training for n, m in model.named_modules()} == modes
        assert ctl.step == step and ctl.last_dropped == last
        for n, p in model.named_parameters():
            if n in no_grad_before:
                assert p.grad is None, n
            else:
                assert torch.equal(p.grad, before_grads[n]), n


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing(reentrant, caplog):
    plain, ctl_plain, closure_plain = _setup("llama", "full")
    ckpt, ctl_ckpt, closure_ckpt = _setup("llama", "full")
    ckpt.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    ids = batch(3)
    ckpt(input_ids=ids, labels=ids).loss.backward()  # leaves a drop pattern that must not leak in
    torch.manual_seed(0)
    want = ctl_plain.calibrate(closure_plain)
    with caplog.at_level(logging.WARNING, logger="dropbp"):
        torch.manual_seed(0)
        got = ctl_ckpt.calibrate(closure_ckpt)
    assert got == pytest.approx(want, rel=1e-5)
    assert ("falls back to exact-recompute" in caplog.text) == reentrant


def test_bad_calibration_input():
    model, ctl, closure = _setup("llama", "full", layers=2)
    with pytest.raises(TypeError, match="closure must be callable"):
        ctl.calibrate(3)
    with pytest.raises(TypeError, match=r"no longer takes method .*dropbp.experimental.exact_recompute\(\)"):
        ctl.calibrate(closure, method="exact-recompute")
    with pytest.raises(TypeError, match="must return a scalar loss tensor, got float"):
        ctl.calibrate(lambda: 1.0)
    for p in model.parameters():
        p.requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        ctl.calibrate(closure)


def _rank_main(rank: int, world: int, init_file: str, out_dir: str) -> None:
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        model = tiny_model("llama", layers=3)
        ctl = dropbp.apply(model, 0.5, pattern="uniform")
        ids = batch(100 + rank)  # every rank calibrates on its own batch
        sens = ctl.calibrate(lambda: model(input_ids=ids, labels=ids).loss)
        torch.save({"rates": ctl.rates, "sens": sens}, os.path.join(out_dir, f"rank{rank}.pt"))
        ranks_done()
    finally:
        torch.distributed.destroy_process_group()


def test_ranks_end_with_identical_rates():
    with tempfile.TemporaryDirectory() as tmp:
        run_ranks(_rank_main, 2, os.path.join(tmp, "init"), tmp, world=2, timeout=120)
        a, b = (torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(2))
    assert a["rates"] == b["rates"] and a["sens"] == b["sens"]
    # the average of the two ranks' own sensitivities
    solo = []
    for r in range(2):
        model = tiny_model("llama", layers=3)
        ids = batch(100 + r)
        solo.append(
            dropbp.apply(model, 0.5, pattern="uniform").calibrate(lambda m=model, i=ids: m(input_ids=i, labels=i).loss)
        )
    assert a["sens"] == pytest.approx([(x + y) / 2 for x, y in zip(*solo, strict=True)], rel=1e-5)
