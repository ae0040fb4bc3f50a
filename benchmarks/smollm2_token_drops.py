"""Token drops on SmolLM2-135M, the README's cell (issue 49): the proxy's token arms on the real model.

The cell is ``benchmarks/smollm2_equal_quality.py``'s: LoRA r=8 on every linear layer of SmolLM2-135M-Instruct,
Python's help text, 8 micro-batches of 1 x 128 tokens per optimizer step, weight decay 0.01, warm-up + cosine over
each run's own steps, 100 steps. Full backprop's frontier (complete runs at 50, 100 and 200 steps, lr 2e-3, its
best of 1e-3, 2e-3 and 4e-3, seeds 0-2) and branch drops at 0.5 are that script's records. Each token arm here:

- one complete run per learning rate of the same grid on seed 0, at its equal-time budget (100 full-backprop steps
  times the arm's step speedup when it first ran, fixed in ``budgets.json``); the best learning rate (lowest final
  validation loss) then runs on seeds 1 and 2;
- time in full-backprop steps MODELLED from ``dropbp bench``'s SmolLM2 LoRA token-drop step speedups
  (``bench_tokens_cpu/lora/bench.json``, 512 tokens a micro-batch; at these runs' 128-token micro-batches,
  ``bench_tokens_cpu_128``, token drops' steps are up to 4% slower), as benchmarks/token_drops.py models the
  proxy's; each run's own wall time is recorded beside it;
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
    """A dropped-backward arm (``token_drop_rate`` with ``token_selection``, and ``drop_rate`` for branch drops), or
    ``half_batch``: full backprop without the library at half the cell's tokens per step (4 x 128), the best-batch
    baseline's other batch. Names are benchmarks/token_drops.py's, so that both report the same arms alike."""

    name: str
    rate: float | str  # "auto": token_drop_rate="auto"
    selection: str = "gradient"
    half_batch: bool = False
    drop_rate: float = 0.0


ARMS = {
    a.name: a
    for a in (
        Arm("tokens0.3", 0.3),
        Arm("tokens0.5", 0.5),
        Arm("tokens-random0.3", 0.3, "random"),
        Arm("tokens-random0.5", 0.5, "random"),
        Arm("tokens-residual0.3", 0.3, "residual"),
        Arm("tokens-residual0.5", 0.5, "residual"),
        Arm("branch0.75", 0.0, drop_rate=0.75),
        Arm("both0.5+tokens0.3", 0.3, drop_rate=0.5),
        Arm("both0.5+tokens0.5", 0.5, drop_rate=0.5),
        Arm("tokens-auto", "auto"),
        Arm("full-half", 0.0, half_batch=True),
    )
}


def budgets(arm: Arm, out: Path = OUT) -> list[int]:
    """A complete run's lengths in optimizer steps, the grid's (equal time: 100 full-backprop steps) first; the half
    batch also at half that time, a second point of its frontier (full backprop's 200-step runs end worse than its
    100-step ones on this cell, so a longer half-batch run is not where its best lies). Fixed the first time an arm
    runs (``budgets.json``), as benchmarks/token_drops.py fixes the proxy's: a later cost record re-times the runs, it
    does not move them."""
    import token_drops  # a sibling script: its fixed_budgets

    return token_drops.fixed_budgets(out / "budgets.json", (arm.name,), lambda: _budgets(arm))


def _budgets(arm: Arm) -> list[int]:
    if arm.rate == "auto":  # its time is its own, known once it ran: full backprop's steps
        return [FULL_STEPS]
    equal_time = round(FULL_STEPS * step_speedup(arm))
    return [equal_time, equal_time // 2] if arm.half_batch else [equal_time]


def step_speedup(arm: Arm, record: Path = COST_RECORD, kept_share: float | None = None) -> float:
    """Full backprop's step time over ``arm``'s: MODELLED as 2 for the half batch (half the micro-batches of the same
    shape; each run's wall time is recorded to check it); with branch drops, from the same record's phase times as
    benchmarks/token_drops.py models the proxy's arms (the kept branches' backward scaled by the token-drop ratio);
    else ``dropbp bench``'s measured SmolLM2 LoRA step speedup for token drops at the arm's rate; for
    token_drop_rate="auto", the proxy's cost model at ``kept_share`` (the run's mean share of rows kept)."""
    if arm.half_batch:
        return 2.0
    if arm.rate == "auto":
        import token_drops

        cost = token_drops.Cost.from_bench(record)
        return cost.speedup(token_drops.BY_NAME["tokens-auto"], cost.tokens, 0.0, kept_share)
    if arm.drop_rate:
        import token_drops  # a sibling script: the proxy's cost model

        cost = token_drops.Cost.from_bench(record)
        return cost.speedup(token_drops.BY_NAME[arm.name], cost.tokens)
    rate = arm.rate
    [point] = json.loads(record.read_text())["points"]
    for row in point["rows"]:
        if row["pattern"] == "tokens" and row["drop_rate"] == rate:
            return row["speedup"]
    raise SystemExit(f"{record} has no token-drop row at {rate}: run dropbp bench --token-drop-rates {rate}")


def load_runs(out: Path = OUT) -> list[dict]:
    path = out / "runs.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def best_lr(runs: list[dict], arm: str) -> float | None:
    """The grid's learning rate with the lowest final loss on seed 0 at the equal-time budget, once the whole grid
    has run."""
    steps = budgets(ARMS[arm])[0]
    grid = {r["lr"]: r["final_loss"] for r in runs if r["arm"] == arm and r["seed"] == 0 and r["steps"] == steps}
    return min(grid, key=grid.get) if set(GRID) <= set(grid) else None


def train(arm: Arm, lr: float, seed: int, steps: int) -> dict:
    """One complete run of ``arm`` for ``steps`` optimizer steps (one torch thread)."""
    torch.set_num_threads(1)
    import convergence  # a sibling script (run as a script, this folder is on the path): full backprop's LoRA

    from dropbp import backends
    from dropbp.tools.compare import Run, compare
    from dropbp.tools.pretrained import load_causal_lm
    from dropbp.tools.textdata import pydoc_topics

    model, tokenizer = load_causal_lm()
    torch.manual_seed(seed)  # LoRA's A matrices: the same start as full backprop's runs of this seed
    model = convergence.with_lora(model)
    data = pydoc_topics(tokenizer, 128, max_val_windows=16)
    if arm.half_batch:
        run, micro_batches = Run(arm.name, None, lr=lr, steps=steps), 4
    else:
        options = {"token_drop_rate": arm.rate, "token_selection": arm.selection}
        if arm.drop_rate:  # branch drops as the shipped default draws them, as branch drops 0.5's runs did
            options |= convergence._CUT_WARMUP
        run = Run(arm.name, arm.drop_rate, lr=lr, steps=steps, **options)
        micro_batches = 8
    started = time.perf_counter()
    [result] = compare(
        model, [run], data, steps=steps, lr=lr, batch_size=micro_batches, backend=backends.get("cpu"),
        eval_every=steps, seed=seed, accumulation=micro_batches, lr_schedule="cosine", weight_decay=0.01,
    )  # fmt: skip
    shares = result.kept_token_shares
    return {"arm": arm.name, "lr": lr, "seed": seed, "steps": steps, "final_loss": result.val_loss[-1],
            "wall_s": time.perf_counter() - started, "date": date.today().isoformat(),
            "kept_token_share": sum(shares) / len(shares) if shares else None}  # fmt: skip


def half_batch_front(runs: list[dict]) -> dict[int, list[tuple[float, float]]] | None:
    """Per seed, the half batch's complete runs as (time in full-backprop steps, final loss) at its best learning
    rate; None until every budget has run on every seed the grid's best ran on."""
    arm = ARMS["full-half"]
    lr = best_lr(runs, arm.name)
    if lr is None:
        return None
    front: dict[int, list[tuple[float, float]]] = {}
    for r in runs:
        if r["arm"] == arm.name and r["lr"] == lr:
            front.setdefault(r["seed"], []).append((r["steps"] / step_speedup(arm), r["final_loss"]))
    complete = {seed: points for seed, points in front.items() if len(points) == len(budgets(arm))}
    return complete or None


def report(out: Path = OUT) -> dict:
    """Per arm with its whole grid run: the best lr and the speedup at equal quality over the seeds run, against
    full backprop at the cell's batch and, where the half batch has run on that seed, at its best of the two
    (the least time over the two batches, each read off its own frontier). Branch drops 0.5
    (smollm2_equal_quality.py's runs) are read alike."""
    import smollm2_equal_quality as eq  # full backprop's runs on this cell

    from dropbp.tools.frontier import best_batch_speedup, equal_quality_speedup, over_seeds

    runs = load_runs(out)
    half = half_batch_front(runs) or {}

    def readings(points: list[tuple[int, float, float]]) -> dict:
        """``(seed, time in full steps, final loss)`` per seed against full backprop at the cell's batch and at
        its best batch (only where every seed has the half batch's runs)."""
        full = {seed: eq.seed_runs(eq.RESULTS, seed)[0] for seed, _, _ in points}
        entry = {"full": over_seeds([equal_quality_speedup(full[s], t, loss) for s, t, loss in points])}
        if all(s in half for s, _, _ in points):
            best = [best_batch_speedup([full[s], half[s]], t, loss) for s, t, loss in points]
            entry["best"] = over_seeds(best)
        return entry

    rows = []
    for arm in ARMS.values():
        lr = best_lr(runs, arm.name)
        if lr is None:
            continue
        steps = budgets(arm)[0]
        at_best = sorted(
            (r for r in runs if r["arm"] == arm.name and r["lr"] == lr and r["steps"] == steps), key=lambda r: r["seed"]
        )
        speedups = [step_speedup(arm, kept_share=r.get("kept_token_share")) for r in at_best]
        timed = list(zip(at_best, speedups, strict=True))
        rows.append(
            {
                "arm": arm.name,
                "lr": lr,
                "grid_seed0": {
                    str(r["lr"]): r["final_loss"]
                    for r in runs
                    if r["arm"] == arm.name and r["seed"] == 0 and r["steps"] == steps
                },
                "steps": steps,
                "step_speedup": sum(speedups) / len(speedups),
                "seeds": [r["seed"] for r in at_best],
                "final_loss": [r["final_loss"] for r in at_best],
                "wall_s": [round(r["wall_s"]) for r in at_best],
                **readings([(r["seed"], r["steps"] / x, r["final_loss"]) for r, x in timed]),
            }
        )
    branch = [(seed, *eq.seed_runs(eq.RESULTS, seed)[1]["equal time"]) for seed in (0, 1, 2)]
    record = {"benchmark": "smollm2_token_drops", "date": date.today().isoformat(), "cost_record":
              str(COST_RECORD.relative_to(HERE.parent)), "grid": list(GRID), "rows": rows,
              "branch0.5": readings(branch), "half_batch_runs": {str(s): p for s, p in half.items()}}  # fmt: skip
    (out / "smollm2_token_drops.json").write_text(json.dumps(record, indent=2) + "\n")
    (out / "smollm2_token_drops.md").write_text(markdown(record))
    return record


def _reading(entry: dict | None) -> str:
    """Per seed (bounds marked), then the mean and its 95% interval; "not run" where there is no entry."""
    if entry is None:
        return "not run (the half batch's runs are not all in)"
    per = " / ".join(
        ("" if p["bound"] == "exact" else {"at least": ">= ", "at most": "<= "}[p["bound"]]) + f"{p['value']:.2f}x"
        for p in entry["per_seed"]
    )
    interval = f"[{entry['low']:.2f}, {entry['high']:.2f}]" if entry["seeds"] > 1 else "(one seed)"
    return f"{per}: **{entry['mean']:.2f}x** {interval}"


def markdown(record: dict) -> str:
    lines = [
        "Token drops on SmolLM2-135M-Instruct, the README's cell (LoRA r=8, pydoc, 8 x 128 tokens a step, 100 "
        "full-backprop steps): speedup at equal quality against full backprop's complete runs at this batch "
        "(benchmarks/smollm2_equal_quality.py's records) and at its best of two batches (this one and 4 x 128 "
        "tokens a step, `full-half`: the least time over the two, each batch read off its own frontier), each arm "
        "at its own best learning rate "
        f"of {', '.join(f'{x:g}' for x in record['grid'])} on seed 0 at its equal-time budget (fixed when it first "
        f"ran). Time MODELLED from the measured step speedups ({record['cost_record']}; the half batch at 2x: half "
        "the micro-batches; each "
        "run's wall time, one torch thread, two runs at a time, is beside it). Method: "
        "benchmarks/smollm2_token_drops.py.",
        "",
        "| arm | lr (seed 0's losses over the grid) | steps | step speedup | final val loss per seed | wall s | "
        "vs full backprop, per seed: mean [95%] | vs full backprop at its best batch |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in record["rows"]:
        grid = ", ".join(f"{float(lr):g}: {loss:.4f}" for lr, loss in sorted(row["grid_seed0"].items()))
        lines.append(
            f"| {row['arm']} | **{row['lr']:g}** ({grid}) | {row['steps']} | {row['step_speedup']:.2f}x | "
            f"{' / '.join(f'{x:.4f}' for x in row['final_loss'])} | {' / '.join(map(str, row['wall_s']))} | "
            f"{_reading(row['full'])} | {_reading(row.get('best'))} |"
        )
    branch = record["branch0.5"]
    lines.append(
        "| branch drops 0.5 (smollm2_equal_quality.md's runs, time measured) | 0.002 | 135 | | | | "
        f"{_reading(branch['full'])} | {_reading(branch.get('best'))} |"
    )
    if record["half_batch_runs"]:
        lines += ["", "The half batch's complete runs (time in full-backprop steps: final val loss):", ""]
        for seed, points in sorted(record["half_batch_runs"].items()):
            lines.append(f"- seed {seed}: " + ", ".join(f"time {t:g}: {loss:.4f}" for t, loss in sorted(points)))
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--train", choices=sorted(ARMS))
    parser.add_argument("--lr", help="a learning rate of the grid, or 'best' (seed 0's best, once its grid ran)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, help="a budget of the arm other than its equal-time one (budgets())")
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
    arm = ARMS[args.train]
    steps = args.steps or budgets(arm)[0]
    if steps not in budgets(arm):
        parser.error(f"{arm.name} runs at {budgets(arm)} steps, not {steps}")
    row = train(arm, lr, args.seed, steps)
    with (OUT / "runs.jsonl").open("a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row))


if __name__ == "__main__":
    main()
