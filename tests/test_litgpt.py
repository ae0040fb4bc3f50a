"""litgpt models: dropbp knows litgpt's ``Block`` by class (no warning, litgpt never imported by
dropbp), and a dropped step's gradients equal those of the unmodified model with what each dropped
branch adds to the residual detached: sequential and parallel residual, a shared attention norm,
post-attention / post-MLP norms, and a mixture-of-experts MLP, full fine-tuning and litgpt's LoRA.

litgpt pins ``huggingface-hub<1.4``, which transformers 5 cannot import with, so these tests run in
the second CI environment (``ci/test.sh``: transformers 4.57 + litgpt); elsewhere they skip.
"""

from __future__ import annotations

import copy
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

litgpt = pytest.importorskip("litgpt", reason="litgpt is not installed (ci/test.sh runs these in .venv-litgpt)")
from litgpt import lora  # noqa: E402
from litgpt.config import Config  # noqa: E402
from litgpt.model import GPT  # noqa: E402

import dropbp  # noqa: E402

VOCAB = 96
_COMMON = dict(block_size=64, vocab_size=VOCAB, padded_vocab_size=VOCAB, n_layer=3, n_head=4, n_embd=32)
_LLAMA = dict(
    n_query_groups=2, bias=False, norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP", intermediate_size=64
)
CONFIGS = {
    "llama": dict(_LLAMA, parallel_residual=False),
    "pythia": dict(parallel_residual=True, shared_attention_norm=False, rotary_percentage=0.25),
    "shared-norm": dict(parallel_residual=True, shared_attention_norm=True),
    "post-norms": dict(_LLAMA, head_size=8, mlp_class_name="GemmaMLP", post_attention_norm=True, post_mlp_norm=True),
    "moe": dict(_LLAMA, mlp_class_name="LLaMAMoE", moe_intermediate_size=48, n_expert=4, n_expert_per_token=2),
}
# What the residual add receives from each branch: the post-norm's output (nn.Identity without one).
RESIDUAL_INPUT = {"attn": "post_attention_norm", "mlp": "post_mlp_norm"}
LORA = dict(lora_r=4, lora_alpha=8, lora_query=True, lora_key=True, lora_value=True, lora_projection=True)
LORA["lora_mlp"] = True


def build(name: str, method: str = "full", seed: int = 0) -> torch.nn.Module:
    """A litgpt GPT from ``CONFIGS[name]`` with random weights; ``lora``: litgpt's LoRA, only the
    adapters trainable, B non-zero so every adapter gets a gradient."""
    torch.manual_seed(seed)
    if method == "full":
        return GPT(Config(**_COMMON, **CONFIGS[name])).train()
    model = lora.GPT(lora.Config(**_COMMON, **CONFIGS[name], **LORA))
    lora.mark_only_lora_as_trainable(model)
    for n, p in model.named_parameters():
        if "lora_B" in n:
            p.data.normal_(std=0.1)
    return model.train()


def loss_and_grads(model: torch.nn.Module, step: int) -> tuple[torch.Tensor, dict]:
    ids = torch.randint(0, VOCAB, (2, 13), generator=torch.Generator().manual_seed(step))
    model.zero_grad(set_to_none=True)
    logits = model(ids[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    loss.backward()
    return loss.detach(), {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def detach_residual_inputs(model: torch.nn.Module, dropped: tuple[str, ...]) -> list:
    """The hand-written reference: detach what each dropped branch adds to the residual stream."""
    modules = dict(model.named_modules())
    names = [f"{b.rsplit('.', 1)[0]}.{RESIDUAL_INPUT[b.rsplit('.', 1)[1]]}" for b in dropped]
    return [modules[n].register_forward_hook(lambda m, a, out: out.detach()) for n in names]


@pytest.mark.parametrize("pattern", ["cut", "uniform"])
@pytest.mark.parametrize("method", ["full", "lora"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_gradients_equal_detached_reference(name, method, pattern, caplog):
    model = build(name, method)
    reference = copy.deepcopy(model)
    with caplog.at_level(logging.WARNING, logger="dropbp"):
        ctl = dropbp.apply(model, 0.5, seed=3, pattern=pattern)
    assert not caplog.records, "a litgpt Block is a known architecture: no warning"
    assert [b.name for b in ctl.branches] == [f"transformer.h.{i}.{k}" for i in range(3) for k in ("attn", "mlp")]
    seen = set()
    for step in range(4):
        loss, grads = loss_and_grads(model, step)
        dropped = ctl.last_dropped
        seen.add(len(dropped))
        handles = detach_residual_inputs(reference, dropped)
        ref_loss, ref_grads = loss_and_grads(reference, step)
        for h in handles:
            h.remove()
        assert torch.equal(loss, ref_loss)
        assert grads.keys() == ref_grads.keys()
        for n, want in ref_grads.items():
            assert (grads[n] is None) == (want is None), f"{n}: gradient presence differs"
            if want is not None:
                torch.testing.assert_close(grads[n], want, atol=1e-6, rtol=0, msg=lambda m, n=n: f"{n}: {m}")
    assert max(seen) > 0 and min(seen) < len(ctl.branches)


def test_post_norms_belong_to_their_branch():
    ctl = dropbp.apply(build("post-norms"), 0.5, pattern="uniform")
    assert [type(b.tail[0]).__name__ for b in ctl.branches] == ["RMSNorm"] * 6
    modules = dict(ctl.model.named_modules())
    assert ctl.branches[0].tail == (modules["transformer.h.0.post_attention_norm"],)
    assert ctl.branches[1].tail == (modules["transformer.h.0.post_mlp_norm"],)
    plain = dropbp.apply(build("llama"), 0.5, pattern="uniform")
    assert all(b.tail == () for b in plain.branches)  # nn.Identity: nothing to drop with the branch


def test_moe_cost_counts_the_experts_a_token_runs_through():
    ctl = dropbp.apply(build("moe"), 0.5, pattern="uniform")
    experts = dict(ctl.branches[1].module.named_modules())["experts"]
    weights = sum(m.in_features * m.out_features for m in experts.modules() if isinstance(m, torch.nn.Linear))
    gate = 32 * 4
    assert ctl.branches[1].flops == pytest.approx(2.0 * (weights * 2 / 4 + gate))


def test_example_runs():
    example = Path(__file__).resolve().parents[1] / "examples" / "litgpt_finetune.py"
    done = subprocess.run([sys.executable, str(example), "--steps", "6"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "calibrated rates" in done.stdout and "step 6" in done.stdout
