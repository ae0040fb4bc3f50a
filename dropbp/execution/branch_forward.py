"""A branch's own forward under DropBP: a dropped branch under ``torch.no_grad()``, a kept one with its importance
weight.

Dropped: values and gradients are those of running the branch with autograd and detaching its output (the research
code's way), without that graph's memory and bookkeeping (docs/memory.md). The model's modules are not replaced: two
hooks per branch module toggle grad mode, so state-dict keys, ``isinstance`` and PEFT target names are unchanged. The
hooks also feed the branch's :class:`~dropbp.execution.recompute.BranchCache` (activation checkpointing skips
recomputing dropped branches), and they run outside ``torch.compile`` graphs (:mod:`dropbp.execution.compile_guards`).
torch runs ``always_call`` hooks after an ``Exception`` only: the grad mode a ``KeyboardInterrupt`` leaves is put back
by the model's guarded forward (:mod:`dropbp.execution.hooks`).

Kept, with a gradient weight ``w`` (a :class:`~dropbp.execution.hooks.KeptGradient`, such as
:class:`dropbp.experimental.ImportanceWeights`' ``1 / (1 - r)``): the gradient arriving at the branch's output is
multiplied by ``w`` and the gradient leaving it through its inputs by ``1 / w``: the backward is linear, so only the
branch's parameters (its post-norm tail's too) see ``w``, and the residual stream carries full backprop's gradient (no
factors compound down the layers).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from dropbp.execution.compile_guards import outside_graphs
from dropbp.execution.patching import map_output
from dropbp.execution.recompute import BranchCache

__all__ = ['attach_gradient_scaling', 'attach_no_grad_hooks', 'scaled_inputs', 'scaled_output']


class _ScaleGrad(torch.autograd.Function):
    """Identity forward (a view, no copy); multiplies the gradient that reaches it by ``factor``.

    A tensor hook on the branch's own output would not do: an attention module also returns its
    weights, from which its output was computed, and a hook there would scale that path twice.
    Downstream code sees the returned view, so only gradient from outside the branch is scaled.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.factor, None


def _needs_grad(item: object) -> bool:
    return torch.is_tensor(item) and item.requires_grad


def _scaled(item: object, factor: float) -> object:
    """``item`` with gradient through it scaled: a tensor that needs one, or each such tensor in a tuple or list."""
    if isinstance(item, (tuple, list)):
        return type(item)(_scaled(x, factor) for x in item)
    return _ScaleGrad.apply(item, factor) if _needs_grad(item) else item


def scaled_output(module: nn.Module, output: object, scale: Callable[[nn.Module], float]) -> object:
    """``output`` of ``module`` with the gradient arriving at it multiplied by ``scale(module)``, or None where
    nothing is scaled (autograd off, or a factor of 1.0): a forward hook's return value."""
    if not torch.is_grad_enabled():
        return None
    factor = scale(module)
    if factor == 1.0:
        return None
    return map_output(output, lambda x: _scaled(x, factor))


def scaled_inputs(args: tuple, kwargs: dict, factor: float) -> tuple[tuple, dict] | None:
    """A module's call arguments with the gradient leaving through each tensor that needs one multiplied by
    ``factor``, or None where nothing is scaled (autograd off, or a factor of 1.0): a forward pre-hook's return
    value (``with_kwargs=True``)."""
    if not torch.is_grad_enabled() or factor == 1.0:
        return None
    return tuple(_scaled(a, factor) for a in args), {k: _scaled(v, factor) for k, v in kwargs.items()}


def attach_gradient_scaling(module: nn.Module, scale: Callable[[nn.Module], float]) -> RemovableHandle:
    """After ``module`` runs with autograd, multiply the gradient arriving at its output from the rest
    of the model by ``scale(module)`` (evaluated at forward time; 1.0 means leave it alone). The branch's
    first module undoes it on its inputs (:func:`dropbp.execution.branch_forward.attach_no_grad_hooks`)."""

    @outside_graphs  # reads the step's pattern: compiled branches must not guard on it
    def after(mod: nn.Module, args: tuple, output: object) -> object:
        return scaled_output(mod, output, scale)

    return module.register_forward_hook(after)


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
    (:func:`dropbp.execution.branch_forward.scaled_output`), decided by the same ``is_dropped()`` as the switch; with
    ``inputs_scale``, the gradient leaving a kept call through its inputs is multiplied by the inverse
    (:func:`dropbp.execution.branch_forward.scaled_inputs`): only the module's own parameters keep the factor.
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
