"""dropbp's work per training forward, counted rather than timed: function calls into ``dropbp/`` and ``backends/``,
and hook calls through ``torch.compiler.disable``'s wrapper, per forward+backward of the hot-path model.

    python benchmarks/hot_path_calls.py 0.5     # from a checkout; prints one line per drop rate given

Counts do not depend on the machine's load, so they compare two commits where timings are too noisy
(benchmarks/results/hot_path_cpu_ab/).
"""

from __future__ import annotations

import cProfile
import pstats
import sys

import torch
from lazy_graphs import smollm2_layout

import dropbp


def counts(rate: float, passes: int = 20) -> tuple[float, float]:
    """(dropbp function calls, compile-wrapper calls) per forward+backward at ``rate``."""
    model = smollm2_layout(64, width=16)
    dropbp.apply(model, rate, seed=0)
    ids = torch.randint(3, 64, (1, 8), generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        model(input_ids=ids, labels=ids).loss.backward()
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(passes):
        model(input_ids=ids, labels=ids).loss.backward()
    profile.disable()
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    own = sum(v[1] for k, v in stats.items() if "/dropbp/" in k[0] or "/backends/" in k[0])
    wrapped = sum(v[1] for k, v in stats.items() if "eval_frame" in k[0])
    return own / passes, wrapped / passes


if __name__ == "__main__":
    torch.set_num_threads(1)
    for arg in sys.argv[1:] or ["0", "0.5"]:
        own, wrapped = counts(float(arg))
        print(f"rate {arg}: dropbp function calls per forward+backward {own:.0f}, compile-wrapper calls {wrapped:.0f}")
