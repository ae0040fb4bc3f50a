"""Compatibility with the DropBP research code: its ``DropBP`` layer and ``DropBPHandler``, apart from the core.

Research scripts import them as ``from dropbp.layer import DropBP`` and ``from dropbp.handler import DropBPHandler``
(those two modules are these import paths and nothing else). Old model code wraps each branch output,
``x = x + self.dropbp_attn(attn_out)``; the layer keeps its original signature and output-detach semantics so such
code runs unchanged, and the handler has the same constructor and methods, same behaviour. The rate allocation runs in
pure Python (:func:`dropbp.allocate_rates`, identical results), so the package installs without a C++/CUDA build. The
brute-force sensitivity measurement (N + 1 backward passes) is kept as it was, for exact reproduction of old runs. New
code should use :func:`dropbp.apply`, which needs no model edits and skips the dropped branch's graph entirely.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Sequence

import torch
from torch import nn

from dropbp.policy.allocation import allocate_rates

log = logging.getLogger("dropbp")

__all__ = ['DropBP', 'DropBPHandler', 'setup_seed']


class DropBP(nn.Module):
    """Identity in eval mode; in training, returns ``input.detach()`` with probability ``p``."""

    def __init__(self, flops: float, p: float = 0) -> None:
        super().__init__()
        self.p = p
        self.flops = flops
        self.count = 0  # how many times this layer has dropped
        self.is_detach = True  # whether the latest training forward dropped

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not self.training or random.random() <= 1 - self.p:
            self.is_detach = False
            return input
        self.count += 1
        self.is_detach = True
        return input.detach()


_SENSITIVITY_SEED = 526  # the research code reseeds with this before every sensitivity pass


def setup_seed(seed: int) -> None:
    """Seed Python, NumPy (when installed) and torch, as the research code does between passes."""
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np
    except ImportError:
        return
    np.random.seed(seed)


class DropBPHandler:
    """Drives the :class:`DropBP` layers of ``model`` toward the average drop rate ``drop_rate``."""

    def __init__(self, model: nn.Module, drop_rate: float) -> None:
        self.model = model
        self.num_layers = len(self._layers())
        self.p = drop_rate
        self.drop_rates = [drop_rate] * self.num_layers

    def _layers(self) -> list[DropBP]:
        return [m for m in self.model.modules() if isinstance(m, DropBP)]

    def set_initial_drop_rate(self, p: float | None = None) -> None:
        """Give every layer the same rate (``p``, or the handler's target when ``None``)."""
        for layer in self._layers():
            layer.p = self.p if p is None else p

    def set_diverse_drop_rate(self, p_list: Sequence[float], print_log: bool = False) -> None:
        """One rate per layer, in module order."""
        if len(p_list) != self.num_layers:
            raise ValueError(
                f"The number of drop rates ({len(p_list)}) does not match the number of DropBP "
                f"layers ({self.num_layers})."
            )
        for i, layer in enumerate(self._layers()):
            layer.p = p_list[i]
            if print_log:
                log.info("Drop rate of layer %d is set to %s", i + 1, p_list[i])

    def sensitivity_based_drop_bp(
        self,
        backprop: Callable[[], None],
        target_probability: float = 0.5,
        min_rate: float = 0,
        gradnorm: bool = True,
    ) -> tuple[list[float], list[float]]:
        """Measure sensitivities with ``backprop`` and set rates by :func:`allocate_rates`."""
        sensitivities = self.compute_sensitivity(backprop, gradnorm=gradnorm)
        drop_rates = allocate_rates(sensitivities, self.extract_flops(), target_probability, min_rate=min_rate)
        self.drop_rates = drop_rates
        log.info("drop rates: %s", drop_rates)
        self.set_diverse_drop_rate(drop_rates)
        return sensitivities, drop_rates

    def set_dropped_layers(self) -> None:
        """Draw this step's drops: Bernoulli per layer, then top up in descending-rate order until the
        fraction dropped reaches the target (the research code's sampler)."""
        dropped = [1 if random.random() < r else 0 for r in self.drop_rates]
        by_rate = sorted(range(self.num_layers), key=lambda i: self.drop_rates[i], reverse=True)
        for i in by_rate:
            if sum(dropped) / self.num_layers >= self.p:
                break
            dropped[i] = 1
        self.set_diverse_drop_rate(dropped)

    def compute_gradient(self, backprop: Callable[[], None], gradnorm: bool = True) -> list:
        setup_seed(_SENSITIVITY_SEED)
        backprop()
        return [
            (p.grad.norm() if gradnorm else p.grad.clone()) if p.grad is not None else 0
            for p in self.model.parameters()
        ]

    def compute_sensitivity(self, backprop: Callable[[], None], gradnorm: bool = True) -> list[float]:
        """S_i = sum over parameters of (g - g_i)^2, with g_i the gradient with only layer i dropped."""
        self.set_initial_drop_rate(0)
        original = self.compute_gradient(backprop, gradnorm)
        sensitivities = []
        for i in range(self.num_layers):
            self.set_diverse_drop_rate([1 if j == i else 0 for j in range(self.num_layers)])
            new = self.compute_gradient(backprop, gradnorm)
            s = sum(
                float(((o - n) ** 2).sum()) if torch.is_tensor(o - n) else float((o - n) ** 2)
                for o, n in zip(original, new, strict=True)
            )
            sensitivities.append(s)
            log.info("Layer %d, sensitivity %s", i + 1, s)
        return sensitivities

    def extract_flops(self) -> list[float]:
        return [layer.flops for layer in self._layers()]

    def extract_count(self) -> list[int]:
        return [layer.count for layer in self._layers()]

    def detact_non_grad(self) -> bool:
        """True when every layer dropped in the latest forward (``loss.backward()`` would fail)."""
        return all(layer.is_detach for layer in self._layers())
