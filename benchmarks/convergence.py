"""Does DropBP reach the same validation loss sooner? SmolLM2-135M (real, pretrained), CPU.

Fine-tunes SmolLM2-135M-Instruct (LoRA or full) on a documentation corpus that ships with Python
(``--corpus pydoc``: its help text; ``stdlib-docstrings``: the standard library's docstrings; the
validation text is held out by topic or module) with full backprop and with DropBP variants, all in
lockstep in one process (see ``dropbp/tools/compare.py``): same starting weights, batches and learning
rate, per-run timing. The learning rate is the baseline's: ``--grid lr`` first, then every other grid
takes the best one recorded (or ``--lr``). Reports per-step speedup, validation loss at equal steps
and at equal wall time, and time-to-target: the training wall time a run needs to reach the
baseline's final validation loss, as a ratio to the baseline's own.

    python benchmarks/convergence.py --grid lr --method lora     # the baseline's learning rate
    python benchmarks/convergence.py --grid levers               # each lever on and off at 0.5
    python benchmarks/convergence.py --grid schedules            # warm-up and annealing at 0.5
    python benchmarks/convergence.py --grid rates --method full  # 0.5 and 0.875
    python benchmarks/convergence.py --grid rates --method qlora # LoRA on nf4 4-bit weights (bitsandbytes)

Where people fine-tune (issue 23): accumulated micro-batches (a pattern each), a learning rate with
linear warm-up and cosine decay over each run's own steps, AdamW weight decay as the research code:

    python benchmarks/convergence.py --grid time-schedules --regime accumulate --lr 2e-3 --dropbp-steps 120
    python benchmarks/convergence.py --grid default --regime accumulate --method full --lr 1e-4 --dropbp-steps 135
    python benchmarks/convergence.py --learning-rates A.json B.json C.json  # the grid at each lr: each run's best

The speedup at equal quality (issue 40, docs/where-it-pays.md): DropBP's own learning rate from the same grid, then
full backprop complete at half, once and twice --steps and DropBP complete at --steps and --dropbp-steps:

    python benchmarks/convergence.py --grid lr-dropbp --regime accumulate --method lora --dropbp-steps 135
    python benchmarks/convergence.py --grid equal-quality --regime accumulate --method lora --lr 2e-3 \\
        --dropbp-lr 2e-3 --dropbp-steps 135
Writes benchmarks/results/convergence_<grid>_<method>_<corpus>.json, .md and .png.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import sys
import time
from dataclasses import replace
from datetime import date
from pathlib import Path

import torch
import transformers

from dropbp import backends
from dropbp.tools.compare import TAIL_WINDOW, Run, RunResult, compare, equal_quality, summarise, with_timed_tails
from dropbp.tools.pretrained import DEFAULT_MODEL, checkpointing_on, load_causal_lm
from dropbp.tools.qlora import quantize_4bit
from dropbp.tools.report import learning_rates_table, plot_curves, seeds_table, steps_and_time_table
from dropbp.tools.textdata import CORPORA

RESULTS = Path(__file__).resolve().parent / "results"

GRIDS = {
    # Each lever on and off at drop rate 0.5.
    "levers": [
        Run("full backprop"),
        Run("uniform 0.5 (paper)", 0.5, dropped_grads="skip"),
        Run("uniform 0.5 + lr comp.", 0.5, dropped_grads="skip", lr_compensation=True),
        Run("uniform 0.5 + unbiased", 0.5, dropped_grads="skip", unbiased=True),
        Run("uniform 0.5 + zero grads", 0.5, dropped_grads="zero"),
        Run("uniform 0.5 + reuse grads", 0.5, dropped_grads="reuse"),
        Run("calibrated 0.5", 0.5, dropped_grads="skip", calibrate=True),
        Run("uniform 0.5 + reuse + warm-up", 0.5, dropped_grads="reuse", schedule="warmup"),
        Run("uniform 0.5 + reuse + anneal", 0.5, dropped_grads="reuse", schedule="anneal"),
    ],
    # apply()'s defaults at 0.5 and 0.875; with the warm-up attach() adds; 0.875 with calibrated rates.
    "rates": [
        Run("full backprop"),
        Run("DropBP 0.5", 0.5),
        Run("DropBP 0.5 + warm-up", 0.5, schedule="warmup"),
        Run("DropBP 0.875", 0.875),
        Run("DropBP 0.875 + calibration", 0.875, calibrate=True),
    ],
    # Pattern shapes (issue "the shape of the drop pattern"): the paper's uniform patterns, random
    # cuts (every branch below a random depth dropped), and controls that say why, at 0.5 and 0.875.
    "patterns": [Run("full backprop")]
    + [
        run
        for p in (0.5, 0.875)
        for run in (
            Run(f"uniform {p} (paper)", p),
            Run(f"cut {p}", p, rates="cut-uncapped"),
            Run(f"cut marginals, uniform shape {p}", p, rates="cut-marginals"),
            Run(f"frozen bottom {p}", p, rates="frozen-bottom"),
            Run(f"cut capped {p}", p, rates="cut-capped"),
            Run(f"cut {p} + warm-up", p, rates="cut-uncapped", schedule="warmup"),
        )
    ],
    # Twice as long: does the ranking hold past the fast initial phase?
    "patterns-long": [
        Run("full backprop"),
        Run("uniform 0.5 (paper)", 0.5),
        Run("cut 0.5", 0.5, rates="cut-uncapped"),
        Run("cut capped 0.5", 0.5, rates="cut-capped"),
        Run("cut capped 0.5 + warm-up", 0.5, rates="cut-capped", schedule="warmup"),
    ],
    # Drop-rate schedules at 0.5: warm-up from 0 (first 20% of the baseline's steps), annealing to 0
    # (last 20% of the run).
    "schedules": [
        Run("full backprop"),
        Run("0.5 + warm-up", 0.5, schedule="warmup"),
        Run("0.5 + anneal", 0.5, schedule="anneal"),
    ],
}


# The regime people fine-tune in (issue 23), each DropBP run with its own complete schedules: a time
# schedule of the drop rate whose mean over the run is the drop rate, against the constant rate with a
# warm-up (whose mean is kept by the same total_steps), and the same at the baseline's number of steps.
_CUT_WARMUP = {"pattern": "cut", "schedule": "warmup", "drop_schedule": "constant"}
_CUT_LINEAR = {"pattern": "cut", "drop_schedule": "linear", "ramp": 0.5}
GRIDS["time-schedules"] = [
    Run("full backprop"),
    Run("cut 0.5 + warm-up (mean kept)", 0.5, **_CUT_WARMUP),
    Run("cut 0.5, linear rise over half", 0.5, **_CUT_LINEAR),
]
# The shipped default (cut, warm-up over 20%, mean kept) at equal steps and at equal time.
GRIDS["time-schedules"].append(Run("cut 0.5 + warm-up (mean kept), equal steps", 0.5, steps=-1, **_CUT_WARMUP))
GRIDS["default"] = [
    Run("full backprop"),
    Run("DropBP 0.5, equal steps", 0.5, steps=-1, **_CUT_WARMUP),
    Run("DropBP 0.5, equal time", 0.5, **_CUT_WARMUP),
]

# The shipped default with activation checkpointing on (--checkpointing): equal steps (its losses are those of
# the same run without checkpointing), equal time at 0.5 and at 0.75 (steps from the step speedups measured with
# checkpointing on, benchmarks/results/bench_checkpointing_cpu).
GRIDS["checkpointing"] = [
    *GRIDS["default"],
    Run("DropBP 0.75, equal time", 0.75, steps=180, **_CUT_WARMUP),
]

# The shipped default as Gaudi's lazy mode runs it (issue 32): its pattern bound (16, a pool per rate level, cycled
# in a fixed order so that accumulated steps repeat) against the unbounded default, at equal steps.
GRIDS["lazy-bound"] = [
    Run("full backprop"),
    Run("DropBP 0.5, equal steps", 0.5, steps=-1, **_CUT_WARMUP),
    Run("DropBP 0.5, pattern bound 16, equal steps", 0.5, steps=-1, max_patterns=16, **_CUT_WARMUP),
]

# Controls of the shipped default at equal time: the paper's uniform shape with the same warm-up; the cut with
# no warm-up (a constant rate over the whole run: no time schedule at all); the same at 0.875 (whose warm-up
# with the mean kept would need rates no cut reaches), given 160 steps (its step speedup was 1.64x on this
# model, so about the baseline's time); and the default in the old regime (the step's sequences in one
# micro-batch, so one pattern per optimizer step, and a constant lr).
GRIDS["controls"] = [
    Run("full backprop"),
    Run("uniform 0.5 + warm-up (mean kept), equal time", 0.5, **{**_CUT_WARMUP, "pattern": "uniform"}),
    Run("cut 0.5, no warm-up, equal time", 0.5, pattern="cut"),
    Run("cut 0.875, no warm-up, 160 steps", 0.875, steps=160, pattern="cut"),
    Run("DropBP 0.5, old regime, equal time", 0.5, accumulation=1, lr_schedule="constant", **_CUT_WARMUP),
]


def equal_quality_runs(steps: int, dropbp_steps: int, dropbp_lr: float) -> list[Run]:
    """The speedup at equal quality (issue 40): full backprop complete at half, once and twice ``steps`` (at the
    comparison's lr, its own best), the shipped default at 0.5 complete at ``steps`` and ``dropbp_steps`` (at
    ``dropbp_lr``, its own best from the same grid: ``--grid lr-dropbp``)."""
    full = [Run("full backprop")] + [Run(f"full backprop, {n} steps", steps=n) for n in (steps // 2, 2 * steps)]
    dropbp = [Run(f"DropBP 0.5, {n} steps", 0.5, steps=n, lr=dropbp_lr, **_CUT_WARMUP) for n in (steps, dropbp_steps)]
    return full + dropbp


# Regimes (--regime): "step" is the one every run before issue 23 used (one pattern per optimizer step,
# a constant learning rate, no weight decay); "accumulate" is the research code's shape on a CPU budget.
REGIMES = {
    "step": {"accumulation": 1, "lr_schedule": "constant", "weight_decay": {"lora": 0.0, "qlora": 0.0, "full": 0.0}},
    "accumulate": {
        "accumulation": 8,
        "lr_schedule": "cosine",
        "weight_decay": {"lora": 0.01, "qlora": 0.01, "full": 0.02},  # the research code's
    },
}

# The baseline's learning rate is chosen first (lowest validation loss after --steps), then fixed.
LR_CANDIDATES = {"lora": (1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 4e-3), "full": (1e-5, 3e-5, 1e-4, 3e-4)}
LR_CANDIDATES["qlora"] = LR_CANDIDATES["lora"]
# QLoRA trains the same adapters as LoRA (on 4-bit base weights): without a sweep of its own it takes
# LoRA's learning rate, as QLoRA recipes do.
LR_FALLBACK = {"qlora": "lora"}


def swept_lr(results: Path, method: str) -> float:
    """The baseline's learning rate: the lowest final validation loss over every recorded
    ``--grid lr`` run for ``method`` on pydoc (the sweep may have been extended in several calls)."""
    rows = [
        (run["val_loss"][-1], run["config"]["lr"])
        for path in sorted(results.glob(f"convergence_lr_{method}_pydoc*.json"))
        for run in json.loads(path.read_text())["runs"]
    ]
    if not rows and method in LR_FALLBACK:
        return swept_lr(results, LR_FALLBACK[method])
    if not rows:
        raise SystemExit(f"no learning-rate sweep for {method} in {results}: run --grid lr --method {method} first")
    return min(rows)[1]


def with_lora(model: torch.nn.Module) -> torch.nn.Module:
    import peft

    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0)
    return peft.get_peft_model(model, config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--grid", choices=[*sorted(GRIDS), "lr", "lr-dropbp", "equal-quality"], default="levers")
    parser.add_argument(
        "--dropbp-lr", type=float, help="--grid equal-quality: DropBP's own best learning rate (--grid lr-dropbp)"
    )
    parser.add_argument("--lrs", type=float, nargs="+", help="--grid lr: these learning rates instead")
    parser.add_argument("--corpus", choices=sorted(CORPORA), default="pydoc")
    parser.add_argument(
        "--method",
        choices=["lora", "qlora", "full"],
        default="lora",
        help="qlora: LoRA on nf4 4-bit base weights (needs bitsandbytes: pip install 'dropbp[qlora]')",
    )
    parser.add_argument("--steps", type=int, default=60, help="baseline steps")
    parser.add_argument("--dropbp-steps", type=int, default=90, help="DropBP runs' steps (budget)")
    parser.add_argument("--lr", type=float, default=None, help="default: the best of --grid lr on pydoc")
    parser.add_argument("--tag", default="", help="appended to the output file names")
    parser.add_argument(
        "--seed", type=int, default=0, help="LoRA's initial adapters, the batches' order and the drop patterns"
    )
    parser.add_argument("--render", type=Path, help="only rewrite the summary, .md and .png of a recorded .json")
    parser.add_argument(
        "--seeds", type=Path, nargs="+", help="only write the per-seed and mean table of recorded runs of one setting"
    )
    parser.add_argument(
        "--learning-rates",
        type=Path,
        nargs="+",
        help="only write the table of recorded runs of one setting at several learning rates (each run's best)",
    )
    parser.add_argument(
        "--only", nargs="+", metavar="RUN", help="of the grid, only these runs (by name) beside full backprop"
    )
    parser.add_argument("--regime", choices=sorted(REGIMES), default="step")
    parser.add_argument(
        "--batch-size", type=int, default=None, help="sequences per optimizer step (default: 4, or 8 when accumulating)"
    )
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument(
        "--checkpointing",
        action="store_true",
        help="Hugging Face activation checkpointing on every layer, non-re-entrant (the Trainer's "
        "gradient_checkpointing=True); losses per step are those of the same run without it, step times are not",
    )
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.render is not None:
        render(args.render)
        return
    if args.seeds:
        over_seeds(args.seeds)
        return
    if args.learning_rates:
        over_learning_rates(args.learning_rates)
        return
    if args.grid == "lr":
        runs = [Run(f"full backprop, lr {x:g}", lr=x) for x in args.lrs or LR_CANDIDATES[args.method]]
    elif args.grid == "lr-dropbp":  # the shipped default at 0.5 over the same grid, at its own budget
        lrs = args.lrs or LR_CANDIDATES[args.method]
        runs = [Run(f"DropBP 0.5, lr {x:g}", 0.5, lr=x, steps=args.dropbp_steps, **_CUT_WARMUP) for x in lrs]
    elif args.grid == "equal-quality":
        if args.dropbp_lr is None:
            raise SystemExit("--grid equal-quality needs --dropbp-lr: DropBP's best from --grid lr-dropbp")
        runs = equal_quality_runs(args.steps, args.dropbp_steps, args.dropbp_lr)
    else:  # steps=-1 in a grid: the baseline's number of steps
        runs = [replace(r, steps=args.steps) if r.steps == -1 else r for r in GRIDS[args.grid]]
        if args.only:
            unknown = set(args.only) - {r.name for r in runs}
            if unknown:
                raise SystemExit(f"--only: no run {sorted(unknown)} in grid {args.grid}: {[r.name for r in runs]}")
            runs = [runs[0], *(r for r in runs[1:] if r.name in args.only)]
    transformers.logging.set_verbosity_error()
    lr = args.lr if args.lr is not None else swept_lr(args.out, args.method)
    model, tokenizer = load_causal_lm(args.model)
    backend = backends.get()
    if args.method == "qlora":  # float32 weights become nf4 4-bit; accelerators still train under autocast
        model = quantize_4bit(model, torch.float32, backend.device)
    if args.method in ("lora", "qlora"):
        torch.manual_seed(args.seed)  # LoRA's A matrices start random: the same start for every run of a seed
        model = with_lora(model)
    if args.checkpointing:
        checkpointing_on(model)
    data = CORPORA[args.corpus](tokenizer, args.seq_len, max_val_windows=16)
    regime = REGIMES[args.regime]
    batch_size = args.batch_size or (8 if args.regime == "accumulate" else 4)
    started = time.perf_counter()

    def progress(step: int, latest: dict[str, float]) -> None:
        losses = " | ".join(f"{k}: {v:.3f}" for k, v in latest.items())
        print(f"step {step} ({time.perf_counter() - started:.0f} s)  val {losses}", file=sys.stderr, flush=True)

    stem = f"convergence_{args.grid}_{args.method}_{args.corpus}"
    if args.grid.startswith("lr") and args.lrs:
        stem += "_" + "_".join(f"{x:g}" for x in args.lrs)
    if args.regime != "step":
        stem += f"_{args.regime}"
    if args.checkpointing:
        stem += "_ckpt"
    if args.seed:
        stem += f"_seed{args.seed}"
    if args.tag:
        stem += f"_{args.tag}"
    record = {
        "benchmark": stem,
        "grid": args.grid,
        "date": date.today().isoformat(),
        "model": args.model,
        "method": args.method,
        "corpus": args.corpus,
        "lr": lr,
        "seed": args.seed,
        "steps": args.steps,
        "dropbp_steps": args.dropbp_steps,
        "batch_size": batch_size,
        "seq_len": args.seq_len,
        "regime": args.regime,
        "dropbp_lr": args.dropbp_lr,
        "checkpointing": args.checkpointing,
        "accumulation": regime["accumulation"],
        "lr_schedule": regime["lr_schedule"],
        "weight_decay": regime["weight_decay"][args.method],
        "command": "python " + shlex.join(sys.argv),
        "device": str(backend.device),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    results = compare(
        model,
        runs,
        data,
        steps=args.steps,
        lr=lr,
        batch_size=batch_size,
        backend=backend,
        eval_every=args.eval_every,
        dropbp_steps=args.dropbp_steps,
        progress=progress,
        accumulation=regime["accumulation"],
        lr_schedule=regime["lr_schedule"],
        weight_decay=regime["weight_decay"][args.method],
        seed=args.seed,
        on_evaluation=lambda so_far: keep_partial(record, so_far, args.out),
    )
    write(record, results, args.out)


def keep_partial(record: dict, results: list[RunResult], out: Path) -> None:
    """Write what a running comparison has measured so far to ``<benchmark>.partial.json`` (the settings and each
    run's curves; no summary): a run stopped before its end keeps its figures. :func:`write` removes it."""
    partial = {**record, "runs": [r.to_dict() for r in results]}
    (out / f"{record['benchmark']}.partial.json").write_text(json.dumps(partial, indent=2) + "\n")


def write(record: dict, results: list[RunResult], out: Path) -> None:
    """Summarise, then write ``<benchmark>.json``, ``.md`` and ``.png`` into ``out`` (and drop the partial record)."""
    record["summary"] = summarise(results, record["steps"])
    record["runs"] = [r.to_dict() for r in results]
    stem = record["benchmark"]
    (out / f"{stem}.json").write_text(json.dumps(record, indent=2) + "\n")
    grid = record.get("grid") or stem.split("_")[1]  # records before "grid" was stored
    if grid == "equal-quality":
        record["equal_quality"] = equal_quality(results)
    lines = (
        _lr_sweep_table(record)
        if grid.startswith("lr")
        else _equal_quality_table(record)
        if grid == "equal-quality"
        else _comparison_table(record)
    )
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    title = f"{record['model']} {record['method']} on {record.get('corpus', 'pydoc')}"
    plot_curves(with_timed_tails(results), out / f"{stem}.png", title=title)
    (out / f"{stem}.partial.json").unlink(missing_ok=True)
    print("\n".join(lines))


def render(path: Path) -> None:
    """Rewrite a recorded run's summary and tables from its measurements (nothing is retrained)."""
    record = json.loads(path.read_text())
    write(record, [RunResult.from_dict(run) for run in record["runs"]], path.parent)


def over_seeds(paths: list[Path]) -> None:
    """Write ``<benchmark>_seeds.md`` beside the first record: the same setting's runs over several seeds, each shown,
    and their mean (:func:`dropbp.tools.report.seeds_table`)."""
    records = sorted((json.loads(p.read_text()) for p in paths), key=lambda r: r.get("seed", 0))
    setting = {f"{_setting(r)}, lr {r['lr']:g}, {r['steps']} baseline steps" for r in records}
    if len(setting) > 1:
        raise SystemExit(f"--seeds takes runs of one setting; these differ: {sorted(setting)}")
    seeds = [r.get("seed", 0) for r in records]
    stem = records[0]["benchmark"].removesuffix(f"_seed{seeds[0]}")
    lines = [
        f"{_setting(records[0])}, lr {records[0]['lr']:g}, seeds {', '.join(map(str, seeds))} "
        f"({', '.join(sorted({r['date'] for r in records}))}). Commands: "
        + "; ".join(f"`{r['command']}`" for r in records),
        "",
        *seeds_table([r["summary"] for r in records], seeds),
    ]
    (paths[0].parent / f"{stem}_seeds.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def over_learning_rates(paths: list[Path]) -> None:
    """Write ``<setting>_lrs.md`` beside the first record: one setting's runs at several learning rates, each run's
    best and the bests against each other (:func:`dropbp.tools.report.learning_rates_table`)."""
    records = sorted((json.loads(p.read_text()) for p in paths), key=lambda r: r["lr"])
    setting = {f"{_setting(r)}, seed {r.get('seed', 0)}, {r['steps']} baseline steps" for r in records}
    if len(setting) > 1 or len({r["lr"] for r in records}) < len(records):
        raise SystemExit(f"--learning-rates takes one setting's runs at different rates; these are: {sorted(setting)}")
    first = records[0]
    stem = f"convergence_{first['grid']}_{first['method']}_{first['corpus']}_{first['regime']}"
    stem += f"_seed{first['seed']}" if first.get("seed") else ""
    comparisons = [(r["lr"], [RunResult.from_dict(run) for run in r["runs"]]) for r in records]
    lines = [
        f"{setting.pop()}, every run at each learning rate ({', '.join(sorted({r['date'] for r in records}))}). "
        "Commands: " + "; ".join(f"`{r['command']}`" for r in records),
        "",
        *learning_rates_table(comparisons),
    ]
    (paths[0].parent / f"{stem}_lrs.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _setting(record: dict) -> str:
    accumulation = record.get("accumulation", 1)
    regime = (
        f"{accumulation} micro-batches of {record['batch_size'] // accumulation} x {record['seq_len']} per step "
        f"(a pattern each), lr warm-up + cosine over each run's steps, weight decay {record['weight_decay']:g}"
        if record.get("regime", "step") != "step"
        else f"batch {record['batch_size']} x {record['seq_len']}"
    )
    return f"{record['model']}, {record['method']} on {record.get('corpus', 'pydoc')}, {regime}"


def _lr_sweep_table(record: dict) -> list[str]:
    lines = [
        f"Learning-rate sweep of the baseline: {_setting(record)}, {record['steps']} steps ({record['date']}).",
        "",
        f"| run | step (s) | val loss @ {record['steps']} |",
        "|---|---|---|",
    ]
    return lines + [f"| {r['run']} | {r['step_s']:.2f} | {r['final_val_loss']:.3f} |" for r in record["summary"]]


def _equal_quality_table(record: dict) -> list[str]:
    """Each DropBP run's speedup at equal quality against full backprop's complete runs at three budgets."""
    full = [r for r in record["summary"] if not r["run"].startswith("DropBP")]
    lines = [
        f"{_setting(record)}, full backprop at lr {record['lr']:g}, DropBP at its own {record['dropbp_lr']:g}, seed "
        f"{record.get('seed', 0)}, {record['device']} ({record['date']}). Command: `{record['command']}`",
        "",
        "Full backprop's frontier (complete runs): "
        + ", ".join(f"{r['steps']} steps {r['train_s']:.0f} s -> {r['final_val_loss']:.3f}" for r in full),
        "",
        "| run | steps | training time (s) | final val loss | speedup at equal quality |",
        "|---|---|---|---|---|",
    ]
    for r in record["equal_quality"]:
        speedup = {"exact": "", "at least": ">= ", "at most": "<= "}[r["bound"]] + f"{r['speedup']:.2f}x"
        lines.append(f"| {r['run']} | {r['steps']} | {r['train_s']:.0f} | {r['final_val_loss']:.3f} | {speedup} |")
    return lines


def _comparison_table(record: dict) -> list[str]:
    rows, steps = record["summary"], record["steps"]
    if record.get("regime", "step") != "step":
        return _regime_table(record)
    lines = [
        f"{_setting(record)}, lr {record['lr']:g}, {steps} baseline steps ({record['dropbp_steps']} for DropBP), "
        f"{record['device']} ({record['date']}); target = the baseline's final validation loss "
        f"{rows[0]['final_val_loss']:.3f}.",
        "",
        f"| run | step (s) | step speedup | val loss @ step {steps} | val loss @ equal time | final val loss "
        "| time to target (s) | time-to-target speedup |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ttt = "not reached" if r["time_to_target_s"] is None else f"{r['time_to_target_s']:.0f}"
        sp = "-" if r["time_to_target_speedup"] is None else f"{r['time_to_target_speedup']:.2f}x"
        at_time = r.get("val_loss_at_equal_time")
        lines.append(
            f"| {r['run']} | {r['step_s']:.2f} | {r['step_speedup']:.2f}x | {r['val_loss_at_equal_steps']:.3f} | "
            f"{'-' if at_time is None else f'{at_time:.3f}'} | {r['final_val_loss']:.3f} | {ttt} | {sp} |"
        )
    return lines


def _regime_table(record: dict) -> list[str]:
    """Each run over its own steps, at equal steps and equal time (:func:`dropbp.tools.report.steps_and_time_table`)."""
    return [
        f"{_setting(record)}, every run at lr {record['lr']:g} and seed {record.get('seed', 0)}, "
        f"{record['device']} ({record['date']}). "
        f"Command: `{record['command']}`",
        "",
        *steps_and_time_table(record["summary"]),
        "",
        "A run that trained for less time than the baseline is read at its own end: its final loss against full "
        "backprop's loss at that time (never more time than the baseline had).",
        *_tail_note(record["summary"]),
    ]


def _tail_note(rows: list[dict]) -> list[str]:
    """Which runs' steps past the baseline's were timed as their last lockstep steps, and why."""
    timed = [f"{r['run']} ({r['tail_timed']} steps)" for r in rows if r.get("tail_timed")]
    if not timed:
        return []
    return [
        "",
        f"Timed as their last lockstep steps (the median of the last {TAIL_WINDOW:.0%} of the baseline's steps), "
        f"since they ran after the baseline had stopped, under another load: the tails of {', '.join(timed)}.",
    ]


if __name__ == "__main__":
    main()
