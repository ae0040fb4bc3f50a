"""What was measured and is not better, kept for the results tables and their tests: out of the core's code, each a
feature given to ``dropbp.apply(model, rate, features=[...])`` that plugs into one of the core's extension points.

- :class:`ImportanceWeights` (0.3's ``unbiased=True``): the kept branch's gradient (:mod:`.importance_weights`).
- :class:`DroppedGradFill` (0.3's ``dropped_grads``): dropped branches' gradients, a step listener
  (:mod:`.dropped_grads`).
- :class:`RisingSchedule` (0.3's ``drop_schedule`` and ``ramp``): the policy's time schedule (:mod:`.schedules`).
- :class:`StratifiedCuts` (0.3's ``stratify``): the policy's pattern draw (:mod:`.stratified`).
- :class:`TokenDrops`: token-level dropped backward, with its row operations (:mod:`.token_rows`); no token arm pays in
  any cell of the project's tables (docs/token-drops.md).
- :func:`apply`: 0.3's entry point for the experimental options; it refuses them now, naming each one's feature.
- :func:`exact_recompute`: ``ctl.calibrate`` inside it measures by the research code's N + 1 passes (the same
  sensitivities as the one-pass default, N + 1 times the passes: benchmarks/results/calibration_cpu.md).
- :func:`param_groups` / :func:`update_param_groups`: learning-rate compensation, ``lr / (1 - rate)`` per branch
  (did not help at the baselines' swept learning rates: docs/convergence.md).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from dropbp import calibration
from dropbp.controller import DropBPController
from dropbp.execution.discovery import holder
from dropbp.experimental import lr_compensation
from dropbp.experimental.dropped_grads import DroppedGradFill
from dropbp.experimental.importance_weights import ImportanceWeights
from dropbp.experimental.schedules import RisingSchedule
from dropbp.experimental.stratified import StratifiedCuts
from dropbp.experimental.token_drops import TokenDrops
from dropbp.options import moved

__all__ = [
    "DroppedGradFill",
    "ImportanceWeights",
    "RisingSchedule",
    "StratifiedCuts",
    "TokenDrops",
    "apply",
    "exact_recompute",
    "param_groups",
    "update_param_groups",
]


def apply(model: nn.Module, drop_rate: float | str, **options: Any) -> DropBPController:
    """0.3's ``dropbp.experimental.apply``: refused, naming the 0.4 way for each option given (every experimental
    option is a feature of this package now: ``dropbp.apply(model, drop_rate, features=[...])``)."""
    ways = [f"{name} {moved(name)}" for name in options if moved(name) is not None]
    raise TypeError(
        "dropbp.experimental.apply is gone in dropbp 0.4: call dropbp.apply(model, drop_rate, ..., features=[...]) "
        "with the experimental features of dropbp.experimental" + ("; " + "; ".join(ways) if ways else "")
    )


@contextmanager
def exact_recompute() -> Iterator[None]:
    """Within the block ``ctl.calibrate`` measures each sensitivity by the research code's N + 1 passes, reseeded
    alike, instead of one pass."""
    token = calibration.METHOD.set("exact-recompute")
    try:
        yield
    finally:
        calibration.METHOD.reset(token)


def param_groups(ctl: DropBPController, lr: float, **options: Any) -> list[dict[str, Any]]:
    """Optimizer parameter groups with learning-rate compensation (:mod:`dropbp.experimental.lr_compensation`): a branch
    dropped with rate ``r`` gets ``lr / (1 - r)``; ``options`` go into every group. After the rates change
    (``calibrate``, ``set_rates``) call :func:`update_param_groups`."""
    holders = [holder(b.parts) for b in ctl.branches]
    return lr_compensation.param_groups(ctl.model, holders, ctl.rates, lr, **options)


def update_param_groups(
    ctl: DropBPController,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
) -> None:
    """Rescale the groups from :func:`param_groups` (and the scheduler's ``base_lrs``) to ``ctl``'s current rates."""
    lr_compensation.update_param_groups(optimizer, ctl.rates, scheduler)
