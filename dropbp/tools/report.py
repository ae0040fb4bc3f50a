"""Tables and plots of comparison results (matplotlib is imported only when a plot is drawn)."""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

from dropbp.files import write_atomically
from dropbp.imports import MissingDependency, require
from dropbp.tools.compare import RunResult, loss_at_time, time_to_target, with_timed_tails

__all__ = ["learning_rates_table", "plot_curves", "seeds_table", "steps_and_time_table"]


def finish_axes(ax: object, xlabel: str, ylabel: str) -> None:
    """Label one plot's axes, with a grid and a small legend."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def save_figure(fig: object, path: Path) -> Path:
    """Lay ``fig`` out, write it to ``path`` (its folder made) and close it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_record(
    out: Path, stem: str, results: dict, markdown: str, plot: Callable[[dict, Path], object]
) -> list[Path]:
    """``stem``.json, .md and .png into ``out``; the paths written. Without matplotlib the figures are still written
    (JSON and table) and the plot is skipped, with a warning that says how to get it: no measurement is lost."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{stem}.json", out / f"{stem}.md", out / f"{stem}.png"]
    write_atomically(paths[0], json.dumps(results, indent=2) + "\n")
    write_atomically(paths[1], markdown)
    try:
        plot(results, paths[2])
    except MissingDependency as missing:
        warnings.warn(f"dropbp: {paths[2].name} not drawn, the figures are in {paths[0].name}: {missing}", stacklevel=2)
        return paths[:2]
    return paths


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
    return save_figure(fig, path)


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


def _equal_time_difference(row: dict, target: float) -> float:
    """A run's loss minus full backprop's at equal training time: at the baseline's time for a run that trained at
    least as long, else at the run's own end (a run whose schedule ended first is never given more time)."""
    reference = row.get("baseline_val_loss_at_run_end")
    return row["val_loss_at_equal_time"] - (target if reference is None else reference)


def seeds_table(summaries: Sequence[Sequence[dict]], seeds: Sequence[int]) -> list[str]:
    """Markdown rows of one setting over several seeds (one :func:`dropbp.tools.compare.summarise` each, the same
    runs in each, the baseline first): per seed and the mean, the equal-steps gap, the time saved, the loss
    difference to full backprop at equal time and the time-to-target speedup ("not reached" counts against the
    mean: it is shown as such rather than averaged away)."""
    names = [row["run"] for row in summaries[0]]
    for summary, seed in zip(summaries, seeds, strict=True):
        if [row["run"] for row in summary] != names:
            raise ValueError(f"seed {seed} has runs {[row['run'] for row in summary]}, seed {seeds[0]} has {names}")
    each = "/".join(f"s{seed}" for seed in seeds)
    lines = [
        f"| run | steps | time saved ({each}; mean) | final val loss ({each}) | gap ({each}; mean) "
        f"| at equal time, minus full backprop ({each}; mean) | time-to-target speedup ({each}; mean) |",
        "|---|---|---|---|---|---|---|",
    ]
    bases = [summary[0] for summary in summaries]
    for i, name in enumerate(names):
        rows = [summary[i] for summary in summaries]
        pairs = list(zip(rows, bases, strict=True))
        saved = [1 - r["train_s"] / b["train_s"] for r, b in pairs]
        gaps = [r["final_val_loss"] / b["final_val_loss"] - 1 for r, b in pairs]
        at_time = [_equal_time_difference(r, b["final_val_loss"]) for r, b in pairs]
        ttt = [r["time_to_target_speedup"] for r in rows]
        ttt_mean = "not reached" if None in ttt else f"{sum(ttt) / len(ttt):.2f}x"
        finals = "/".join(f"{r['final_val_loss']:.3f}" for r in rows)
        lines.append(
            f"| {name} | {'/'.join(str(r['steps']) for r in rows)} | {_each(saved, '{:+.0%}')} | "
            f"{finals} | {_each(gaps, '{:+.2%}')} | "
            f"{_each(at_time, '{:+.3f}')} | {'/'.join('-' if t is None else f'{t:.2f}x' for t in ttt)}; {ttt_mean} |"
        )
    return lines


def _each(values: Sequence[float], fmt: str) -> str:
    return "/".join(fmt.format(v) for v in values) + "; " + fmt.format(sum(values) / len(values))


def learning_rates_table(comparisons: Sequence[tuple[float, Sequence[RunResult]]]) -> list[str]:
    """Markdown rows of one setting trained at several learning rates, every run at each (one comparison per rate,
    its first run the baseline): each run's final validation loss per rate, then each run at its own best rate
    against full backprop at its own best. Times are in units of each comparison's own baseline training time
    (a comparison that shared the machine with more processes is not held against its runs), tails timed as in
    :func:`dropbp.tools.compare.summarise`."""
    names = [r.run.name for r in comparisons[0][1]]
    for lr, results in comparisons:
        if [r.run.name for r in results] != names:
            first = comparisons[0][0]
            raise ValueError(f"lr {lr:g} has runs {[r.run.name for r in results]}, lr {first:g} has {names}")
    scaled = {lr: _in_baseline_units(results) for lr, results in comparisons}
    rates = [lr for lr, _ in comparisons]
    best = {i: min(rates, key=lambda lr: scaled[lr][i].val_loss[-1]) for i in range(len(names))}
    lines = [
        "| run | " + " | ".join(f"final val loss, lr {lr:g}" for lr in rates) + " | its best lr |",
        "|---|" + "---|" * (len(rates) + 1),
    ]
    for i, name in enumerate(names):
        cells = [f"{scaled[lr][i].val_loss[-1]:.3f}" for lr in rates]
        lines.append(f"| {name} | {' | '.join(cells)} | {best[i]:g} |")
    base = scaled[best[0]][0]
    target = base.val_loss[-1]
    base_reached = time_to_target(base, target)
    lines += [
        "",
        f"Each run at its own best learning rate against full backprop at its own ({best[0]:g}, final loss "
        f"{target:.3f}); training time in units of the same comparison's full backprop:",
        "",
        "| run | lr | training time | final val loss | gap | at equal time, minus full backprop | time-to-target "
        "speedup |",
        "|---|---|---|---|---|---|---|",
    ]
    for i, name in enumerate(names):
        run = scaled[best[i]][i]
        end = run.eval_seconds[-1]
        at_time = (loss_at_time(run, 1.0) - target) if end >= 1.0 else run.val_loss[-1] - loss_at_time(base, end)
        reached = time_to_target(run, target)
        speedup = "not reached" if reached is None else f"{base_reached / reached:.2f}x"
        lines.append(
            f"| {name} | {best[i]:g} | {end:.2f} | {run.val_loss[-1]:.3f} | {run.val_loss[-1] / target - 1:+.2%} | "
            f"{at_time:+.3f} | {speedup} |"
        )
    return lines


def _in_baseline_units(results: Sequence[RunResult]) -> list[RunResult]:
    """A comparison's runs, tails timed, with evaluation times over its baseline's training time."""
    timed = with_timed_tails(results)
    unit = timed[0].eval_seconds[-1]
    return [replace(r, eval_seconds=[t / unit for t in r.eval_seconds]) for r in timed]
