"""What was measured and is not better, kept for the results tables and their tests: out of ``dropbp.apply``'s
signature, one line for a researcher.

- :func:`apply`: ``dropbp.apply`` with the experimental options too (``unbiased``, ``dropped_grads``,
  ``drop_schedule``, ``ramp``, ``stratify``, ``seq_len``, ``windows``; each with its record in
  :data:`dropbp.options.EXPERIMENTAL`).
- :class:`TokenDrops`: token-level dropped backward, a feature (no token arm pays in any cell of the project's tables:
  docs/token-drops.md).
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
from dropbp.api import apply_options
from dropbp.controller import DropBPController
from dropbp.execution.discovery import holder
from dropbp.experimental.token_drops import TokenDrops
from dropbp.options import DropBPOptions, takes_options
from dropbp.policy import lr_compensation

__all__ = ["TokenDrops", "apply", "exact_recompute", "param_groups", "update_param_groups"]


@takes_options(DropBPOptions, experimental=True)
def apply(model: nn.Module, drop_rate: float | str, **options: Any) -> DropBPController:
    """:func:`dropbp.apply` with the experimental options too; the same controller (``ctl.replace_options`` changes
    them later)."""
    return apply_options(model, DropBPOptions.given("dropbp.experimental.apply", True, drop_rate=drop_rate, **options))


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
    """Optimizer parameter groups with learning-rate compensation (:mod:`dropbp.policy.lr_compensation`): a branch
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
