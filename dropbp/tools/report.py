"""Tables and plots of comparison results (matplotlib is imported only when a plot is drawn)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ..imports import require
from .compare import RunResult

__all__ = ["plot_curves"]


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
