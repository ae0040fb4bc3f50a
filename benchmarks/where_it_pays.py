"""Where DropBP pays: speedup at equal quality over run length and tokens per optimizer step (issue 40).

A proxy fast enough for 2 cores: a small Llama-shaped model (6 layers, hidden 64, byte-level vocabulary) pre-trained
here on the standard library's source code, then fully fine-tuned on Python's help text (``pydoc_data.topics``,
every tenth topic held out). For each cell of the map (full backprop's run length L in optimizer steps, tokens per
step T, as micro-batches of 4 x 128 tokens, a drop pattern each):

1. learning rates: every arm swept over the same grid on seed 0, full backprop first (at L steps), each DropBP rate
   at its equal-time budget (the steps its modelled step speedup buys in L full-backprop steps); each arm keeps its
   own best;
2. complete runs (each its own lr warm-up + cosine decay, and for DropBP the shipped default: cut patterns, rates
   warmed up over the first 20% with the mean kept): full backprop at L/2, L and 2L steps, DropBP at L steps and at
   its equal-time budget, on 3 seeds (batch order and patterns; the same pre-trained start);
3. the figure (``dropbp.tools.frontier``): the time full backprop needs to reach DropBP's final loss, read from that
   seed's full-backprop frontier, over DropBP's time; mean and 95% interval over the seeds.

Time is MODELLED, not timed on the proxy: each optimizer step costs what SmolLM2-135M's measured step components
(``--cost-record``: forward, backward, backward with every branch dropped, optimizer; full fine-tuning, 512 tokens,
2 CPU cores) give for the fraction of branch FLOPs that step's micro-batches dropped (``F + B0 + (1 - f)(B - B0)``
per micro-batch; that record's speedups sit on this line, per-round efficiency 1.01-1.02). The proxy's own steps are
dominated by other costs; its wall times are recorded beside, not used. Runs are independent, so two run at once
(one thread each); every finished run is appended to ``runs.jsonl`` and a stopped map resumes where it was.

    python benchmarks/where_it_pays.py --cells 100x1k 300x1k 100x8k 1000x1k 300x8k   # runs, in the background
    python benchmarks/where_it_pays.py --report                                       # map.md, map.json, map.png
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import sysconfig
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import asdict, dataclass
from datetime import date
from multiprocessing import get_context
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
OUT = RESULTS / "where_it_pays"
COST_RECORD = RESULTS / "bench_checkpointing_cpu" / "full" / "bench.json"
CACHE = Path.home() / ".cache" / "dropbp"
#: what dropbp.experimental.where_it_pays reads
SHIPPED_MAP = RESULTS.parent.parent / "dropbp" / "experimental" / "where_it_pays.json"

SEQ_LEN = 128
MICRO_SEQUENCES = 4  # 512 tokens per micro-batch, as the cost record's step
PROXY = {"hidden_size": 64, "intermediate_size": 168, "num_hidden_layers": 6, "num_attention_heads": 4}
PRETRAIN = {"steps": 1500, "sequences": 16, "lr": 3e-3, "seed": 0, "max_bytes": 4_000_000}
LR_GRID = (5e-4, 1e-3, 2e-3, 4e-3)
MAX_WIDENING = 2  # grid points added at an edge where an arm's best lies
DEFAULT = "default"
#: DropBP's arms: the shipped default, and each lever of issue 40 on (its Run options, its key's suffix).
VARIANTS = {
    DEFAULT: {"suffix": "", "options": {}},
    "importance-weights": {"suffix": "+iw", "options": {"unbiased": True}},
    "stratified": {"suffix": "+st", "options": {"stratified": True}},
}
RATES = (0.5, 0.75)
SEEDS = (0, 1, 2)
BASELINE_BUDGETS = (0.5, 1.0, 2.0)  # full backprop's complete runs, as multiples of the cell's run length
WEIGHT_DECAY = 0.02  # the research code's, for full fine-tuning
VAL_WINDOWS = 64


# -- the proxy ---------------------------------------------------------------------------------------------------
class ByteTokenizer:
    """UTF-8 bytes as token ids (vocabulary 256): nothing to download or train."""

    def __call__(self, text: str) -> dict[str, list[int]]:
        return {"input_ids": list(text.encode("utf-8"))}


def proxy_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=256,
        num_key_value_heads=PROXY["num_attention_heads"],
        max_position_embeddings=SEQ_LEN,
        tie_word_embeddings=False,
        **PROXY,
    )


def stdlib_source(max_bytes: int) -> str:
    """The standard library's own Python source, files in sorted order, up to ``max_bytes`` characters."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts, size = [], 0
    for path in sorted(root.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        parts.append(text)
        size += len(text)
        if size >= max_bytes:
            break
    return "\n\n".join(parts)


def pretrained_proxy() -> Path:
    """Pre-train the proxy on stdlib source once (lr warm-up + cosine), cached by its settings; returns the file."""
    key = hashlib.sha256(json.dumps([PROXY, PRETRAIN, SEQ_LEN]).encode()).hexdigest()[:12]
    path = CACHE / f"where_it_pays_proxy_{key}.pt"
    if path.exists():
        return path
    from transformers import LlamaForCausalLM

    from dropbp.tools.compare import lr_factor

    torch.manual_seed(PRETRAIN["seed"])
    model = LlamaForCausalLM(proxy_config())
    ids = torch.tensor(list(stdlib_source(PRETRAIN["max_bytes"]).encode("utf-8")))
    windows = ids[: len(ids) // SEQ_LEN * SEQ_LEN].view(-1, SEQ_LEN)
    opt = torch.optim.AdamW(model.parameters(), lr=PRETRAIN["lr"], weight_decay=0.1)
    g = torch.Generator().manual_seed(PRETRAIN["seed"])
    started = time.perf_counter()
    for step in range(PRETRAIN["steps"]):
        for group in opt.param_groups:
            group["lr"] = PRETRAIN["lr"] * lr_factor(step, PRETRAIN["steps"], "cosine")
        batch = windows[torch.randint(0, len(windows), (PRETRAIN["sequences"],), generator=g)]
        model(input_ids=batch, labels=batch).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 250 == 0:
            print(f"pre-training step {step} ({time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), path)
    return path


# -- the time model ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StepCost:
    """One micro-batch's forward, backward, backward with every branch dropped, and the optimizer step (seconds)."""

    forward: float
    backward: float
    backward_all_dropped: float
    optimizer: float
    tokens: int

    @classmethod
    def from_bench(cls, path: Path) -> StepCost:
        """The first point of a ``dropbp bench`` record (batch 1, its ``seq_len`` tokens)."""
        point = json.loads(path.read_text())["points"][0]
        base = point["baseline"]
        return cls(
            base["forward_s"],
            base["backward_s"],
            point["all_dropped"]["backward_s"],
            base["optimizer_s"],
            point["seq_len"] * point["batch_size"],
        )

    def step_seconds(self, dropped_fraction: float, tokens_per_step: int) -> float:
        """An optimizer step of ``tokens_per_step`` tokens whose micro-batches dropped ``dropped_fraction`` of the
        branch FLOPs on average: ``F + B0 + (1 - f)(B - B0)`` per micro-batch of ``tokens`` tokens, then one
        optimizer step."""
        micro = (
            self.forward
            + self.backward_all_dropped
            + (1 - dropped_fraction) * (self.backward - self.backward_all_dropped)
        )
        return micro * tokens_per_step / self.tokens + self.optimizer

    def speedup(self, dropped_fraction: float, tokens_per_step: int) -> float:
        """Full backprop's step time over a step that dropped ``dropped_fraction``."""
        return self.step_seconds(0.0, tokens_per_step) / self.step_seconds(dropped_fraction, tokens_per_step)


# -- the map's runs ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Cell:
    steps: int  # full backprop's run length
    tokens: int  # tokens per optimizer step

    @classmethod
    def parse(cls, text: str) -> Cell:
        """``"300x8k"``: 300 optimizer steps of 8192 tokens."""
        steps, _, tokens = text.partition("x")
        if not steps.isdigit() or not tokens.removesuffix("k").isdigit() or not tokens.endswith("k"):
            raise argparse.ArgumentTypeError(f"a cell is STEPSxTOKENSk, such as 300x8k; got {text!r}")
        return cls(int(steps), int(tokens.removesuffix("k")) * 1024)

    @property
    def name(self) -> str:
        return f"{self.steps}x{self.tokens // 1024}k"


@dataclass(frozen=True)
class Job:
    cell: str
    tokens: int
    rate: float | None  # None: full backprop
    lr: float
    steps: int
    seed: int
    phase: str  # "sweep" or "runs"
    variant: str = DEFAULT  # DropBP's: the shipped default, or one lever on (:data:`VARIANTS`)

    @property
    def key(self) -> str:
        arm = "full" if self.rate is None else f"dropbp{self.rate:g}" + VARIANTS[self.variant]["suffix"]
        return f"{self.cell}/{arm}/lr{self.lr:g}/steps{self.steps}/seed{self.seed}"


def equal_time_steps(cost: StepCost, cell: Cell, rate: float) -> int:
    """DropBP's steps in the time of ``cell.steps`` full-backprop steps, at its expected dropped fraction."""
    return round(cell.steps * cost.speedup(rate, cell.tokens))


def variant_of(row: dict) -> str:
    """A recorded run's variant (runs recorded before variants had names say ``unbiased``)."""
    return row.get("variant") or ("importance-weights" if row.get("unbiased") else DEFAULT)


def _sweep_rows(done: dict[str, dict], cell: Cell, rate: float | None, variant: str) -> dict[float, float]:
    """An arm's sweep so far: learning rate -> final loss."""
    return {
        r["lr"]: r["final_loss"]
        for r in done.values()
        if r["cell"] == cell.name and r["rate"] == rate and r["phase"] == "sweep" and variant_of(r) == variant
    }


def widened_grid(sweeps: Callable[[], list[dict[float, float]]]) -> list[float]:
    """:data:`LR_GRID`, widened by a factor of 2 at an edge where any arm's best lies (at most :data:`MAX_WIDENING`
    times), once every arm has run the grid so far; ``sweeps()`` gives each arm's learning rate -> final loss."""
    grid = list(LR_GRID)
    while len(grid) < len(LR_GRID) + MAX_WIDENING:
        found = sweeps()
        if any(not set(grid) <= set(sweep) for sweep in found):
            break  # the grid so far is still running
        bests = {min(grid, key=sweep.__getitem__) for sweep in found}
        if grid[-1] in bests:
            grid.append(grid[-1] * 2)
        elif grid[0] in bests:
            grid.insert(0, grid[0] / 2)
        else:
            break
    return grid


def lr_grid(done: dict[str, dict], cell: Cell) -> list[float]:
    """The cell's learning-rate grid, the same for every arm (:func:`widened_grid`)."""
    arms = [(None, DEFAULT), *((rate, DEFAULT) for rate in RATES)]
    arms += [(rate, v) for v in VARIANTS if v != DEFAULT for rate in RATES if _sweep_rows(done, cell, rate, v)]
    return widened_grid(lambda: [_sweep_rows(done, cell, rate, variant) for rate, variant in arms])


def sweep_jobs(cell: Cell, cost: StepCost, done: dict[str, dict], variant: str = DEFAULT) -> list[Job]:
    """The learning-rate grid: full backprop, then each DropBP rate (as ``variant``)."""
    grid = lr_grid(done, cell)
    jobs = [Job(cell.name, cell.tokens, None, lr, cell.steps, 0, "sweep") for lr in grid]
    for rate in RATES:
        steps = equal_time_steps(cost, cell, rate)
        jobs += [Job(cell.name, cell.tokens, rate, lr, steps, 0, "sweep", variant) for lr in grid]
    return jobs


def best_lr(done: dict[str, dict], cell: Cell, rate: float | None, variant: str = DEFAULT) -> float | None:
    """The arm's learning rate with the lowest final loss over the cell's grid (None until the grid is settled
    and the arm ran every point of it)."""
    grid = lr_grid(done, cell)
    sweep = _sweep_rows(done, cell, rate, variant)
    others = [_sweep_rows(done, cell, r, DEFAULT) for r in (None, *RATES)]
    if not all(set(grid) <= set(rows) for rows in (sweep, *others)):
        return None
    best = min(grid, key=sweep.__getitem__)
    edge = best in (grid[0], grid[-1]) and len(grid) < len(LR_GRID) + MAX_WIDENING
    return None if edge else best


def run_jobs(cell: Cell, cost: StepCost, done: dict[str, dict], variant: str = DEFAULT) -> list[Job]:
    """The complete runs at each arm's best learning rate (empty until the cell's sweep finished)."""
    full_lr = best_lr(done, cell, None)
    lrs = {rate: best_lr(done, cell, rate, variant) for rate in RATES}
    if full_lr is None or None in lrs.values():
        return []
    jobs = [
        Job(cell.name, cell.tokens, None, full_lr, round(cell.steps * b), seed, "runs")
        for seed in SEEDS
        for b in BASELINE_BUDGETS
    ]
    for rate, lr in lrs.items():
        for seed in SEEDS:
            for steps in (cell.steps, equal_time_steps(cost, cell, rate)):
                jobs.append(Job(cell.name, cell.tokens, rate, lr, steps, seed, "runs", variant))
    return jobs


def same_run(done: dict[str, dict], job: Job) -> dict | None:
    """A finished run with the same settings in either phase (the sweep's best runs are seed 0's runs)."""
    return done.get(job.key)


def train(job: Job, proxy: str, cost: StepCost) -> dict:
    """One complete run of ``job`` on the pre-trained proxy (one thread); its curve and modelled time."""
    torch.set_num_threads(1)
    import transformers
    from transformers import LlamaForCausalLM

    from dropbp import backends
    from dropbp.tools.compare import Run, compare
    from dropbp.tools.textdata import pydoc_topics

    transformers.logging.set_verbosity_error()
    model = LlamaForCausalLM(proxy_config())
    model.load_state_dict(torch.load(proxy, weights_only=True))
    data = pydoc_topics(ByteTokenizer(), SEQ_LEN, max_val_windows=VAL_WINDOWS)
    default = {"pattern": "cut", "schedule": "warmup", "drop_schedule": "constant"}  # the shipped default
    arm = {**default, **VARIANTS[job.variant]["options"]} if job.rate is not None else {}
    run = Run(job.key, job.rate, lr=job.lr, steps=job.steps, **arm)
    sequences = job.tokens // SEQ_LEN
    started = time.perf_counter()
    [result] = compare(
        model,
        [run],
        data,
        steps=job.steps,
        lr=job.lr,
        batch_size=sequences,
        backend=backends.get("cpu"),
        eval_every=max(1, job.steps // 5),
        seed=job.seed,
        accumulation=sequences // MICRO_SEQUENCES,
        lr_schedule="cosine",
        weight_decay=WEIGHT_DECAY,
    )
    modelled = [cost.step_seconds(f, job.tokens) for f in result.dropped_fractions]
    elapsed = [0.0]
    for seconds in modelled:
        elapsed.append(elapsed[-1] + seconds)
    return {
        **asdict(job),
        "key": job.key,
        "final_loss": result.val_loss[-1],
        "modelled_s": elapsed[-1],
        "measured_s": sum(result.step_seconds),
        "wall_s": time.perf_counter() - started,
        "mean_dropped_fraction": sum(result.dropped_fractions) / len(result.dropped_fractions),
        "eval_steps": result.eval_steps,
        "eval_modelled_s": [elapsed[s] for s in result.eval_steps],
        "val_loss": result.val_loss,
    }


def load_done(path: Path) -> dict[str, dict]:
    if not path.exists():
        return {}
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {row["key"]: row for row in rows}


def record_run(log: Path, row: dict, key: str, started: float, detail: str) -> None:
    """Append a finished run to ``log`` and say so on stderr, with the time since ``started``."""
    with log.open("a") as f:
        f.write(json.dumps(row) + "\n")
    elapsed = time.perf_counter() - started
    print(f"[{elapsed:6.0f} s] {key}: loss {row['final_loss']:.4f}, {detail}", file=sys.stderr, flush=True)


def run_map(cells: list[Cell], workers: int, out: Path, cost: StepCost, variant: str = DEFAULT) -> None:
    """Run every cell's sweep, then its complete runs, ``workers`` at a time, cells in the order given (DropBP's arms
    as ``variant``; full backprop's runs are the default runner's)."""
    out.mkdir(parents=True, exist_ok=True)
    log = out / "runs.jsonl"
    done = load_done(log)
    proxy = str(pretrained_proxy())
    started = time.perf_counter()
    running: dict[Future, Job] = {}
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
        while True:
            ready = [
                job
                for cell in cells
                for job in [*sweep_jobs(cell, cost, done, variant), *run_jobs(cell, cost, done, variant)]
                if same_run(done, job) is None
                and job.key not in {j.key for j in running.values()}
                and (variant == DEFAULT or job.variant == variant)  # full backprop is the default runner's
            ]
            ready = list(dict.fromkeys(ready))
            while ready and len(running) < workers:
                job = ready.pop(0)
                running[pool.submit(train, job, proxy, cost)] = job
            if not running:
                break
            finished, _ = wait(running, return_when=FIRST_COMPLETED)
            done.update(load_done(log))  # another runner (the other arm) may share the record
            for future in finished:
                job = running.pop(future)
                row = future.result()
                done[job.key] = row
                detail = f"modelled {row['modelled_s']:.0f} s, proxy {row['wall_s']:.0f} s"
                record_run(log, row, job.key, started, detail)


# -- the report --------------------------------------------------------------------------------------------------
def cell_figures(cell: Cell, done: dict[str, dict], cost: StepCost) -> dict | None:
    """The cell's learning rates, frontier runs and, per DropBP arm (rate, with or without importance weights) and
    budget, the speedup at equal quality; None until the default arms' runs are all done."""
    jobs = run_jobs(cell, cost, done)
    if not jobs or any(same_run(done, j) is None for j in jobs):
        return None
    rows = [same_run(done, j) for j in jobs]
    full = [r for r in rows if r["rate"] is None]
    figures = {"cell": cell.name, "steps": cell.steps, "tokens": cell.tokens, "lr": {"full": full[0]["lr"]}}
    figures["full"] = {
        str(n): [r["final_loss"] for r in full if r["steps"] == n] for n in sorted({r["steps"] for r in full})
    }
    baseline = {s: [(r["modelled_s"], r["final_loss"]) for r in full if r["seed"] == s] for s in SEEDS}
    arms = [(r, DEFAULT) for r in rows if r["rate"] is not None]
    for variant in VARIANTS:
        jobs = run_jobs(cell, cost, done, variant) if variant != DEFAULT else []
        if jobs and all(same_run(done, j) is not None for j in jobs):
            arms += [(same_run(done, j), variant) for j in jobs if j.rate is not None]
    for rate in RATES:
        for variant in VARIANTS:
            arm = [r for r, v in arms if v == variant and r["rate"] == rate]
            if arm:
                name = f"{rate:g}" + VARIANTS[variant]["suffix"]
                figures["lr"][name] = arm[0]["lr"]
                figures[name] = _budgets(arm, baseline, cost, cell, rate)
    return figures


def _budgets(arm: list[dict], baseline: dict, cost: StepCost, cell: Cell, rate: float) -> dict:
    from dropbp.tools.frontier import equal_quality_speedup, over_seeds

    budgets = {}
    for steps in sorted({r["steps"] for r in arm}):
        runs = sorted((r for r in arm if r["steps"] == steps), key=lambda r: r["seed"])
        readings = [equal_quality_speedup(baseline[r["seed"]], r["modelled_s"], r["final_loss"]) for r in runs]
        full_step = cost.step_seconds(0.0, cell.tokens)
        budgets[str(steps)] = {
            **over_seeds(readings),
            # full backprop's steps to the same loss per DropBP step (speedup over the run's own step speedup)
            "step_worth": sum(
                x.value * r["modelled_s"] / (steps * full_step) for x, r in zip(readings, runs, strict=True)
            )
            / len(runs),
            "final_loss": [r["final_loss"] for r in runs],
            "equal_time": steps == equal_time_steps(cost, cell, rate),
        }
    return budgets


def report(out: Path, cost: StepCost, cost_record: Path) -> None:
    done = load_done(out / "runs.jsonl")
    cells = sorted({Cell.parse(r["cell"]) for r in done.values()}, key=lambda c: (c.tokens, c.steps))
    figures = [f for c in cells if (f := cell_figures(c, done, cost)) is not None]
    record = {
        "benchmark": "where_it_pays",
        "date": date.today().isoformat(),
        "proxy": {**PROXY, "vocab_size": 256, "seq_len": SEQ_LEN, "pretrain": PRETRAIN},
        "micro_batch_tokens": SEQ_LEN * MICRO_SEQUENCES,
        "lr_grid": LR_GRID,
        "seeds": SEEDS,
        "baseline_budgets": BASELINE_BUDGETS,
        "cost_record": str(cost_record.relative_to(RESULTS.parent.parent)),
        "step_cost": asdict(cost),
        "torch": torch.__version__,
        "cells": figures,
    }
    (out / "map.json").write_text(json.dumps(record, indent=2) + "\n")
    SHIPPED_MAP.write_text(json.dumps(shipped_map(record), indent=1) + "\n")
    header = [
        "Speedup at equal quality of DropBP against full backprop's frontier (complete runs at L/2, L and 2L steps), "
        f"per cell and arm; each arm at its own best learning rate from one grid (seed 0); {len(SEEDS)} seeds, mean "
        "and Student-t 95% interval; a bound where DropBP's loss fell outside the frontier's budgets. Time modelled "
        f"on SmolLM2-135M's measured CPU step ({record['cost_record']}). Method and commands: "
        "docs/where-it-pays.md.",
        "",
    ]
    lines = header + map_table(figures, cost) + sweep_only(cells, figures, done)
    (out / "map.md").write_text("\n".join(lines) + "\n")
    plot_map(figures, out / "map.png")
    print("\n".join(lines))


def sweep_only(cells: list[Cell], figures: list[dict], done: dict[str, dict]) -> list[str]:
    """Cells whose complete runs did not all finish: each arm's best final loss on the seed-0 sweep (full backprop
    at L steps, DropBP at its equal-time budget), one seed and no frontier: an indication, not the figure."""
    finished = {f["cell"] for f in figures}
    lines = []
    for cell in cells:
        if cell.name in finished:
            continue
        arms = [("full backprop", None), *((f"DropBP {r:g}", r) for r in RATES)]
        sweeps = {name: _sweep_rows(done, cell, rate, DEFAULT) for name, rate in arms}
        if not all(sweeps.values()):
            continue
        best = ", ".join(
            f"{name} {min(sweep.values()):.4f} (lr {min(sweep, key=sweep.get):g}, {len(sweep)} of the grid)"
            for name, sweep in sweeps.items()
        )
        lines.append(f"- {cell.name}, not finished: seed 0's sweep, best final loss at equal time: {best}.")
    return ["", "Cells in progress (one seed, no frontier):", *lines] if lines else []


def shipped_map(record: dict) -> dict:
    """What ``dropbp.experimental.where_it_pays`` reads: per cell and DropBP rate, the shipped default's speedup at
    equal quality at equal time (mean and 95% interval over the seeds), and the share of a micro-batch's time the
    branches' backward takes in the cost record (the noise-scale forecast's default step cost)."""
    cells = []
    for f in record["cells"]:
        for rate in RATES:
            equal = next(b for b in f[f"{rate:g}"].values() if b["equal_time"])
            cells.append(
                {"steps": f["steps"], "tokens": f["tokens"], "rate": rate}
                | {k: round(equal[k], 3) for k in ("mean", "low", "high")}
            )
    conditions = (
        f"a {PROXY['num_hidden_layers']}-layer, {PROXY['hidden_size']}-wide Llama-shaped proxy, full fine-tuning, "
        f"{len(SEEDS)} seeds, time modelled on SmolLM2-135M's CPU steps"
    )
    cost = record["step_cost"]
    share = (cost["backward"] - cost["backward_all_dropped"]) / (cost["forward"] + cost["backward"])
    return {
        "source": "benchmarks/results/where_it_pays/map.json",
        "conditions": conditions,
        "cells": cells,
        "branch_share": round(share, 3),
        "branch_share_source": record["cost_record"],
    }


def _speedup_cell(budget: dict) -> str:
    text = f"**{budget['mean']:.2f}x**"
    if budget["seeds"] > 1:
        text += f" [{budget['low']:.2f}, {budget['high']:.2f}]"
    if budget["bounded"]:
        bounds = sorted({p["bound"] for p in budget["per_seed"] if p["bound"] != "exact"})
        text += f" ({budget['bounded']} of {budget['seeds']} seeds {' / '.join(bounds)})"
    return text


def map_table(figures: list[dict], cost: StepCost) -> list[str]:
    lines = [
        "| run length x tokens per step | DropBP | modelled step speedup | lr full / DropBP | DropBP at equal time: "
        "speedup at equal quality [95%] | a DropBP step is worth (full-backprop steps) | DropBP at L steps: speedup "
        "at equal quality [95%] |",
        "|---|---|---|---|---|---|---|",
    ]
    for f in figures:
        for rate in RATES:
            for variant, settings in VARIANTS.items():
                name = f"{rate:g}" + settings["suffix"]
                if name not in f:
                    continue
                budgets = f[name]
                equal = next(b for b in budgets.values() if b["equal_time"])
                same = budgets[str(f["steps"])]
                label = f"{rate:g}" + ("" if variant == DEFAULT else f" + {variant.replace('-', ' ')}")
                lines.append(
                    f"| {f['steps']} x {f['tokens'] // 1024}k | {label} | {cost.speedup(rate, f['tokens']):.2f}x | "
                    f"{f['lr']['full']:g} / {f['lr'][name]:g} | {_speedup_cell(equal)} | {equal['step_worth']:.2f} | "
                    f"{_speedup_cell(same)} |"
                )
    return lines


def plot_map(figures: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(RATES), figsize=(6 * len(RATES), 4.5), sharey=True)
    for ax, rate in zip(axes, RATES, strict=True):
        for i, tokens in enumerate(sorted({f["tokens"] for f in figures})):
            for (variant, settings), style, shift in zip(
                VARIANTS.items(), ("-", "--", ":"), (1.0, 1.03, 0.97), strict=True
            ):
                arm = f"{rate:g}" + settings["suffix"]
                row = sorted((f for f in figures if f["tokens"] == tokens and arm in f), key=lambda f: f["steps"])
                if not row:
                    continue
                eq = [next(b for b in f[arm].values() if b["equal_time"]) for f in row]
                errors = [[b["mean"] - b["low"] for b in eq], [b["high"] - b["mean"] for b in eq]]
                label = f"{tokens // 1024}k tokens/step" + ("" if variant == DEFAULT else f", {variant}")
                ax.errorbar(
                    [f["steps"] * shift for f in row],
                    [b["mean"] for b in eq],
                    yerr=errors,
                    marker="o",
                    capsize=3,
                    linestyle=style,
                    color=f"C{i}",
                    label=label,
                )
        ax.set_xscale("log")
        ax.set_xticks(sorted({f["steps"] for f in figures}), [str(s) for s in sorted({f["steps"] for f in figures})])
        ax.minorticks_off()
        ax.axhline(1.0, color="grey", linestyle=":", linewidth=1)
        ax.axhline(1.3, color="green", linestyle="--", linewidth=0.8)
        ax.set_xlabel("full backprop's run length (optimizer steps)")
        ax.set_title(f"DropBP {rate:g} at equal time")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_ylabel("speedup at equal quality (mean, 95% over 3 seeds)")
    fig.suptitle("Where DropBP pays: proxy Llama (6 x 64), full fine-tuning, time modelled on SmolLM2-135M's steps")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cells", type=Cell.parse, nargs="+", default=[])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--report", action="store_true", help="only write map.json, map.md and map.png")
    parser.add_argument(
        "--variant",
        choices=sorted(VARIANTS),
        default=DEFAULT,
        help="DropBP's arms: the shipped default, or with importance weights (unbiased=True) or stratified cuts",
    )
    parser.add_argument("--cost-record", type=Path, default=COST_RECORD)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    cost = StepCost.from_bench(args.cost_record)
    if args.report:
        report(args.out, cost, args.cost_record)
        return
    if not args.cells:
        parser.error("give --cells (such as 100x1k 300x8k) or --report")
    run_map(args.cells, args.workers, args.out, cost, args.variant)


if __name__ == "__main__":
    main()
