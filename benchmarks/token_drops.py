"""Token drops against full backprop at its best batch and against branch drops (issue 49), on the map's proxy.

The proxy, corpus, learning-rate grid, seeds and frontier measure are the map's (``where_it_pays.py``, whose docstring
says how): a 6-layer Llama-shaped byte-level model pre-trained on the standard library's source, fully fine-tuned on
Python's help text, each arm at its own best learning rate from one grid (seed 0), then complete runs (each its own
warm-up and cosine decay) on 3 seeds. Arms at each cell (``L`` optimizer steps of ``T`` tokens):

- ``full``: full backprop at ``T`` tokens per step, complete runs at L/2, L and 2L steps (the map's own runs);
- ``full-half``: full backprop at ``T/2`` tokens per step, runs at L, 2L and 4L steps (the same times): the batch a user
  who tunes it would also try; **full backprop at its best batch** is the least time over the two batches, each read
  off its own frontier (``dropbp.tools.frontier.best_batch_time``);
- ``tokens<r>``: token drops at ``token_drop_rate=r`` (importance sampling on the gradient's row norms), no branch
  drops, at 0.3, 0.5 and 0.75;
- ``tokens-random<r>``: the same with random rows (the control), at 0.3 and 0.5;
- ``tokens-residual<r>``: importance from the forward (the norm of the row a branch adds, TokenDrop's), at 0.3 and 0.5;
- ``tokens-cumulative<r>``: TokenDrop's cumulative selection (the topmost kept branch's rows, by gradient, kept in
  every branch below), at 0.3 and 0.5;
- ``branch<r>``: DropBP's shipped default (cut patterns with warm-up), the map's own runs, at 0.5 and 0.75;
- ``both0.5+tokens<r>``: branch drops at 0.5 and token drops at 0.3 or 0.5 on the kept branches;
- ``auto``: ``drop_rate="auto"``, each step's rate chosen from the measured gradient noise scale (one budget, the
  cell's steps: its time is what its own drops make it);
- ``tokens-auto``: ``token_drop_rate="auto"``, each branch's keep share chosen after every forward from its measured
  added variance (one budget, the cell's steps; its time modelled at the mean share its selections kept, ``t(r)``
  linear between the measured rates and 1 at 0).

Each DropBP arm runs at L steps and at its equal-time budget (the steps its modelled step speedup buys in L full
steps). Time is MODELLED on SmolLM2-135M's measured CPU steps (``--cost-record``, a ``dropbp bench`` record with
``--patterns tokens``, full fine-tuning, 512 tokens): a micro-batch of 512 tokens costs ``F + B0 + (1 - f)(B - B0)
* t(r)`` plus the optimizer, ``f`` the branch FLOPs dropped and ``t(r)`` the measured cost of a branch's backward under
token drops relative to full (``(step(r) - F - O - B0) / (B - B0)`` from the record's token rows; random rows run the
same operations, so both rules share it). The map's reused
runs are re-timed with the same record, so every arm shares one clock. Runs are appended to
``results/token_drops/runs.jsonl`` (the map's runs are read from ``results/where_it_pays/runs.jsonl``).

    python benchmarks/token_drops.py --cells 100x1k --workers 2      # runs (resumable)
    python benchmarks/token_drops.py --report                          # token_drops.md / .json
    python benchmarks/token_drops.py --report \
        --cost-record benchmarks/results/bench_tokens_cpu/full_checkpointing/bench.json
                                               # the same runs re-timed with activation checkpointing's steps
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import asdict, dataclass
from datetime import date
from multiprocessing import get_context
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
OUT = RESULTS / "token_drops"
MAP_RUNS = RESULTS / "where_it_pays" / "runs.jsonl"
COST_RECORD = RESULTS / "bench_tokens_cpu" / "full" / "bench.json"
RATES = (0.5, 0.75)  # branch drops: the map's rates
TOKEN_RATES = (0.3, 0.5, 0.75)  # importance-sampled token drops; the random control at the first two
SEEDS = (0, 1, 2)


def _map_module():
    spec = importlib.util.spec_from_file_location("where_it_pays", HERE / "where_it_pays.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["where_it_pays"] = module
    spec.loader.exec_module(module)
    return module


wip = _map_module()
MAP_COST = wip.StepCost.from_bench(wip.COST_RECORD)


@dataclass(frozen=True)
class Arm:
    name: str
    drop_rate: float | str | None  # None: full backprop, no library; "auto": the rate from the noise scale
    token_drop_rate: float | str = 0.0  # "auto": each branch's share from its added variance
    token_selection: str = "gradient"
    half_batch: bool = False

    @property
    def map_key(self) -> str | None:
        """The arm's name in the map's run keys, where the map ran it."""
        if self.drop_rate is None and not self.half_batch:
            return "full"
        if isinstance(self.drop_rate, float) and self.drop_rate and not self.token_drop_rate:
            return f"dropbp{self.drop_rate:g}"
        return None


ARMS = [
    Arm("full", None),
    Arm("full-half", None, half_batch=True),
    *(Arm(f"tokens{r:g}", 0.0, r) for r in TOKEN_RATES),
    *(Arm(f"tokens-random{r:g}", 0.0, r, "random") for r in TOKEN_RATES[:2]),
    *(Arm(f"tokens-residual{r:g}", 0.0, r, "residual") for r in TOKEN_RATES[:2]),
    *(Arm(f"tokens-cumulative{r:g}", 0.0, r, "cumulative") for r in TOKEN_RATES[:2]),
    *(Arm(f"branch{r:g}", r) for r in RATES),
    Arm("both0.5+tokens0.3", 0.5, 0.3),
    Arm("both0.5+tokens0.5", 0.5, 0.5),
    Arm("auto", "auto"),
    Arm("tokens-auto", 0.0, "auto"),
]
BY_NAME = {a.name: a for a in ARMS}


@dataclass(frozen=True)
class Cost:
    """SmolLM2-135M's measured step components (one micro-batch of ``tokens``) and the token-drop backward ratios."""

    forward: float
    backward: float
    backward_all_dropped: float
    optimizer: float
    tokens: int
    token_ratio: dict[str, float]  # "0.5" -> t(r) (either rule: the same operations)

    @classmethod
    def from_bench(cls, path: Path) -> Cost:
        point = json.loads(path.read_text())["points"][0]
        base = point["baseline"]
        f, b, o, b0 = base["forward_s"], base["backward_s"], base["optimizer_s"], point["all_dropped"]["backward_s"]
        ratios = {}
        for row in point["rows"]:
            if row["pattern"] == "tokens":
                ratios[f"{row['drop_rate']:g}"] = (row["step_s"] - f - o - b0) / (b - b0)
        return cls(f, b, b0, o, point["seq_len"] * point["batch_size"], ratios)

    def token_ratio_at(self, rate: float) -> float:
        """The kept branches' backward time at token drop ``rate`` over full rows': linear between the measured
        rates, 1 at 0 (token_drop_rate="auto" runs at the mean share its selections kept)."""
        points = sorted([(0.0, 1.0), *((float(r), t) for r, t in self.token_ratio.items())])
        for (r0, t0), (r1, t1) in zip(points, points[1:], strict=False):
            if rate <= r1:
                return t0 + (t1 - t0) * (rate - r0) / (r1 - r0)
        return points[-1][1]

    def step_seconds(
        self, arm: Arm, dropped_fraction: float, tokens_per_step: int, kept_token_share: float | None = None
    ) -> float:
        ratio = 1.0
        if arm.token_drop_rate == "auto":
            ratio = self.token_ratio_at(1.0 - kept_token_share)
        elif arm.token_drop_rate:
            ratio = self.token_ratio[f"{arm.token_drop_rate:g}"]
        branch = (1 - dropped_fraction) * (self.backward - self.backward_all_dropped) * ratio
        micro = self.forward + self.backward_all_dropped + branch
        return micro * tokens_per_step / self.tokens + self.optimizer

    def speedup(
        self, arm: Arm, tokens_per_step: int, dropped: float | None = None, kept_token_share: float | None = None
    ) -> float:
        """Full backprop's step time over ``arm``'s, at ``dropped`` (default: its drop rate; "auto" needs it) and
        ``kept_token_share`` (token_drop_rate="auto" needs it)."""
        expected = dropped if dropped is not None else arm.drop_rate or 0.0
        full = self.step_seconds(BY_NAME["full"], 0.0, tokens_per_step)
        return full / self.step_seconds(arm, expected, _tokens(arm, tokens_per_step), kept_token_share)


def _tokens(arm: Arm, cell_tokens: int) -> int:
    return cell_tokens // 2 if arm.half_batch else cell_tokens


def budgets(arm: Arm, cell, cost: Cost) -> list[int]:
    """The complete runs' lengths in optimizer steps (the first is the sweep's), fixed the first time a cell runs."""
    return fixed_budgets(OUT / "budgets.json", (cell.name, arm.name), lambda: _budgets(arm, cell, cost))


def fixed_budgets(path: Path, keys: tuple[str, ...], make: Callable[[], list[int]]) -> list[int]:
    """The run lengths held at ``keys`` in the JSON file ``path``; the first time, ``make()``'s, stored there: a later
    cost record re-times the runs, it does not move them (benchmarks/smollm2_token_drops.py fixes its own alike)."""
    fixed = json.loads(path.read_text()) if path.exists() else {}
    node = fixed
    for key in keys[:-1]:
        node = node.setdefault(key, {})
    if keys[-1] not in node:
        node[keys[-1]] = make()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(fixed, indent=1) + "\n")
    return node[keys[-1]]


def cell_arms(cell) -> list[Arm]:
    """The arms a cell runs: those given when it first ran or added since (``--arms``; all by default), as
    ``budgets.json`` holds."""
    path = OUT / "budgets.json"
    fixed = json.loads(path.read_text()).get(cell.name, {}) if path.exists() else {}
    return [arm for arm in ARMS if arm.name in fixed] or ARMS


def _budgets(arm: Arm, cell, cost: Cost) -> list[int]:
    if arm.drop_rate is None:
        scale = 2 if arm.half_batch else 1
        return [cell.steps * scale, cell.steps * scale // 2, cell.steps * scale * 2]
    if "auto" in (arm.drop_rate, arm.token_drop_rate):  # its time is its own, known once it ran: the cell's steps
        return [cell.steps]
    if arm.map_key:  # the map's own runs: its equal-time budget (re-timed here, as every arm, on one clock)
        return [wip.equal_time_steps(MAP_COST, cell, arm.drop_rate), cell.steps]
    return [round(cell.steps * cost.speedup(arm, cell.tokens)), cell.steps]


def key(cell, arm: Arm, lr: float, steps: int, seed: int) -> str:
    return f"{cell.name}/{arm.map_key or arm.name}/lr{lr:g}/steps{steps}/seed{seed}"


def load_runs() -> dict[str, dict]:
    return {**wip.load_done(MAP_RUNS), **wip.load_done(OUT / "runs.jsonl")}


def sweep(done: dict[str, dict], cell, arm: Arm, cost: Cost, arms: list[Arm] | None = None) -> dict[float, float]:
    steps = budgets(arm, cell, cost)[0]
    points = grid(done, cell, cost, arms)
    return {lr: done[k]["final_loss"] for lr in points if (k := key(cell, arm, lr, steps, 0)) in done}


def grid(done: dict[str, dict], cell, cost: Cost, arms: list[Arm] | None = None) -> list[float]:
    """The map's grid, widened as the map widens it (``where_it_pays.widened_grid``) over every arm here (or over
    ``arms``: the report's, which leaves out arms whose sweep is still catching up with the grid)."""

    lrs = {r["lr"] for r in done.values() if r["cell"] == cell.name}

    def sweeps() -> list[dict[float, float]]:
        found = []
        for arm in cell_arms(cell) if arms is None else arms:
            steps = budgets(arm, cell, cost)[0]
            found.append({lr: done[k]["final_loss"] for lr in lrs if (k := key(cell, arm, lr, steps, 0)) in done})
        return found

    return wip.widened_grid(sweeps)


def best_lr(done: dict[str, dict], cell, arm: Arm, cost: Cost, arms: list[Arm] | None = None) -> float | None:
    points = grid(done, cell, cost, arms)
    rows = sweep(done, cell, arm, cost, arms)
    if len(rows) < len(points):
        return None
    best = min(points, key=rows.get)
    edge = best in (points[0], points[-1]) and len(points) < len(wip.LR_GRID) + wip.MAX_WIDENING
    return None if edge else best


def jobs(done: dict[str, dict], cell, cost: Cost) -> list[tuple[Arm, float, int, int]]:
    """What is left to run: the sweep (seed 0, each arm's first budget), then each arm's complete runs."""
    todo = []
    for arm in cell_arms(cell):
        steps = budgets(arm, cell, cost)[0]
        todo += [(arm, lr, steps, 0) for lr in grid(done, cell, cost)]
    for arm in cell_arms(cell):
        lr = best_lr(done, cell, arm, cost)
        if lr is not None:
            todo += [(arm, lr, steps, seed) for seed in SEEDS for steps in budgets(arm, cell, cost)]
    return [j for j in dict.fromkeys(todo) if key(cell, j[0], j[1], j[2], j[3]) not in done]


def train(cell_name: str, tokens: int, arm: Arm, lr: float, steps: int, seed: int, proxy: str) -> dict:
    """One complete run on the pre-trained proxy (one thread)."""
    torch.set_num_threads(1)
    import transformers
    from transformers import LlamaForCausalLM

    from dropbp import backends
    from dropbp.tools.compare import Run, compare
    from dropbp.tools.textdata import pydoc_topics

    transformers.logging.set_verbosity_error()
    model = LlamaForCausalLM(wip.proxy_config())
    model.load_state_dict(torch.load(proxy, weights_only=True))
    data = pydoc_topics(wip.ByteTokenizer(), wip.SEQ_LEN, max_val_windows=wip.VAL_WINDOWS)
    options = {}
    if arm.drop_rate is not None:
        options = {"pattern": "cut", "schedule": "warmup", "drop_schedule": "constant"}  # the shipped default
        options |= {"token_drop_rate": arm.token_drop_rate, "token_selection": arm.token_selection}
    run = Run(arm.name, arm.drop_rate, lr=lr, steps=steps, **options)
    sequences = _tokens(arm, tokens) // wip.SEQ_LEN
    started = time.perf_counter()
    [result] = compare(
        model,
        [run],
        data,
        steps=steps,
        lr=lr,
        batch_size=sequences,
        backend=backends.get("cpu"),
        eval_every=max(1, steps // 5),
        seed=seed,
        accumulation=max(1, sequences // wip.MICRO_SEQUENCES),
        lr_schedule="cosine",
        weight_decay=wip.WEIGHT_DECAY,
    )
    return {
        "cell": cell_name,
        "tokens": _tokens(arm, tokens),
        "arm": arm.name,
        "rate": arm.drop_rate,
        "token_drop_rate": arm.token_drop_rate,
        "token_selection": arm.token_selection,
        "lr": lr,
        "steps": steps,
        "seed": seed,
        "final_loss": result.val_loss[-1],
        "mean_dropped_fraction": sum(result.dropped_fractions) / len(result.dropped_fractions),
        "mean_kept_token_share": (
            sum(result.kept_token_shares) / len(result.kept_token_shares) if result.kept_token_shares else None
        ),
        "wall_s": time.perf_counter() - started,
        "val_loss": result.val_loss,
    }


def run_cells(cells: list, workers: int, cost: Cost) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    log = OUT / "runs.jsonl"
    proxy = str(wip.pretrained_proxy())
    started = time.perf_counter()
    running: dict[Future, tuple] = {}
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
        while True:
            done = load_runs()
            busy = {key(c, *j) for c, j in running.values()}
            ready = [(c, j) for c in cells for j in jobs(done, c, cost) if key(c, *j) not in busy]
            while ready and len(running) < workers:
                cell, job = ready.pop(0)
                arm, lr, steps, seed = job
                running[pool.submit(train, cell.name, cell.tokens, arm, lr, steps, seed, proxy)] = (cell, job)
            if not running:
                break
            finished, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in finished:
                cell, job = running.pop(future)
                row = {"key": key(cell, *job), **future.result()}
                wip.record_run(log, row, row["key"], started, f"{row['wall_s']:.0f} s")


def _dropped(row: dict) -> float:
    return row.get("mean_dropped_fraction", 0.0)


def _kept_share(row: dict) -> float | None:
    return row.get("mean_kept_token_share")


def _modelled(row: dict, arm: Arm, cost: Cost) -> float:
    return row["steps"] * cost.step_seconds(arm, _dropped(row), row["tokens"], _kept_share(row))


def settled_arms(done: dict[str, dict], cell, cost: Cost) -> list[Arm]:
    """The arms the report reads the grid over: those whose sweep has caught up with full backprop's, less those
    whose best there lies on an edge that widens the grid past full backprop's runs (their best may lie beyond: they
    are still running, as the arms not caught up are)."""
    full, lrs = BY_NAME["full"], {r["lr"] for r in done.values() if r["cell"] == cell.name}
    steps = budgets(full, cell, cost)[0]
    points = sorted(lr for lr in lrs if key(cell, full, lr, steps, 0) in done)  # full backprop's sweep so far
    arms = []
    for arm in cell_arms(cell):
        steps = budgets(arm, cell, cost)[0]
        losses = {lr: done[k]["final_loss"] for lr in points if (k := key(cell, arm, lr, steps, 0)) in done}
        if len(losses) < len(points):
            continue  # still catching up
        best = min(points, key=losses.get)
        if set(grid(done, cell, cost, [*arms, arm])) <= set(points) or best not in (points[0], points[-1]):
            arms.append(arm)
    return arms


def _mean_share(runs: list[dict]) -> float | None:
    shares = [_kept_share(r) for r in runs]
    return None if None in shares else sum(shares) / len(shares)


def cell_report(cell, done: dict[str, dict], cost: Cost) -> dict | None:
    """Per arm: its learning rate and, per budget, the speedup at equal quality over the seeds against full
    backprop at the cell's batch and at its best batch; None until every complete run is in."""
    from dropbp.tools.frontier import Reading, best_batch_speedup, equal_quality_speedup, over_seeds

    arms = cell_arms(cell)
    lrs = {arm.name: best_lr(done, cell, arm, cost, settled_arms(done, cell, cost)) for arm in arms}
    rows, unfinished = {}, []
    for arm in arms:
        lr = lrs[arm.name]
        plan = [] if lr is None else [(s, seed) for seed in SEEDS for s in budgets(arm, cell, cost)]
        found = [done.get(key(cell, arm, lr, s, seed)) for s, seed in plan]
        if lr is None or None in found:
            if arm.drop_rate is None:
                return None  # no frontier yet
            unfinished.append(arm.name)  # an arm still running is left out, and named
            continue
        rows[arm.name] = found
    arms = [arm for arm in arms if arm.name in rows]
    lrs = {name: lr for name, lr in lrs.items() if name in rows}
    front = {name: {s: [] for s in SEEDS} for name in ("full", "full-half")}  # each batch's own runs, per seed
    for name in front:
        for r in rows[name]:
            front[name][r["seed"]].append((_modelled(r, BY_NAME[name], cost), r["final_loss"]))

    def reading(name: str, r: dict, arm: Arm) -> Reading:
        """The run ``r`` against full backprop at the cell's batch (``full``) or at its best batch (``best``)."""
        time, loss = _modelled(r, arm, cost), r["final_loss"]
        if name == "full":
            return equal_quality_speedup(front["full"][r["seed"]], time, loss)
        return best_batch_speedup([front["full"][r["seed"]], front["full-half"][r["seed"]]], time, loss)
    report = {"cell": cell.name, "steps": cell.steps, "tokens": cell.tokens, "lr": lrs, "arms": {}}
    if unfinished:
        report["unfinished"] = unfinished
    full_step = cost.step_seconds(BY_NAME["full"], 0.0, cell.tokens)
    half = BY_NAME["full-half"]
    runs = sorted((r for r in rows[half.name] if r["steps"] == budgets(half, cell, cost)[0]), key=lambda r: r["seed"])
    readings = [reading("full", r, half) for r in runs]
    report["half_batch"] = {"steps": runs[0]["steps"], "full": over_seeds(readings)}  # against the cell's batch
    for arm in arms:
        if arm.drop_rate is None:
            report["arms"][arm.name] = {
                str(s): [r["final_loss"] for r in rows[arm.name] if r["steps"] == s] for s in budgets(arm, cell, cost)
            }
            continue
        per_budget = {}
        for steps in budgets(arm, cell, cost):
            runs = sorted((r for r in rows[arm.name] if r["steps"] == steps), key=lambda r: r["seed"])
            dropped, share = sum(_dropped(r) for r in runs) / len(runs), _mean_share(runs)
            entry = {
                "final_loss": [r["final_loss"] for r in runs],
                "step_speedup": cost.speedup(arm, cell.tokens, dropped, share),
                "equal_time": steps == budgets(arm, cell, cost)[0],
            }
            if share is not None:  # the token rows its selections kept, over the kept branches (mean of the runs)
                entry["kept_token_share"] = share
            for name in ("full", "best"):
                readings = [reading(name, r, arm) for r in runs]
                entry[name] = over_seeds(readings)
                if name == "best":  # full backprop steps (best batch) to the same loss per step of this arm
                    entry["step_worth"] = sum(
                        x.value * _modelled(r, arm, cost) / (steps * full_step)
                        for x, r in zip(readings, runs, strict=True)
                    ) / len(runs)
            per_budget[str(steps)] = entry
        report["arms"][arm.name] = per_budget
    return report


def _cell_text(entry: dict) -> str:
    text = f"{entry['mean']:.2f}x [{entry['low']:.2f}, {entry['high']:.2f}]"
    return text + (f" ({entry['bounded']} bound)" if entry.get("bounded") else "")


def report(cost: Cost, cost_record: Path = COST_RECORD) -> None:
    """token_drops.md / .json; with another cost record (checkpointing's), the same runs re-timed on it, written as
    token_drops_<its folder>.md / .json."""
    done = load_runs()
    names = sorted({r["cell"] for r in wip.load_done(OUT / "runs.jsonl").values()})
    cells = sorted((wip.Cell.parse(n) for n in names), key=lambda c: (c.tokens, c.steps))
    figures = [f for c in cells if (f := cell_report(c, done, cost)) is not None]
    record = {
        "benchmark": "token_drops",
        "date": date.today().isoformat(),
        "cost_record": str(cost_record.resolve().relative_to(HERE.parent)),
        "cost": asdict(cost),
        "seeds": SEEDS,
        "lr_grid": wip.LR_GRID,
        "torch": torch.__version__,
        "cells": figures,
    }
    name = "token_drops" if cost_record.resolve() == COST_RECORD else f"token_drops_{cost_record.parent.name}"
    (OUT / f"{name}.json").write_text(json.dumps(record, indent=2) + "\n")
    lines = [
        "Speedup at equal quality (mean [95% interval] over 3 seeds) of each arm against full backprop at the cell's "
        "batch and at its best of two batches (the cell's and half of it), on the map's proxy; each arm at its own "
        "best learning rate from one grid. Time modelled on SmolLM2-135M's measured CPU steps "
        f"({record['cost_record']}). "
        "Method: benchmarks/token_drops.py.",
        "",
        "| cell | arm | lr | steps | step speedup | vs full backprop | vs full backprop at its best batch | "
        "worth of a step (best batch) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for f in figures:
        for arm in [BY_NAME[name] for name in f["arms"]]:
            if arm.drop_rate is None:
                losses = "; ".join(f"{s} steps {sum(v) / len(v):.4f}" for s, v in f["arms"][arm.name].items())
                half = _cell_text(f["half_batch"]["full"]) if arm.half_batch else ""
                lines.append(f"| {f['cell']} | {arm.name} | {f['lr'][arm.name]:g} | {losses} | 1.00x | {half} | | |")
                continue
            for steps, e in f["arms"][arm.name].items():
                lines.append(
                    f"| {f['cell']} | {arm.name} | {f['lr'][arm.name]:g} | {steps} | {e['step_speedup']:.2f}x | "
                    f"{_cell_text(e['full'])} | **{_cell_text(e['best'])}** | {e['step_worth']:.2f} |"
                )
    (OUT / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", nargs="+", type=wip.Cell.parse, default=[])
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--cost-record", type=Path, default=COST_RECORD)
    parser.add_argument("--report", action="store_true")
    parser.add_argument(
        "--arms",
        nargs="+",
        choices=list(BY_NAME),
        help="a new cell's arms (default all; full backprop's always), or arms to add to a cell that ran",
    )
    args = parser.parse_args()
    cost = Cost.from_bench(args.cost_record)
    fixed = json.loads((OUT / "budgets.json").read_text()) if (OUT / "budgets.json").exists() else {}
    for cell in args.cells:  # a cell's arms are fixed with their budgets when first given; --arms adds arms
        if cell.name not in fixed or args.arms:
            for name in dict.fromkeys(["full", "full-half", *(args.arms or BY_NAME)]):
                budgets(BY_NAME[name], cell, cost)
    if args.cells:
        run_cells(args.cells, args.workers, cost)
    if args.report:
        report(cost, args.cost_record)


if __name__ == "__main__":
    main()
