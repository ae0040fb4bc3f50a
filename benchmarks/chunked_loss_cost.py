"""Step-time cost of ``chunked_loss``: SmolLM2-135M LoRA, the plain loss against the chunked one.

The chunked head recomputes each chunk's logits in backward: one extra head matrix product per
token (2 x hidden x vocab FLOPs), which is large for a small model with a 49k vocabulary. Measured
the way measuring.md asks: one model in one process, plain and chunked interleaved in rotating
order (A B, B A, ...), after warm-up; per round the ratio chunked / plain of full step times
(forward + backward + optimizer step); the median of the ratios, so machine drift cancels. No
DropBP attached (drop rate 0 on both sides): only the loss path differs.

    DROPBP_CACHE=... python benchmarks/chunked_loss_cost.py --seq-len 512 --rounds 5
Writes benchmarks/results/chunked_loss_cost_cpu.json and .md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from datetime import date
from pathlib import Path

import torch
import transformers

from dropbp.features.chunked_loss import ChunkedLoss
from dropbp.tools.bench import PRETRAINED, build_model

RESULTS = Path(__file__).resolve().parent / "results"


def step(model: torch.nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor) -> float:
    start = time.perf_counter()
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    model = build_model(PRETRAINED, "lora", args.seq_len, torch.float32, torch.device("cpu"))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    ids = torch.randint(0, model.config.vocab_size, (1, args.seq_len), generator=torch.Generator().manual_seed(0))
    times: dict[str, list[float]] = {"plain": [], "chunked": []}
    for rnd in range(args.warmup + args.rounds):
        order = ["plain", "chunked"] if rnd % 2 == 0 else ["chunked", "plain"]
        for name in order:
            patch = ChunkedLoss(model) if name == "chunked" else None
            t = step(model, opt, ids)
            if patch is not None:
                patch.remove()
            if rnd >= args.warmup:
                times[name].append(t)
        print(f"round {rnd + 1}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items() if v), flush=True)
    ratios = [c / p for c, p in zip(times["chunked"], times["plain"], strict=True)]
    result = {
        "model": "SmolLM2-135M-Instruct (LoRA r=8, all linear layers)",
        "seq_len": args.seq_len,
        "micro_batch": 1,
        "rounds": args.rounds,
        "date": date.today().isoformat(),
        "torch": torch.__version__,
        "plain_step_s": times["plain"],
        "chunked_step_s": times["chunked"],
        "median_ratio_chunked_over_plain": statistics.median(ratios),
        "command": f"python benchmarks/chunked_loss_cost.py --seq-len {args.seq_len} --rounds {args.rounds}",
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "chunked_loss_cost_cpu.json").write_text(json.dumps(result, indent=2) + "\n")
    md = (
        f"chunked_loss step-time cost, {result['model']}, seq {args.seq_len}, micro-batch 1, CPU (2 shared cores), "
        f"{args.rounds} interleaved rounds after {args.warmup} warm-up: median plain step "
        f"{statistics.median(times['plain']):.2f} s, chunked {statistics.median(times['chunked']):.2f} s, "
        f"median per-round ratio chunked/plain **{result['median_ratio_chunked_over_plain']:.3f}**.\n\n"
        f"Command: `{result['command']}`\n"
    )
    (RESULTS / "chunked_loss_cost_cpu.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
