"""Running a dropped branch: forward under ``torch.no_grad()``, so it builds no graph.

The research code computes a dropped branch with autograd on and detaches its output afterwards;
that gives the same numbers but still records the graph and keeps every activation the branch
saved until the step ends. Switching grad mode off around the branch's own call gives identical
values and gradients (nothing upstream can receive a gradient through a detached output) while
saving that memory and the bookkeeping. The model's modules are not replaced: two hooks per branch
module toggle grad mode, so state-dict keys, ``isinstance`` and PEFT target names are unchanged.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

__all__ = ["attach_no_grad_hooks"]


def attach_no_grad_hooks(module: nn.Module, is_dropped: Callable[[], bool]) -> list[RemovableHandle]:
    """Make ``module`` run without autograd whenever ``is_dropped()`` is true at call time.

    Grad mode is switched off only while the module is in training mode with grad enabled, and
    restored after the call even if it raises (``always_call``). Re-entrant calls nest correctly.
    """
    switched: list[bool] = []

    def before(mod: nn.Module, args: tuple) -> None:
        drop = mod.training and torch.is_grad_enabled() and is_dropped()
        if drop:
            torch.set_grad_enabled(False)
        switched.append(drop)

    def after(mod: nn.Module, args: tuple, output: object) -> None:
        if switched.pop():
            torch.set_grad_enabled(True)

    return [
        module.register_forward_pre_hook(before),
        module.register_forward_hook(after, always_call=True),
    ]
