"""The longest trainable sequence of the shipped default at a high drop rate, against full backprop with and without
activation checkpointing, and each one's step time at its longest length.

SmolLM2-135M-Instruct, LoRA, micro-batch 1, float32 on the CPU, a budget of peak resident memory for the whole
process. Each length is one real training step in a fresh process (:mod:`dropbp.tools.memprobe`); the search is
``dropbp bench --max-seq-len``'s (a grid of lengths 256 x 2^(k/4), doubling then bisection). The shipped default
(the cut, the memory bound on at this rate) trains the first step of the first seed whose cut keeps every branch
there: the step in which the bound does the most.

    python benchmarks/longest_sequence.py                  # 0.875, budget 3 GiB

Writes benchmarks/results/longest_sequence_<rate>.{json,md}.
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


def configs(rate: float, seed: int) -> dict[str, tuple[float, bool, dict]]:
    """Name -> (drop rate, chunked loss, the probe's other settings)."""
    default = {"pattern": "cut", "memory_bound": True, "seed": seed, "steps": 1}
    return {
        "full backprop": (0.0, False, {}),
        "full backprop, checkpointing on": (0.0, False, {"checkpointing": True}),
        "full backprop, checkpointing on, chunked loss": (0.0, True, {"checkpointing": True}),
        f"DropBP default {rate:g}": (rate, False, default),
        f"DropBP default {rate:g}, chunked loss": (rate, True, default),
        f"DropBP default {rate:g}, checkpointing on, chunked loss": (rate, True, {**default, "checkpointing": True}),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=0.875)
    parser.add_argument("--budget", default="3GiB", help="peak resident memory of the whole process")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--configs", nargs="+", help="measure only these configurations (names as in the table) and keep the record's "
        "other rows, each with the date it was measured"
    )  # fmt: skip
    args = parser.parse_args()
    budget = parse_size(args.budget)
    seed = worst_case_seed(args.rate, 1)
    say = lambda text: print(text, file=sys.stderr, flush=True)  # noqa: E731
    stem = f"longest_sequence_{args.rate:g}"
    chosen = configs(args.rate, seed)
    unknown = set(args.configs or ()) - set(chosen)
    if unknown:
        parser.error(f"unknown configurations {sorted(unknown)}; known: {sorted(chosen)}")
    previous: dict[str, dict] = {}
    if args.configs and (args.out / f"{stem}.json").is_file():
        old = json.loads((args.out / f"{stem}.json").read_text())
        previous = {r["config"]: {"date": old["date"], **r} for r in old["rows"]}
    rows = []
    for name, (rate, chunked, common) in chosen.items():
        if args.configs and name not in args.configs:
            if name in previous:
                rows.append(previous[name])
            continue
        found = longest_sequence("smollm2", "lora", [rate], chunked, budget, common, say=say)[str(rate)]
        fitting = [p for p in found["probes"] if p["fits"] and p["seq_len"] == found["longest"]]
        step_s = min(fitting[0]["step_s"]) if fitting else None
        rows.append(
            {"config": name, "date": date.today().isoformat(), "longest": found["longest"], "step_s": step_s,
             "probes": found["probes"]}
        )  # fmt: skip
        say(f"{name}: {found['longest']} tokens")
    record = {
        "benchmark": "longest_sequence",
        "date": date.today().isoformat(),
        "command": "python " + shlex.join(sys.argv),
        "torch": torch.__version__,
        "rate": args.rate,
        "budget_bytes": budget,
        "seed": seed,
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.json").write_text(json.dumps(record, indent=2) + "\n")
    by_name = {r["config"]: r["longest"] for r in rows}
    base, ckpt = by_name["full backprop"], by_name["full backprop, checkpointing on"]
    fair = by_name.get("full backprop, checkpointing on, chunked loss")
    lines = [
        f"Longest trainable sequence, SmolLM2-135M LoRA, micro-batch 1, budget {budget / 2**30:.2f} GiB of peak "
        f"resident memory (whole process, glibc's mmap threshold fixed at 64 KiB), CPU float32, torch "
        f"{torch.__version__}; the default's step is the first of seed {seed} (its cut keeps every branch). Search "
        "grid: 256 x 2^(k/4) tokens, multiples of 64. Like for like: DropBP with the chunked loss against full "
        "backprop with checkpointing and the same chunked loss (the fifth column).",
        f"Command: `{record['command']}`",
        "",
        "| configuration | longest (tokens) | vs full backprop | vs full backprop + checkpointing | vs full backprop "
        "+ checkpointing + chunked loss | step at it | measured |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        step = f"{r['step_s']:.1f} s" if r["step_s"] else "-"
        versus_fair = f"{r['longest'] / fair:.2f}x" if fair else "not measured"
        lines.append(
            f"| {r['config']} | {r['longest']} | {r['longest'] / base:.2f}x | {r['longest'] / ckpt:.2f}x | "
            f"{versus_fair} | {step} | {r.get('date', record['date'])} |"
        )
    (args.out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
