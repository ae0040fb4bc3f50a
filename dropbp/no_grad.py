"""Running a dropped branch: forward under ``torch.no_grad()``, so it builds no graph.

Values and gradients are those of running the branch with autograd and detaching its output (the research code's
way), without that graph's memory and bookkeeping (docs/memory.md). The model's modules are not replaced: two hooks
per branch module toggle grad mode, so state-dict keys, ``isinstance`` and PEFT target names are unchanged. The
hooks also feed the branch's :class:`~dropbp.recompute.BranchCache` (activation checkpointing skips recomputing
dropped branches), and they run outside ``torch.compile`` graphs (:mod:`dropbp.compile`). torch runs
``always_call`` hooks after an ``Exception`` only: the grad mode a ``KeyboardInterrupt`` leaves is put back by the
model's guarded forward (:mod:`dropbp.hooks`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .eager import outside_graphs
from .recompute import BranchCache
from .scaling import scaled_inputs, scaled_output

__all__ = ["attach_no_grad_hooks"]


def attach_no_grad_hooks(
    module: nn.Module,
    is_dropped: Callable[[], bool],
    cache: BranchCache | None = None,
    scale: Callable[[nn.Module], float] | None = None,
    inputs_scale: Callable[[nn.Module], float] | None = None,
) -> list[RemovableHandle]:
    """Make ``module`` run without autograd whenever ``is_dropped()`` is true at call time.

    Grad mode is switched off only while grad is enabled, and restored after the call even if it
    raises an ``Exception`` (``always_call``). Re-entrant calls nest correctly.
    With a ``cache``, the output of a dropped call inside a checkpointed region is held for the
    recomputation. With ``scale``, a kept call's output has its incoming gradient scaled
    (:func:`dropbp.scaling.scaled_output`), decided by the same ``is_dropped()`` as the switch; with
    ``inputs_scale``, the gradient leaving a kept call through its inputs is multiplied by the inverse
    (:func:`dropbp.scaling.scaled_inputs`): only the module's own parameters keep the factor.
    """
    calls: list[tuple[bool, bool, bool]] = []  # per call under way: (dropped, grad switched off here, to hold)

    @outside_graphs
    def before(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        dropped = is_dropped()  # the step's decision, drawn from the model's mode, not this module's
        hold = cache is not None and cache.on_call(dropped)
        switch = dropped and torch.is_grad_enabled()
        if switch:
            torch.set_grad_enabled(False)
        calls.append((dropped, switch, hold))
        if inputs_scale is None or dropped:
            return None
        return scaled_inputs(args, kwargs, 1.0 / inputs_scale(mod))

    @outside_graphs
    def after(mod: nn.Module, args: tuple, output: object) -> object:
        dropped, switch, hold = calls.pop()
        if switch:
            torch.set_grad_enabled(True)
        if output is None:  # the call raised (always_call)
            return None
        if hold:
            cache.hold(output)
        if scale is None or dropped:  # a dropped branch's output gets no gradient
            return None
        return scaled_output(mod, output, scale)

    return [
        module.register_forward_pre_hook(before, with_kwargs=True),
        module.register_forward_hook(after, always_call=True),
    ]
