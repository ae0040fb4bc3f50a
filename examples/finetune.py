"""Fine-tune a small Llama with DropBP on whichever device ``DROPBP_BACKEND`` names: one script for all.

    DROPBP_BACKEND=cpu  python examples/finetune.py
    DROPBP_BACKEND=cuda python examples/finetune.py
    DROPBP_BACKEND=hpu  python examples/finetune.py      # Intel Gaudi (lazy or eager mode)
    DROPBP_BACKEND=xpu  python examples/finetune.py

There is no device code here: the backend gives the device, the autocast context and the memory
figures, the timer and the graph-compilation count, and
``ctl.backward`` / ``ctl.optimizer_step`` place the step boundaries (the graph breaks a lazy-mode
Gaudi needs). The model is built from a config with random weights, so nothing is downloaded, and it
learns Python's own help text (``pydoc_data.topics``) one byte per token: the loss
starts near ln(256) = 5.5 and falls within a few dozen steps.
"""

from __future__ import annotations

import argparse
import logging
import pydoc_data.topics
from collections import Counter

import torch
from transformers import AutoConfig, AutoModelForCausalLM

import dropbp
from dropbp import backends
from dropbp.tools.cli import positive, rate, sequence_length
from dropbp.tools.device_tools import tools_for


def byte_corpus() -> torch.Tensor:
    """Every pydoc topic, in a fixed order, as UTF-8 bytes: a vocabulary of 256, no tokenizer needed."""
    topics = pydoc_data.topics.topics
    text = "\n\n".join(topics[name] for name in sorted(topics))
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def sample(data: torch.Tensor, batch: int, seq_len: int, generator: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(data) - seq_len, (batch,), generator=generator)
    return torch.stack([data[s : s + seq_len] for s in starts.tolist()])


def build_model(layers: int, hidden: int, seq_len: int) -> torch.nn.Module:
    config = AutoConfig.for_model(
        "llama",
        vocab_size=256,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=seq_len,
    )
    return AutoModelForCausalLM.from_config(config).train()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", help="cpu, cuda, hpu, xpu or auto (default: $DROPBP_BACKEND, else auto)")
    parser.add_argument("--steps", type=positive, default=40)
    parser.add_argument("--drop-rate", type=rate, default=0.5)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=sequence_length, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=10)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")

    try:
        backend = backends.get(args.backend)
    except backends.BackendUnavailable as exc:
        raise SystemExit(f"finetune.py: {exc}") from None

    torch.manual_seed(args.seed)
    model = build_model(args.layers, args.hidden, args.seq_len)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model, optimizer = backend.prepare(model, optimizer)  # before apply: prepare may replace the model
    ctl = dropbp.apply(model, args.drop_rate, seed=args.seed, backend=backend)

    data = byte_corpus()
    split = len(data) * 9 // 10
    train, held_out = data[:split], data[split:]
    generator = torch.Generator().manual_seed(args.seed)
    eval_ids = sample(held_out, args.batch, args.seq_len, generator).to(backend.device)

    def eval_loss() -> float:
        model.eval()  # eval forwards drop nothing
        with torch.no_grad(), backend.autocast():
            loss = model(input_ids=eval_ids, labels=eval_ids).loss
        backend.graph_break()
        model.train()
        return loss.item()

    n = len(ctl.branches)
    print(
        f"{backend!r}: {sum(p.numel() for p in model.parameters()):,} parameters, {n} branches, "
        f"drop_rate {args.drop_rate}, max_patterns {ctl.max_patterns}"
    )
    print(f"held-out loss before: {eval_loss():.3f}")

    drops: Counter[str] = Counter()
    patterns: set[tuple[str, ...]] = set()
    skipped = 0
    backend.reset_peak_memory()
    with tools_for(backend).timer() as timer:
        for step in range(1, args.steps + 1):
            ids = sample(train, args.batch, args.seq_len, generator).to(backend.device)
            with backend.autocast():
                loss = model(input_ids=ids, labels=ids).loss
            skipped += not ctl.backward(loss)
            ctl.optimizer_step(optimizer)
            optimizer.zero_grad(set_to_none=True)
            drops.update(ctl.last_dropped)
            patterns.add(ctl.last_dropped)
            if step == 1 or step % args.log_every == 0 or step == args.steps:
                print(f"step {step:4d}  loss {loss.item():.3f}  dropped {len(ctl.last_dropped)}/{n} branches")

    print(f"held-out loss after:  {eval_loss():.3f}")
    kinds = {b.name: b.kind for b in ctl.branches}
    for kind in ("attn", "mlp"):
        count = sum(1 for b in ctl.branches if b.kind == kind)
        share = sum(c for name, c in drops.items() if kinds[name] == kind) / (count * args.steps)
        print(f"drop figures: {kind} branches dropped {share:.3f} of the time")
    print(
        f"drop figures: {sum(drops.values()) / (n * args.steps):.3f} of branch backwards dropped "
        f"(target {args.drop_rate}), {len(patterns)} distinct patterns, {skipped} backward(s) skipped"
    )
    peak = backend.max_memory_allocated()
    compilations = tools_for(backend).graph_compilations()
    print(
        f"device figures: {timer.seconds / args.steps * 1000:.1f} ms/step, "
        f"peak memory {f'{peak / 2**20:.1f} MiB' if peak else 'n/a'}, "
        f"graph compilations {'n/a' if compilations is None else compilations}"
    )


if __name__ == "__main__":
    main()
