"""The figures README.md and docs/ quote in prose, each read from its record: one truth per figure.

A ``Figure`` names a record under ``benchmarks/results``, how to read the figure from it (formatted as the pages
print it) and the places the pages state it: regular expressions whose one group is the figure's text there.
``tests/test_readme.py`` checks that every place is on a page and says the record's value, so a figure cannot
drift from its record or take two values. Tables are not here: ``readme_results.py`` makes them from the records
and the same tests compare them whole. Intervals (``0.98x [0.87, 1.09]``) are checked apart, wherever they stand:
each must be a mean and interval some record holds (``recorded_intervals``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from dropbp.tools.frontier import exact_seeds

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
X = r"(\d+\.\d\dx)"  # a speedup as the pages print it


@cache
def _json(path: str) -> dict:
    return json.loads((RESULTS / path).read_text())


def _bench_row(path: str, checkpointing: bool, pattern: str, rate: float) -> dict:
    for point in _json(path)["points"]:
        if bool(point.get("checkpointing")) == checkpointing:
            for row in point["rows"]:
                if row["pattern"] == pattern and row["drop_rate"] == rate:
                    return row
    raise LookupError(f"{path} has no {pattern} row at {rate} with checkpointing {checkpointing}")


def _at_expected(model: str, checkpointing: bool) -> str:
    path = f"bench_checkpointing_cpu/{model}_0.5_at_expected/bench.json"
    return f"{_bench_row(path, checkpointing, 'cut', 0.5)['speedup_at_expected']:.2f}x"


def _h200_checkpointing_memory() -> str:
    """DropBP 0.5's peak against full backprop's on the H200, both with activation checkpointing (README's first
    screen: "at about checkpointing's memory")."""
    point = next(p for p in _json("gpu_h200_core/bench_cuda_1b/bench.json")["points"]
                 if p["method"] == "lora" and p["checkpointing"])  # fmt: skip
    ours = next(r for r in point["rows"] if r["pattern"] == "uniform" and r["drop_rate"] == 0.5)["peak_memory_bytes"]
    full = point["baseline"]["peak_memory_bytes"]
    way = "above" if ours > full else "below"
    return f"{100 * abs(ours / full - 1):.0f}% {way} it on the H200: {ours / 2**30:.1f} against {full / 2**30:.1f} GiB"


def _long_document_steps() -> str:
    """README's one-document line: the step speedup at 4096 tokens, LoRA with checkpointing, at the expected share."""
    point = next(p for p in _json("long_document_cpu/bench.json")["points"]
                 if p["method"] == "lora" and p["seq_len"] == 4096 and p["checkpointing"])  # fmt: skip
    row = {(r["pattern"], r["drop_rate"]): r["speedup_at_expected"] for r in point["rows"]}
    return f"{row[('cut', 0.5)]:.2f}x faster at 0.5 (the cut) and {row[('uniform', 0.875)]:.2f}x at 0.875 (uniform)"


def _long_document_memory() -> str:
    """README's one-document line: the peak without checkpointing, 0.5 and 0.875 against full backprop (4096)."""
    rows = [r for r in _json("long_document_memory/memory.json")["memory"]
            if r["seq_len"] == 4096 and not r["checkpointing"]]  # fmt: skip
    peak = {r["rate"] or 0.0: r["peak_above_level_bytes"] for r in rows}
    return f"{peak[0.0] / peak[0.5]:.2f}x and {peak[0.0] / peak[0.875]:.2f}x"


def _fastest_token_step(method: str) -> str:
    [point] = _json(f"bench_tokens_cpu/{method}/bench.json")["points"]
    return f"{max(r['speedup'] for r in point['rows'] if r['pattern'] == 'tokens'):.2f}x"


def _token_cell(name: str) -> dict:
    return next(c for c in _json("token_drops/token_drops.json")["cells"] if c["cell"] == name)


def _equal_time_worth(cell: str, arm: str) -> float:
    """Worth of a step (against full backprop at its best batch) of ``arm`` at its equal-time budget in ``cell``."""
    return next(b["step_worth"] for b in _token_cell(cell)["arms"][arm].values() if b["equal_time"])


AUTO_CELLS = ("100x1k", "300x1k", "100x8k")  # the proxy's cells token_drop_rate="auto" ran in


def _auto_entry(cell: str) -> dict:
    """token_drop_rate="auto"'s one budget in ``cell``."""
    [entry] = _token_cell(cell)["arms"]["tokens-auto"].values()
    return entry


def _worths(arm: str) -> str:
    values = [f"{_equal_time_worth(cell, arm):.2f}" for cell in ("100x1k", "300x1k", "100x8k")]
    return f"{values[0]}, {values[1]} and {values[2]}"


def _equal_steps_saving() -> str:
    """The claims table's equal-steps row (readme_results.py makes it): time saved and the loss gap, LoRA at 0.5."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("readme_results", ROOT / "benchmarks" / "readme_results.py")
    results = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(results)
    _, stems = results.SETTINGS[0]
    _, saved, gap, _ = results._equal_steps(stems)
    return f"{100 * saved:.0f}% sooner at {100 * gap:+.2f}%"


@dataclass(frozen=True)
class Figure:
    """One figure: ``read()`` gives its text from the record; ``places`` are (page, regex with one group)."""

    name: str
    read: Callable[[], str]
    places: tuple[tuple[str, str], ...]


def _best_of_cells(arms: Callable[[str], bool]) -> str:
    """The best mean, over the proxy's cells and the arms ``arms`` admits, against full backprop at its best batch."""
    return "{:.2f}x".format(
        max(
            budget["best"]["mean"]
            for cell in _json("token_drops/token_drops.json")["cells"]
            for arm, budgets in cell["arms"].items()
            if arms(arm)
            for budget in budgets.values()
            if isinstance(budget, dict) and budget.get("equal_time")
        )
    )


def _longer_run() -> str:
    """docs/regime.md's longer run: DropBP's steps against full backprop's, both final losses, the time saved."""
    runs = {r["run"]: r for r in _json("convergence_time-schedules_lora_pydoc_accumulate.json")["summary"]}
    full, drop = runs["full backprop"], runs["cut 0.5 + warm-up (mean kept)"]
    return (
        f"{drop['steps']} steps to full backprop's {full['steps']}: {drop['final_val_loss']:.3f} against "
        f"{full['final_val_loss']:.3f} in {100 * (1 - drop['train_s'] / full['train_s']):.0f}% less time"
    )


FIGURES = (
    Figure(
        "one document of 4096 tokens a step: the step speedup (SmolLM2-135M LoRA, checkpointing on)",
        _long_document_steps,
        (("README.md", r"step (\d\.\d\dx faster at 0\.5 \(the cut\) and \d\.\d\dx at 0\.875 \(uniform\))"),),
    ),
    Figure(
        "one document of 4096 tokens a step: the peak without checkpointing (SmolLM2-135M LoRA)",
        _long_document_memory,
        (("README.md", r"cuts the peak (\d\.\d\dx and \d\.\d\dx)"),),
    ),
    Figure(
        "DropBP 0.5's peak memory against full backprop's, both with activation checkpointing (H200, 1.1B shape)",
        _h200_checkpointing_memory,
        (("README.md", r"at 0\.5, (\d+% (?:above|below) it on the H200: [\d.]+ against [\d.]+\s+GiB)"),),
    ),
    Figure(
        "the longer run at equal time (SmolLM2-135M LoRA, Python help text, 0.5 with warm-up)",
        _longer_run,
        (("docs/demo.md", r"DropBP given (\d+ steps to full backprop's \d+: [\d.]+ against [\d.]+ in "
                          r"\d+% less time)"),),  # fmt: skip
    ),
    Figure(
        "branch drops at 0.5 against full backprop at its best batch, the best of the proxy's cells",
        lambda: _best_of_cells(lambda arm: arm == "branch0.5"),
        (("README.md", r"branch drops at 0\.5\s+read at best " + X),),
    ),
    Figure(
        'drop_rate="auto" against full backprop at its best batch, the best of the proxy\'s cells',
        lambda: _best_of_cells(lambda arm: arm == "auto"),
        (("README.md", r'`drop_rate="auto"` at best ' + X),),
    ),
    Figure(
        "the best token arm against full backprop at its best batch, the best of the proxy's cells",
        lambda: _best_of_cells(lambda arm: arm.startswith("tokens")),
        (("README.md", r"token drops at best " + X),),
    ),
    Figure(
        "time saved at equal steps and the loss it costs (SmolLM2-135M LoRA, Python help text, 0.5; 2 seeds)",
        _equal_steps_saving,
        (("README.md", r"at 0\.5 it ends\s+(\d+% sooner at [+-]\d\.\d\d%) validation loss"),),
    ),
    Figure(
        "LoRA step speedup at 0.5 with activation checkpointing (bench, at the cut's expected fraction)",
        lambda: _at_expected("lora", True),
        (
            ("docs/checkpointing.md", r"\| 0\.5 \| [\d.]+x \(at the cut's expected fraction, below\) \| \*\*" + X),
            ("docs/checkpointing.md", r"\*\*" + X + r" with checkpointing, [\d.]+x without\*\*"),
            ("docs/results.md", r"LoRA [\d.]+x,\s+" + X + r" with activation checkpointing"),
        ),
    ),
    Figure(
        "LoRA step speedup at 0.5 without checkpointing (bench, at the cut's expected fraction)",
        lambda: _at_expected("lora", False),
        (
            ("docs/checkpointing.md", r"\| 0\.5 \| " + X + r" \(at the cut's expected fraction, below\)"),
            ("docs/checkpointing.md", r"with checkpointing, " + X + r" without\*\*"),
            ("docs/results.md", r"at the cut's expected fraction\): LoRA " + X),
        ),
    ),
    Figure(
        "full fine-tuning step speedup at 0.5 without / with checkpointing (bench, at the cut's expected fraction)",
        lambda: f"{_at_expected('full', False)} / {_at_expected('full', True)}",
        (
            ("docs/checkpointing.md", r"\*\*(\d\.\d\dx / \d\.\d\dx)\*\* without / with checkpointing at 0\.5"),
            ("docs/results.md", r"full fine-tuning (\d\.\d\dx / \d\.\d\dx);"),
        ),
    ),
    Figure(
        "the fastest token-dropped step, full fine-tuning (SmolLM2-135M, 512 tokens, CPU)",
        lambda: _fastest_token_step("full"),
        (
            ("README.md", r"their step is at most " + X + " faster"),
            ("docs/token-drops.md", r"a token-dropped step is at most " + X + " faster"),
            ("docs/token-drops.md", r"\(at\s+most\s+" + X + r"\s+at a quarter of the rows\)"),
        ),
    ),
    Figure(
        "the fastest token-dropped step, LoRA (SmolLM2-135M, 512 tokens, CPU)",
        lambda: _fastest_token_step("lora"),
        (("docs/token-drops.md", r"\(full fine-tuning;\s+" + X + r" with LoRA\)"),),
    ),
    Figure(
        "the fastest token-dropped step with activation checkpointing, full fine-tuning (SmolLM2-135M, 512 tokens)",
        lambda: _fastest_token_step("full_checkpointing"),
        (
            ("README.md", r"with activation checkpointing at most " + X),
            ("docs/token-drops.md", r"with activation checkpointing, at most " + X + r" \(full fine-tuning"),
            ("CHANGELOG.md", r"idle, the ceiling is " + X),
        ),
    ),
    Figure(
        "the fastest token-dropped step with activation checkpointing, LoRA (SmolLM2-135M, 512 tokens)",
        lambda: _fastest_token_step("lora_checkpointing"),
        (("docs/token-drops.md", r"with activation checkpointing, at most \d\.\d\dx \(full fine-tuning;\s+" + X),),
    ),
    Figure(
        "full backprop at half the batch against the cell's batch, 30 steps x 32k tokens",
        lambda: f"{_token_cell('30x32k')['half_batch']['full']['mean']:.2f}x",
        (
            ("README.md", r"full backprop at half the batch beats both \(" + X + r"\)"),
            ("docs/noise-scale.md", r"at 30 x 32k\s+\([\d.]+x forecast, " + X + r" measured\)"),
        ),
    ),
    Figure(
        "worth of a kept token row by gradient over a random one (token drops 0.3, 100 x 1k, equal time)",
        lambda: f"{_equal_time_worth('100x1k', 'tokens0.3') / _equal_time_worth('100x1k', 'tokens-random0.3'):.1f}x",
        (
            ("README.md", r"worth (\d\.\dx) a random one"),
            ("docs/token-drops.md", r"Importance sampling is worth (\d\.\dx) random rows"),
        ),
    ),
    Figure(
        "worth of a step keeping 70% of the token rows by gradient, per cell (100 x 1k, 300 x 1k, 100 x 8k)",
        lambda: _worths("tokens0.3"),
        (("docs/token-drops.md", r"70% of the rows is worth ([\d.]+, [\d.]+ and [\d.]+) of a full"),),
    ),
    Figure(
        "worth of a step keeping 70% of the rows by the branch output's size, at random and by gradient (300 x 1k)",
        lambda: "{:.2f} against {:.2f} and {:.2f}".format(
            *(_equal_time_worth("300x1k", arm) for arm in ("tokens-residual0.3", "tokens-random0.3", "tokens0.3"))
        ),
        (("docs/token-drops.md", r"(\d\.\d\d against \d\.\d\d and \d\.\d\d)\s+at 300 x 1k"),),
    ),
    Figure(
        'token_drop_rate="auto": the mean share of token rows its selections kept (100 x 1k, 300 x 1k, 100 x 8k)',
        lambda: "{}, {} and {}".format(*(f"{_auto_entry(cell)['kept_token_share']:.0%}" for cell in AUTO_CELLS)),
        (("docs/token-drops.md", r"Its branches kept \*\*(\d+%, \d+% and \d+%)\*\* of the rows"),),
    ),
    Figure(
        'token_drop_rate="auto": the worth of a step (100 x 1k, 300 x 1k, 100 x 8k)',
        lambda: "{}, {} and {}".format(*(f"{_auto_entry(cell)['step_worth']:.2f}" for cell in AUTO_CELLS)),
        (("docs/token-drops.md", r"a step was worth \*\*([\d.]+, [\d.]+ and [\d.]+)\*\* of a full one"),),
    ),
    Figure(
        "SmolLM2 LoRA step speedup at 1 x 128 tokens, token drops 0.3, 0.5 and 0.75 (the README cell's micro-batch)",
        lambda: "{:.2f}x, {:.2f}x and {:.2f}x".format(
            *(
                _bench_row("bench_tokens_cpu_128/lora/bench.json", False, "tokens", r)["speedup"]
                for r in (0.3, 0.5, 0.75)
            )
        ),
        (("docs/token-drops.md", r"make a step \*\*(\d\.\d\dx, \d\.\d\dx and \d\.\d\dx)\*\* as fast"),),
    ),
    Figure(
        "GPU (H200) LoRA step speedup, token drops 0.5 and branch drops 0.5 (uniform), 8 x 512 tokens",
        lambda: "{:.2f}x; branch drops at 0.5: {:.2f}x".format(
            *(_bench_row("bench_tokens_cuda/lora/bench.json", False, p, 0.5)["speedup"] for p in ("tokens", "uniform"))
        ),
        (("README.md", r"slower than full backprop's \((\d\.\d\dx; branch drops at 0\.5: \d\.\d\dx)\)"),),
    ),
    Figure(
        "worth of a step keeping 70% of the token rows at random, per cell (100 x 1k, 300 x 1k, 100 x 8k)",
        lambda: _worths("tokens-random0.3"),
        (("docs/token-drops.md", r"against ([\d.]+, [\d.]+ and [\d.]+) with random rows"),),
    ),
)


def _intervals(value: object) -> Iterator[str]:
    if isinstance(value, dict):
        if all(isinstance(value.get(k), int | float) for k in ("mean", "low", "high")):
            yield f"{value['mean']:.2f}x [{value['low']:.2f}, {value['high']:.2f}]"
            exact = exact_seeds(value) if value.get("bounded") else None  # the exact seeds' own interval
            if exact is not None and exact["seeds"] > 1:
                yield f"{exact['mean']:.2f}x [{exact['low']:.2f}, {exact['high']:.2f}]"
        for inner in value.values():
            yield from _intervals(inner)
    elif isinstance(value, list):
        for inner in value:
            yield from _intervals(inner)


def recorded_intervals() -> set[str]:
    """Every speedup with its 95% interval any JSON record holds, as the pages print it (``0.98x [0.87, 1.09]``)."""
    return {text for path in RESULTS.rglob("*.json") for text in _intervals(json.loads(path.read_text()))}
