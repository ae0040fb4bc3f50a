"""What the rounds of `dropbp bench` records drew, and each row's speedup at the pattern's expected fraction.

For records written before the bench kept each round's dropped FLOPs fraction, the fractions are drawn again: round
``r`` of a row ran the pattern of ``apply(model, rate, seed=r, pattern=...)`` at its first step, so ``dropped_at(0)``
of that seed gives it without timing anything. Prints, per DropBP row: rounds, the mean fraction drawn, the median
and mean-of-means speedups, the speedup at the expected fraction (``dropbp.tools.bench.at_expected_fraction``), the
median per-round efficiency (per-round ideal from the record's phases and the round's own fraction) and the ideal.

    python benchmarks/drawn_cuts.py benchmarks/results/bench_checkpointing_cpu/*/bench.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from dropbp.tools.arms import apply_arm
from dropbp.tools.bench import _shape, at_expected_fraction, build_model


def redrawn(point: dict, row: dict, rounds: int, warmup: int) -> list[float]:
    """The FLOP-weighted fraction each timed round of ``row`` dropped, from the seeds the bench used."""
    model = build_model(point["preset"], point["method"], point["seq_len"], torch.float32, torch.device("cpu"))
    fractions = []
    for seed in range(warmup, warmup + rounds):
        ctl = apply_arm(model, row["drop_rate"], seed=seed, seq_len=point["seq_len"], **_shape(row["pattern"]))
        flops = {b.name: b.flops for b in ctl.branches}
        fractions.append(sum(flops[n] for n in ctl.dropped_at(0)) / sum(flops.values()))
        ctl.remove()
    return fractions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("records", nargs="+", type=Path, help="bench.json files")
    parser.add_argument("--warmup", type=int, default=2, help="the untimed rounds the records ran (default 2)")
    args = parser.parse_args()
    print("| record | checkpointing | pattern @ rate | rounds | FLOPs dropped | median | mean | at expected "
          "| per-round efficiency | ideal |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for path in args.records:
        record = json.loads(path.read_text())
        for point in record["points"]:
            base, dropped = point["baseline"], point["all_dropped"]
            for row in point["rows"]:
                if "round_step_s" not in row or row["drop_rate"] == 0:
                    continue  # records before per-round times were kept cannot be corrected
                steps = row["round_step_s"]
                drawn = row.get("round_dropped_fraction") or redrawn(point, row, len(steps), args.warmup)
                f, b, o = base["forward_s"], base["backward_s"], base["optimizer_s"]
                b0, o0 = dropped["backward_s"], dropped["optimizer_s"]
                ideal = [f + b0 + o0 + (1 - d) * (b - b0 + o - o0) for d in drawn]
                mean_base = statistics.mean(base["round_step_s"])
                at = mean_base / at_expected_fraction(steps, drawn, row["drop_rate"])
                print(
                    f"| {path.parent.name} | {'on' if point.get('checkpointing') else 'off'} | "
                    f"{row['pattern']} @ {row['drop_rate']} | {len(steps)} | {statistics.mean(drawn):.3f} | "
                    f"{row['speedup']:.2f}x | {mean_base / statistics.mean(steps):.2f}x | {at:.2f}x | "
                    f"{statistics.median(i / s for i, s in zip(ideal, steps, strict=True)):.3f} | "
                    f"{row['ideal_speedup']:.2f}x |"
                )


if __name__ == "__main__":
    main()
