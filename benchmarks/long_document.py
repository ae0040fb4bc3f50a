"""One long document a step: the speedup at equal quality where the batch cannot shrink (issue 69, item 4).

The regime: each optimizer step trains on one document of ``L`` tokens; the only smaller step a user can make is to
truncate the documents. Arms, each a complete run with its own learning-rate warm-up and cosine decay, on 3 scored
seeds (batch order and patterns), each at its own best learning rate from one grid chosen on seed 0 (which is not
scored here: :data:`SWEEP_SEED`):

- full backprop at ``L``: :data:`STEPS` steps, one document each, and 0.5 and 2 times as many (its frontier);
- full backprop at ``L/2``: every document truncated to its first half, in 0.5, 1 and 2 times full backprop's time
  (its cheaper steps buy more of them, repeating the documents: the truncation a user could make instead);
- branch drops at 0.5 and 0.875 (the shipped default: cut patterns, a 20% warm-up with the mean kept), each at its
  equal-time budget (the steps its modelled step speedup buys in full backprop's time). Not at full backprop's 50
  steps: there 0.875's warm-up peaks past what cuts reach on the proxy's 12 branches (``apply`` refuses it).

Quality is the validation loss on held-out documents at their full length ``L``, whatever the arm trained on. The
figure: the time full backprop needs to reach an arm's final loss, read from that seed's frontier, over the arm's
time (:mod:`dropbp.tools.frontier`); against full backprop at ``L`` and against the better of ``L`` and ``L/2``.

The model is :mod:`where_it_pays`'s proxy (a 6-layer, 64-wide Llama-shaped byte-level model pre-trained on the
standard library's source at 128 tokens), fine-tuned at ``L`` tokens on Python's help text: its fine-tuning extends
its context, as long-context fine-tuning does. Documents: the help topics, every tenth held out, joined and cut into
``L``-byte documents. Time is MODELLED on SmolLM2-135M's measured step at one document of ``L`` and of ``L/2`` tokens
(full fine-tuning, activation checkpointing on: ``--cost-record``, benchmarks/results/long_document_cpu), per step
``F + B0 + (1 - f)(B - B0) + O`` for the fraction ``f`` of branch FLOPs the step dropped; the proxy's own wall time
is recorded beside. The noise scale the library reads within one step (``dropbp.NoiseScale``, one micro-batch a step)
is measured on the proxy at the start and its forecast set beside each arm.

    OMP_NUM_THREADS=1 python benchmarks/long_document.py --run        # the runs, resumable (runs.jsonl)
    python benchmarks/long_document.py --report                        # long_document.json, .md
    python benchmarks/long_document.py --figure                        # step time and memory against L

``--figure`` draws SmolLM2-135M's step speedup (LoRA, checkpointing on, at the expected dropped share) and peak memory
(LoRA, one real step in a fresh process, checkpointing off and on) against the document length, from the records of
item 2 (:data:`STEP_RECORDS`, :data:`MEMORY_RECORDS`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from datetime import date
from pathlib import Path

import torch
from readme_results import seeds_text
from where_it_pays import PROXY, ByteTokenizer, StepCost, pretrained_proxy, proxy_config

RESULTS = Path(__file__).resolve().parent / "results"
OUT = RESULTS / "long_document_quality"
COST_RECORD = RESULTS / "long_document_cpu" / "bench.json"
#: ``dropbp bench`` records of one document a step (SmolLM2-135M; checkpointing on, then off; a later record's point
#: replaces an earlier one's: the cut at 0.5 and 8192 tokens measured again in two rounds), and its memory records.
STEP_RECORDS = (
    RESULTS / "long_document_cpu" / "bench.json",
    RESULTS / "long_document_cpu_8k" / "bench.json",
    RESULTS / "long_document_cpu_8k_half" / "bench.json",
    RESULTS / "long_document_cpu_nockpt" / "bench.json",
    RESULTS / "long_document_cpu_16k" / "bench.json",
)
#: Points of those records the figure leaves out, and why (each record's README says it too).
NOT_DRAWN = {
    (16384, "cut", 0.875): "one of its two rounds drew a cut that dropped nothing, and the line through the two "
    "rounds (a fifth apart in their full steps) carries it past the ideal",
}
MEMORY_RECORDS = (RESULTS / "long_document_memory" / "memory.json", RESULTS / "long_document_memory_8k" / "memory.json")
LENGTH = 4096  # tokens (bytes) of one document
STEPS = 50  # full backprop's run: one document a step (about half an epoch of the 105 documents)
LR_GRID = (1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2, 3.2e-2)  # the map's middle three, widened upward: every best sat at 4e-3
SWEEP_SEED = 9  # chooses the learning rates; not scored
SEEDS = (0, 1, 2)
BUDGETS = (0.5, 1.0, 2.0)  # full backprop's runs (both lengths), as multiples of its steps
RATES = (0.5, 0.875)
WEIGHT_DECAY = 0.02
VAL_DOCUMENTS = 8


@dataclass(frozen=True)
class Arm:
    name: str  # "full", "half" (truncated to L/2) or "dropbp<rate>"
    rate: float | None
    tokens: int  # trained per step


ARMS = (Arm("full", None, LENGTH), Arm("half", None, LENGTH // 2), *(Arm(f"dropbp{r:g}", r, LENGTH) for r in RATES))


def step_costs(record: Path) -> dict[int, StepCost]:
    """SmolLM2-135M's full fine-tuning step with checkpointing on, per document length, from a ``dropbp bench``
    record with one sequence a step."""
    costs = {}
    for point in json.loads(record.read_text())["points"]:
        if point["method"] == "full" and point["checkpointing"] and point["batch_size"] == 1:
            base = point["baseline"]
            costs[point["seq_len"]] = StepCost(
                base["forward_s"], base["backward_s"], point["all_dropped"]["backward_s"], base["optimizer_s"],
                point["seq_len"],
            )  # fmt: skip
    return costs


def documents() -> tuple[torch.Tensor, torch.Tensor]:
    """Training and validation documents of :data:`LENGTH` bytes: the help topics (every tenth held out), joined."""
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    names = sorted(topics)

    def cut(text: str) -> torch.Tensor:
        ids = torch.tensor(ByteTokenizer()(text)["input_ids"])
        return ids[: len(ids) // LENGTH * LENGTH].view(-1, LENGTH)

    train = cut("\n\n".join(topics[n] for i, n in enumerate(names) if i % 10 != 0))
    val = cut("\n\n".join(topics[n] for i, n in enumerate(names) if i % 10 == 0))
    return train, val[:VAL_DOCUMENTS]


def steps_of(arm: Arm, costs: dict[int, StepCost], budget: float = 1.0) -> int:
    """An arm's steps in ``budget`` times the time of full backprop's :data:`STEPS` steps at ``L``: the truncated
    arm's cheaper steps and a drop's alike buy more steps in that time."""
    full = costs[LENGTH].step_seconds(0.0, LENGTH)
    own = costs[arm.tokens].step_seconds(0.0 if arm.rate is None else arm.rate, arm.tokens)
    return round(STEPS * budget * full / own)


def key(arm: Arm, lr: float, steps: int, seed: int) -> str:
    return f"{arm.name}/lr{lr:g}/steps{steps}/seed{seed}"


def train(arm: Arm, lr: float, steps: int, seed: int, proxy: str, costs: dict[int, StepCost]) -> dict:
    """One complete run on the pre-trained proxy (one thread): its curve on full-length documents and modelled time."""
    torch.set_num_threads(1)
    import transformers
    from transformers import LlamaForCausalLM

    from dropbp import backends
    from dropbp.tools.compare import Run, compare
    from dropbp.tools.textdata import TokenData

    transformers.logging.set_verbosity_error()
    model = LlamaForCausalLM(proxy_config())
    model.load_state_dict(torch.load(proxy, weights_only=True))
    train_docs, val_docs = documents()
    data = TokenData(train_docs[:, : arm.tokens].contiguous(), val_docs)
    default = {"pattern": "cut", "schedule": "warmup", "drop_schedule": "constant"}  # the shipped default
    run = Run(key(arm, lr, steps, seed), arm.rate, lr=lr, steps=steps, **(default if arm.rate is not None else {}))
    started = time.perf_counter()
    [result] = compare(
        model, [run], data, steps=steps, lr=lr, batch_size=1, backend=backends.get("cpu"),
        eval_every=max(1, steps // 5), seed=seed, lr_schedule="cosine", weight_decay=WEIGHT_DECAY,
    )  # fmt: skip
    cost = costs[arm.tokens]
    elapsed = [0.0]
    for f in result.dropped_fractions:
        elapsed.append(elapsed[-1] + cost.step_seconds(f, arm.tokens))
    return {
        "key": key(arm, lr, steps, seed), "arm": arm.name, "rate": arm.rate, "tokens": arm.tokens, "lr": lr,
        "steps": steps, "seed": seed, "final_loss": result.val_loss[-1], "modelled_s": elapsed[-1],
        "wall_s": time.perf_counter() - started,
        "mean_dropped_fraction": sum(result.dropped_fractions) / len(result.dropped_fractions),
        "eval_steps": result.eval_steps, "val_loss": result.val_loss,
    }  # fmt: skip


def load(log: Path) -> dict[str, dict]:
    rows = [json.loads(line) for line in log.read_text().splitlines() if line.strip()] if log.exists() else []
    return {r["key"]: r for r in rows}


def best_lr(done: dict[str, dict], arm: Arm, costs: dict[int, StepCost]) -> float | None:
    steps = steps_of(arm, costs)
    losses = {lr: done.get(key(arm, lr, steps, SWEEP_SEED), {}).get("final_loss") for lr in LR_GRID}
    return None if None in losses.values() else min(LR_GRID, key=losses.__getitem__)


def jobs(done: dict[str, dict], costs: dict[int, StepCost]) -> list[tuple[Arm, float, int, int]]:
    """The sweep (every arm over the grid on :data:`SWEEP_SEED`), then each arm's scored runs at its best."""
    todo = [(arm, lr, steps_of(arm, costs), SWEEP_SEED) for arm in ARMS for lr in LR_GRID]
    for arm in ARMS:
        lr = best_lr(done, arm, costs)
        if lr is None:
            continue
        budgets = BUDGETS if arm.rate is None else (1.0,)  # a drop at its equal-time budget
        todo += [(arm, lr, steps_of(arm, costs, b), seed) for seed in SEEDS for b in budgets]
    return [j for j in todo if key(j[0], j[1], j[2], j[3]) not in done]


def run(out: Path, costs: dict[int, StepCost], workers: int = 2) -> None:
    """Every job of :func:`jobs`, ``workers`` at a time (one thread each), each appended to ``runs.jsonl`` as it
    finishes: a stopped study resumes where it was."""
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
    from multiprocessing import get_context

    out.mkdir(parents=True, exist_ok=True)
    log = out / "runs.jsonl"
    proxy = str(pretrained_proxy())
    started = time.perf_counter()
    running: dict = {}
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
        while True:
            busy = {key(*job) for job in running.values()}
            ready = [j for j in jobs(load(log), costs) if key(*j) not in busy]
            while ready and len(running) < workers:
                job = ready.pop(0)
                running[pool.submit(train, *job, proxy, costs)] = job
            if not running:
                break
            finished, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in finished:
                running.pop(future)
                row = future.result()
                with log.open("a") as f:
                    f.write(json.dumps(row) + "\n")
                said = f"loss {row['final_loss']:.4f}, modelled {row['modelled_s']:.0f} s, proxy {row['wall_s']:.0f} s"
                print(f"[{time.perf_counter() - started:6.0f} s] {row['key']}: {said}", file=sys.stderr, flush=True)


def noise_reading(proxy: str, cost: StepCost, steps: int = 8) -> dict:
    """B_simple of the proxy at its pre-trained weights, read within one step (one document a step, no optimizer
    step), and what it forecasts for each arm at one document a step (the branches' share of a step from ``cost``)."""
    from transformers import LlamaForCausalLM

    import dropbp
    from dropbp.policy.noise_scale import auto_drop_rate, forecast_arms

    torch.manual_seed(0)
    model = LlamaForCausalLM(proxy_config())
    model.load_state_dict(torch.load(proxy, weights_only=True))
    model.train()
    noise = dropbp.NoiseScale()
    ctl = dropbp.apply(model, 0.0, features=[noise])
    train_docs, _ = documents()
    for i in range(steps):
        model.zero_grad(set_to_none=True)
        doc = train_docs[i : i + 1]
        model(input_ids=doc, labels=doc).loss.backward()
    noise.flush()
    reading = noise.estimate()
    ctl.remove()
    share = (cost.backward - cost.backward_all_dropped) / cost.step_seconds(0.0, cost.tokens)
    names = {f"branch drops at {r:g}": f"dropbp{r:g}" for r in RATES} | {"full backprop at half the batch": "half"}
    forecast = {names[a.name]: a.speedup for a in forecast_arms(reading.tokens, LENGTH, share, RATES)}
    return {"tokens": reading.tokens, "documents": reading.tokens / LENGTH, "steps": reading.steps,
            "branch_share": share, "forecast": forecast, "auto_rate": auto_drop_rate(reading, share)}  # fmt: skip


def report(out: Path, costs: dict[int, StepCost], cost_record: Path) -> None:
    from dropbp.tools.frontier import best_batch_speedup, equal_quality_speedup, over_seeds

    done = list(load(out / "runs.jsonl").values())
    lrs = {arm.name: best_lr({r["key"]: r for r in done}, arm, costs) for arm in ARMS}
    scored = [r for r in done if r["seed"] in SEEDS]

    def points(name: str, seed: int) -> list[tuple[float, float]]:
        return [(r["modelled_s"], r["final_loss"]) for r in scored if r["arm"] == name and r["seed"] == seed]

    rows = []
    for arm in ARMS:
        if arm.name == "full":
            continue
        runs = [r for r in scored if r["arm"] == arm.name and r["lr"] == lrs[arm.name]]
        for steps in sorted({r["steps"] for r in runs}):
            at = sorted((r for r in runs if r["steps"] == steps), key=lambda r: r["seed"])
            if len(at) < len(SEEDS):
                continue
            against_full = [equal_quality_speedup(points("full", r["seed"]), r["modelled_s"], r["final_loss"])
                            for r in at]  # fmt: skip
            against_best = [
                best_batch_speedup([points("full", r["seed"]), points("half", r["seed"])], r["modelled_s"],
                                   r["final_loss"])
                for r in at
            ]  # fmt: skip
            rows.append({
                "arm": arm.name, "rate": arm.rate, "tokens": arm.tokens, "lr": lrs[arm.name], "steps": steps,
                "equal_time": steps == steps_of(arm, costs),
                "modelled_s": [r["modelled_s"] for r in at], "final_loss": [r["final_loss"] for r in at],
                "against_full": over_seeds(against_full), "against_best": over_seeds(against_best),
            })  # fmt: skip
    record = {
        "benchmark": "long_document",
        "date": date.today().isoformat(),
        "proxy": {**PROXY, "vocab_size": 256},
        "length": LENGTH,
        "steps": STEPS,
        "lr_grid": LR_GRID,
        "sweep_seed": SWEEP_SEED,
        "seeds": SEEDS,
        "lr": lrs,
        "cost_record": str(cost_record.relative_to(RESULTS.parent.parent)),
        "step_cost": {str(n): asdict(c) for n, c in costs.items()},
        "noise_scale": noise_reading(str(pretrained_proxy()), costs[LENGTH]),
        "full": {str(n): sorted(r["final_loss"] for r in scored if r["arm"] == "full" and r["steps"] == n)
                 for n in sorted({r["steps"] for r in scored if r["arm"] == "full"})},  # fmt: skip
        "rows": rows,
    }
    (out / "long_document.json").write_text(json.dumps(record, indent=2, default=str) + "\n")
    (out / "long_document.md").write_text(markdown(record) + "\n")
    print(markdown(record))


def markdown(record: dict) -> str:
    noise = record["noise_scale"]
    forecast = noise["forecast"]
    lines = [
        f"# One long document a step: speedup at equal quality (proxy, {record['length']} tokens a step)",
        "",
        "| arm | steps | lr | against full backprop at L | against the better of L and L/2 | forecast |",
        "|---|---|---|---|---|---|",
    ]
    for row in record["rows"]:
        name = "full backprop at L/2 (truncated)" if row["arm"] == "half" else f"branch drops {row['rate']:g}"
        name += " (equal time)" if row["equal_time"] else ""
        guess = forecast.get(row["arm"])
        lines.append(
            f"| {name} | {row['steps']} | {row['lr']:g} | {seeds_text(row['against_full'])} | "
            f"{seeds_text(row['against_best'])} | {'' if guess is None else f'{guess:.2f}x'} |"
        )
    edges = [name for name, lr in record["lr"].items() if lr in (min(record["lr_grid"]), max(record["lr_grid"]))]
    lines += [
        "",
        f"Learning-rate grid {list(record['lr_grid'])}; at its edge: {', '.join(edges) or 'none'} (a wider grid may "
        "move those arms).",
        "",
        f"Full backprop at L: lr {record['lr']['full']:g}; at L/2: lr {record['lr']['half']:g}. Mean [95% interval] "
        f"over seeds {list(record['seeds'])}; learning rates chosen on seed {record['sweep_seed']} (not scored). "
        f"Noise scale read within one step at the start: {noise['tokens']:.0f} tokens ({noise['documents']:.2f} "
        f"documents; `drop_rate=\"auto\"` would choose {noise['auto_rate']:g}); the forecast column is its model "
        f"(McCandlish et al.) against full backprop at L. Time modelled on {record['cost_record']}.",
    ]
    return "\n".join(lines)


def figure(out: Path) -> Path:
    """Step speedup and peak memory against the document length (:data:`STEP_RECORDS` but :data:`NOT_DRAWN`,
    :data:`MEMORY_RECORDS`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (speed, memory) = plt.subplots(1, 2, figsize=(11, 4))
    speedups: dict[tuple[bool, str, float], dict[int, float]] = {}
    for path in STEP_RECORDS:
        for point in json.loads(path.read_text())["points"]:
            if point["method"] != "lora":
                continue
            for row in point["rows"]:
                if (point["seq_len"], row["pattern"], row["drop_rate"]) in NOT_DRAWN:
                    continue
                line = speedups.setdefault((bool(point["checkpointing"]), row["pattern"], row["drop_rate"]), {})
                line[point["seq_len"]] = row["speedup_at_expected"]
    for (ckpt, pattern, rate), pts in sorted(speedups.items(), reverse=True):
        label = f"{pattern} {rate:g}{'' if ckpt else ', no checkpointing'}"
        speed.plot(*zip(*sorted(pts.items()), strict=True), marker="o", linestyle="-" if ckpt else "--", label=label)
    speed.axhline(1.0, color="grey", linewidth=1, linestyle=":")
    speed.set_xscale("log", base=2)
    speed.set_xlabel("one document a step (tokens)")
    speed.set_ylabel("step speedup vs full backprop")
    speed.set_title(
        "LoRA; checkpointing on (solid) and off (dashed)\n8192: one round (the cut at 0.5: two); 16384: the cut at 0.5",
        fontsize=9,
    )
    speed.legend(fontsize=8)
    peaks: dict[tuple[bool, float], list[tuple[int, float]]] = {}
    for path in MEMORY_RECORDS:
        for row in json.loads(path.read_text())["memory"]:
            peaks.setdefault((row["checkpointing"], row["rate"] or 0.0), []).append(
                (row["seq_len"], row["peak_above_level_bytes"] / 2**30)
            )
    for (ckpt, rate), pts in sorted(peaks.items()):
        label = f"{'full backprop' if rate == 0 else f'drop {rate:g}'}{', checkpointing' if ckpt else ''}"
        memory.plot(*zip(*sorted(pts), strict=True), marker="o", linestyle="-" if ckpt else "--", label=label)
    memory.set_xscale("log", base=2)
    memory.set_xlabel("one document a step (tokens)")
    memory.set_ylabel("peak memory above the loaded model (GiB)")
    memory.legend(fontsize=8)
    fig.suptitle("SmolLM2-135M, LoRA, one document a step, 1 CPU thread (benchmarks/results/long_document_*)")
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    path = out / "long_document.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", action="store_true")
    parser.add_argument("--report", action="store_true")
    parser.add_argument("--figure", action="store_true", help="step time and memory against L, from item 2's records")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--cost-record", type=Path, default=COST_RECORD)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    costs = step_costs(args.cost_record)
    if args.run:
        run(args.out, costs, args.workers)
    if args.report:
        report(args.out, costs, args.cost_record)
    if args.figure:
        print(f"wrote {figure(args.out)}")


if __name__ == "__main__":
    main()
