"""Importance weights (``unbiased=True``): a kept branch's own parameters get their gradient times ``1 / (1 - r)``.

``r`` is the branch's rate in force at the forward that kept it (under warm-up or a time schedule too). The gradient
arriving at the branch's output is multiplied by ``w = 1 / (1 - r)`` and the gradient leaving it through its inputs by
``1 / w``: the backward is linear, so only the branch's parameters (its post-norm tail's too) see ``w``, and the
residual stream carries full backprop's gradient (no factors compound down the layers). With cut patterns a kept
branch's gradient is exactly full backprop's, so its expected weighted gradient is exactly full backprop's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .eager import outside_graphs
from .intercept import map_output

__all__ = ["attach_gradient_scaling", "scaled_inputs", "scaled_output"]


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
    first module undoes it on its inputs (:func:`dropbp.no_grad.attach_no_grad_hooks`)."""

    @outside_graphs  # reads the step's pattern: compiled branches must not guard on it
    def after(mod: nn.Module, args: tuple, output: object) -> object:
        return scaled_output(mod, output, scale)

    return module.register_forward_hook(after)
