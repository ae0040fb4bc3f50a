"""Unbiased backward scaling: the gradient entering a KEPT branch's output is multiplied by 1 / (1 - p).

A branch kept with probability ``1 - p`` passes its gradient on only in those steps, so the gradient
that reaches its parameters and, through it, the layers before it is on average ``1 - p`` of the
full-backprop gradient. Scaling the incoming gradient of a kept branch by ``1 / (1 - p)`` (the
forward is untouched) makes the expected gradient of every parameter equal to the full-backprop
gradient when branches drop independently — the inverted-dropout correction, applied to the
backward only. (With a fixed count per step the drops are slightly negatively correlated, so the
equality is close rather than exact for paths through several branches.)
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .eager import outside_graphs
from .intercept import map_output

__all__ = ["attach_gradient_scaling", "scaled_output"]


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


def scaled_output(module: nn.Module, output: object, scale: Callable[[nn.Module], float]) -> object:
    """``output`` of ``module`` with the gradient arriving at it multiplied by ``scale(module)``, or None where
    nothing is scaled (autograd off, or a factor of 1.0): a forward hook's return value."""
    if not torch.is_grad_enabled():
        return None
    factor = scale(module)
    if factor == 1.0:
        return None
    return map_output(output, lambda x: _ScaleGrad.apply(x, factor) if _needs_grad(x) else x)


def attach_gradient_scaling(module: nn.Module, scale: Callable[[nn.Module], float]) -> RemovableHandle:
    """After ``module`` runs with autograd, multiply the gradient arriving at its output from the rest
    of the model by ``scale(module)`` (evaluated at forward time; 1.0 means leave it alone)."""

    @outside_graphs  # reads the step's pattern: compiled branches must not guard on it
    def after(mod: nn.Module, args: tuple, output: object) -> object:
        return scaled_output(mod, output, scale)

    return module.register_forward_hook(after)
