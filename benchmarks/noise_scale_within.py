"""The noise scale read from within one step against the one read across micro-batches, on the same text (issue 69).

With one micro-batch a step (one long document a step) ``dropbp.NoiseScale`` reads chunks of the step's tokens at the
output layer's input: the last hidden layer's noise, a proxy for the whole model's. This script sets the two side by
side on SmolLM2-135M-Instruct (real weights, LoRA r=8, Python's help text): for each step, the same 4 sequences of
``--seq-len`` tokens are read once as 4 micro-batches of one sequence (the whole model's trainable parameters) and
once as one micro-batch of 4 sequences (within the step, 8 chunks); backward only (no optimizer step: the weights as
loaded, as ``dropbp check`` reads them). Both figures are B_simple in tokens.

    OMP_NUM_THREADS=1 python benchmarks/noise_scale_within.py --steps 8 --seq-len 512 \\
        --out benchmarks/results/noise_scale_within
"""

from __future__ import annotations

import argparse
import json
from datetime import date
from pathlib import Path

import torch

import dropbp
from dropbp.tools.pretrained import load_causal_lm
from dropbp.tools.qlora import with_lora
from dropbp.tools.textdata import pydoc_topics


def read(model: torch.nn.Module, steps: list[torch.Tensor], micro_batches: int) -> dict:
    """B_simple over ``steps`` (each ``[sequences, seq_len]``), each step as ``micro_batches`` micro-batches."""
    noise = dropbp.NoiseScale()
    ctl = dropbp.apply(model, 0.0, features=[noise])
    for ids in steps:
        model.zero_grad(set_to_none=True)
        for part in ids.chunk(micro_batches):
            (model(input_ids=part, labels=part).loss / micro_batches).backward()
    noise.flush()
    reading = noise.estimate()
    ctl.remove()
    model.zero_grad(set_to_none=True)
    return {"tokens": reading.tokens, "gradient_sq_norm": reading.gradient_sq_norm, "trace": reading.trace,
            "tokens_per_step": reading.tokens_per_step, "steps": reading.steps}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/noise_scale_within"))
    args = parser.parse_args()
    model, tokenizer = load_causal_lm()
    torch.manual_seed(0)
    model = with_lora(model).train()
    windows = pydoc_topics(tokenizer, args.seq_len).train
    steps = [windows[4 * i : 4 * i + 4] for i in range(args.steps)]
    across = read(model, steps, micro_batches=4)
    within = read(model, steps, micro_batches=1)
    record = {
        "date": date.today().isoformat(),
        "dropbp": dropbp.__version__,
        "torch": torch.__version__,
        "model": "SmolLM2-135M-Instruct, LoRA r=8",
        "text": "pydoc_data.topics (Python's help text)",
        "seq_len": args.seq_len,
        "sequences_per_step": 4,
        "across_micro_batches": across,
        "within_the_step": within,
        "within_over_across": within["tokens"] / across["tokens"],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "noise_scale_within.json").write_text(json.dumps(record, indent=2) + "\n")
    lines = [
        "# The noise scale read within one step against across micro-batches (SmolLM2-135M-Instruct, LoRA)",
        "",
        f"{args.steps} steps of 4 sequences x {args.seq_len} tokens of Python's help text, at the loaded weights "
        "(backward only). Command: `OMP_NUM_THREADS=1 python benchmarks/noise_scale_within.py --steps "
        f"{args.steps} --seq-len {args.seq_len} --out {args.out}`.",
        "",
        "| read | what it reads | B_simple (tokens) |",
        "|---|---|---|",
        f"| across 4 micro-batches | every trainable parameter (LoRA) | {across['tokens']:.0f} |",
        f"| within the step, 8 chunks | the output layer's input (last hidden layer) | {within['tokens']:.0f} |",
        "",
        f"Within over across: {record['within_over_across']:.2f}x.",
    ]
    (args.out / "noise_scale_within.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
