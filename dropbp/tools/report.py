"""Tables and plots of comparison results (matplotlib is imported only when a plot is drawn)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ..imports import require
from .compare import RunResult

__all__ = ["plot_curves", "steps_and_time_table"]


def plot_curves(results: Sequence[RunResult], path: Path, title: str) -> Path:
    """Validation loss against training wall time (left) and against steps (right), one line per run."""
    matplotlib = require("matplotlib", "plotting")

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_time, by_step) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in results:
        by_time.plot(r.eval_seconds, r.val_loss, marker="o", markersize=3, label=r.run.name)
        by_step.plot(r.eval_steps, r.val_loss, marker="o", markersize=3, label=r.run.name)
    target = results[0].val_loss[-1]
    for ax, xlabel in ((by_time, "training wall time (s)"), (by_step, "step")):
        ax.axhline(target, color="grey", linestyle=":", linewidth=1)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("validation loss")
        ax.grid(alpha=0.3)
    by_time.legend(fontsize=8)
    fig.suptitle(title + f" (dotted: {results[0].run.name}'s final loss)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _loss(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def steps_and_time_table(summary: Sequence[dict]) -> list[str]:
    """Markdown rows of :func:`dropbp.tools.compare.summarise` for runs over their own steps: equal steps (final
    loss, its gap to the baseline's, training time saved), equal time read both ways (the run's loss at the
    baseline's training time; full backprop's loss at this run's own end) and the time to the baseline's final
    loss (``summary[0]`` is the baseline)."""
    base = summary[0]
    target = base["final_val_loss"]
    lines = [
        f"| run | steps | time/step | step speedup | training time | time saved | final val loss | gap "
        f"| val loss @ baseline's time | full backprop @ this run's time | time to {target:.3f} | vs full backprop |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in summary:
        reached = "not reached" if r["time_to_target_s"] is None else f"{r['time_to_target_s']:.0f} s"
        ratio = "-" if r["time_to_target_speedup"] is None else f"{r['time_to_target_speedup']:.2f}x"
        lines.append(
            f"| {r['run']} | {r['steps']} | {r['step_s']:.2f} s | {r['step_speedup']:.2f}x | {r['train_s']:.0f} s | "
            f"{1 - r['train_s'] / base['train_s']:+.0%} | {r['final_val_loss']:.3f} | "
            f"{r['final_val_loss'] / target - 1:+.2%} | {_loss(r.get('val_loss_at_equal_time'))} | "
            f"{_loss(r.get('baseline_val_loss_at_run_end'))} | {reached} | {ratio} |"
        )
    return lines
