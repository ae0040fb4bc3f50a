"""The longest trainable sequence at 0.875 with the shipped default, against full backprop with and without activation
checkpointing (what users do today to fit long sequences). SmolLM2-135M-Instruct, LoRA, micro-batch 1, float32 on
the CPU, within a budget of peak resident memory for the whole process; every probe is a real training step in a
fresh process (:func:`dropbp.tools.membench.longest_sequence`). The DropBP probes use a seed whose first step's cut
keeps every branch (the default cut's worst step), so the figure is what holds at every step.

    python benchmarks/longest_sequence.py   # budget 3 GiB, as benchmarks/results/memory_smollm2_lora_longest

Writes benchmarks/results/longest_sequence_0.875.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from datetime import date
from pathlib import Path

import torch
from bounded_memory import worst_case_seed

from dropbp.tools.membench import longest_sequence, parse_size

RESULTS = Path(__file__).resolve().parent / "results"
RATE = 0.875


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", default="3GiB")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    budget = parse_size(args.budget)
    seed = worst_case_seed(RATE, 1)
    default = {"pattern": "cut", "memory_bound": True, "seed": seed}
    configs = [  # (name, drop rate, chunked loss, probe settings)
        ("full backprop", 0.0, False, {}),
        ("full backprop + checkpointing", 0.0, False, {"checkpointing": True}),
        ("full backprop + checkpointing, chunked loss", 0.0, True, {"checkpointing": True}),
        (f"DropBP {RATE} (shipped default: cut, bounded)", RATE, False, default),
        (f"DropBP {RATE} (shipped default: cut, bounded), chunked loss", RATE, True, default),
    ]
    rows = []
    for name, rate, chunked, common in configs:
        found = longest_sequence(
            "smollm2", "lora", [rate], chunked, budget, common, say=lambda text: print(text, file=sys.stderr)
        )[str(rate)]
        rows.append({"config": name, "rate": rate, "chunked": chunked, **common, **found})
        print(f"{name}: {found['longest']} tokens", file=sys.stderr, flush=True)
    record = {
        "benchmark": "longest_sequence",
        "date": date.today().isoformat(),
        "command": "python " + shlex.join(sys.argv),
        "torch": torch.__version__,
        "budget_bytes": budget,
        "seed": seed,
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"longest_sequence_{RATE:g}"
    (args.out / f"{stem}.json").write_text(json.dumps(record, indent=2) + "\n")
    plain = rows[0]["longest"]
    lines = [
        f"Longest trainable sequence, SmolLM2-135M LoRA, micro-batch 1, budget {args.budget} of peak resident memory "
        f"(whole process), CPU float32, torch {torch.__version__}, {record['date']}; grid 256 x 2^(k/4). DropBP "
        f"probes use seed {seed}, whose first step's cut keeps every branch.",
        f"Command: `{record['command']}`",
        "",
        "| configuration | longest (tokens) | vs full backprop | step at that length (s) |",
        "|---|---|---|---|",
    ]
    for r in rows:
        fitting = [p for p in r["probes"] if p.get("fits") and p["seq_len"] == r["longest"]]
        step = f"{fitting[-1]['step_s'][-1]:.1f}" if fitting and fitting[-1].get("step_s") else "n/a"
        lines.append(f"| {r['config']} | {r['longest']} | {r['longest'] / plain:.2f}x | {step} |")
    (args.out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
