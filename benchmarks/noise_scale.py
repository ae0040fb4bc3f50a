"""The gradient noise scale on the map's cells, and what it forecasts against what the map measured (issue 50).

For each cell of the map (``where_it_pays.py``: the proxy fully fine-tuned on Python's help text, ``L`` optimizer
steps of ``T`` tokens), full backprop runs at the map's best learning rate for it, with the noise scale measured
(2 or more micro-batches of 512 tokens per step: the map's own accumulation), on 3 seeds; its ``estimate()`` is
read after every step. From that trajectory, per arm (branch drops at 0.5 and 0.75, full backprop at half the batch):

- the forecast worth of a step: the mean over the run of ``(1 + r) / (1 + r / q)`` with ``r = B_simple / T`` read at
  each step (from 10% of the run on: the estimate needs a few steps), ``q = 1 - p`` for branch drops at ``p`` and
  ``1/2`` for half the batch;
- the forecast speedup at equal quality against full backprop at the cell's batch: that worth times the arm's
  modelled step speedup (the map's cost record, as the map's own runs);
- what was measured: the map's equal-time speedup at equal quality (``where_it_pays/map.json``; for a cell the map
  did not run, benchmarks/token_drops.py's branch arms) and full backprop at half the batch against full backprop
  (``token_drops/token_drops.json``).

    python benchmarks/noise_scale.py --cells 100x1k 300x1k 1000x1k 100x8k 30x32k   # runs (resumable)
    python benchmarks/noise_scale.py --smollm2                               # the SmolLM2 cell, one seed
    python benchmarks/noise_scale.py --report                                # validation.md / .json / .png
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import statistics
import sys
import time
from datetime import date
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
OUT = HERE / "results" / "noise_scale"
SEEDS = (0, 1, 2)
START = 0.1  # the share of a run before its estimate counts (bias-corrected, smoothed over about 10 steps)
ARMS = {"branch0.5": 0.5, "branch0.75": 0.75, "full-half": None}


def _module(name: str):
    spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


wip = _module("where_it_pays")


def full_lr(cell) -> float:
    """Full backprop's best learning rate at ``cell``: the map's, else benchmarks/token_drops.py's (new cells)."""
    lr = wip.best_lr(wip.load_done(wip.OUT / "runs.jsonl"), cell, None)
    if lr is None:
        td = _module("token_drops")
        lr = td.best_lr(td.load_runs(), cell, td.BY_NAME["full"], td.Cost.from_bench(td.COST_RECORD))
    if lr is None:
        raise SystemExit(f"neither the map nor token_drops.py has full backprop's best learning rate at {cell.name}")
    return lr


def train(cell, seed: int) -> dict:
    """One complete run of full backprop with the noise scale measured (one thread)."""
    torch.set_num_threads(1)
    import transformers
    from transformers import LlamaForCausalLM

    from dropbp import backends
    from dropbp.tools.compare import Run, compare
    from dropbp.tools.textdata import pydoc_topics

    transformers.logging.set_verbosity_error()
    model = LlamaForCausalLM(wip.proxy_config())
    model.load_state_dict(torch.load(wip.pretrained_proxy(), weights_only=True))
    data = pydoc_topics(wip.ByteTokenizer(), wip.SEQ_LEN, max_val_windows=wip.VAL_WINDOWS)
    lr = full_lr(cell)
    sequences = cell.tokens // wip.SEQ_LEN
    started = time.perf_counter()
    [result] = compare(
        model,
        [Run("full", 0.0, lr=lr, steps=cell.steps, measure_noise_scale=True)],
        data,
        steps=cell.steps,
        lr=lr,
        batch_size=sequences,
        backend=backends.get("cpu"),
        eval_every=cell.steps,
        seed=seed,
        accumulation=max(1, sequences // wip.MICRO_SEQUENCES),
        lr_schedule="cosine",
        weight_decay=wip.WEIGHT_DECAY,
    )
    return {"cell": cell.name, "seed": seed, "lr": lr, "tokens": cell.tokens, "steps": cell.steps,
            "noise_scale": result.noise_scale, "final_loss": result.val_loss[-1],
            "wall_s": time.perf_counter() - started}  # fmt: skip


SMOLLM2 = "smollm2-lora-100x1k"  # the README's regime: benchmarks/smollm2_equal_quality.py's cell


def train_smollm2(seed: int) -> dict:
    """Full backprop on SmolLM2-135M-Instruct as benchmarks/smollm2_equal_quality.py ran it (LoRA r=8 on every
    linear layer, Python's help text, 8 micro-batches of 1 x 128 tokens, lr 2e-3 warm-up + cosine, weight decay
    0.01, 100 steps), with the noise scale measured (one thread)."""
    torch.set_num_threads(1)
    from dropbp import backends
    from dropbp.tools.compare import Run, compare
    from dropbp.tools.pretrained import load_causal_lm
    from dropbp.tools.qlora import with_lora
    from dropbp.tools.textdata import pydoc_topics

    model, tokenizer = load_causal_lm()
    model = with_lora(model)
    data = pydoc_topics(tokenizer, 128)
    started = time.perf_counter()
    [result] = compare(
        model, [Run("full", 0.0, lr=2e-3, steps=100, measure_noise_scale=True)], data, steps=100, lr=2e-3,
        batch_size=8, backend=backends.get("cpu"), eval_every=100, seed=seed, accumulation=8,
        lr_schedule="cosine", weight_decay=0.01,
    )  # fmt: skip
    return {"cell": SMOLLM2, "seed": seed, "lr": 2e-3, "tokens": 1024, "steps": 100,
            "noise_scale": result.noise_scale, "final_loss": result.val_loss[-1],
            "wall_s": time.perf_counter() - started}  # fmt: skip


def load_runs() -> dict[str, dict]:
    path = OUT / "runs.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return {f"{r['cell']}/seed{r['seed']}": r for r in rows}


def run_cells(cells: list, seeds: tuple[int, ...] = SEEDS) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    done = load_runs()
    started = time.perf_counter()
    for cell in cells:
        for seed in seeds:
            if f"{getattr(cell, 'name', cell)}/seed{seed}" in done:
                continue
            row = train_smollm2(seed) if cell == SMOLLM2 else train(cell, seed)
            with (OUT / "runs.jsonl").open("a") as f:
                f.write(json.dumps(row) + "\n")
            elapsed = time.perf_counter() - started
            print(f"[{elapsed:6.0f} s] {row['cell']}/seed{seed}: noise scale start {_start(row):.0f}, end "
                  f"{row['noise_scale'][-1]:.0f} tokens ({row['wall_s']:.0f} s)", flush=True)  # fmt: skip


def _start(row: dict) -> float:
    return row["noise_scale"][max(1, round(START * row["steps"]))]


def _smollm2_step_speedup() -> float:
    """DropBP 0.5's step speedup on the SmolLM2 cell: its 135 steps over their time in full-backprop steps."""
    record = json.loads((HERE / "results" / "smollm2_equal_quality.json").read_text())
    row = next(r for r in record["rows"] if r["run"] == "DropBP 0.5, equal time")
    return 135 * len(row["time_in_full_steps"]) / sum(row["time_in_full_steps"])


def _step_speedup(cell, arm: str) -> float:
    if cell == SMOLLM2:
        if arm == "full-half":
            return 2.0  # half the micro-batches of the same shape: smollm2_token_drops.py's model of its time
        if arm != "branch0.5":
            raise KeyError(arm)  # branch drops on SmolLM2 ran at 0.5 only
        return _smollm2_step_speedup()
    cost = wip.StepCost.from_bench(wip.COST_RECORD)
    if ARMS[arm] is None:
        return cost.step_seconds(0.0, cell.tokens) / cost.step_seconds(0.0, cell.tokens // 2)
    return cost.speedup(ARMS[arm], cell.tokens)


def forecast(row: dict, arm: str) -> tuple[float, float]:
    """(mean worth of a step over the run, speedup at equal quality) the run's noise scale forecasts for ``arm``."""
    from dropbp.policy.noise_scale import step_worth

    kept = 0.5 if ARMS[arm] is None else 1.0 - ARMS[arm]
    tokens = row["tokens"]
    read = [n for n in row["noise_scale"][max(1, round(START * row["steps"])) :] if n is not None]
    worth = sum(step_worth(kept, n / tokens if math.isfinite(n) else math.inf) for n in read) / len(read)
    cell = SMOLLM2 if row["cell"] == SMOLLM2 else wip.Cell.parse(row["cell"])
    return worth, worth * _step_speedup(cell, arm)


def measured(cell_name: str) -> dict[str, dict]:
    """What the map (branch drops, equal time) and token_drops.py (half the batch) measured against full backprop;
    on the SmolLM2 cell, benchmarks/smollm2_equal_quality.py's DropBP 0.5 at equal time and
    benchmarks/smollm2_token_drops.py's half batch."""
    found = {}
    if cell_name == SMOLLM2:
        record = json.loads((HERE / "results" / "smollm2_equal_quality.json").read_text())
        found["branch0.5"] = next(r for r in record["rows"] if r["run"] == "DropBP 0.5, equal time")["speedup"]
        tokens = json.loads((HERE / "results" / "smollm2_token_drops" / "smollm2_token_drops.json").read_text())
        half = next((r for r in tokens["rows"] if r["arm"] == "full-half"), None)
        if half is not None and len(half["seeds"]) == len(SEEDS):  # the half batch, once on every seed
            found["full-half"] = half["full"]
        return found
    for c in json.loads((wip.OUT / "map.json").read_text())["cells"]:
        if c["cell"] == cell_name:
            for arm, rate in ARMS.items():
                if rate is not None:
                    found[arm] = next(b for b in c[f"{rate:g}"].values() if b["equal_time"])
    tokens = json.loads((HERE / "results" / "token_drops" / "token_drops.json").read_text())
    for c in tokens["cells"]:
        if c["cell"] != cell_name:
            continue
        if "half_batch" in c:
            found["full-half"] = c["half_batch"]["full"]
        for arm, rate in ARMS.items():  # a cell the map did not run (benchmarks/token_drops.py ran its branch arms)
            budgets = c["arms"].get(arm)
            if rate is not None and arm not in found and budgets:
                found[arm] = next(b for b in budgets.values() if b["equal_time"])["full"]
    return found


def report() -> None:
    runs = load_runs()
    cells = sorted({wip.Cell.parse(r["cell"]) for r in runs.values() if r["cell"] != SMOLLM2},
                   key=lambda c: (c.tokens, c.steps))  # fmt: skip
    cells += [SMOLLM2] if any(r["cell"] == SMOLLM2 for r in runs.values()) else []
    rows = []
    for cell in cells:
        name = getattr(cell, "name", cell)
        seeds = [runs[f"{name}/seed{s}"] for s in SEEDS if f"{name}/seed{s}" in runs]
        seen = measured(name)
        for arm in ARMS if cell != SMOLLM2 else ["branch0.5", *(["full-half"] if "full-half" in seen else [])]:
            predicted = [forecast(r, arm) for r in seeds]
            got = seen.get(arm)
            mean_got = None if got is None else got["mean"]
            rows.append({
                "cell": name, "arm": arm, "seeds": len(seeds),
                "noise_start": statistics.median(_start(r) for r in seeds),
                "noise_end": statistics.median(r["noise_scale"][-1] for r in seeds),
                "step_speedup": _step_speedup(cell, arm),
                "forecast_worth": sum(w for w, _ in predicted) / len(predicted),
                "forecast": sum(s for _, s in predicted) / len(predicted),
                "measured": mean_got, "measured_low": None if got is None else got["low"],
                "measured_high": None if got is None else got["high"],
            })  # fmt: skip
    record = {"benchmark": "noise_scale", "date": date.today().isoformat(), "seeds": SEEDS, "start": START,
              "torch": torch.__version__, "rows": rows}  # fmt: skip
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "validation.json").write_text(json.dumps(record, indent=2) + "\n")
    lines = [
        "The gradient noise scale of full backprop on the map's cells and the README's SmolLM2 cell (median of the "
        "seeds: 3 on the proxy, 1 on SmolLM2 (LoRA, lr 2e-3); read at 10% of the run "
        "and at its end; inf where the estimate of |G|^2 was not positive) and the speedup at equal quality it "
        "forecasts against full backprop at the cell's batch, beside the one measured (the map's equal-time runs; "
        "full backprop at half the batch from benchmarks/token_drops.py; mean [95% interval] over 3 seeds). "
        "Forecast: a step keeping a random share q of its samples is worth (1 + r) / (1 + r / q), r = B_simple / "
        "tokens per step, averaged over the run, times the modelled step speedup. Method: benchmarks/noise_scale.py.",
        "",
        "| cell | arm | noise scale at 10% / end (tokens) | step speedup | forecast worth of a step | forecast speedup "
        "| measured speedup | forecast - measured |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        got = "not measured" if r["measured"] is None else (
            f"{r['measured']:.2f}x [{r['measured_low']:.2f}, {r['measured_high']:.2f}]")  # fmt: skip
        error = "" if r["measured"] is None else f"{r['forecast'] - r['measured']:+.2f}"
        lines.append(
            f"| {r['cell']} | {r['arm']} | {r['noise_start']:,.0f} / {r['noise_end']:,.0f} | {r['step_speedup']:.2f}x "
            f"| {r['forecast_worth']:.2f} | {r['forecast']:.2f}x | {got} | {error} |"
        )
    (OUT / "validation.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    _plot(rows)


def _plot(rows: list[dict]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is missing: validation.png not drawn (the table and JSON are written)")
        return
    fig, ax = plt.subplots(figsize=(5.5, 5))
    marks = {"branch0.5": "o", "branch0.75": "s", "full-half": "^"}
    for arm, mark in marks.items():
        pts = [r for r in rows if r["arm"] == arm and r["measured"] is not None]
        below = [r["measured"] - r["measured_low"] for r in pts]
        above = [r["measured_high"] - r["measured"] for r in pts]
        x, y = [r["forecast"] for r in pts], [r["measured"] for r in pts]
        ax.errorbar(x, y, yerr=[below, above], fmt=mark, label=arm, capsize=3)
        for r in pts:
            where = (r["forecast"], r["measured"])
            ax.annotate(r["cell"], where, fontsize=7, xytext=(4, 2), textcoords="offset points")
    ax.plot([0.3, 1.6], [0.3, 1.6], color="grey", lw=0.8, ls="--")
    ax.set_xlabel("forecast speedup at equal quality (from the noise scale)")
    ax.set_ylabel("measured speedup at equal quality")
    ax.set_title("Noise-scale forecast against the map (proxy, CPU-modelled time)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(OUT / "validation.png", dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", nargs="+", type=wip.Cell.parse, default=[])
    parser.add_argument("--smollm2", action="store_true", help="also the SmolLM2 cell (one seed: minutes a run here)")
    parser.add_argument("--report", action="store_true")
    args = parser.parse_args()
    if args.cells:
        run_cells(args.cells)
    if args.smollm2:
        run_cells([SMOLLM2], seeds=(0,))
    if args.report:
        report()


if __name__ == "__main__":
    main()
