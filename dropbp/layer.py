"""Compatibility with the research code's ``DropBP`` layer (``from dropbp.layer import DropBP``).

Old model code wraps each branch output: ``x = x + self.dropbp_attn(attn_out)``. The layer keeps
its original signature and output-detach semantics so such code runs unchanged. New code should use
:func:`dropbp.apply`, which needs no model edits and skips the dropped branch's graph entirely.
"""

from __future__ import annotations

import random

import torch
from torch import nn

__all__ = ["DropBP"]


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
