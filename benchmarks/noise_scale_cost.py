"""What measuring the gradient noise scale costs a training step (``dropbp.NoiseScale``; issue 50).

SmolLM2-135M-Instruct on Python's help text, LoRA (r=8, every linear layer) and full fine-tuning, an optimizer step
of ``--micro`` micro-batches of 1 x ``--seq-len`` tokens (AdamW), with dropbp applied at drop rate 0 both ways and the
noise scale's reads on in one arm only. The arms alternate round by round (interleaved: the machine's noise hits
both), and the figure is the median over rounds of the ratio of a round's two step times.

    python benchmarks/noise_scale_cost.py --rounds 12       # results/noise_scale/cost_cpu.{json,md}
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from datetime import date
from pathlib import Path

import torch

import dropbp
from dropbp.tools.pretrained import load_causal_lm
from dropbp.tools.qlora import with_lora
from dropbp.tools.textdata import pydoc_topics

OUT = Path(__file__).resolve().parent / "results" / "noise_scale"


def _step(model, optimizer, batches) -> float:
    start = time.perf_counter()
    for ids in batches:
        (model(input_ids=ids, labels=ids).loss / len(batches)).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def measure(method: str, rounds: int, micro: int, seq_len: int) -> dict:
    model, tokenizer = load_causal_lm()
    if method == "lora":
        model = with_lora(model)
    model.train()
    data = pydoc_topics(tokenizer, seq_len)
    windows = data.train[: micro * (rounds + 1) * 2]
    ctl = dropbp.apply(model, 0.0, backend="cpu")
    noise = dropbp.NoiseScale()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    times: dict[bool, list[float]] = {False: [], True: []}
    for r in range(rounds + 1):  # round 0 warms up
        for on in (r % 2 == 0, r % 2 == 1):  # alternate which arm goes first
            ctl.replace_options(features=[noise] if on else [])
            batches = [windows[(2 * r + on) * micro + k].unsqueeze(0) for k in range(micro)]
            seconds = _step(model, optimizer, batches)
            if r:
                times[on].append(seconds)
    ratios = [a / b for a, b in zip(times[True], times[False], strict=True)]
    return {
        "method": method,
        "step_s_off": statistics.median(times[False]),
        "step_s_on": statistics.median(times[True]),
        "overhead": statistics.median(ratios) - 1.0,
        "overhead_quartiles": [q - 1.0 for q in statistics.quantiles(ratios, n=4)],
        "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--micro", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=512)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = [measure(method, args.rounds, args.micro, args.seq_len) for method in ("lora", "full")]
    record = {"benchmark": "noise_scale_cost", "date": date.today().isoformat(), "torch": torch.__version__,
              "model": "SmolLM2-135M-Instruct", "micro_batches": args.micro, "seq_len": args.seq_len,
              "rounds": args.rounds, "threads": 1, "rows": rows}  # fmt: skip
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "cost_cpu.json").write_text(json.dumps(record, indent=2) + "\n")
    lines = [
        f"What measure_noise_scale=True costs an optimizer step: SmolLM2-135M-Instruct, {args.micro} micro-batches "
        f"of 1 x {args.seq_len} tokens, AdamW, CPU (1 thread), median of {args.rounds} interleaved rounds' ratios "
        "(quartiles). Method: benchmarks/noise_scale_cost.py.",
        "",
        "| method | trainable parameters | step, off | step, on | cost of the reads |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        low, _, high = r["overhead_quartiles"]
        lines.append(
            f"| {r['method']} | {r['trainable_parameters']:,} | {r['step_s_off']:.2f} s | {r['step_s_on']:.2f} s | "
            f"{100 * r['overhead']:+.1f}% [{100 * low:+.1f}%, {100 * high:+.1f}%] |"
        )
    (OUT / "cost_cpu.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
