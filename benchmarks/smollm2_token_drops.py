"""Token drops on SmolLM2-135M, the README's cell (issue 49): the proxy's token arms on the real model.

The cell is ``benchmarks/smollm2_equal_quality.py``'s: LoRA r=8 on every linear layer of SmolLM2-135M-Instruct,
Python's help text, 8 micro-batches of 1 x 128 tokens per optimizer step, weight decay 0.01, warm-up + cosine over
each run's own steps, 100 steps. Full backprop's frontier (complete runs at 50, 100 and 200 steps, lr 2e-3, its
best of 1e-3, 2e-3 and 4e-3, seeds 0-2) and branch drops at 0.5 are that script's records. Each token arm here:

- one complete run per learning rate of the same grid on seed 0, at its equal-time budget (100 full-backprop steps
  times the arm's step speedup); the best learning rate (lowest final validation loss) then runs on seeds 1 and 2;
- time in full-backprop steps MODELLED from ``dropbp bench``'s SmolLM2 LoRA token-drop step speedups
  (``bench_tokens_cpu/lora/bench.json``, 512 tokens a micro-batch: these runs' 128-token micro-batches were not
  benched), as benchmarks/token_drops.py models the proxy's; each run's own wall time is recorded beside it;
- speedup at equal quality against full backprop's frontier, per seed, mean and 95% interval.

    python benchmarks/smollm2_token_drops.py --train tokens0.5 --lr 2e-3 --seed 0   # one run (one thread)
    python benchmarks/smollm2_token_drops.py --train tokens0.5 --lr best --seed 1   # seed 0's best lr
    python benchmarks/smollm2_token_drops.py --report                               # .md / .json
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from datetime import date
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
OUT = HERE / "results" / "smollm2_token_drops"
COST_RECORD = HERE / "results" / "bench_tokens_cpu" / "lora" / "bench.json"
GRID = (1e-3, 2e-3, 4e-3)  # full backprop's and branch drops' grid on this cell
FULL_STEPS = 100


@dataclass(frozen=True)
class Arm:
    """A token-drop arm: ``token_drop_rate`` with ``token_selection``, no branch drops."""

    name: str
    rate: float
    selection: str = "gradient"


ARMS = {a.name: a for a in (Arm("tokens0.3", 0.3), Arm("tokens0.5", 0.5), Arm("tokens-random0.3", 0.3, "random"))}


def step_speedup(rate: float, record: Path = COST_RECORD) -> float:
    """``dropbp bench``'s measured SmolLM2 LoRA step speedup for token drops at ``rate``."""
    [point] = json.loads(record.read_text())["points"]
    for row in point["rows"]:
        if row["pattern"] == "tokens" and row["drop_rate"] == rate:
            return row["speedup"]
    raise SystemExit(f"{record} has no token-drop row at {rate}: run dropbp bench --token-drop-rates {rate}")


def load_runs(out: Path = OUT) -> list[dict]:
    path = out / "runs.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def best_lr(runs: list[dict], arm: str) -> float | None:
    """The grid's learning rate with the lowest final loss on seed 0, once the whole grid has run."""
    grid = {r["lr"]: r["final_loss"] for r in runs if r["arm"] == arm and r["seed"] == 0}
    return min(grid, key=grid.get) if set(GRID) <= set(grid) else None


def train(arm: Arm, lr: float, seed: int) -> dict:
    """One complete run of ``arm`` at its equal-time budget (one torch thread)."""
    torch.set_num_threads(1)
    import convergence  # a sibling script (run as a script, this folder is on the path): full backprop's LoRA

    from dropbp import backends
    from dropbp.tools.compare import Run, compare
    from dropbp.tools.pretrained import load_causal_lm
    from dropbp.tools.textdata import pydoc_topics

    steps = round(FULL_STEPS * step_speedup(arm.rate))
    model, tokenizer = load_causal_lm()
    torch.manual_seed(seed)  # LoRA's A matrices: the same start as full backprop's runs of this seed
    model = convergence.with_lora(model)
    data = pydoc_topics(tokenizer, 128, max_val_windows=16)
    run = Run(arm.name, 0.0, lr=lr, steps=steps, token_drop_rate=arm.rate, token_selection=arm.selection)
    started = time.perf_counter()
    [result] = compare(
        model, [run], data, steps=steps, lr=lr, batch_size=8, backend=backends.get("cpu"), eval_every=steps,
        seed=seed, accumulation=8, lr_schedule="cosine", weight_decay=0.01,
    )  # fmt: skip
    return {"arm": arm.name, "lr": lr, "seed": seed, "steps": steps, "final_loss": result.val_loss[-1],
            "wall_s": time.perf_counter() - started, "date": date.today().isoformat()}  # fmt: skip


def report(out: Path = OUT) -> dict:
    """Per arm with its whole grid run: the best lr and the speedup at equal quality over the seeds run."""
    import smollm2_equal_quality as eq  # full backprop's runs on this cell

    from dropbp.tools.frontier import equal_quality_speedup, over_seeds

    runs = load_runs(out)
    rows = []
    for arm in ARMS.values():
        lr = best_lr(runs, arm.name)
        if lr is None:
            continue
        speedup = step_speedup(arm.rate)
        at_best = sorted((r for r in runs if r["arm"] == arm.name and r["lr"] == lr), key=lambda r: r["seed"])
        readings = [
            equal_quality_speedup(eq.seed_runs(eq.RESULTS, r["seed"])[0], r["steps"] / speedup, r["final_loss"])
            for r in at_best
        ]
        rows.append(
            {
                "arm": arm.name,
                "lr": lr,
                "grid_seed0": {str(r["lr"]): r["final_loss"] for r in runs if r["arm"] == arm.name and r["seed"] == 0},
                "steps": at_best[0]["steps"],
                "step_speedup": speedup,
                "seeds": [r["seed"] for r in at_best],
                "final_loss": [r["final_loss"] for r in at_best],
                "speedup": over_seeds(readings),
            }
        )
    record = {"benchmark": "smollm2_token_drops", "date": date.today().isoformat(), "cost_record":
              str(COST_RECORD.relative_to(HERE.parent)), "grid": list(GRID), "rows": rows}  # fmt: skip
    (out / "smollm2_token_drops.json").write_text(json.dumps(record, indent=2) + "\n")
    (out / "smollm2_token_drops.md").write_text(markdown(record))
    return record


def markdown(record: dict) -> str:
    lines = [
        "Token drops on SmolLM2-135M-Instruct, the README's cell (LoRA r=8, pydoc, 8 x 128 tokens a step, 100 "
        "full-backprop steps): speedup at equal quality against full backprop's complete runs "
        "(benchmarks/smollm2_equal_quality.py's records), each arm at its own best learning rate of "
        f"{', '.join(f'{x:g}' for x in record['grid'])} on seed 0. Time MODELLED from the measured step speedups "
        f"({record['cost_record']}). Method: benchmarks/smollm2_token_drops.py.",
        "",
        "| arm | lr (seed 0's losses over the grid) | steps | step speedup | final val loss per seed | "
        "speedup at equal quality, per seed | mean [95%] |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in record["rows"]:
        s = row["speedup"]
        grid = ", ".join(f"{float(lr):g}: {loss:.4f}" for lr, loss in sorted(row["grid_seed0"].items()))
        per = " / ".join(
            ("" if p["bound"] == "exact" else {"at least": ">= ", "at most": "<= "}[p["bound"]]) + f"{p['value']:.2f}x"
            for p in s["per_seed"]
        )
        interval = f"[{s['low']:.2f}, {s['high']:.2f}]" if s["seeds"] > 1 else "(one seed)"
        lines.append(
            f"| {row['arm']} | **{row['lr']:g}** ({grid}) | {row['steps']} | {row['step_speedup']:.2f}x | "
            f"{' / '.join(f'{x:.4f}' for x in row['final_loss'])} | {per} | **{s['mean']:.2f}x** {interval} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--train", choices=sorted(ARMS))
    parser.add_argument("--lr", help="a learning rate of the grid, or 'best' (seed 0's best, once its grid ran)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--report", action="store_true")
    args = parser.parse_args()
    if args.report:
        print(markdown(report()))
        return
    if args.train is None or args.lr is None:
        parser.error("give --train ARM --lr LR (or --report)")
    lr = best_lr(load_runs(), args.train) if args.lr == "best" else float(args.lr)
    if lr is None:
        raise SystemExit(f"{args.train}: seed 0 has not run the whole grid {GRID}; no best learning rate yet")
    OUT.mkdir(parents=True, exist_ok=True)
    row = train(ARMS[args.train], lr, args.seed)
    with (OUT / "runs.jsonl").open("a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row))


if __name__ == "__main__":
    main()
