"""Calibration cost: one-pass sensitivities against the research code's N + 1 passes (CPU).

Two 16-layer Llama-architecture models (32 branches, random weights): SmolLM2-135M's shapes cut to
16 layers, and a narrow model with a small vocabulary (the harder case: its head, which only the
full passes pay for, is cheap). Full fine-tuning and LoRA, one batch. Both methods run interleaved
(repeats alternate their order) on the same model and batch; the figure is the median wall time of
each, and their ratio. The sensitivities of the two methods
are compared too (largest relative difference), so the speed is not bought with accuracy.

    python benchmarks/calibration.py            # ~6 minutes on 2 cores
Writes benchmarks/results/calibration_cpu.json and .md.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from datetime import date
from pathlib import Path

import torch
import transformers
from torch import nn

import dropbp
from dropbp.execution.discovery import flops_at_length

RESULTS = Path(__file__).resolve().parent / "results"
METHODS = ("one-pass", "exact-recompute")


SHAPES = {
    # SmolLM2-135M's layer and vocabulary shapes, cut to 16 layers: what a real small LLM looks like.
    "smollm2-16l": dict(
        hidden_size=576,
        intermediate_size=1536,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
        tie_word_embeddings=True,
    ),
    # A narrow model with a small vocabulary: the head is cheap, so this is the harder case.
    "narrow-16l": dict(
        hidden_size=256,
        intermediate_size=688,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=8192,
        tie_word_embeddings=False,
    ),
}


def build_model(shape: str, method: str) -> nn.Module:
    config = transformers.AutoConfig.for_model(
        "llama", num_hidden_layers=16, max_position_embeddings=512, **SHAPES[shape]
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).train()
    if method == "lora":
        import peft

        lora = peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False)
        model = peft.get_peft_model(model, lora)
    return model.train()


def run(shape: str, method: str, repeats: int, batch: int, seq: int) -> dict:
    model = build_model(shape, method)
    with flops_at_length(seq):
        ctl = dropbp.apply(model, 0.5)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))

    def closure() -> torch.Tensor:
        return model(input_ids=ids, labels=ids).loss

    times: dict[str, list[float]] = {m: [] for m in METHODS}
    sens: dict[str, list[float]] = {}
    for r in range(repeats):
        for name in METHODS if r % 2 == 0 else METHODS[::-1]:
            torch.manual_seed(1)
            t0 = time.perf_counter()
            sens[name] = ctl.calibrate(closure, method=name)
            times[name].append(time.perf_counter() - t0)
            print(f"{shape} {method} repeat {r + 1}/{repeats} {name}: {times[name][-1]:.2f}s", flush=True)
    one, brute = sens["one-pass"], sens["exact-recompute"]
    rel = max(abs(a - b) / max(abs(b), 1e-30) for a, b in zip(one, brute, strict=True))
    med = {m: statistics.median(times[m]) for m in METHODS}
    return {
        "shape": shape,
        "method": method,
        "branches": len(ctl.branches),
        "parameters": sum(p.numel() for p in model.parameters()),
        "one_pass_s": med["one-pass"],
        "exact_recompute_s": med["exact-recompute"],
        "speedup": med["exact-recompute"] / med["one-pass"],
        "times": times,
        "max_relative_difference": rel,
        "rates_equal": dropbp.allocate_rates(one, [b.flops for b in ctl.branches], 0.5)
        == dropbp.allocate_rates(brute, [b.flops for b in ctl.branches], 0.5),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    rows = [run(s, m, args.repeats, args.batch, args.seq_len) for s in SHAPES for m in ("full", "lora")]
    results = {
        "benchmark": "calibration_cpu",
        "date": date.today().isoformat(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "batch": args.batch,
        "seq_len": args.seq_len,
        "repeats": args.repeats,
        "rows": rows,
    }
    lines = [
        f"Calibration on CPU: Llama-architecture, 16 layers (32 branches), batch {args.batch} x "
        f"{args.seq_len} tokens, median of {args.repeats} interleaved repeats "
        f"(torch {torch.__version__}, {torch.get_num_threads()} threads, {results['date']}).",
        "",
        "| model | fine-tuning | one-pass (s) | N + 1 passes (s) | speedup | max rel. diff. | same rates |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['shape']} ({r['parameters'] / 1e6:.0f}M) | {r['method']} | {r['one_pass_s']:.2f} | "
            f"{r['exact_recompute_s']:.2f} | "
            f"{r['speedup']:.1f}x | {r['max_relative_difference']:.1e} | {r['rates_equal']} |"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "calibration_cpu.json").write_text(json.dumps(results, indent=2) + "\n")
    (args.out / "calibration_cpu.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
