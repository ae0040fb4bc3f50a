"""An encoder through ``branches=``: BERT's residual branches are the modules inside its residual
adds, and naming a module that adds the residual itself stops at the forward with what to pass."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import assert_same_grads, detach_outputs, weighted_outputs
from transformers import BertConfig, BertForMaskedLM

import dropbp

LAYERS = 3
VOCAB = 96


def _bert(method: str) -> torch.nn.Module:
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    model = BertForMaskedLM(config).train()
    if method == "lora":
        peft = pytest.importorskip("peft")
        lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["query", "value", "dense"], init_lora_weights=False)
        torch.manual_seed(1)
        model = peft.get_peft_model(model, lora).train()
    return model


def _branches(model: torch.nn.Module) -> list[str]:
    """The f of each residual add: self-attention (its output projection and the add follow in
    ``attention.output``) and the feed-forward's first half (``output`` adds the residual)."""
    prefix = next(n.removesuffix("bert.encoder") for n, _ in model.named_modules() if n.endswith("bert.encoder"))
    return [
        f"{prefix}bert.encoder.layer.{i}.{part}" for i in range(LAYERS) for part in ("attention.self", "intermediate")
    ]


def _loss_and_grads(model: torch.nn.Module, step: int) -> tuple[torch.Tensor, dict]:
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(3, VOCAB, (2, 12), generator=g)
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("pattern", ["cut", "uniform"])
@pytest.mark.parametrize("method", ["full", "lora"])
def test_bert_through_branches_gives_the_detached_reference_gradients(method, pattern):
    model = _bert(method)
    reference = copy.deepcopy(model)
    ctl = dropbp.apply(model, 0.5, seed=2, branches=_branches(model), pattern=pattern)
    seen = set()
    for step in range(6):
        loss, grads = _loss_and_grads(model, step)
        dropped = ctl.last_dropped
        seen.add(len(dropped))
        handles = detach_outputs(reference, dropped)
        ref_loss, ref_grads = _loss_and_grads(reference, step)
        for h in handles:
            h.remove()
        assert torch.equal(loss, ref_loss)
        assert_same_grads(grads, ref_grads)
    assert max(seen) > 0 and min(seen) < 2 * LAYERS


def test_no_branches_found_in_an_encoder_says_which_modules_to_name():
    with pytest.raises(ValueError, match=r"no residual layers in this BertForMaskedLM.*encoder.layer.N.attention.self"):
        dropbp.apply(_bert("full"), 0.5)


def test_a_module_that_adds_the_residual_itself_is_stopped_at_the_forward():
    """BERT's ``attention`` holds its own residual add and LayerNorm: dropped, it detaches the whole
    residual stream, and with LoRA only in attention nothing below or in it is left to train."""
    model = _bert("full")
    for p in model.parameters():
        p.requires_grad_(False)
    for layer in model.bert.encoder.layer:
        layer.attention.self.query.weight.requires_grad_(True)
    wrong = [f"bert.encoder.layer.{i}.attention" for i in range(LAYERS)]
    ctl = dropbp.apply(model, 0.5, seed=0, branches=wrong, pattern="uniform")
    ctl.set_rates([0.0, 0.0, 0.9])  # the top layer's attention drops in most steps
    step = next(s for s in range(20) if "bert.encoder.layer.2.attention" in ctl.dropped_at(s))
    ids = torch.randint(3, VOCAB, (2, 12))
    for _ in range(step):
        model(input_ids=ids, labels=ids).loss.backward()
    with pytest.raises(ValueError, match=r"needs no gradient.*x = x \+ f\(x\).*attention.self"):
        model(input_ids=ids, labels=ids)


def test_whole_encoder_layers_are_refused_at_apply_with_the_modules_to_name():
    """A BertLayer (attention, intermediate, output) adds the residual itself: refused before any forward."""
    wrong = [f"bert.encoder.layer.{i}" for i in range(LAYERS)]
    expected = r"a BertLayer\) that adds the residual itself.*'bert.encoder.layer.N.intermediate'"
    with pytest.raises(ValueError, match=expected):
        dropbp.apply(_bert("full"), 0.5, branches=wrong, pattern="uniform")


@pytest.mark.parametrize("method", ["full", "lora"])
def test_bert_token_drops_class_attention_as_attention_and_equal_the_reference(method):
    """README's BERT branches (``attention.self``, ``intermediate``) under token drops: ``attention.self`` is an
    attention branch (its class says so; the leaf name ``self`` says nothing), so its keys and values run full rows,
    and every gradient equals a reference that weights each branch output's rows by the recorded selection."""
    from dropbp.experimental import TokenDrops

    model = _bert(method)
    ctl = dropbp.apply(model, 0.0, seed=3, branches=_branches(model), features=[TokenDrops(0.5)])
    assert {b.name.rsplit(".", 1)[-1]: b.kind for b in ctl.branches} == {"self": "attn", "intermediate": "mlp"}
    for step in range(3):
        loss, got = _loss_and_grads(model, step)
        weights = ctl.features["token_drops"].weights()
        assert len(weights) == 2 * LAYERS
        ctl.remove()
        handles = weighted_outputs(model, weights)
        want_loss, want = _loss_and_grads(model, step)
        for h in handles:
            h.remove()
        assert torch.equal(loss, want_loss)
        assert_same_grads(got, want, atol=1e-5)
        ctl = dropbp.apply(model, 0.0, seed=3, branches=_branches(model), features=[TokenDrops(0.5)])
        ctl.load_state_dict(ctl.state_dict() | {"step": step + 1})
