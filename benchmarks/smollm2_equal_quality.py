"""SmolLM2-135M's speedup at equal quality (issue 40): the map's figure, confirmed on the real model.

LoRA on Python's help text, 8 micro-batches of 128 tokens per optimizer step (1k tokens), 100 steps: the map's
100 x 1k cell, the one whose SmolLM2 runs fit these 2 cores. Per seed, from complete runs of ``convergence.py``
(each its own warm-up + cosine schedule, each arm at its own best learning rate from the same grid, swept on seed 0
by ``--grid default --lr X`` at 1e-3, 2e-3 and 4e-3: full backprop's best and DropBP's at its equal-time budget are
both 2e-3, ``convergence_default_lora_pydoc_accumulate_lrs.md``):

- full backprop at 50, 100 and 200 steps: its frontier;
- DropBP 0.5 (the shipped default) at 100 steps and at 135 (its equal-time budget).

Time is counted in full-backprop steps of the same lockstep run: a run's training time over full backprop's time
per step in the run that timed both (a full-backprop run is its number of steps). So runs timed on another day, or
under another load, still share one time axis. Speedup at equal quality = the steps full backprop needs to reach
DropBP's final loss (``dropbp.tools.frontier``) over DropBP's time in those steps; mean and 95% interval over seeds.

    python benchmarks/smollm2_equal_quality.py            # reads the records below, writes the table

Records: ``convergence_default_lora_pydoc_accumulate[_seedN].json`` (full at 100, DropBP at 100 and 135, one
lockstep run per seed), ``convergence_budget_lora_pydoc_0.002_accumulate[_seedN]_budget{50,200}.json`` (full backprop
alone at 50 and 200 steps: ``convergence.py --grid lr`` records, renamed so that ``swept_lr`` does not read them)
and ``convergence_equal-quality_lora_pydoc_accumulate_seedN.json`` (all five in one lockstep run:
``convergence.py --grid equal-quality``). Writes ``smollm2_equal_quality.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
from datetime import date
from pathlib import Path

from dropbp.tools.frontier import equal_quality_speedup, over_seeds

RESULTS = Path(__file__).resolve().parent / "results"
STEM = "lora_pydoc_accumulate"
DROPBP_RUNS = {"DropBP 0.5, equal steps": "L steps", "DropBP 0.5, equal time": "equal time"}


def _suffix(seed: int) -> str:
    return f"_seed{seed}" if seed else ""


def _summary(path: Path) -> list[dict]:
    return json.loads(path.read_text())["summary"]


def _in_full_steps(rows: list[dict]) -> dict[str, tuple[float, float]]:
    """Each run of one lockstep record as (time in full-backprop steps, final validation loss)."""
    full = next(r for r in rows if r["run"] == "full backprop")
    per_step = full["train_s"] / full["steps"]
    return {r["run"]: (r["train_s"] / per_step, r["final_val_loss"]) for r in rows}


def seed_runs(results: Path, seed: int) -> tuple[list[tuple[float, float]], dict[str, tuple[float, float]]]:
    """Full backprop's complete runs (steps, final loss) and DropBP's (time in full steps, final loss) for ``seed``."""
    together = results / f"convergence_equal-quality_{STEM}{_suffix(seed)}.json"
    if together.exists():
        runs = _in_full_steps(_summary(together))
        full = [t_loss for name, t_loss in runs.items() if name.startswith("full backprop")]
        dropbp = {DROPBP_RUNS["DropBP 0.5, equal steps"]: runs["DropBP 0.5, 100 steps"]}
        dropbp[DROPBP_RUNS["DropBP 0.5, equal time"]] = runs["DropBP 0.5, 135 steps"]
        return full, dropbp
    runs = _in_full_steps(_summary(results / f"convergence_default_{STEM}{_suffix(seed)}.json"))
    full = [runs["full backprop"]]
    for budget in (50, 200):
        path = results / f"convergence_budget_lora_pydoc_0.002_accumulate{_suffix(seed)}_budget{budget}.json"
        (row,) = _summary(path)
        full.append((float(row["steps"]), row["final_val_loss"]))
    return full, {label: runs[name] for name, label in DROPBP_RUNS.items()}


def table(results: Path, seeds: list[int]) -> dict:
    per_seed = {seed: seed_runs(results, seed) for seed in seeds}
    rows = []
    for label in DROPBP_RUNS.values():
        readings = [equal_quality_speedup(full, *dropbp[label]) for full, dropbp in (per_seed[s] for s in seeds)]
        rows.append(
            {
                "run": f"DropBP 0.5, {label}",
                "time_in_full_steps": [per_seed[s][1][label][0] for s in seeds],
                "final_loss": [per_seed[s][1][label][1] for s in seeds],
                "speedup": over_seeds(readings),
            }
        )
    return {
        "benchmark": "smollm2_equal_quality",
        "date": date.today().isoformat(),
        "model": "SmolLM2-135M-Instruct",
        "setting": "LoRA r=8 on every linear layer, pydoc, 8 micro-batches of 1 x 128 tokens per step, weight decay "
        "0.01, lr warm-up 10% + cosine over each run's own steps, cpu (2 cores)",
        "lr": {"full backprop": 2e-3, "DropBP 0.5": 2e-3, "grid": [1e-3, 2e-3, 4e-3]},
        "seeds": seeds,
        "full_backprop": {str(s): sorted(per_seed[s][0]) for s in seeds},
        "rows": rows,
    }


def markdown(record: dict) -> str:
    seeds = record["seeds"]
    lines = [
        f"Speedup at equal quality on {record['model']} ({record['setting']}); learning rates: full backprop "
        f"{record['lr']['full backprop']:g}, DropBP {record['lr']['DropBP 0.5']:g}, each its own best of "
        f"{', '.join(f'{x:g}' for x in record['lr']['grid'])} on seed 0; seeds {', '.join(map(str, seeds))} "
        f"({record['date']}). Time in full-backprop steps of the same lockstep run. Method: "
        "benchmarks/smollm2_equal_quality.py, docs/where-it-pays.md.",
        "",
        "| run | time (full-backprop steps) | final val loss | speedup at equal quality, per seed | mean [95%] |",
        "|---|---|---|---|---|",
    ]
    for row in record["rows"]:
        s = row["speedup"]
        per = " / ".join(
            ("" if p["bound"] == "exact" else {"at least": ">= ", "at most": "<= "}[p["bound"]]) + f"{p['value']:.2f}x"
            for p in s["per_seed"]
        )
        bounded = f" ({s['bounded']} of {s['seeds']} seeds a bound)" if s["bounded"] else ""
        lines.append(
            f"| {row['run']} | {' / '.join(f'{t:.0f}' for t in row['time_in_full_steps'])} | "
            f"{' / '.join(f'{x:.4f}' for x in row['final_loss'])} | {per} | **{s['mean']:.2f}x** "
            f"[{s['low']:.2f}, {s['high']:.2f}]{bounded} |"
        )
    head = "Full backprop's complete runs at 50, 100 and 200 steps (time in full-backprop steps: final val loss):"
    lines += ["", head, ""]
    for seed, points in record["full_backprop"].items():
        lines.append(f"- seed {seed}: " + ", ".join(f"time {t:.0f}: {loss:.4f}" for t, loss in points))
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    record = table(args.results, args.seeds)
    (args.results / "smollm2_equal_quality.json").write_text(json.dumps(record, indent=2) + "\n")
    (args.results / "smollm2_equal_quality.md").write_text(markdown(record))
    print(markdown(record))


if __name__ == "__main__":
    main()
