"""The README's results table, made from the convergence records under benchmarks/results (never typed by hand).

    python benchmarks/readme_results.py           # print the table
    python benchmarks/readme_results.py --write   # put it between README.md's results-table markers

Each row is one setting of the accumulation regime (docs/regime.md: SmolLM2-135M-Instruct, 100 optimizer steps of
8 micro-batches of 128 tokens, lr warm-up and cosine decay, 2 CPU cores), the shipped default at drop rate 0.5
against full backprop, over every seed recorded. ``tests/test_readme.py`` fails when README.md's table is not
what this script makes of the records.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
README = ROOT / "README.md"
BEGIN, END = "<!-- results-table: made by benchmarks/readme_results.py -->", "<!-- end of results-table -->"

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


def row(setting: str, stems: list[str]) -> str | None:
    """The table row of one setting, or None when no record of it exists yet."""
    seeds = [runs for runs in map(_runs, stems) if runs is not None]
    if not seeds:
        return None
    speedups = [s[EQUAL_STEPS if EQUAL_STEPS in s else EQUAL_TIME]["step_speedup"] for s in seeds]
    steps = [(1 - s[EQUAL_STEPS]["train_s"] / s[BASELINE]["train_s"], s[EQUAL_STEPS]["final_val_loss"] /
              s[BASELINE]["final_val_loss"] - 1) for s in seeds if EQUAL_STEPS in s]
    timed = [s for s in seeds if EQUAL_TIME in s]
    # at the same training time, the shorter run's (as the records' tables read it): a DropBP run that trained less
    # than the baseline against the baseline at its end, one that trained longer read at the baseline's end
    gaps = [s[EQUAL_TIME]["val_loss_at_equal_time"] - _baseline_then(s) for s in timed]
    targets = [s[EQUAL_TIME]["time_to_target_speedup"] for s in timed]
    equal_steps = (
        f"{100 * _mean([t for t, _ in steps]):.0f}% less time, {100 * _mean([g for _, g in steps]):+.2f}% loss"
        + (f" ({len(steps)} seeds)" if len(steps) > 1 else " (1 seed)")
        if steps
        else "not run"
    )
    equal_time = f"{_signed(_mean(gaps))} ({', '.join(map(_signed, gaps))})" if gaps else "not run"
    to_target = ", ".join("not reached" if t is None else f"{t:.2f}x" for t in targets) or "not run"
    return (
        f"| {setting} | {_mean(speedups):.2f}x | {equal_steps} | {equal_time} | {to_target} | "
        f"{len(seeds)} of {len(stems)} |"
    )


def table() -> str:
    """The whole table, markers included."""
    lines = [
        BEGIN,
        "| fine-tuning, corpus | step speedup | equal steps: time saved, loss gap (mean) | equal time: loss minus "
        "full backprop's at the same time, mean (per seed) | time to full backprop's final loss (per seed) | seeds |",
        "|---|---|---|---|---|---|",
    ]
    lines += [r for r in (row(setting, stems) for setting, stems in SETTINGS) if r is not None]
    return "\n".join([*lines, END])


def readme_table(text: str) -> str | None:
    """The table as README.md has it (markers included), or None."""
    if BEGIN not in text or END not in text:
        return None
    start = text.index(BEGIN)
    return text[start : text.index(END, start) + len(END)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help="replace the table in README.md")
    args = parser.parse_args()
    made = table()
    if args.write:
        text = README.read_text()
        current = readme_table(text)
        if current is None:
            raise SystemExit(f"README.md has no {BEGIN} ... {END} markers to put the table between")
        README.write_text(text.replace(current, made))
    print(made)


if __name__ == "__main__":
    main()
