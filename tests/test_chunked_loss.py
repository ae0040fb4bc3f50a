"""chunked_loss: the chunked LM head + cross-entropy gives the plain path's loss and gradients."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import VOCAB, batch, tiny_model, with_lora
from torch import nn

import dropbp
from dropbp.features.chunked_loss import UnsupportedModel
from dropbp.tools.arms import apply_arm
from dropbp.tools.memory import saved_bytes

CHUNK = 7  # does not divide the 2 x 20 tokens: the last chunk is short


def _labels(ids: torch.Tensor) -> torch.Tensor:
    labels = ids.clone()
    labels[0, :5] = -100  # a masked prompt
    labels[1, -3:] = -100  # padding at the end
    return labels


def _run(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor, **kwargs) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    out = model(input_ids=ids, labels=labels, **kwargs)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_close(loss, grads, ref_loss, ref_grads) -> None:
    """Relative to 1e-6 in float32: the loss, and each gradient by its norm."""
    assert abs(loss.item() - ref_loss.item()) <= 1e-6 * abs(ref_loss.item())
    assert grads.keys() == ref_grads.keys()
    for name, want in ref_grads.items():
        err = (grads[name] - want).norm() / want.norm().clamp_min(1e-30)
        assert err <= 1e-6, f"{name}: relative error {err.item():.2e}"


def _model(arch: str, method: str) -> nn.Module:
    model = tiny_model(arch, layers=2)
    return with_lora(model) if method == "lora" else model


@pytest.mark.parametrize("method", ["full", "lora"])
@pytest.mark.parametrize("arch", ["llama", "gpt2", "gpt_neox"])
def test_same_loss_and_gradients_at_rate_zero(arch, method):
    model = _model(arch, method)
    reference = copy.deepcopy(model)
    ctl = apply_arm(model, 0.0, pattern="uniform", chunked_loss=CHUNK)
    assert ctl.features["chunked_loss"].chunk_tokens == CHUNK
    ids = batch(length=20)
    out, grads = _run(model, ids, _labels(ids))
    ref, ref_grads = _run(reference, ids, _labels(ids))
    assert out.logits is None
    _assert_close(out.loss, grads, ref.loss, ref_grads)


def test_same_gradients_while_dropping():
    model = _model("llama", "full")
    plain = copy.deepcopy(model)
    ctl = apply_arm(model, 0.5, seed=4, pattern="uniform", chunked_loss=CHUNK)
    plain_ctl = dropbp.apply(plain, 0.5, seed=4, pattern="uniform")
    ids = batch(length=20)
    for _ in range(2):
        out, grads = _run(model, ids, _labels(ids))
        ref, ref_grads = _run(plain, ids, _labels(ids))
        assert ctl.last_dropped == plain_ctl.last_dropped != ()
        _assert_close(out.loss, grads, ref.loss, ref_grads)


def test_trainer_item_count_and_positional_labels():
    model = _model("llama", "full")
    reference = copy.deepcopy(model)
    dropbp.apply(model, 0.0, pattern="uniform", features=[dropbp.ChunkedLoss()])
    ids = batch(length=20)
    count = torch.tensor(50)  # what the Trainer passes under gradient accumulation
    out, grads = _run(model, ids, _labels(ids), num_items_in_batch=count)
    ref, ref_grads = _run(reference, ids, _labels(ids), num_items_in_batch=count)
    _assert_close(out.loss, grads, ref.loss, ref_grads)
    positional = model(ids, None, None, None, None, _labels(ids))  # labels is the 6th argument
    want = reference(input_ids=ids, labels=_labels(ids)).loss
    assert positional.logits is None and abs(positional.loss.item() - want.item()) <= 1e-6 * want.item()


def test_eval_keeps_logits_and_remove_restores():
    model = _model("llama", "lora")
    reference = copy.deepcopy(model)
    keys = list(model.state_dict())
    ctl = dropbp.apply(model, 0.0, pattern="uniform", features=[dropbp.ChunkedLoss()])
    ids = batch(length=20)
    model.eval()
    with torch.no_grad():
        got = model(input_ids=ids, labels=ids)
        want = reference.eval()(input_ids=ids, labels=ids)
    assert torch.equal(got.logits, want.logits) and torch.equal(got.loss, want.loss)
    model.train()
    ctl.remove()
    lm = model.get_base_model()
    assert "forward" not in vars(lm) and "forward" not in vars(lm.get_output_embeddings())
    assert list(model.state_dict()) == keys
    out = model(input_ids=ids, labels=ids)
    assert out.logits is not None and out.logits.shape == (2, 20, VOCAB)


def test_saves_no_logits():
    """The plain path keeps the log-softmax of every position's logits; the chunked one keeps none."""
    model = _model("llama", "full")
    twin = copy.deepcopy(model)
    ids = batch(length=20)
    plain = saved_bytes(dropbp.apply(model, 0.0, pattern="uniform"), ids).total
    chunked = saved_bytes(apply_arm(twin, 0.0, pattern="uniform", chunked_loss=CHUNK), ids).total
    log_softmax = ids.numel() * VOCAB * 4  # float32 at every position
    labels = (ids.numel() + ids.shape[0]) * 8  # int64, padded by one per row: each path keeps its own
    assert abs((plain - chunked) - log_softmax) <= labels


def test_refuses_what_it_cannot_handle():
    class Plain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mlp = nn.Linear(4, 4)

        def forward(self, x):
            return x + self.mlp(x)

    with pytest.raises(UnsupportedModel, match="(?i)leave dropbp.ChunkedLoss out"):
        dropbp.apply(Plain(), 0.0, branches=["mlp"], pattern="uniform", features=[dropbp.ChunkedLoss()])
    capped = tiny_model("llama", layers=2)
    capped.config.final_logit_softcapping = 30.0
    with pytest.raises(UnsupportedModel, match="final_logit_softcapping"):
        dropbp.apply(capped, 0.0, pattern="uniform", features=[dropbp.ChunkedLoss()])
    dropbp.apply(capped, 0.0, pattern="uniform").remove()  # the refusal left nothing attached
    for bad in (0, -3, 1.5, "yes", True):
        with pytest.raises(ValueError, match="chunk_tokens must be a positive int"):
            dropbp.ChunkedLoss(bad)


_MOE = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=8),
}


@pytest.mark.parametrize("arch", sorted(_MOE))
def test_a_mixture_of_experts_keeps_its_router_loss(arch):
    """The model adds router_aux_loss_coef x its load-balancing loss when given labels: so must the chunked path."""
    common = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)
    model = tiny_model(arch, layers=2, output_router_logits=True, **common, **_MOE[arch])
    reference = copy.deepcopy(model)
    ctl = apply_arm(model, 0.0, pattern="uniform", chunked_loss=CHUNK)
    ids = batch(length=20)
    out, grads = _run(model, ids, _labels(ids))
    ref, ref_grads = _run(reference, ids, _labels(ids))
    assert ref.aux_loss is not None and ref.aux_loss.item() > 0
    _assert_close(out.loss, grads, ref.loss, ref_grads)
    with pytest.raises(UnsupportedModel, match="return_dict=True or leave dropbp.ChunkedLoss out"):
        model(input_ids=ids, labels=_labels(ids), return_dict=False)
    ctl.remove()


def test_equals_the_plain_loss_where_every_label_is_ignored_and_with_its_ignore_index():
    """Issue 71, class D: every label ignored, the plain path's loss is NaN (a mean over nothing) and its gradients 0;
    the chunked loss's too (it made them NaN: 0 / 0 times zeroed rows). ``ignore_index=`` given to the model's
    forward reaches the chunked loss as it reaches the plain one."""
    model = tiny_model("llama", layers=2)
    reference = copy.deepcopy(model)
    dropbp.apply(model, 0.0, features=[dropbp.ChunkedLoss(CHUNK)])
    ids = batch(length=20)
    ignored = torch.full_like(ids, -100)
    out, grads = _run(model, ids, ignored)
    ref, ref_grads = _run(reference, ids, ignored)
    assert out.loss.isnan() and ref.loss.isnan()
    assert grads.keys() == ref_grads.keys() and all(not g.any() for g in [*grads.values(), *ref_grads.values()])
    labels = ids.clone()
    labels[:, :6] = 0  # token 0 as the ignored id
    out, grads = _run(model, ids, labels, ignore_index=0)
    ref, ref_grads = _run(reference, ids, labels, ignore_index=0)
    _assert_close(out.loss, grads, ref.loss, ref_grads)
