"""The results tables of README.md and docs/results.md, made from the records under benchmarks/results (never typed).

    python benchmarks/readme_results.py           # print the tables
    python benchmarks/readme_results.py --write   # put them between the pages' markers

README.md has one: the paper's three claims beside this library's figure for each, with its conditions
(:func:`claims_table`). docs/results.md has the rest: the map of the speedup at equal quality
(benchmarks/where_it_pays.py, docs/where-it-pays.md), that figure on SmolLM2-135M (benchmarks/smollm2_equal_quality.py),
and SmolLM2-135M at equal steps and equal time.

Each row is one setting of the accumulation regime (docs/regime.md: SmolLM2-135M-Instruct, 100 optimizer steps of
8 micro-batches of 128 tokens, lr warm-up and cosine decay, 2 CPU cores), the shipped default at drop rate 0.5
against full backprop, over every seed recorded. ``tests/test_readme.py`` fails when README.md's table is not
what this script makes of the records.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dropbp.policy.drop_policy import AUTO_BOUND_RATE
from dropbp.tools.frontier import exact_seeds

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
README = ROOT / "README.md"
RESULTS_PAGE = ROOT / "docs" / "results.md"
CLAIMS_BEGIN = "<!-- claims-table: made by benchmarks/readme_results.py -->"
CLAIMS_END = "<!-- end of claims-table -->"
LONGEST = RESULTS / "longest_sequence_0.875.json"
UNIFORM_LONGEST = RESULTS / "memory_smollm2_lora_longest" / "memory.json"  # uniform patterns, plain and chunked loss
BEGIN, END = "<!-- results-table: made by benchmarks/readme_results.py -->", "<!-- end of results-table -->"
MAP_BEGIN, MAP_END = "<!-- map-table: made by benchmarks/readme_results.py -->", "<!-- end of map-table -->"
MAP = RESULTS / "where_it_pays" / "map.json"
EQ_BEGIN = "<!-- smollm2-equal-quality: made by benchmarks/readme_results.py -->"
EQ_END = "<!-- end of smollm2-equal-quality -->"
SMOLLM2_EQUAL_QUALITY = RESULTS / "smollm2_equal_quality.json"
ARMS_BEGIN = "<!-- arms-table: made by benchmarks/readme_results.py -->"
ARMS_END = "<!-- end of arms-table -->"
FOUR_BEGIN = "<!-- four-arms-table: made by benchmarks/readme_results.py -->"
FOUR_END = "<!-- end of four-arms-table -->"
BUYS_BEGIN = "<!-- what-it-buys: made by benchmarks/readme_results.py -->"
BUYS_END = "<!-- end of what-it-buys -->"
FIGURE = RESULTS / "readme_figure"  # README's picture (figure.png) and the figures it draws (figure.json)
RUNS_BEGIN = "<!-- where-it-runs: made by benchmarks/readme_results.py -->"
RUNS_END = "<!-- end of where-it-runs -->"
CPU_STEPS = RESULTS / "bench_checkpointing_cpu"  # SmolLM2-135M LoRA, 512 tokens: checkpointing_off/, checkpointing_on/
H200_STEPS = RESULTS / "gpu_h200_core" / "bench_cuda_1b" / "bench.json"
PAPER_ALGORITHM = RESULTS / "convergence_rates_lora_pydoc.json"  # uniform patterns, calibrated, 0.875 (2026-11-22)
TOKEN_DROPS = RESULTS / "token_drops" / "token_drops.json"
TOKEN_PAGE = ROOT / "docs" / "token-drops.md"
TOKEN_BENCH = RESULTS / "bench_tokens_cpu"
TOKEN_BENCH_GPU = RESULTS / "bench_tokens_cuda"
NOISE_PAGE = ROOT / "docs" / "noise-scale.md"
NOISE_RECORDS = RESULTS / "noise_scale"
NOISE_BEGIN = "<!-- noise-scale-tables: made by benchmarks/readme_results.py -->"
NOISE_END = "<!-- end of noise-scale-tables -->"
TBENCH_BEGIN = "<!-- token-bench-table: made by benchmarks/readme_results.py -->"
TBENCH_END = "<!-- end of token-bench-table -->"
KEPT_ROWS = RESULTS / "kept_rows_recompute"
KEPT_BEGIN = "<!-- kept-rows-table: made by benchmarks/readme_results.py -->"
KEPT_END = "<!-- end of kept-rows-table -->"
TGPU_BEGIN = "<!-- gpu-token-bench-table: made by benchmarks/readme_results.py -->"
TGPU_END = "<!-- end of gpu-token-bench-table -->"
TFRONT_BEGIN = "<!-- token-frontier-table: made by benchmarks/readme_results.py -->"
TFRONT_END = "<!-- end of token-frontier-table -->"
TOKEN_DROPS_CHECKPOINTING = RESULTS / "token_drops" / "token_drops_full_checkpointing.json"
TCKPT_BEGIN = "<!-- token-frontier-checkpointing-table: made by benchmarks/readme_results.py -->"
TCKPT_END = "<!-- end of token-frontier-checkpointing-table -->"
TSMOL_BEGIN = "<!-- smollm2-token-table: made by benchmarks/readme_results.py -->"
TSMOL_END = "<!-- end of smollm2-token-table -->"
SMOLLM2_TOKENS = RESULTS / "smollm2_token_drops" / "smollm2_token_drops.json"
#: How the arms of benchmarks/token_drops.py read in a table.
ARM_NAMES = {
    "tokens": "token drops {r}, by gradient",
    "tokens-random": "token drops {r}, random rows",
    "tokens-residual": "token drops {r}, by the branch output's size (TokenDrop's rule)",
    "tokens-cumulative": "token drops {r}, cumulative (TokenDrop's selection)",
    "branch": "branch drops {r} (DropBP)",
    "both0.5+tokens": "branch drops 0.5 + token drops {r}",
}

#: (setting, the records of its seeds: stems under benchmarks/results)
SETTINGS = [
    (
        "LoRA, Python help text",
        ["convergence_default_lora_pydoc_accumulate", "convergence_default_lora_pydoc_accumulate_seed1"],
    ),
    (
        "LoRA, stdlib docstrings",
        [
            "convergence_default_lora_stdlib-docstrings_accumulate",
            "convergence_default_lora_stdlib-docstrings_accumulate_seed1",
        ],
    ),
    (
        "full, Python help text",
        ["convergence_default_full_pydoc_accumulate", "convergence_default_full_pydoc_accumulate_seed1"],
    ),
    (
        "full, stdlib docstrings",
        [
            "convergence_default_full_stdlib-docstrings_accumulate",
            "convergence_default_full_stdlib-docstrings_accumulate_seed1",
        ],
    ),
    (
        "LoRA + checkpointing, Python help text",
        [
            "convergence_checkpointing_lora_pydoc_accumulate_ckpt",
            "convergence_checkpointing_lora_pydoc_accumulate_ckpt_seed1",
        ],
    ),
    (
        "LoRA + checkpointing, stdlib docstrings",
        [
            "convergence_checkpointing_lora_stdlib-docstrings_accumulate_ckpt",
            "convergence_checkpointing_lora_stdlib-docstrings_accumulate_ckpt_seed1",
        ],
    ),
    (
        "full + checkpointing, Python help text",
        [
            "convergence_checkpointing_full_pydoc_accumulate_ckpt",
            "convergence_checkpointing_full_pydoc_accumulate_ckpt_seed1",
        ],
    ),
    (
        "full + checkpointing, stdlib docstrings",
        [
            "convergence_checkpointing_full_stdlib-docstrings_accumulate_ckpt",
            "convergence_checkpointing_full_stdlib-docstrings_accumulate_ckpt_seed1",
        ],
    ),
]
EQUAL_STEPS, EQUAL_TIME, BASELINE = "DropBP 0.5, equal steps", "DropBP 0.5, equal time", "full backprop"


def _runs(stem: str) -> dict[str, dict] | None:
    path = RESULTS / f"{stem}.json"
    if not path.is_file():
        return None
    return {r["run"]: r for r in json.loads(path.read_text())["summary"]}


def _baseline_then(seed: dict[str, dict]) -> float:
    """Full backprop's loss at the end of the equal-time run, or its final loss if that run trained longer."""
    then = seed[EQUAL_TIME]["baseline_val_loss_at_run_end"]
    return seed[BASELINE]["final_val_loss"] if then is None else then


def _signed(x: float) -> str:
    return f"{0.0 if abs(x) < 0.0005 else x:+.3f}"


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _saved_and_gap(seeds: list[dict[str, dict]]) -> list[tuple[float, float]]:
    """Per seed with an equal-steps run: the training time it saved and its relative loss gap."""
    return [
        (
            1 - s[EQUAL_STEPS]["train_s"] / s[BASELINE]["train_s"],
            s[EQUAL_STEPS]["final_val_loss"] / s[BASELINE]["final_val_loss"] - 1,
        )
        for s in seeds
        if EQUAL_STEPS in s
    ]


def row(setting: str, stems: list[str]) -> str | None:
    """The table row of one setting, or None when no record of it exists yet."""
    seeds = [runs for runs in map(_runs, stems) if runs is not None]
    if not seeds:
        return None
    speedups = [s[EQUAL_STEPS if EQUAL_STEPS in s else EQUAL_TIME]["step_speedup"] for s in seeds]
    steps = _saved_and_gap(seeds)
    timed = [s for s in seeds if EQUAL_TIME in s]
    # at the same training time, the shorter run's (as the records' tables read it): a DropBP run that trained less
    # than the baseline against the baseline at its end, one that trained longer read at the baseline's end
    gaps = [s[EQUAL_TIME]["val_loss_at_equal_time"] - _baseline_then(s) for s in timed]
    equal_steps = (
        f"{100 * _mean([t for t, _ in steps]):.0f}% less time, {100 * _mean([g for _, g in steps]):+.2f}% loss"
        + (f" ({len(steps)} seeds)" if len(steps) > 1 else " (1 seed)")
        if steps
        else "not run"
    )
    equal_time = f"{_signed(_mean(gaps))} ({', '.join(map(_signed, gaps))})" if gaps else "not run"
    return f"| {setting} | {_mean(speedups):.2f}x | {equal_steps} | {equal_time} | {len(seeds)} of {len(stems)} |"


def table() -> str:
    """The SmolLM2 table, markers included."""
    lines = [
        BEGIN,
        "| fine-tuning, corpus (against full backprop, same batch) | step speedup | equal steps: time saved, loss gap "
        "(mean) | equal time: loss minus "
        "full backprop's at the same time, mean (per seed) | seeds |",
        "|---|---|---|---|---|",
    ]
    lines += [r for r in (row(setting, stems) for setting, stems in SETTINGS) if r is not None]
    step, saved, _, _ = _equal_steps(SETTINGS[0][1])
    lines += [
        "",
        "The step speedup is the runs' median training step; the time saved is the whole run's wall time, which also "
        f"holds the evaluations and the data, unchanged by drops: a {step:.2f}x step alone would save "
        f"{100 * (1 - 1 / step):.0f}%, the run saved {100 * saved:.0f}%.",
    ]
    return "\n".join([*lines, END])


def _interval(budget: dict) -> str:
    bound = f", {budget['bounded']} of {budget['seeds']} seeds a bound" if budget["bounded"] else ""
    return f"**{budget['mean']:.2f}x** [{budget['low']:.2f}, {budget['high']:.2f}]{bound}"


def map_table() -> str:
    """The map's table, markers included: per regime, the shipped default at 0.5 and 0.75 given full backprop's
    time (its equal-time budget), each arm at its own best learning rate."""
    record = json.loads(MAP.read_text())
    lines = [
        MAP_BEGIN,
        "| run length x tokens per step (against full backprop at the same tokens per step; time modelled) | DropBP "
        "0.5: speedup at equal quality [95%] | DropBP 0.75 | "
        "learning rate full / 0.5 / 0.75 | seeds |",
        "|---|---|---|---|---|",
    ]
    for cell in record["cells"]:
        figures = [next(b for b in cell[f"{r:g}"].values() if b["equal_time"]) for r in (0.5, 0.75)]
        lrs = " / ".join(f"{cell['lr'][k]:g}" for k in ("full", "0.5", "0.75"))
        lines.append(
            f"| {cell['steps']} x {cell['tokens'] // 1024}k tokens | {_interval(figures[0])} | "
            f"{_interval(figures[1])} | {lrs} | {figures[0]['seeds']} |"
        )
    return "\n".join([*lines, MAP_END])


def smollm2_table() -> str:
    """SmolLM2-135M's speedup at equal quality (benchmarks/smollm2_equal_quality.py), markers included: the
    shipped default at 0.5 at full backprop's time and at full backprop's steps, each arm at its own learning rate."""
    record = json.loads(SMOLLM2_EQUAL_QUALITY.read_text())
    lr = record["lr"]
    lines = [
        EQ_BEGIN,
        "| model, fine-tuning, run length x tokens per step (against full backprop at the same batch; time measured) "
        "| DropBP 0.5 at equal time: speedup at equal quality "
        "| DropBP 0.5 at equal steps | learning rate full / 0.5 | seeds |",
        "|---|---|---|---|---|",
    ]
    rows = {row["run"]: row["speedup"] for row in record["rows"]}
    lines.append(
        f"| {record['model']}, LoRA, 100 x 1k tokens | {seeds_text(rows['DropBP 0.5, equal time'])} | "
        f"{seeds_text(rows['DropBP 0.5, L steps'])} | {lr['full backprop']:g} / {lr['DropBP 0.5']:g} | "
        f"{len(record['seeds'])} |"
    )
    return "\n".join([*lines, EQ_END])


def _equal_steps(stems: list[str]) -> tuple[float, float, float, int]:
    """Over the seeds recorded: mean step speedup, time saved and loss gap at equal steps, and the seeds."""
    seeds = [s for s in map(_runs, stems) if s is not None and EQUAL_STEPS in s]
    figures = _saved_and_gap(seeds)
    speedup = _mean([s[EQUAL_STEPS]["step_speedup"] for s in seeds])
    return speedup, _mean([t for t, _ in figures]), _mean([g for _, g in figures]), len(seeds)


def _longest() -> tuple[str, str]:
    """The longest-sequence row's figure and its baseline: DropBP 0.875 with activation checkpointing and the chunked
    loss against full backprop with the same two (like for like), else DropBP with the chunked loss alone."""
    rows = {r["config"]: r["longest"] for r in json.loads(LONGEST.read_text())["rows"]}
    fair = rows.get("full backprop, checkpointing on, chunked loss")
    if fair is None:
        return "not measured like for like yet", ""
    both = rows.get("DropBP default 0.875, checkpointing on, chunked loss")
    ours, how = (both, "both with") if both else (rows["DropBP default 0.875, chunked loss"], "DropBP without")
    return (
        f"**{ours / fair:.2f}x** ({ours} against {fair} tokens)",
        f"full backprop, {how} activation checkpointing, both with the chunked loss",
    )


def paper_longest() -> str:
    """The paper's algorithm (uniform patterns, 0.875) against plain full backprop, the paper's comparison: the
    longest sequence in 3 GiB with the plain loss, neither with activation checkpointing."""
    probes = json.loads(UNIFORM_LONGEST.read_text())["max_seq_len"]["smollm2/lora"]["plain"]
    ours, full = probes["0.875"]["longest"], probes["0.0"]["longest"]
    return f"**{ours / full:.2f}x** ({ours} against {full} tokens in 3 GiB, plain loss, no checkpointing)"


def _bounds(entry: dict) -> str:
    """Where seeds' readings are bounds, how many and which way (the mean then counts them at their bound)."""
    kinds = sorted({s["bound"] for s in entry["per_seed"] if s["bound"] != "exact"})
    if not kinds:
        return ""
    said = f"{entry['bounded']} of {entry['seeds']} seeds {' or '.join(kinds)}"
    return f" (a lower bound: {said})" if kinds == ["at least"] else f" ({said})"


def _bench_point(path: Path, method: str, checkpointing: bool) -> dict:
    for point in json.loads(path.read_text())["points"]:
        if point["method"] == method and bool(point["checkpointing"]) == checkpointing:
            return point
    raise LookupError(f"{path} has no {method} point with checkpointing {checkpointing}")


def _bench_row(point: dict, pattern: str, rate: float) -> dict:
    return next(r for r in point["rows"] if r["pattern"] == pattern and r["drop_rate"] == rate)


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def seeds_text(entry: dict, bold: str = "**") -> str:
    """A speedup over seeds as README gives it: the mean [95% interval] of the seeds whose reading is exact, and the
    seeds whose reading is a bound listed apart (a bound never enters an interval)."""
    exact = exact_seeds(entry)
    parts = []
    if exact is not None and exact["seeds"] > 1:
        parts.append(f"{bold}{exact['mean']:.2f}x{bold} [{exact['low']:.2f}, {exact['high']:.2f}]")
        if exact["seeds"] < entry["seeds"]:
            parts[-1] += f" ({exact['seeds']} seeds)"
    elif exact is not None:
        parts.append(f"{bold}{exact['mean']:.2f}x{bold} (1 seed)")
    for kind in ("at least", "at most"):
        values = [s["value"] for s in entry["per_seed"] if s["bound"] == kind]
        if values:
            parts.append(f"{len(values)} seed{'s' if len(values) > 1 else ''} {kind} " + ", ".join(
                f"{v:.2f}x" for v in values))  # fmt: skip
    return "; ".join(parts)


def buys_tables() -> str:
    """README's first screen: the step speedups (CPU and H200, 0.5 and 0.875, checkpointing off and on) with the
    H200's peak memory, then what a run gets (equal steps, equal quality at the same batch and at the best batch,
    the longest sequence), each table's header naming its baseline; markers included."""
    cpu = {on: _bench_point(CPU_STEPS / f"checkpointing_{'on' if on else 'off'}" / "bench.json", "lora", on)
           for on in (False, True)}  # fmt: skip
    gpu = {on: _bench_point(H200_STEPS, "lora", on) for on in (False, True)}

    def cpu_pattern(on: bool, rate: float) -> str:  # the default: the memory bound on from AUTO_BOUND_RATE up
        return "cut" if on else "cut:bounded" if rate >= AUTO_BOUND_RATE else "cut:unbounded"

    lines = [
        BUYS_BEGIN,
        "| step speedup against full backprop, same batch | CPU | H200 | H200 peak memory |",
        "|---|---|---|---|",
    ]
    for on in (False, True):
        for rate in (0.5, 0.875):
            row = _bench_row(gpu[on], "uniform", rate)
            lines.append(
                f"| drop rate {rate}{', checkpointing on' if on else ''} | "
                f"**{_bench_row(cpu[on], cpu_pattern(on, rate), rate)['speedup']:.2f}x** | **{row['speedup']:.2f}x** | "
                f"{_gib(row['peak_memory_bytes'])} |"
            )
    lines += [
        "",
        "CPU: 2 cores, SmolLM2-135M, LoRA, 1 x 512 tokens, fp32, cut patterns (the default). H200: TinyLlama-1.1B's "
        "shape, LoRA, 4 x 2048 tokens, bf16, uniform patterns. Both arms without, or both with, activation "
        f"checkpointing; full backprop's H200 peak: {_gib(gpu[False]['baseline']['peak_memory_bytes'])}, with "
        f"checkpointing {_gib(gpu[True]['baseline']['peak_memory_bytes'])}.",
    ]
    setting, stems = SETTINGS[0]  # LoRA, Python help text
    _, saved, gap, seeds = _equal_steps(stems)
    equal = json.loads(SMOLLM2_EQUAL_QUALITY.read_text())
    at_time = next(r["speedup"] for r in equal["rows"] if r["run"] == "DropBP 0.5, equal time")
    best = json.loads(SMOLLM2_TOKENS.read_text())["branch0.5"]["best"]
    longest, baseline = _longest()
    lines += [
        "",
        "| what a run gets at drop rate 0.5 | against | measured |",
        "|---|---|---|",
        "| at equal steps: training time, validation loss | full backprop, same steps and batch | "
        f"**{100 * saved:.0f}% less time**, {100 * gap:+.2f}% loss ({seeds} seeds) |",
        "| at equal quality: how much sooner it reaches full backprop's validation loss | full backprop at the same "
        f"batch | {seeds_text(at_time)} |",
        "| the same | full backprop at its best batch (this one or half of it) | " + seeds_text(best) + " |",
        f"| longest sequence in 3 GiB, drop rate 0.875 | {baseline} | {longest} |",
        "",
        "SmolLM2-135M-Instruct, LoRA r=8, 100 steps of 8 x 128 tokens, 2 CPU cores. "
        "Step speedups: medians of interleaved rounds ([CPU](benchmarks/results/bench_checkpointing_cpu/README.md), "
        "[H200](benchmarks/results/gpu_h200_core/README.md)). Runs: Python's help text, lr warm-up and cosine decay, "
        "at equal quality each arm at its own best learning rate of one grid, chosen on seed 0 (which is also "
        "scored; at equal steps both at full backprop's best, [regime.md](docs/regime.md)); \"at least\" / "
        "\"at most\": seeds that ended past full backprop's longest or shortest run (here full backprop overfits after "
        "100 steps, so its frontier cannot say how much longer it would need: read the equal-quality rows as level, "
        "not as a loss or a gain). Every arm, cell and record: [docs/results.md](docs/results.md).",
        BUYS_END,
    ]
    return "\n".join(lines)


def figure_data() -> dict:
    """README's picture, as figures read from the records: the step speedup against full backprop at the same batch
    (CPU: SmolLM2-135M LoRA 1 x 512 tokens, the default cut; H200: TinyLlama-1.1B's shape LoRA 4 x 2048 tokens,
    uniform) and the H200's peak memory, at 0.5 and 0.875, activation checkpointing off and on."""
    cpu = {on: _bench_point(CPU_STEPS / f"checkpointing_{'on' if on else 'off'}" / "bench.json", "lora", on)
           for on in (False, True)}  # fmt: skip
    gpu = {on: _bench_point(H200_STEPS, "lora", on) for on in (False, True)}
    bars = []
    for on in (False, True):
        cpu_pattern = "cut" if on else None
        for rate in (0.5, 0.875):
            pattern = cpu_pattern or ("cut:bounded" if rate >= AUTO_BOUND_RATE else "cut:unbounded")
            bars.append(
                {
                    "checkpointing": on,
                    "drop_rate": rate,
                    "cpu_speedup": round(_bench_row(cpu[on], pattern, rate)["speedup"], 4),
                    "h200_speedup": round(_bench_row(gpu[on], "uniform", rate)["speedup"], 4),
                    "h200_peak_gib": round(_bench_row(gpu[on], "uniform", rate)["peak_memory_bytes"] / 2**30, 3),
                }
            )
    baseline = {str(on).lower(): round(gpu[on]["baseline"]["peak_memory_bytes"] / 2**30, 3) for on in (False, True)}
    return {"bars": bars, "h200_full_backprop_peak_gib": baseline}


def draw_figure(data: dict, path: Path) -> None:
    """README's picture from :func:`figure_data`: step speedup (left), the H200's peak memory (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (speed, memory) = plt.subplots(1, 2, figsize=(11, 3.6))
    labels = [f"{b['drop_rate']}{' + ckpt' if b['checkpointing'] else ''}" for b in data["bars"]]
    at = list(range(len(labels)))
    for offset, key, name in ((-0.2, "cpu_speedup", "CPU, SmolLM2-135M"), (0.2, "h200_speedup", "H200, 1.1B shape")):
        values = [b[key] for b in data["bars"]]
        speed.bar([i + offset for i in at], values, 0.4, label=name)
        for i, v in zip(at, values, strict=True):
            speed.annotate(f"{v:.2f}x", (i + offset, v), ha="center", va="bottom", fontsize=8)
    speed.axhline(1.0, color="grey", linewidth=1, linestyle=":")
    speed.set_xticks(at, labels)
    speed.set_xlabel("drop rate (+ ckpt: both arms with activation checkpointing)")
    speed.set_ylabel("step speedup vs full backprop")
    speed.legend(loc="upper left", fontsize=8)
    full = data["h200_full_backprop_peak_gib"]
    groups = [("full backprop", full["false"], full["true"])]
    for rate in (0.5, 0.875):
        peaks = {b["checkpointing"]: b["h200_peak_gib"] for b in data["bars"] if b["drop_rate"] == rate}
        groups.append((f"drop rate {rate}", peaks[False], peaks[True]))
    at = list(range(len(groups)))
    memory.bar([i - 0.2 for i in at], [g[1] for g in groups], 0.4, label="checkpointing off")
    memory.bar([i + 0.2 for i in at], [g[2] for g in groups], 0.4, label="checkpointing on")
    memory.set_xticks(at, [g[0] for g in groups])
    memory.set_ylabel("H200 peak memory (GiB)")
    memory.legend(fontsize=8)
    fig.suptitle("dropbp: LoRA step speedup and peak memory (benchmarks/results, medians of interleaved rounds)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def claims_table() -> str:
    """README's claims: the paper's five claims (LLaMA2-70B QLoRA on A100s; Gaudi2's throughput) beside this library's
    figure at the paper's algorithm and rate and at the shipped default; markers included."""
    setting, stems = SETTINGS[0]  # LoRA, Python help text
    speedup, saved, gap, seeds = _equal_steps(stems)
    equal = json.loads(SMOLLM2_EQUAL_QUALITY.read_text())
    at_time = next(r["speedup"] for r in equal["rows"] if r["run"] == "DropBP 0.5, equal time")
    paper = {r["run"]: r for r in json.loads(PAPER_ALGORITHM.read_text())["summary"]}
    full, calibrated = paper["full backprop"], paper["DropBP 0.875 + calibration"]
    paper_gap = calibrated["val_loss_at_equal_steps"] / full["val_loss_at_equal_steps"] - 1
    record = json.loads(PAPER_ALGORITHM.read_text())
    reached = (
        f"not reached in {record['dropbp_steps']} steps (full backprop's {record['steps']})"
        if calibrated["time_to_target_speedup"] is None
        else f"{calibrated['time_to_target_speedup']:.2f}x (1 seed)"
    )
    longest, _ = _longest()
    gpu = {on: _bench_point(H200_STEPS, "lora", on) for on in (False, True)}
    cpu = _bench_point(CPU_STEPS / "checkpointing_off" / "bench.json", "lora", False)
    uniform = [_bench_row(gpu[on], "uniform", 0.875)["speedup"] for on in (False, True)]
    cut = _bench_row(cpu, "cut:unbounded", 0.5)["speedup"]  # the record predates the expected-cut correction
    cut_gpu = _bench_row(gpu[False], "cut", 0.5)["speedup_at_expected"]
    lines = [
        CLAIMS_BEGIN,
        "| the paper's claim, against full backprop | paper | here: the paper's algorithm (uniform, 0.875) | "
        "here: the shipped default (cut, 0.5) |",
        "|---|---|---|---|",
        f"| training time at comparable accuracy | 44% less | {100 * (1 - 1 / calibrated['step_speedup']):.0f}% less "
        f"at {100 * paper_gap:+.1f}% loss: not comparable (calibrated; [1 seed, 60 steps]"
        "(benchmarks/results/convergence_rates_lora_pydoc.md)) | "
        f"**{100 * saved:.0f}% less** at {100 * gap:+.2f}% loss ({seeds} seeds, above) |",
        f"| time to full backprop's validation loss | 1.5x faster | {reached} | "
        f"{seeds_text(at_time)} at the same batch (above) |",
        f"| longest trainable sequence | 6.2x longer | {paper_longest()} | at 0.875: {longest} |",
        f"| throughput, NVIDIA A100, LoRA | +79% | H200: **{100 * (uniform[0] - 1):+.0f}%** "
        f"({100 * (uniform[1] - 1):+.0f}% both with checkpointing) | CPU {100 * (cut - 1):+.0f}% (the cuts drawn), "
        f"H200 {100 * (cut_gpu - 1):+.0f}% (at the expected cut) |",
        "| throughput, Intel Gaudi2 | +117% | not measured: no Gaudi2 here (a stand-in checks the lazy-mode path) | "
        "not measured |",
        "",
        "The paper's figures: LLaMA2-70B QLoRA on A100s, its throughput rows LoRA on an A100 and on Gaudi2. "
        "Every row is a SmolLM2-135M or 1.1B-shaped model here, not the paper's 70B; the records: "
        "[docs/results.md](docs/results.md), [the paper's settings](docs/reproduce-the-paper.md).",
        CLAIMS_END,
    ]
    return "\n".join(lines)


#: README's "where it runs": per platform and column, the evidence of each mark as (label, path). A path under
#: benchmarks/results is a record made on that hardware (measured); a test is run by CI on the CPU; a ``STAND_IN``
#: test checks a platform on a stand-in of its vendor API or an engine of the same design, never on the hardware.
RUNS_COLUMNS = ("exact gradients", "step speed", "convergence", "Trainer / TRL", "DDP / FSDP2", "DeepSpeed ZeRO 1-3",
                "QLoRA")  # fmt: skip
STAND_IN = "stand-in"
RUNS: dict[str, dict[str, list[tuple[str, str]]]] = {
    "CPU": {
        "exact gradients": [("CI", "tests/test_gradients.py")],
        "step speed": [("bench", "benchmarks/results/bench_checkpointing_cpu/README.md")],
        "convergence": [("regime", "docs/regime.md")],
        "Trainer / TRL": [("CI", "tests/test_hf_integration.py")],
        "DDP / FSDP2": [("gloo, CI", "tests/test_distributed.py")],
        "DeepSpeed ZeRO 1-3": [("CPU accelerator, CI", "tests/test_deepspeed.py")],
        "QLoRA": [("CI", "tests/test_qlora.py"), ("bench", "benchmarks/results/bench_qlora_smollm2_cpu/README.md")],
    },
    "CPU + IPEX 2.8": {"exact gradients": [("once", "benchmarks/results/ipex_cpu/README.md")]},
    "CUDA (H100, H200)": {
        "exact gradients": [
            ("H200: dropbp check, GPU tests", "benchmarks/results/gpu_h200_core/check_cuda_final/check.md")
        ],
        "step speed": [("H100", "benchmarks/results/gpu_h100/README.md"),
                       ("H200", "benchmarks/results/gpu_h200_core/README.md"),
                       ("H200, token drops", "benchmarks/results/gpu_h200_tokens/README.md")],
        "convergence": [("H100, 60-step study", "benchmarks/results/gpu_h100/README.md")],
    },
    "Gaudi2, lazy": {
        "exact gradients": [(STAND_IN, "`torch._lazy`", "tests/test_lazy_engine.py")],
        "Trainer / TRL": [(STAND_IN, "GaudiTrainer-like", "tests/test_lazy_engine.py")],
    },
    "Gaudi2, eager": {"exact gradients": [(STAND_IN, "mode and graph breaks", "tests/test_hpu_standin.py")]},
    "Intel GPU (XPU)": {},
}


def where_it_runs_table() -> str:
    """README's "where it runs" matrix from :data:`RUNS`: ✅ where a record made on that hardware or a CPU test in CI
    shows it, 🟡 where only a stand-in does, ❔ where nothing does; every mark links its evidence, which must exist."""
    lines = [
        RUNS_BEGIN,
        "| platform (✅ measured; 🟡 a stand-in only; ❔ not run) | "
        + " | ".join(RUNS_COLUMNS)
        + " |",
        "|---|" + "---|" * len(RUNS_COLUMNS),
    ]
    for platform, columns in RUNS.items():
        cells = []
        for column in RUNS_COLUMNS:
            evidence = columns.get(column, [])
            for *_, path in evidence:
                if not (ROOT / path).exists():
                    raise FileNotFoundError(f"where it runs: {platform} / {column} cites {path}, which is not there")
            stand_in = any(e[0] == STAND_IN for e in evidence)
            links = ", ".join(f"[{e[-2]}]({e[-1]})" for e in evidence)
            cells.append(f"{'🟡' if stand_in else '✅'} {links}" if evidence else "❔")
        lines.append(f"| {platform} | " + " | ".join(cells) + " |")
    return "\n".join([*lines, RUNS_END])


def _arm_name(arm: str) -> str:
    if arm == "auto":
        return 'branch drops, drop_rate="auto" (rate from the measured noise scale)'
    if arm == "tokens-auto":
        return 'token drops, token_drop_rate="auto" (each branch\'s share from its measured added variance)'
    if arm == "full-half":
        return "nothing: full backprop at half the batch"
    for prefix in sorted(ARM_NAMES, key=len, reverse=True):
        rate = arm.removeprefix(prefix)
        if arm.startswith(prefix) and rate.replace(".", "").isdigit():
            return ARM_NAMES[prefix].format(r=rate)
    return arm


def _reading(entry: dict) -> str:
    """:func:`seeds_text` unbolded: where seeds ended outside full backprop's budgets their readings are bounds ("at
    most" above the shortest budget's loss, "at least" below the longest's), listed apart from the exact ones'."""
    return seeds_text(entry, bold="")


def arms_table(few: bool = False) -> str:
    """Every arm of benchmarks/token_drops.py at its equal-time budget against full backprop at its best of two
    batches, one column per cell, the best arm (mean over the cells) first (docs/results.md); ``few``: README's four,
    full backprop, branch drops at 0.5, ``drop_rate="auto"`` and the best token arm."""
    record = json.loads(TOKEN_DROPS.read_text())
    cells = record["cells"]
    arms: dict[str, dict[str, dict]] = {}
    for cell in cells:
        for arm, budgets in cell["arms"].items():
            equal = next((b for b in budgets.values() if isinstance(b, dict) and b.get("equal_time")), None)
            if equal is not None:
                arms.setdefault(arm, {})[cell["cell"]] = {**equal, "lr": cell["lr"][arm]}
    names = [f"6-layer Llama proxy, {c['steps']} steps x {c['tokens'] // 1024}k tokens" for c in cells]
    smollm2 = _smollm2_arms()
    lines = [
        FOUR_BEGIN if few else ARMS_BEGIN,
        "| speedup at equal quality against full backprop's best batch | "
        + " | ".join(names)
        + " | SmolLM2-135M, LoRA, 100 steps x 1k tokens |",
        "|---|" + "---|" * (len(cells) + 1),
    ]

    def mean(arm: str) -> float:
        values = [e["best"]["mean"] for e in arms[arm].values()] + [v for v, _ in smollm2.get(arm, [])]
        return sum(values) / len(values)

    shown = sorted(arms, key=lambda a: -mean(a))
    if few:
        best_token = next(a for a in shown if a.startswith("tokens"))
        shown = [a for a in shown if a in ("branch0.5", "auto", best_token)]
    for arm in shown:
        readings = [arms[arm].get(c["cell"]) for c in cells]
        texts = [
            "" if e is None else f"{seeds_text(e['best'])} (step {e['step_speedup']:.2f}x, lr {e['lr']:g})"
            for e in readings
        ]
        texts.append(" ".join(text for _, text in smollm2.get(arm, [])))
        lines.append(f"| {_arm_name(arm)} | " + " | ".join(texts) + " |")
    full = [f"1.00x (lr {c['lr']['full']:g}; half batch {c['lr']['full-half']:g})" for c in cells]
    tokens = json.loads(SMOLLM2_TOKENS.read_text())
    half = next((r for r in tokens["rows"] if r["arm"] == "full-half"), None)
    best_batch = "best" in tokens["branch0.5"]
    full.append(f"1.00x (lr 0.002; half batch {half['lr']:g})" if best_batch else "1.00x (lr 0.002; this batch only)")
    lines.append("| nothing: full backprop at its best batch | " + " | ".join(full) + " |")
    cost, docs = record["cost"], "docs/" if few else ""
    lines += [
        "",
        "Speedup at equal quality against full backprop at its best of two batches (the cell's and half of it): mean "
        f"[95% interval] over {len(record['seeds'])} seeds, each arm at its own best learning rate from one grid and "
        "at its equal-time budget (\"step\": its modelled step speedup in that cell); learning rates chosen on seed 0, "
        "which is also scored; \"at most\" / \"at least\": seeds that ended above full backprop's shortest run or "
        "below its longest, listed apart from the exact seeds' interval. Conditions: the "
        "map's proxy (a 6-layer Llama-shaped byte-level model, full fine-tuning on Python's help text); time modelled "
        f"on SmolLM2-135M's measured step on 2 CPU cores (full fine-tuning, {cost['tokens']} tokens: "
        f"{record['cost_record']}). Worth of a step and every budget: [token-drops.md]({docs}token-drops.md). "
        "The SmolLM2 column is the README's cell on the real model (LoRA r=8, Python's help text, 8 x 128 tokens a "
        "step), against full backprop at "
        + ("its best of the same two batches" if best_batch else "that batch only (half the batch not yet run there)")
        + ", each arm at its own "
        "best learning rate: branch drops from benchmarks/results/smollm2_equal_quality.md (time measured in the "
        "run), token drops from benchmarks/results/smollm2_token_drops/smollm2_token_drops.md (time modelled from "
        "the measured LoRA step).",
        FOUR_END if few else ARMS_END,
    ]
    return "\n".join(lines)


def _smollm2_best(entry: dict) -> tuple[dict, str]:
    """A SmolLM2 arm's reading against full backprop at its best batch where the half batch has run, else at the
    cell's batch; and which of the two it is."""
    return (entry["best"], "best batch") if "best" in entry else (entry["full"], "this batch")


def _smollm2_arms() -> dict[str, list[tuple[float, str]]]:
    """The SmolLM2 cell's arms for README's first table: (mean, text) by token_drops.py's arm name."""
    record = json.loads(SMOLLM2_TOKENS.read_text())
    branch = json.loads(SMOLLM2_EQUAL_QUALITY.read_text())
    reading, _ = _smollm2_best(record["branch0.5"])
    arms = {"branch0.5": [(reading["mean"], f"{seeds_text(reading)} (lr {branch['lr']['DropBP 0.5']:g})")]}
    for row in record["rows"]:
        if row["arm"] == "full-half":
            continue
        entry, _ = _smollm2_best(row)
        [first] = entry["per_seed"][:1]
        bound = "" if first["bound"] == "exact" else f", {first['bound']}"
        shown = seeds_text(entry) if entry["seeds"] > 1 else f"**{first['value']:.2f}x** (one seed{bound})"
        arms[row["arm"]] = [(entry["mean"], f"{shown} (step {row['step_speedup']:.2f}x, lr {row['lr']:g})")]
    return arms


def _one_seed(entry: dict) -> str:
    [reading] = entry["per_seed"]
    bound = {"exact": "", "at most": "at most ", "at least": "at least "}[reading["bound"]]
    return f"**{bound}{reading['value']:.2f}x** (one seed)"


def smollm2_token_table() -> str:
    """docs/token-drops.md: the token arms on SmolLM2-135M, the README's cell (benchmarks/smollm2_token_drops.py),
    beside branch drops at 0.5 on the same cell (benchmarks/smollm2_equal_quality.py's runs), against full backprop
    at the cell's batch and at its best of two batches; markers included."""
    tokens = json.loads(SMOLLM2_TOKENS.read_text())
    branch = json.loads(SMOLLM2_EQUAL_QUALITY.read_text())

    def shown(entry: dict | None) -> str:
        if entry is None:
            return "not run"
        return _interval(entry) if entry["seeds"] > 1 else _one_seed(entry)

    def row_text(name: str, lr: str, step: str, row: dict, best: str | None = None) -> str:
        best = best or shown(row.get("best"))
        return f"| {name} | {lr} | {step} | {shown(row['full'])} | {best} | {row['full']['seeds']} |"

    lines = [
        TSMOL_BEGIN,
        "| arm | learning rate (seed 0's final loss over the grid) | step speedup (modelled) | vs full backprop at "
        "this batch "
        "[95%] | vs full backprop at its best batch [95%] | seeds |",
        "|---|---|---|---|---|---|",
        row_text("branch drops 0.5 (DropBP)", f"{branch['lr']['DropBP 0.5']:g}", "measured in the run",
                 tokens["branch0.5"]),  # fmt: skip
    ]
    for row in tokens["rows"]:
        grid = ", ".join(f"{float(lr):g}: {loss:.4f}" for lr, loss in sorted(row["grid_seed0"].items()))
        if row["arm"] == "full-half":  # a baseline: its runs make half of the best-batch frontier
            step, best = "2.00x: half the tokens a step", "(one of the two batches)"
        else:
            step, best = f"{row['step_speedup']:.2f}x", None
        lines.append(row_text(_arm_name(row["arm"]), f"{row['lr']:g} ({grid})", f"{step} (modelled)", row, best))
    lines += [
        "",
        "Full backprop's complete runs at 50, 100 and 200 steps (lr 0.002, its best of "
        f"{', '.join(f'{x:g}' for x in tokens['grid'])}) are the frontier at this batch; with the half batch's "
        "complete runs (4 x 128 tokens a step, at 100 and 50 steps' time), full backprop at its best batch is the "
        "least time over the two, each batch read off its own frontier; "
        "[smollm2_token_drops.md](../benchmarks/results/smollm2_token_drops/smollm2_token_drops.md), "
        "[smollm2_equal_quality.md](../benchmarks/results/smollm2_equal_quality.md).",
        TSMOL_END,
    ]
    return "\n".join(lines)


def token_frontier_table() -> str:
    """docs/token-drops.md: every arm and budget of benchmarks/token_drops.py against full backprop at the cell's
    batch and at its best of two."""
    record = json.loads(TOKEN_DROPS.read_text())
    lines = [
        TFRONT_BEGIN,
        "| cell | arm | lr | steps | step speedup (modelled) | vs full backprop at the cell's batch | vs full backprop "
        "at its best batch | "
        "worth of a step |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for cell in record["cells"]:
        for arm, budgets in cell["arms"].items():
            lr = cell["lr"][arm]
            if arm.startswith("full"):
                losses = ", ".join(f"{s} steps {sum(v) / len(v):.4f}" for s, v in budgets.items())
                lines.append(f"| {cell['cell']} | full backprop{' at half the batch' * ('half' in arm)} | {lr:g} | "
                             f"{losses} (mean final loss) | 1.00x | | | |")  # fmt: skip
                continue
            for steps, e in budgets.items():
                lines.append(
                    f"| {cell['cell']} | {_arm_name(arm)} | {lr:g} | {steps}{' (equal time)' * e['equal_time']} | "
                    f"{e['step_speedup']:.2f}x | {_reading(e['full'])} | **{_reading(e['best'])}** | "
                    f"{e['step_worth']:.2f} |"
                )
    lines.append(TFRONT_END)
    return "\n".join(lines)


def token_frontier_checkpointing_table() -> str:
    """docs/token-drops.md: each dropping arm's equal-time runs against full backprop at its best batch, timed on the
    steps without activation checkpointing and re-timed on checkpointing's (the same runs)."""
    records = [json.loads(path.read_text()) for path in (TOKEN_DROPS, TOKEN_DROPS_CHECKPOINTING)]
    lines = [
        TCKPT_BEGIN,
        "| cell | arm | step speedup without / with checkpointing (modelled) | vs full backprop at its best batch, "
        "both without "
        "| with checkpointing |",
        "|---|---|---|---|---|",
    ]
    for plain, checkpointed in zip(records[0]["cells"], records[1]["cells"], strict=True):
        for arm, budgets in plain["arms"].items():
            if arm.startswith("full"):
                continue
            steps, e = next((s, e) for s, e in budgets.items() if e["equal_time"])
            c = checkpointed["arms"][arm][steps]
            lines.append(
                f"| {plain['cell']} | {_arm_name(arm)} | {e['step_speedup']:.2f}x / {c['step_speedup']:.2f}x | "
                f"{_reading(e['best'])} | **{_reading(c['best'])}** |"
            )
    lines.append(TCKPT_END)
    return "\n".join(lines)


def token_bench_table() -> str:
    """docs/token-drops.md: token-level step times against their ideal, per ``dropbp bench`` record."""
    lines = [
        TBENCH_BEGIN,
        "| method | activation checkpointing | token drop rate | step speedup against full backprop (same "
        "checkpointing) | ideal | efficiency | rounds |",
        "|---|---|---|---|---|---|---|",
    ]
    for path in sorted(TOKEN_BENCH.glob("*/bench.json")):
        record = json.loads(path.read_text())
        for point in record["points"]:
            for row in point["rows"]:
                lines.append(
                    f"| {point['method']} | {'on' if point.get('checkpointing') else 'off'} | {row['drop_rate']:g} | "
                    f"{row['speedup']:.2f}x | {row['ideal_speedup']:.2f}x | {row['efficiency']:.2f} | "
                    f"{record['rounds']} |"
                )
    lines.append(TBENCH_END)
    return "\n".join(lines)


def kept_rows_table() -> str:
    """docs/token-drops.md: token-dropped step speedups under checkpointing, an MLP branch recomputed on every row
    (``old_*``) and on its kept rows (``new_*``), each against the model without the library in its own run."""
    lines = [
        KEPT_BEGIN,
        "| method | token drop rate | step speedup against full backprop with checkpointing, recomputed on every row "
        "| on the kept rows | their ideals |",
        "|---|---|---|---|---|",
    ]
    for method in ("lora", "full"):
        [old], [new] = (json.loads((KEPT_ROWS / f"{code}_{method}" / "bench.json").read_text())["points"]
                        for code in ("old", "new"))  # fmt: skip
        for before, after in zip(old["rows"], new["rows"], strict=True):
            lines.append(
                f"| {'LoRA' if method == 'lora' else method} | {after['drop_rate']:g} | {before['speedup']:.2f}x | "
                f"**{after['speedup']:.2f}x** | {before['ideal_speedup']:.2f}x / {after['ideal_speedup']:.2f}x |"
            )
    lines.append(KEPT_END)
    return "\n".join(lines)


def gpu_token_bench_table() -> str:
    """docs/token-drops.md: token and branch drops' step speedups on a GPU, and the token drops' ideal, per record."""
    lines = [
        TGPU_BEGIN,
        "| method | activation checkpointing | full backprop step | token drops 0.3 / 0.5 / 0.75 | their ideal | "
        "branch drops 0.3 / 0.5 / 0.75 (uniform) |",
        "|---|---|---|---|---|---|",
    ]
    for path in sorted(TOKEN_BENCH_GPU.glob("*/bench.json"), key=lambda p: ("checkpointing" in p.parent.name, p)):
        record = json.loads(path.read_text())
        for point in record["points"]:
            rows = {(row["pattern"], row["drop_rate"]): row for row in point["rows"]}
            rates = sorted({rate for _, rate in rows})

            def cells(pattern: str, field: str, rows: dict = rows, rates: list = rates) -> str:
                return " / ".join(f"{rows[(pattern, rate)][field]:.2f}x" for rate in rates)

            lines.append(
                f"| {point['method']} | {'on' if point.get('checkpointing') else 'off'} | "
                f"{point['baseline']['step_s']:.3f} s | {cells('tokens', 'speedup')} | "
                f"{cells('tokens', 'ideal_speedup')} | {cells('uniform', 'speedup')} |"
            )
    lines.append(TGPU_END)
    return "\n".join(lines)


def noise_tables() -> str:
    """docs/noise-scale.md: the forecast against the map (benchmarks/noise_scale.py) and what the reads cost
    (benchmarks/noise_scale_cost.py), as their records' tables say them."""
    parts = [NOISE_BEGIN]
    for name in ("validation.md", "cost_cpu.md"):
        path = NOISE_RECORDS / name
        if path.exists():
            parts += [path.read_text().strip(), f"(record: [{name}](../benchmarks/results/noise_scale/{name}))", ""]
    parts.append(NOISE_END)
    return "\n".join(parts)


def between(text: str, begin: str, end: str) -> str | None:
    """The part of ``text`` from ``begin`` to ``end`` (markers included), or None."""
    if begin not in text or end not in text:
        return None
    start = text.index(begin)
    return text[start : text.index(end, start) + len(end)]


def readme_table(text: str) -> str | None:
    """The SmolLM2 table as README.md has it (markers included), or None."""
    return between(text, BEGIN, END)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--write", action="store_true", help="replace the tables in README.md and the pages, and draw README's picture"
    )
    args = parser.parse_args()
    made = {
        README: {
            (BUYS_BEGIN, BUYS_END): buys_tables(),
            (CLAIMS_BEGIN, CLAIMS_END): claims_table(),
            (FOUR_BEGIN, FOUR_END): arms_table(few=True),
            (RUNS_BEGIN, RUNS_END): where_it_runs_table(),
        },
        TOKEN_PAGE: {
            (TBENCH_BEGIN, TBENCH_END): token_bench_table(),
            (KEPT_BEGIN, KEPT_END): kept_rows_table(),
            (TGPU_BEGIN, TGPU_END): gpu_token_bench_table(),
            (TFRONT_BEGIN, TFRONT_END): token_frontier_table(),
            (TCKPT_BEGIN, TCKPT_END): token_frontier_checkpointing_table(),
            (TSMOL_BEGIN, TSMOL_END): smollm2_token_table(),
        },
        RESULTS_PAGE: {
            (ARMS_BEGIN, ARMS_END): arms_table(),
            (MAP_BEGIN, MAP_END): map_table(),
            (EQ_BEGIN, EQ_END): smollm2_table(),
            (BEGIN, END): table(),
        },
        NOISE_PAGE: {(NOISE_BEGIN, NOISE_END): noise_tables()},
    }
    if args.write:
        FIGURE.mkdir(exist_ok=True)
        data = figure_data()
        (FIGURE / "figure.json").write_text(json.dumps(data, indent=2) + "\n")
        draw_figure(data, FIGURE / "figure.png")
    for page, tables in made.items():
        if args.write:
            text = page.read_text()
            for (begin, end), new in tables.items():
                current = between(text, begin, end)
                if current is None:
                    raise SystemExit(f"{page.name} has no {begin} ... {end} markers to put the table between")
                text = text.replace(current, new)
            page.write_text(text)
        print("\n\n".join(tables.values()))


if __name__ == "__main__":
    main()
