"""Learning-rate compensation: a branch updated in only ``1 - r`` of the steps gets ``lr / (1 - r)``.

A branch dropped with rate ``r`` receives a gradient (and, with "skip", an update) in ``1 - r`` of
the steps; scaling its learning rate by :func:`compensation` makes its expected update per step that
of full backprop. Measured, this did not help at the baselines' swept learning rates (larger steps on
an already tuned lr); it is kept as an option (:func:`dropbp.experimental.param_groups`). The same factor is the
importance weights' (:mod:`dropbp.experimental.importance_weights`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["compensation", "param_groups", "update_param_groups"]


def compensation(rate: float) -> float:
    """``1 / (1 - rate)``: how much rarer a branch dropped with ``rate`` is kept than one never dropped."""
    return 1.0 / (1.0 - rate)


def param_groups(
    model: nn.Module, branch_modules: Sequence[nn.Module], rates: Sequence[float], lr: float, **options: Any
) -> list[dict[str, Any]]:
    """Optimizer parameter groups: each branch's trainable parameters at ``lr * compensation(rate)``.

    Args:
        model: the model; its trainable parameters outside every branch form one group at ``lr``.
        branch_modules: the branch modules, in branch order (a parameter shared by two branches
            belongs to the first).
        rates: the branches' drop rates, in branch order.
        lr: the base learning rate.
        **options: other group options (weight_decay, betas, ...), put into every group.
    """
    seen: set[int] = set()
    groups = []
    for index, module in enumerate(branch_modules):
        own = [p for p in module.parameters() if p.requires_grad and id(p) not in seen]
        seen.update(id(p) for p in own)
        if own:
            factor = compensation(rates[index])
            group = {"params": own, "lr": lr * factor, "dropbp_branch": index, "dropbp_factor": factor}
            groups.append({**group, **options})
    rest = [p for p in model.parameters() if p.requires_grad and id(p) not in seen]
    if rest:
        groups.insert(0, {"params": rest, "lr": lr, "dropbp_branch": None, **options})
    return groups


def update_param_groups(
    optimizer: torch.optim.Optimizer,
    rates: Sequence[float],
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
) -> None:
    """Rescale the groups made by :func:`param_groups` to new rates.

    Args:
        optimizer: the optimizer built on :func:`param_groups`' groups.
        rates: the branches' current drop rates, in branch order.
        scheduler: the learning-rate scheduler, if any: schedulers recompute ``lr`` from their
            ``base_lrs`` at every step, so those are rescaled too (with ``initial_lr``).
    """
    for position, group in enumerate(optimizer.param_groups):
        index = group.get("dropbp_branch")
        if index is None:
            continue
        factor = compensation(rates[index])
        ratio = factor / group["dropbp_factor"]
        group["lr"] *= ratio
        if "initial_lr" in group:
            group["initial_lr"] *= ratio
        if scheduler is not None:
            scheduler.base_lrs[position] *= ratio
        group["dropbp_factor"] = factor
