"""LoRA fine-tuning of a litgpt model with DropBP, calibrated: the three lines a litgpt script needs.

    pip install "litgpt>=0.5" dropbp   # litgpt pins huggingface-hub<1.4: transformers 4.x, not 5.x
    python examples/litgpt_finetune.py

In a litgpt fine-tuning script (``litgpt/finetune/lora.py`` and friends) the same three calls go
right after the model is built and before the loop: ``dropbp.apply(model, rate, pattern="uniform")``,
one ``ctl.calibrate(closure)`` on a batch, and nothing else - the hooks draw each step's pattern on
the model's forward. (The default cut patterns need no calibration: leave ``pattern`` out and skip
``calibrate``.) dropbp recognises litgpt's ``Block`` by class, its post-attention / post-MLP norms
included, without importing litgpt itself.

The model is a tiny litgpt Llama-style config with random weights (nothing is downloaded) learning
Python's help text (``pydoc_data.topics``) one byte per token.
"""

from __future__ import annotations

import argparse

import torch
from litgpt import lora

import dropbp
from dropbp.tools.textdata import pydoc_topics

VOCAB = 256  # bytes


def build_model(layers: int, hidden: int, seq_len: int) -> torch.nn.Module:
    """litgpt's LoRA GPT (Llama-style blocks), only the adapters trainable."""
    config = lora.Config(
        block_size=seq_len,
        vocab_size=VOCAB,
        padded_vocab_size=VOCAB,
        n_layer=layers,
        n_head=4,
        n_query_groups=2,
        n_embd=hidden,
        bias=False,
        norm_class_name="RMSNorm",
        mlp_class_name="LLaMAMLP",
        intermediate_size=2 * hidden,
        parallel_residual=False,
        lora_r=8,
        lora_alpha=16,
        lora_query=True,
        lora_value=True,
        lora_mlp=True,
    )
    model = lora.GPT(config)
    lora.mark_only_lora_as_trainable(model)
    return model.train()


def lm_loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy: litgpt's GPT returns logits."""
    logits = model(ids[:, :-1])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--drop-rate", type=float, default=0.5)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    data = pydoc_topics(lambda text: {"input_ids": list(text.encode("utf-8"))}, args.seq_len + 1)
    model = build_model(args.layers, args.hidden, args.seq_len)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)

    ctl = dropbp.apply(model, args.drop_rate, pattern="uniform", seed=args.seed)
    calibration_batch = data.train_batch(0, args.batch, args.seed)
    ctl.calibrate(lambda: lm_loss(model, calibration_batch))
    print(f"{len(ctl.branches)} branches; calibrated rates {[round(r, 2) for r in ctl.rates]}")

    for step in range(1, args.steps + 1):
        loss = lm_loss(model, data.train_batch(step, args.batch, args.seed))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step == 1 or step % 10 == 0 or step == args.steps:
            print(f"step {step}  loss {loss.item():.3f}  dropped {len(ctl.last_dropped)}/{len(ctl.branches)}")

    model.eval()
    with torch.no_grad():
        batches = data.val_batches(args.batch)
        val = sum(lm_loss(model, b).item() for b in batches) / len(batches)
    print(f"held-out loss {val:.3f}")


if __name__ == "__main__":
    main()
