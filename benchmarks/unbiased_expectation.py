"""How close ``unbiased=True``'s expected gradient is to full backprop's, per branch, with and without a pattern pool.

A 3-layer tiny Llama (the tests' shape, random weights), one fixed batch, drop rate 0.5, no warm-up: the weighted
gradient averaged over the steps (400 drawn afresh; 8 cycles of a pool of 4 patterns) and projected on full
backprop's, per branch (1.00: the same in expectation). With cut patterns a kept branch's gradient is full backprop's
and the weights make the mean exact (the pool's own frequencies, over a whole cycle); with uniform patterns a kept
branch's gradient depends on the branches dropped above it, which no weight undoes.

    python benchmarks/unbiased_expectation.py     # prints the table; results/unbiased_expectation.md holds a run's
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from conftest import batch, loss_and_grads, tiny_model  # noqa: E402

import dropbp  # noqa: E402


def main() -> None:
    print("| pattern | pattern pool | steps averaged | expected gradient over full backprop's, per branch (bottom "
          "first) |")
    print("|---|---|---|---|")
    for pattern in ("cut", "uniform"):
        for pool in (None, 4):
            model = tiny_model("llama", layers=3)
            ids = batch(0)
            _, full = loss_and_grads(copy.deepcopy(model), ids)
            options = {"max_patterns": pool} if pool else {}
            options |= {"warmup_steps": 0, "seed": 0, "pattern": pattern}
            ctl = dropbp.apply(model, 0.5, features=[dropbp.experimental.ImportanceWeights()], **options)
            steps = 400 if pool is None else 8 * pool
            mean = {k: torch.zeros_like(v) for k, v in full.items() if v is not None}
            for _ in range(steps):
                _, got = loss_and_grads(model, ids)
                for k in mean:
                    if got[k] is not None:
                        mean[k] += got[k] / steps
            ratios = []
            for branch in ctl.branches:
                keys = [k for k in mean if k.startswith(branch.name + ".")]
                along = sum(float((mean[k] * full[k]).sum()) for k in keys)
                ratios.append(along / sum(float(full[k].pow(2).sum()) for k in keys))
            print(f"| {pattern} | {pool or 'none'} | {steps} | {', '.join(f'{r:.2f}' for r in ratios)} |")


if __name__ == "__main__":
    main()
