"""dropbp's own CPU time per training forward: what its hooks, sampler and bookkeeping add to a step.

A model whose arithmetic costs next to nothing (SmolLM2-135M's layout, 30 layers and 60 branches, at width 16 and 8
tokens) makes a training forward mostly Python, so the time dropbp adds shows: the same model without the library,
with dropbp at drop rate 0 (every hook runs, nothing drops) and at 0.5 (the shipped cut), forward alone and
forward+backward, the best of ``--repeats`` means over ``--forwards`` forwards each, interleaved. The added time is
then set against a real forward of SmolLM2-135M with LoRA at 128 tokens on this machine (the issue's yardstick: at
most 2%), and given in microseconds per forward and per branch call for GPU users, whose forwards are short.

    python benchmarks/hot_path.py

Writes benchmarks/results/hot_path_cpu.{json,md}.
"""

from __future__ import annotations

import argparse
import copy
import json
import shlex
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

import torch
from lazy_graphs import smollm2_layout

import dropbp

RESULTS = Path(__file__).resolve().parent / "results"


def mean_seconds(model: torch.nn.Module, ids: torch.Tensor, forwards: int, backward: bool) -> float:
    start = time.perf_counter()
    for _ in range(forwards):
        loss = model(input_ids=ids, labels=ids).loss
        if backward:
            loss.backward()
    return (time.perf_counter() - start) / forwards


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--forwards", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--stem", default="hot_path_cpu", help="file names of the record: <stem>.json and .md")
    parser.add_argument("--layers", type=int, default=30, help="decoder layers (30: SmolLM2-135M's depth)")
    args = parser.parse_args()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # dropbp's time is Python time: one thread, and no OpenMP spinning in between
    base = smollm2_layout(64, width=16, layers=args.layers)  # arithmetic next to nothing: mostly Python
    # every configuration a copy of one model, the baseline too: a deep copy alone ran 7% faster than the model it
    # was copied from (its tensors laid out afresh), which made dropbp at rate 0 read faster than no library
    models = {"without dropbp": copy.deepcopy(base)}
    for name, rate in (("dropbp, drop rate 0", 0.0), ("dropbp 0.5 (cut)", 0.5)):
        models[name] = copy.deepcopy(base)
        ctl = dropbp.apply(models[name], rate, seed=0)
    branches = len(ctl.branches)
    ids = torch.randint(3, 64, (1, 8), generator=torch.Generator().manual_seed(0))
    best: dict[tuple[str, bool], float] = {}
    for backward in (False, True):
        for model in models.values():  # warm-up
            mean_seconds(model, ids, 5, backward)
        for _ in range(args.repeats):  # interleaved: a busy moment hits every configuration alike
            for name, model in models.items():
                t = mean_seconds(model, ids, args.forwards, backward)
                best[name, backward] = min(best.get((name, backward), t), t)
    torch.set_num_threads(threads)  # the yardstick as a user runs it: every core (a shorter forward: the harder test)
    real = _smollm2_lora_forward()
    rows = []
    for name in models:
        for backward in (False, True):
            added = best[name, backward] - best["without dropbp", backward]
            rows.append(
                {
                    "config": name,
                    "backward": backward,
                    "seconds": best[name, backward],
                    "added_us": added * 1e6,
                    "x_plain": best[name, backward] / best["without dropbp", backward],
                    "added_us_per_branch_call": added * 1e6 / branches,
                    "added_share_of_smollm2_lora_forward": added / real if real else None,
                }
            )
    record = {
        "benchmark": "hot_path",
        "date": date.today().isoformat(),
        "command": "python " + shlex.join(sys.argv),
        "commit": _commit(),
        "torch": torch.__version__,
        "branches": branches,
        "smollm2_lora_forward_128_s": real,
        "smollm2_threads": threads,
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.stem}.json").write_text(json.dumps(record, indent=2) + "\n")
    lines = [
        f"dropbp's own time per training forward, CPU (one thread), torch {torch.__version__}, {record['date']}: "
        f"SmolLM2-135M's layout at {args.layers} layers ({branches} branches), width 16 and 8 tokens, "
        f"best of {args.repeats} interleaved "
        f"means over {args.forwards} forwards. Yardstick: a real SmolLM2-135M LoRA training forward at 128 tokens here "
        f"took {real * 1e3:.1f} ms ({threads} threads). dropbp at commit {record['commit']}.",
        f"Command: `{record['command']}`",
        "",
        "| configuration | measured | time/forward | x plain | added by dropbp | per branch call | share of a SmolLM2 "
        "LoRA forward (128 tokens) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        share = "" if r["config"] == "without dropbp" else f"{100 * r['added_share_of_smollm2_lora_forward']:.2f}%"
        lines.append(
            f"| {r['config']} | {'forward+backward' if r['backward'] else 'forward'} | {r['seconds'] * 1e3:.2f} ms | "
            f"{r['x_plain']:.3f} | "
            f"{r['added_us']:.0f} us | {r['added_us_per_branch_call']:.1f} us | {share} |"
        )
    (args.out / f"{args.stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _commit() -> str:
    """The commit of the dropbp measured (the checkout this script runs from), with ``+`` if it has changes."""
    root = Path(__file__).resolve().parent.parent
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True)
    status = ["git", "status", "--porcelain", "dropbp", "backends"]
    dirty = subprocess.run(status, cwd=root, capture_output=True, text=True)
    return head.stdout.strip() + ("+" if dirty.stdout.strip() else "")


def _smollm2_lora_forward() -> float:
    """The best of 5 training forwards of SmolLM2-135M with LoRA at 128 tokens, without dropbp."""
    from dropbp.tools.bench import build_model

    model = build_model("smollm2", "lora", 128, torch.float32, torch.device("cpu"))
    ids = torch.randint(3, 1000, (1, 128), generator=torch.Generator().manual_seed(0))
    mean_seconds(model, ids, 1, False)
    return min(mean_seconds(model, ids, 1, False) for _ in range(5))


if __name__ == "__main__":
    main()
