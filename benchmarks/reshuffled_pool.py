"""``benchmarks/convergence.py`` with the pattern pool reshuffled every cycle, as the sampler drew before the pool
was cycled in one fixed order (issue 32): the control for the lazy-bound grid.

    python benchmarks/reshuffled_pool.py --grid lazy-bound --only "DropBP 0.5, pattern bound 16, equal steps" \\
        --regime accumulate --method lora --lr 2e-3 --steps 100 --seed 0 --tag reshuffled-pool
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

from dropbp.policy.sampler import PatternSampler


def reshuffled_pattern(self: PatternSampler, step: int) -> frozenset[int]:
    """The pool's pattern at ``step``, its order reshuffled every cycle of ``len(pool)`` steps."""
    if not any(self.rates):
        return frozenset()
    if self._pool is not None:
        cycle, position = divmod(step, len(self._pool))
        slots = list(range(len(self._pool)))
        self._rng("cycle", cycle).shuffle(slots)
        return self._pool[slots[position]]
    return self._draw(step)


if __name__ == "__main__":
    PatternSampler.pattern = reshuffled_pattern
    script = Path(__file__).with_name("convergence.py")
    sys.argv = [str(script), *sys.argv[1:]]
    runpy.run_path(str(script), run_name="__main__")
